"""How the command line logs: ``--log-level`` and ``--log-format text|json`` (one JSON object per line, for collectors)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import typing

from weightcache.core.server.serve_config import LOG_CHOICES

LEVELS = LOG_CHOICES["log_level"]
FORMATS = LOG_CHOICES["log_format"]
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FIELDS = ("entry", "model", "bytes", "peer_pid", "publisher_pid", "op", "code", "reason", "state")
"""Structured fields a log call may pass with ``extra=`` (entry: a full digest, model: its label, peer_pid: the pid of
the client whose request the line is about, publisher_pid: the pid that published the entry); ``--log-format json``
writes each one a record carries, beside the message that names them too."""


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``pid``, ``message``, the
    structured ``FIELDS`` the record carries and, for an exception, ``exception`` (its formatted traceback)."""

    converter = staticmethod(time.gmtime)

    def format(self, record: logging.LogRecord) -> str:
        shown: dict[str, typing.Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                shown[name] = value
        if record.exc_info:
            shown["exception"] = self.formatException(record.exc_info)
        return json.dumps(shown, ensure_ascii=False)


QUIET_THIRD_PARTIES = {"NIXL_LOG_LEVEL": "WARN"}
"""Libraries that log on their own (NIXL prints INFO lines to stdout through a logger it configures when imported,
and its C++ core to stderr): the level they are held to below ``debug``, through the variable each reads. An
operator's own setting of the variable wins."""


def ours_or_a_warning(record: logging.LogRecord) -> bool:
    """A record weightcache's own loggers made, or one of WARNING or above (a third party's INFO stays out)."""
    return record.levelno >= logging.WARNING or record.name == "weightcache" or record.name.startswith("weightcache.")


def configure(level: str, form: str = "text", brief: bool = False) -> None:
    """Log to stderr at ``level`` (one of LEVELS) in ``form`` (one of FORMATS); ``brief``: ``LEVEL: message`` only
    (the one-shot commands, whose results go to stdout). Below ``debug``, third parties' INFO lines stay out: those
    of Python loggers through a filter, those of libraries that print on their own through QUIET_THIRD_PARTIES."""
    handler = logging.StreamHandler(sys.stderr)
    if level != "debug":
        for variable, quiet in QUIET_THIRD_PARTIES.items():
            os.environ.setdefault(variable, quiet)
        handler.addFilter(ours_or_a_warning)
    if form == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s" if brief else _TEXT))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)
