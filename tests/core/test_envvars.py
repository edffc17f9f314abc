"""``WEIGHTCACHE_*`` environment values: a value that does not parse is named in one warning, once, and ignored."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from tests.helpers import ServerProcess
from weightcache.core import envvars
from weightcache.core.load import reader


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "weightcache.core.envvars"]


@pytest.mark.parametrize(
    ("variable", "value", "read", "accepted"),
    [
        ("WEIGHTCACHE_READ_PROCESS", "yes", lambda: envvars.switch("WEIGHTCACHE_READ_PROCESS"), "1 (on) or 0 (off)"),
        ("WEIGHTCACHE_READ_THREADS", "300", reader._configured_threads, "an integer from 1 to 256"),
        ("WEIGHTCACHE_READ_THREADS", "eight", reader._configured_threads, "an integer from 1 to 256"),
        ("WEIGHTCACHE_READ_BLOCK_KIB", "6", reader._configured_block, "an integer from 4 to 65536 in steps of 4 or 0"),
        ("WEIGHTCACHE_READ_SLOTS", "1", lambda: reader._slots(reader.ReadMode(512 << 10, 16, "test")), "an integer from 2 to 64"),
        (
            "WEIGHTCACHE_SCRUB_PAUSE_S",
            "-1",
            lambda: envvars.seconds("WEIGHTCACHE_SCRUB_PAUSE_S"),
            "a number of seconds, 0 or more",
        ),
    ],
)
def test_a_value_that_does_not_parse_is_warned_about_once_and_the_default_applies(
    variable, value, read, accepted, monkeypatch, caplog
):
    monkeypatch.delenv(variable, raising=False)
    default = read()
    monkeypatch.setenv(variable, value)
    with caplog.at_level(logging.WARNING):
        assert read() == default
        assert read() == default
    assert _warnings(caplog) == [f"weightcache: ignoring {variable}={value!r}: it accepts {accepted}; the default applies"]


def test_valid_values_are_read_without_a_word(monkeypatch, caplog):
    settings = {
        "WEIGHTCACHE_READ_PROCESS": "0",
        "WEIGHTCACHE_READ_DIRECT": "0",
        "WEIGHTCACHE_READ_THREADS": "12",
        "WEIGHTCACHE_READ_BLOCK_KIB": "0",
        "WEIGHTCACHE_READ_SLOTS": "8",
        "WEIGHTCACHE_SCRUB_PAUSE_S": "0.5",
    }
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING):
        assert envvars.switch("WEIGHTCACHE_READ_PROCESS") is False
        assert reader.default_direct() is False
        assert reader._configured_threads() == 12
        assert reader._configured_block() == 0
        assert reader._slots(reader.ReadMode(512 << 10, 16, "test")) == 8
        assert envvars.seconds("WEIGHTCACHE_SCRUB_PAUSE_S") == 0.5
    monkeypatch.setenv("WEIGHTCACHE_READ_BLOCK_KIB", "512")
    assert reader._configured_block() == 512 << 10
    assert _warnings(caplog) == []


def test_weightcache_load_says_once_which_setting_it_ignores(model_dir, socket_dir):
    server = ServerProcess.start(socket_dir)
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "weightcache.core.cli.cli",
                "load",
                "--model",
                str(model_dir("llama")),
                "--socket-dir",
                str(socket_dir),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "WEIGHTCACHE_READ_THREADS": "lots", "WEIGHTCACHE_READ_DIRECT": "no"},
        )
    finally:
        server.close()
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    for variable, value, accepted in (
        ("WEIGHTCACHE_READ_THREADS", "lots", "an integer from 1 to 256"),
        ("WEIGHTCACHE_READ_DIRECT", "no", "1 (on) or 0 (off)"),
    ):
        said = [line for line in lines if variable in line]
        assert len(said) == 1 and f"{variable}={value!r}: it accepts {accepted}" in said[0], lines
