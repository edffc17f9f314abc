"""benchmarks/read_patterns.py and benchmarks/rebind_parts.py: their rows parse, run on a real file and say what failed."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def patterns(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # it imports its neighbour restart.py
    return importlib.import_module("read_patterns")


@pytest.mark.parametrize(
    ("text", "said"),
    [("anon4k", "KIND:BLOCK_KIB"), ("anon4k:big", "KIND:BLOCK_KIB"), ("anon4k:6", "multiple of 4 KiB"), ("anon4k:0", "positive")],
)
def test_a_malformed_row_is_refused_saying_its_form(patterns, text, said):
    with pytest.raises(ValueError, match=said):
        patterns.parse_row(text, 16)


def test_rows_read_every_byte_of_the_files_and_an_unknown_kind_is_an_error_row(tmp_path):
    """Each kind reads the whole file (the disk's counters may be absent in a container: the bytes are checked by the
    row's own EOF check, which raises on a short read); a kind it does not know becomes that row's error, the others run."""
    (tmp_path / "model.safetensors").write_bytes(bytes(range(256)) * 4096 * 3 + b"tail")  # not a multiple of a block
    record = tmp_path / "out.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "read_patterns.py"),
            "--model",
            str(tmp_path),
            "--rows",
            "anon4k:64:2,anonthp:64,memfd:128:3,buffered:64,nonsense:64",
            "--threads",
            "2",
            "--json",
            str(record),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(record.read_text())["rows"]
    assert [row["row"] for row in rows] == ["anon4k:64:2", "anonthp:64:2", "memfd:128:3", "buffered:64:2", "nonsense:64:2"]
    assert all("seconds" in row for row in rows[:4]), rows
    assert "unknown memory kind 'nonsense'" in rows[4]["error"]
    assert "| nonsense:64:2 | error: ValueError" in proc.stdout


def test_rebind_parts_times_every_step_on_a_small_count():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "rebind_parts.py"), "--tensors", "2000", "--repeat", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    steps = [line.split("|")[1].strip() for line in proc.stdout.splitlines() if line.startswith("| ") and "step" not in line]
    assert steps == [
        "unbind",
        "class",
        "values",
        "types",
        "shapes",
        "compare",
        "free shapes",
        "update",
        "free meta",
        "free made",
        "all",
    ]
