"""Numeric server options through the Python API: ``ServerConfig`` refuses what ``weightcache serve`` refuses.

The command line's refusals are in test_cli.py (by their exact line); here every
numeric field of ``ServerConfig`` meets the values that used to start a server
that resets every connection, and the error names the field and its range.
"""

from __future__ import annotations

import math
import re

import attrs
import pytest

from weightcache.core.server import bounds
from weightcache.core.server.server import ServerConfig

NOT_NUMBERS = {"socket_dir", "metrics_host"}
NUMERIC_FIELDS = [field.name for field in attrs.fields(ServerConfig) if field.name not in NOT_NUMBERS]
HOSTILE = [math.nan, math.inf, -math.inf, -1, 0, True, 1e30, 2**70, "10"]
MEANINGFUL = {("metrics_port", 0)}
"""Values of the hostile list that mean something for one field: port 0 is any free port."""


def test_every_numeric_field_of_server_config_has_a_bound():
    assert all(attrs.fields_dict(ServerConfig)[name].validator is not None for name in NUMERIC_FIELDS)


@pytest.mark.parametrize("name", NUMERIC_FIELDS)
@pytest.mark.parametrize("value", HOSTILE, ids=repr)
def test_a_server_config_refuses_a_number_out_of_range(tmp_path, name, value):
    if (name, value) in MEANINGFUL:
        assert getattr(ServerConfig(socket_dir=tmp_path, **{name: value}), name) == value
        return
    with pytest.raises(ValueError, match=rf"^{name} is {re.escape(repr(value))}; give a") as caught:
        ServerConfig(socket_dir=tmp_path, **{name: value})
    with pytest.raises(ValueError):
        attrs.evolve(ServerConfig(socket_dir=tmp_path), **{name: value})
    assert list(tmp_path.iterdir()) == []
    assert "from" in str(caught.value) and " to " in str(caught.value)


def test_the_messages_say_the_range_and_what_none_means(tmp_path):
    with pytest.raises(ValueError) as caught:
        ServerConfig(socket_dir=tmp_path, frame_deadline_s=math.nan)
    assert str(caught.value) == "frame_deadline_s is nan; give a number of seconds from 0.01 to 86400 (1 day)"
    with pytest.raises(ValueError) as caught:
        ServerConfig(socket_dir=tmp_path, idle_timeout_s=-1)
    assert str(caught.value) == "idle_timeout_s is -1; give a number of seconds from 0.01 to 86400 (1 day), or None for never"
    with pytest.raises(ValueError) as caught:
        ServerConfig(socket_dir=tmp_path, byte_budget=-5)
    assert str(caught.value) == "byte_budget is -5; give a whole number of bytes from 1 to 1 EiB, or None for no limit"


def test_the_defaults_and_values_at_the_bounds_are_accepted(tmp_path):
    ServerConfig(socket_dir=tmp_path)
    ServerConfig(
        socket_dir=tmp_path,
        byte_budget=1 << 60,
        host_budget=1,
        gpu_budget=None,
        frame_deadline_s=0.01,
        idle_timeout_s=None,
        max_connections=1,
        inflight_wait_s=86400,
    )


def test_a_bound_parses_text_as_the_command_line_gives_it():
    assert bounds.SECONDS.parse("2.5") == 2.5
    assert bounds.IDLE_SECONDS.parse("0", zero="never") == 0
    assert bounds.CONNECTIONS.parse("4") == 4
    for text in ("nan", "0", "-1", "inf", "1e400", "", "ten"):
        with pytest.raises(ValueError, match=f"^{re.escape(repr(text))} is not a number of seconds from 0.01 to 86400"):
            bounds.SECONDS.parse(text)
