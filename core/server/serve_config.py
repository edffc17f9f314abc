"""``weightcache serve --config FILE.toml``: the server's settings and the models it keeps warm.

::

    [server]                      # every key optional; a command-line flag overrides it
    socket_dir = "/run/weightcache"
    byte_budget = "600G"          # a size as the flags take it, or a number of bytes
    host_budget = "200G"
    gpu_budget = "70G"
    idle_timeout = 120            # seconds; 0: never
    max_connections = 1024
    frame_deadline = 10           # seconds
    metrics_port = 9464           # 0: any free port; leave it out for none
    metrics_host = "127.0.0.1"
    log_level = "info"            # debug, info, warning, error
    log_format = "json"           # text or json
    log_file = "/var/log/weightcache.log"  # with --detach only (default: server.log in the socket directory)

    [[warm]]                      # loaded in the background, in this order, by `weightcache load`
    model = "/models/llama-8b"    # a checkpoint directory, or what the adapter accepts (a hub id)
    dtype = "bfloat16"            # optional (default: the checkpoint's own)
    device = "cuda:0"             # optional (default: cpu)
    tier = "device"               # device, host or both (default: device)
    quant = "fp8-block"           # optional
    adapter = "hf"                # optional (default: hf)

TOML is read with ``tomllib`` (Python 3.11+) or, on 3.10, the ``tomli`` package when installed.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
import types
from pathlib import Path

import attrs

from weightcache.core.errors import WeightCacheError
from weightcache.core.server import bounds
from weightcache.core.socket_dir import SocketDir


class ConfigError(WeightCacheError):
    """The serve config file cannot be read or names something the server does not know."""


TIERS = ("device", "host", "both")
_SERVER_KEYS = (
    "socket_dir",
    "byte_budget",
    "host_budget",
    "gpu_budget",
    "idle_timeout",
    "max_connections",
    "frame_deadline",
    "metrics_port",
    "metrics_host",
    "log_level",
    "log_format",
    "log_file",
)
LOG_KEYS = ("log_level", "log_format", "log_file")
"""Keys of ``[server]`` that set how the command logs, not the server: ``ServeFile.logging``."""
LOG_CHOICES = {"log_level": ("debug", "info", "warning", "error"), "log_format": ("text", "json")}
_CONFIG_FIELD = {"idle_timeout": "idle_timeout_s", "frame_deadline": "frame_deadline_s"}  # else the key is the field


@attrs.frozen
class WarmItem:
    """One model rank to keep warm: what ``weightcache load`` is run with."""

    model: str
    dtype: str | None = None
    device: str = "cpu"
    tier: str = attrs.field(default="device", validator=attrs.validators.in_(TIERS))
    quant: str | None = None
    adapter: str = "hf"

    def command(self, socket_dir: SocketDir) -> list[str]:
        """The ``weightcache load`` command line that publishes this item to the server on ``socket_dir``."""
        args = [sys.executable, "-m", "weightcache.core.cli.cli", "load", "--socket-dir", str(socket_dir)]
        args += ["--model", self.model, "--device", self.device, "--tier", self.tier, "--adapter", self.adapter]
        args += ["--dtype", self.dtype] if self.dtype else []
        args += ["--quant", self.quant] if self.quant else []
        return args

    def describe(self) -> dict:
        return {field.name: getattr(self, field.name) for field in attrs.fields(WarmItem)}


@attrs.frozen
class ServeFile:
    """A parsed config file: ``settings`` as ServerConfig keyword arguments, ``logging`` (LOG_KEYS given), and the warm
    list in order."""

    path: Path
    settings: dict
    warm: tuple[WarmItem, ...]
    logging: dict = attrs.field(factory=dict)

    @classmethod
    def load(cls, path: str | os.PathLike) -> ServeFile:
        path = Path(path)
        try:
            text = path.read_bytes().decode()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the config file {path}: {exc}") from None
        try:
            data = _toml().loads(text)
        except ValueError as exc:  # tomllib.TOMLDecodeError is a ValueError
            raise ConfigError(f"{path} is not valid TOML: {exc}; fix the file") from None
        _known(data, ("server", "warm"), f"{path}")
        settings = _settings(data.get("server", {}), path)
        logging = {key: settings.pop(key) for key in LOG_KEYS if key in settings}
        return cls(path, settings, _warm(data.get("warm", []), path), logging)


@attrs.frozen
class ServeSource:
    """Where a server's settings come from: a config file (or none) and the flags given, which win over it.

    ``flags`` holds ServerConfig keyword arguments, only those given on the command line.
    Read again on SIGHUP, so the flags keep winning.
    """

    path: Path | None
    flags: dict = attrs.field(factory=dict)

    def read(self) -> tuple[dict, tuple[WarmItem, ...]]:
        """ServerConfig keyword arguments (the file's, then the flags over them) and the warm list."""
        file = ServeFile.load(self.path) if self.path is not None else None
        return {**(file.settings if file else {}), **self.flags}, (file.warm if file else ())

    def logging(self) -> dict:
        """The file's LOG_KEYS (the command line's options win over them; the caller knows which it was given)."""
        return ServeFile.load(self.path).logging if self.path is not None else {}


def _toml() -> types.ModuleType:
    for name in ("tomllib", "tomli"):  # the standard library's from Python 3.11; the tomli package on 3.10
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise ConfigError("Python 3.10 reads TOML with the tomli package: `pip install tomli`, or use Python 3.11+")


def _known(table, keys: tuple[str, ...], where: str) -> None:
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    for key in table:
        if key not in keys:
            close = difflib.get_close_matches(key, keys, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(keys)}"
            raise ConfigError(f"{where}: unknown key {key!r}{hint}")


def _settings(server, path: Path) -> dict:
    _known(server, _SERVER_KEYS, f"{path} [server]")
    settings = {}
    for key, value in server.items():
        try:
            if key.endswith("_budget"):
                value = bounds.parse_size(value)
            elif key == "idle_timeout":
                value = bounds.IDLE_SECONDS.parse(str(value)) if value else None
            elif key == "frame_deadline":
                value = bounds.SECONDS.parse(str(value))
            elif key == "max_connections":
                value = bounds.CONNECTIONS.parse(str(value))
            elif key == "metrics_port":
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"{value!r} is not a port number (0 to 65535; leave the key out for none)")
                value = bounds.PORT.parse(str(value))
            elif key in LOG_CHOICES and value not in LOG_CHOICES[key]:
                raise ValueError(f"{value!r} is not one of {', '.join(LOG_CHOICES[key])}")
            elif not isinstance(value, str):
                raise ValueError(f"{value!r} is not a {'host' if key == 'metrics_host' else 'path'}")
        except ValueError as exc:
            raise ConfigError(f"{path} [server] {key}: {exc}") from None
        settings[_CONFIG_FIELD.get(key, key)] = value
    return settings


def _warm(items, path: Path) -> tuple[WarmItem, ...]:
    if not isinstance(items, list):
        raise ConfigError(f"{path}: warm must be a list of tables ([[warm]])")
    keys = tuple(field.name for field in attrs.fields(WarmItem))
    parsed = []
    for index, item in enumerate(items):
        where = f"{path} [[warm]] #{index + 1}"
        _known(item, keys, where)
        if not isinstance(item.get("model"), str):
            raise ConfigError(f'{where}: give the model (a checkpoint directory or a hub id) as model = "..."')
        try:
            parsed.append(WarmItem(**{key: str(value) for key, value in item.items()}))
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}; tier is one of {', '.join(TIERS)}") from None
    return tuple(parsed)
