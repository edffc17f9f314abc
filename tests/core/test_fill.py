"""``fill.sources`` against a real server process that lies in its ``locate`` replies (tests/core/lying_server.py).

A loader copies from what ``locate`` names and publishes the copy under its own
fingerprint, so a row of another content would publish other bytes. Whatever a
server answers, ``sources`` keeps only other entries of the requested content
and says what it ignored in one warning line per reply.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.support import make_fingerprint
from weightcache.core.fingerprint import HOST_TIER, Fingerprint
from weightcache.core.node import fill
from weightcache.core.node.fill import MAX_SOURCE_BYTES, Source
from weightcache.core.wire.protocol import MAX_SOURCES

WANTED = make_fingerprint(gpu_uuid="GPU-bbbbbbbb-0000-0000-0000-000000000000")
PEER = WANTED.on_device("GPU-aaaaaaaa-0000-0000-0000-000000000000")
HOST = WANTED.on_device(HOST_TIER)


def row(
    fingerprint: Fingerprint | dict = PEER, tier: object = "GPU-aaaaaaaa-0000-0000-0000-000000000000", nbytes: object = 16384
):
    data = fingerprint.to_json() if isinstance(fingerprint, Fingerprint) else fingerprint
    return {"fingerprint": data, "tier": tier, "bytes": nbytes}


GOOD_ROWS = [row(), row(HOST, HOST_TIER, 8192)]
GOOD_SOURCES = [Source(PEER, "GPU-aaaaaaaa-0000-0000-0000-000000000000", 16384), Source(HOST, HOST_TIER, 8192)]

HOSTILE_ROWS = {
    "a list": [PEER.to_json(), "host", 1],
    "a string": "GPU-aaaaaaaa",
    "null": None,
    "no fingerprint": {"tier": HOST_TIER, "bytes": 1},
    "no bytes": {"fingerprint": PEER.to_json(), "tier": HOST_TIER},
    "a fingerprint that is not an object": row(fingerprint=["not", "a", "fingerprint"]),
    "a fingerprint with a field missing": row(fingerprint={k: v for k, v in PEER.to_json().items() if k != "dtype"}),
    "a fingerprint with a field of the wrong type": row(fingerprint={**PEER.to_json(), "tp_size": "2"}),
    "another dtype": row(attrs.evolve(PEER, dtype="float16")),
    "another checkpoint": row(attrs.evolve(HOST, checkpoint="0" * 64)),
    "another adapter field": row(attrs.evolve(PEER, extra={"kernel": "fast"})),
    "the requester's own fingerprint": row(WANTED),
    "negative bytes": row(nbytes=-1),
    "zero bytes": row(nbytes=0),
    "bool bytes": row(nbytes=True),
    "huge bytes": row(nbytes=MAX_SOURCE_BYTES + 1),
    "string bytes": row(nbytes="16384"),
    "float bytes": row(nbytes=16384.0),
    "a tier that is a number": row(tier=5),
    "a tier that is null": row(tier=None),
    "an empty tier": row(tier=""),
    "a tier of a thousand characters": row(tier="G" * 1000),
    "a source named twice": row(),
}


class LyingServer:
    """tests/core/lying_server.py in its own process; ``lie(reply)`` sets what it answers to the next ``locate``."""

    def __init__(self, socket_dir: Path, reply_file: Path):
        self.socket_dir, self.reply_file = socket_dir, reply_file
        self.lie({"ok": True, "sources": []})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.core.lying_server", str(socket_dir), str(reply_file)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        if self.proc.stdout.readline().strip() != "ready":
            self.proc.kill()
            raise AssertionError(f"the lying server did not start: {self.proc.communicate(timeout=10)[1][-3000:]}")

    def lie(self, reply: dict) -> None:
        self.reply_file.write_text(json.dumps(reply))

    def sources(self, caplog) -> tuple[list[Source], list[str]]:
        """What ``fill.sources(WANTED)`` returns, and the lines it logged."""
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="weightcache.core.node.fill"):
            found = fill.sources(WANTED, self.socket_dir)
        return found, [r.getMessage() for r in caplog.records if r.name == "weightcache.core.node.fill"]

    def close(self) -> None:
        self.proc.kill()
        self.proc.communicate(timeout=10)


@pytest.fixture(scope="module")
def liar(tmp_path_factory):
    import tempfile

    socket_dir = Path(tempfile.mkdtemp(prefix="wc-liar-"))  # short: socket paths are limited to 107 bytes
    socket_dir.chmod(0o700)
    server = LyingServer(socket_dir, tmp_path_factory.mktemp("liar") / "reply.json")
    try:
        yield server
    finally:
        server.close()
        for child in socket_dir.iterdir():
            child.unlink()
        socket_dir.rmdir()


def test_an_honest_reply_is_used_whole_and_logs_nothing(liar, caplog):
    liar.lie({"ok": True, "sources": GOOD_ROWS})
    assert liar.sources(caplog) == (GOOD_SOURCES, [])


@pytest.mark.parametrize("kind", HOSTILE_ROWS)
def test_one_hostile_row_is_dropped_with_one_line_and_the_honest_rows_kept(liar, caplog, kind):
    liar.lie({"ok": True, "sources": [GOOD_ROWS[0], HOSTILE_ROWS[kind], GOOD_ROWS[1]]})
    found, lines = liar.sources(caplog)
    assert found == GOOD_SOURCES, kind
    assert len(lines) == 1 and lines[0].startswith(
        f"weightcache: ignoring 1 of the 3 sources the server named for {WANTED.short}: a row"
    ), lines


def test_the_line_for_another_content_names_the_fields_that_differ(liar, caplog):
    liar.lie({"ok": True, "sources": [HOSTILE_ROWS["another dtype"]]})
    assert liar.sources(caplog) == (
        [],
        [
            f"weightcache: ignoring 1 of the 1 sources the server named for {WANTED.short}: a row names another content "
            "(it differs in dtype); run the same weightcache version on both sides"
        ],
    )


def test_a_reply_of_every_lie_at_once_costs_one_line(liar, caplog):
    rows = [*GOOD_ROWS, *HOSTILE_ROWS.values()]
    liar.lie({"ok": True, "sources": rows})
    found, lines = liar.sources(caplog)
    assert found == GOOD_SOURCES
    expected = f"weightcache: ignoring {len(rows) - 2} of the {len(rows)} sources the server named for {WANTED.short}: "
    assert len(lines) == 1 and lines[0].startswith(expected), lines
    assert f"at most {MAX_SOURCES} are read" in lines[0], "rows past the limit were read"


def test_more_rows_than_a_reply_may_name_are_not_read(liar, caplog):
    rows = [row(PEER.on_device(f"GPU-{n:08d}"), HOST_TIER, 4096) for n in range(MAX_SOURCES + 4)]
    liar.lie({"ok": True, "sources": rows})
    found, lines = liar.sources(caplog)
    assert [s.fingerprint.gpu_uuid for s in found] == [f"GPU-{n:08d}" for n in range(MAX_SOURCES)]
    assert len(lines) == 1 and "ignoring 4 of the 20 sources" in lines[0], lines


NO_LIST_OF_SOURCES = {
    "sources a string": {"ok": True, "sources": "GPU-aaaaaaaa"},
    "sources an object": {"ok": True, "sources": {"0": GOOD_ROWS[0]}},
    "no sources": {"ok": True},
    "ok not true": {"ok": "yes", "sources": GOOD_ROWS},
    "an error without an error object": {"ok": False},
    "an error object that is a string": {"ok": False, "error": "no"},
    "an error code that is a number": {"ok": False, "error": {"code": 5, "message": "no"}},
    "a refusal": {"ok": False, "error": {"code": "bad_request", "message": "no such op"}},
    "a not_found with fields that are no list": {"ok": False, "error": {"code": "not_found", "message": "no", "fields": 5}},
}


@pytest.mark.parametrize("kind", NO_LIST_OF_SOURCES)
def test_a_reply_that_is_no_list_of_sources_is_no_source_and_one_line(liar, caplog, kind):
    liar.lie(NO_LIST_OF_SOURCES[kind])
    found, lines = liar.sources(caplog)
    assert found == []
    assert len(lines) == 1 and lines[0].startswith(f"weightcache: ignoring the server's locate reply for {WANTED.short}: "), lines


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
FIELD_VALUES = JSON | st.sampled_from([PEER.to_json(), HOST.to_json(), WANTED.to_json(), HOST_TIER, 16384, -1, True])
ROWS = st.one_of(
    JSON,
    st.sampled_from(GOOD_ROWS),
    st.fixed_dictionaries({}, optional={"fingerprint": FIELD_VALUES, "tier": FIELD_VALUES, "bytes": FIELD_VALUES}),
    st.builds(
        lambda fingerprint, field, value: row({**fingerprint.to_json(), field: value}),
        st.sampled_from([PEER, HOST]),
        st.sampled_from([f.name for f in attrs.fields(Fingerprint)]),
        FIELD_VALUES,
    ),
)


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sources=st.lists(ROWS, max_size=MAX_SOURCES + 2) | JSON)
def test_whatever_a_server_answers_sources_are_of_the_requested_content_and_one_line_at_most(liar, caplog, sources):
    liar.lie({"ok": True, "sources": sources})
    found, lines = liar.sources(caplog)
    assert len(lines) <= 1, lines
    for source in found:
        assert source.fingerprint.content_digest == WANTED.content_digest and source.fingerprint != WANTED, source
        assert isinstance(source.tier, str) and type(source.nbytes) is int and 0 < source.nbytes <= MAX_SOURCE_BYTES
    assert len({s.fingerprint.digest for s in found}) == len(found), "a source was named twice"
    assert bool(lines) == (not isinstance(sources, list) or len(found) < len(sources)), (sources, found, lines)
    assert liar.proc.poll() is None, "the lying server died: a silent empty answer proves nothing"
