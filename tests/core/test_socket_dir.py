"""SocketDir: parsed once where a directory enters, owning its default and its socket path."""

from __future__ import annotations

from pathlib import Path

import pytest

from weightcache.core.cli.cli import build_parser
from weightcache.core.errors import ServerUnavailable
from weightcache.core.flow.modes import CacheOptions
from weightcache.core.server.server import ServerConfig
from weightcache.core.socket_dir import ENV_SOCKET_DIR, LOCK_NAME, SOCKET_NAME, SocketDir


def test_parse_takes_a_path_a_string_or_itself_and_none_is_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_SOCKET_DIR, str(tmp_path / "env"))
    parsed = SocketDir.parse(str(tmp_path))
    assert parsed == SocketDir.parse(tmp_path) == SocketDir(tmp_path) and SocketDir.parse(parsed) is parsed
    assert SocketDir.parse(None) == SocketDir.parse("") == SocketDir.default() == SocketDir(tmp_path / "env")
    assert parsed.socket == tmp_path / SOCKET_NAME and parsed.lock == tmp_path / LOCK_NAME
    assert Path(parsed) == tmp_path and str(parsed) == str(tmp_path)


def test_the_default_follows_xdg_then_tmp(monkeypatch):
    monkeypatch.delenv(ENV_SOCKET_DIR, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/7")
    assert SocketDir.default().path == Path("/run/user/7/weightcache")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert SocketDir.default().path.name.startswith("weightcache-")


def test_the_serve_hint_names_the_directory_unless_it_is_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_SOCKET_DIR, str(tmp_path / "default"))
    assert SocketDir.of_socket(tmp_path / "default" / SOCKET_NAME).serve_command() == "weightcache serve"
    odd = tmp_path / "with space"
    assert SocketDir.of_socket(odd).serve_command() == f"weightcache serve --socket-dir '{odd}'"
    assert f"--socket-dir '{odd}'" in str(ServerUnavailable(str(odd / SOCKET_NAME), "no socket"))


def test_every_entry_point_parses_it_once(tmp_path):
    """The CLI, the options of a load and the server's config all hold a SocketDir, whatever they were given."""
    args = build_parser().parse_args(["status", "--socket-dir", str(tmp_path)])
    assert args.socket_dir == SocketDir(tmp_path)
    assert build_parser().parse_args(["status"]).socket_dir is None  # absent: the config file or the default decides
    assert CacheOptions(socket_dir=str(tmp_path)).socket_dir == SocketDir(tmp_path)
    assert CacheOptions().socket_dir == SocketDir.default()
    assert ServerConfig(socket_dir=tmp_path).socket_dir == SocketDir(tmp_path)


def test_a_value_that_is_no_path_is_refused():
    with pytest.raises(TypeError):
        SocketDir.parse(42)  # type: ignore[arg-type]
