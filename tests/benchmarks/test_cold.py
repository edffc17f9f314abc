"""benchmarks/cold.py: the checkpoint it writes, the CLI phases it reads, and a verification that bites."""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    """benchmarks/cold.py's modules by name (cold, cold_checkpoint, cold_parent, ...): they import their neighbours."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module


@pytest.fixture
def cold(bench):
    return bench("cold")


@pytest.fixture
def checkpoint(bench):
    return bench("cold_checkpoint")


@pytest.fixture
def parent(bench):
    return bench("cold_parent")


def test_gib_16_is_llama_3_8b_as_the_issue_measured_it(checkpoint):
    tensors = checkpoint.llama_tensors(checkpoint.llama_shape(16))
    nbytes = 2 * sum(math.prod(shape) for _, shape in tensors)
    assert (len(tensors), nbytes) == (291, 16_060_522_496), "Llama-3-8B in bf16: 291 tensors, 16.06 GB"
    shards = checkpoint.shard_of(tensors)
    assert shards == sorted(shards) and set(shards) == {0, 1, 2, 3}, "4 shards, in state_dict order"


def test_other_sizes_keep_291_tensors_and_scale_the_bytes(checkpoint):
    for gib in (0.05, 1, 4):
        tensors = checkpoint.llama_tensors(checkpoint.llama_shape(gib))
        nbytes = 2 * sum(math.prod(shape) for _, shape in tensors)
        assert len(tensors) == 291
        assert 0.5 < nbytes / (gib / 16 * 16.06e9) < 2, f"--gib {gib} wrote {nbytes / 1e9:.3f} GB"


def test_the_cli_wall_clock_is_split_at_its_notes(parent):
    lines = [
        (1.0, "checking /m ..."),
        (5.2, "hashing 4 weight files seen for the first time (15.0 GiB) ..."),
        (15.3, "loading m (LlamaForCausalLM, hf) (15.0 GiB or more) into cuda:0 arenas ..."),
        (23.7, "published 0123456789ab  m (LlamaForCausalLM, hf): 291 tensors, 15.0 GiB in 8 arenas, 18.42 s"),
    ]
    phases = parent.cli_phases(lines, wall=25.3)
    assert phases["start_and_checks_s"] == 5.2 and phases["cli_reported_s"] == 18.42
    assert phases["hashing_s"] == pytest.approx(10.1) and phases["read_and_publish_s"] == pytest.approx(8.4)
    assert phases["exit_s"] == pytest.approx(1.6)
    remembered = parent.cli_phases([lines[0], (5.0, lines[2][1]), (13.0, lines[3][1])], wall=14.0)
    assert remembered["hashing_s"] is None and remembered["start_and_checks_s"] == 5.0


def test_a_flipped_byte_reads_NO_and_fails_the_run(tmp_path):
    """Two rows on a tiny checkpoint on the CPU: plain reads verify, one byte changed after the clock does not."""
    out = tmp_path / "cold.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "cold.py"), "--make-checkpoint", str(tmp_path / "ck"), "--gib", "0.002"]
    command += ["--device", "cpu", "--methods", "raw-buffered,control-flip,serverless-llm-store", "--json", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, f"a mismatch must fail the run:\n{proc.stdout}\n{proc.stderr}"
    methods = json.loads(out.read_text())["methods"]
    assert methods["raw-buffered"]["verified"] is True, proc.stdout
    assert methods["control-flip"]["verified"] is False
    assert methods["control-flip"]["runs"][0]["verify"]["differ"], "the changed tensor is named"
    assert methods["serverless-llm-store"]["status"] == "not run" and "cp310" in methods["serverless-llm-store"]["reason"]
    assert "| NO (1 differ) |" in proc.stdout and "BYTES DIFFER: control" in proc.stdout


def test_rows_rotate_between_runs_and_the_bracketing_row_stays_last(parent):
    names = ["raw-direct", "fastsafetensors", "wc-reader", "raw-direct"]
    assert [n for _, n in parent.rotated(names, 0)] == names
    assert parent.rotated(names, 1) == [(1, "fastsafetensors"), (2, "wc-reader"), (0, "raw-direct"), (3, "raw-direct")]
    assert [n for _, n in parent.rotated(["a", "b"], 3)] == ["b", "a"]


def test_priming_reads_every_file_once(parent, tmp_path):
    files = []
    for number, size in enumerate((5, parent.PIECE_BYTES + 3)):
        files.append(tmp_path / f"f{number}")
        files[-1].write_bytes(b"x" * size)
    before = _bytes_read()
    assert parent.prime_disk(files) >= 0
    assert _bytes_read() - before >= sum(f.stat().st_size for f in files)


def _bytes_read() -> int:
    with open("/proc/self/io") as fh:
        return int(next(line for line in fh if line.startswith("rchar:")).split()[1])


def test_a_reader_variant_is_a_wc_reader_row_with_its_environment(cold):
    assert cold.parse_variant("32 threads:WEIGHTCACHE_READ_THREADS=32, X=1") == (
        "wc-reader [32 threads]",
        {"WEIGHTCACHE_READ_THREADS": "32", "X": "1"},
    )
    assert cold.parse_variant("wc-publish-first@pieces:WEIGHTCACHE_READ_BLOCK_KIB=0") == (
        "wc-publish-first [pieces]",
        {"WEIGHTCACHE_READ_BLOCK_KIB": "0"},
    )
    for malformed in ("no-colon", ":A=1", "label:", "label:A"):
        with pytest.raises(ValueError, match="LABEL:ENV=VALUE"):
            cold.parse_variant(malformed)
    for unknown in ("nosuch@x:A=1", "serverless-llm-store@x:A=1"):
        with pytest.raises(ValueError, match="not a method that runs"):
            cold.parse_variant(unknown)
