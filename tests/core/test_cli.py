"""The ``weightcache`` command as a user meets it: each mistake ends in one line and a non-zero exit.

Every test runs the CLI in a fresh process and asserts on its exit status and the exact
first line of stderr. A small wrapper reports which heavy modules the process imported:
a check that must happen before any weight is read must not even import torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pty
import re
import select
import shlex
import struct
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest

from tests import zygote
from tests.core.support import make_fingerprint, publish_host_entry
from tests.helpers import ServerProcess
from weightcache.core import __version__
from weightcache.core.client.client import Connection
from weightcache.core.errors import FingerprintMismatch, UnsupportedQuantization
from weightcache.core.progress import format_bytes, format_speedup
from weightcache.core.quantization.allowlist import PER_TENSOR_FP8
from weightcache.core.server.bounds import SIZE_EXAMPLE

ROOT = Path(__file__).resolve().parents[2]
DEVICE_SPELLINGS = "'cpu', 'cuda', 'cuda:N' or a GPU UUID ('GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx')"
CHECKPOINT_HINT = "pass a checkpoint directory that holds *.safetensors files (save_pretrained writes them)"
DAMAGED = "the file is damaged; copy or download the checkpoint again"

_WRAPPER = """
import os, sys
for name in filter(None, os.environ.get("WC_TEST_HIDE_MODULES", "").split(",")):
    sys.modules[name] = None  # as if the package were not installed
from weightcache.core.cli.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
sys.stderr.write("[imported: " + " ".join(m for m in ("torch", "weightcache.core.load.reader") if sys.modules.get(m)) + "]\\n")
sys.exit(code)
"""


@attrs.frozen
class Run:
    code: int
    stdout: str
    stderr: list[str]  # the CLI's lines, without the wrapper's
    imported: set[str] | None  # None where the process was forked from the test zygote (it has torch imported)

    @property
    def first(self) -> str:
        return self.stderr[0] if self.stderr else ""


def cli(*args: str, env: dict | None = None, timeout: float = 300, fork: bool = False) -> Run:
    """``weightcache ARGS`` in a fresh process (stderr not a terminal); ``fork``: from the test zygote (tests/zygote.py)
    if its rules allow, for a test that does not ask what the process imported (``imported`` is None then)."""
    proc = (zygote.run if fork else subprocess.run)(
        [sys.executable, "-c", _WRAPPER, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )
    lines = proc.stderr.splitlines()
    assert lines and lines[-1].startswith("[imported:"), proc.stderr
    imported = set(lines[-1].removeprefix("[imported:").rstrip("]").split())
    return Run(proc.returncode, proc.stdout, lines[:-1], None if isinstance(proc, zygote.Forked) else imported)


def write_safetensors(path: Path, data: bytes = bytes(range(64))) -> Path:
    """A one-tensor safetensors file ("w": float32 4x4), written by hand."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    directory = tmp_path / "tiny"
    directory.mkdir()
    write_safetensors(directory / "model.safetensors")
    return directory


@pytest.fixture
def no_server(tmp_path) -> Path:
    directory = tmp_path / "no-server"
    directory.mkdir(mode=0o700)
    return directory


# --- options refused before anything is read -------------------------------------------------------


@pytest.mark.parametrize("device", ["gpu", "mps", "banana", "cpu:0", "cuda0"])
def test_a_device_weightcache_cannot_use_is_refused_in_one_line(device, checkpoint):
    run = cli("load", "--model", str(checkpoint), "--device", device)
    assert run.code == 2 and run.stderr == [
        f"weightcache: error: argument --device: '{device}' is not a device weightcache can use; use {DEVICE_SPELLINGS} "
        "(see `weightcache load --help`)"
    ]
    assert run.stdout == "" and not run.imported


def test_an_unknown_dtype_is_refused_with_the_choices(checkpoint):
    run = cli("load", "--model", str(checkpoint), "--dtype", "bogus")
    assert run.code == 2 and run.first == (
        "weightcache: error: argument --dtype: invalid choice: 'bogus' (choose from 'auto', 'bfloat16', 'float16', 'float32') "
        "(see `weightcache load --help`)"
    )


def test_a_rank_outside_the_tensor_parallel_size_is_refused(checkpoint, no_server):
    run = cli("load", "--model", str(checkpoint), "--tp-size", "2", "--tp-rank", "5", "--socket-dir", str(no_server))
    assert run.code == 1 and run.stderr == ["weightcache: error: --tp-rank 5 does not fit --tp-size 2; give a rank from 0 to 1"]
    assert cli("load", "--model", str(checkpoint), "--tp-size", "0").first == (
        "weightcache: error: argument --tp-size: '0' is not a whole number of at least 1 (see `weightcache load --help`)"
    )


@pytest.mark.parametrize("method", ["fp8-per-tensor", "fp8-tensor", "fp8"])
def test_per_tensor_fp8_is_refused_with_its_reason_not_as_unknown(method, checkpoint, no_server):
    run = cli("load", "--model", str(checkpoint), "--quant", method, "--socket-dir", str(no_server))
    assert run.code == 1 and run.stderr == [f"weightcache: error: {UnsupportedQuantization(method, PER_TENSOR_FP8)}"]
    assert "per-tensor FP8" in run.first and "unknown" not in run.first and not run.imported


# --- the checkpoint: files and headers --------------------------------------------------------------


def test_a_missing_empty_or_safetensors_less_directory_is_refused(tmp_path, no_server):
    missing, empty, configs_only = tmp_path / "missing", tmp_path / "empty", tmp_path / "configs-only"
    empty.mkdir()
    configs_only.mkdir()
    (configs_only / "config.json").write_text("{}")
    expected = {
        missing: "no such file or directory",
        empty: "it is empty (weightcache reads safetensors checkpoints only)",
        configs_only: "it holds no *.safetensors file (weightcache reads safetensors checkpoints only)",
    }
    for path, problem in expected.items():
        run = cli("load", "--model", str(path), "--socket-dir", str(no_server))
        assert run.code == 1 and run.stderr == [f"weightcache: error: {path}: {problem}; {CHECKPOINT_HINT}"], run
        assert not run.imported


def test_a_truncated_file_is_refused_before_reading_weights(checkpoint, no_server):
    file = checkpoint / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-10])
    run = cli("load", "--model", str(checkpoint), "--socket-dir", str(no_server))
    assert run.code == 1 and run.stderr == [
        f"weightcache: error: {file}: it is 10 bytes shorter than its header says (cut off?); {DAMAGED}"
    ]
    assert not run.imported


@pytest.mark.parametrize(
    ("header", "problem"),
    [
        (
            b'{"w": {"dtype": "F32", "shape": [4, 4]}}',
            "the header's record of tensor 'w' is malformed (it needs dtype, shape and data_offsets)",
        ),
        (
            b'{"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 60]}}',
            "tensor 'w' spans 60 bytes but its dtype and shape need 64",
        ),
        (b"not json at all", "its header is not a safetensors JSON object"),
    ],
)
def test_a_corrupted_header_is_refused(header, problem, checkpoint, no_server):
    file = checkpoint / "model.safetensors"
    file.write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    run = cli("load", "--model", str(checkpoint), "--socket-dir", str(no_server))
    assert run.code == 1 and run.stderr == [f"weightcache: error: {file}: {problem}; {DAMAGED}"]


# --- the server --------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["load", "--model", "CHECKPOINT"], ["status"], ["evict", "abcd1234"]])
def test_no_server_says_how_to_start_one_on_the_directory_given(command, checkpoint, no_server):
    args = [str(checkpoint) if arg == "CHECKPOINT" else arg for arg in command]
    run = cli(*args, "--socket-dir", str(no_server))
    assert run.code == 1 and run.stderr == [
        f"weightcache: error: no weightcache server at {no_server}/weightcache.sock (no socket); "
        f"start one with `weightcache serve --socket-dir {no_server}`"
    ]
    assert "daemon" not in run.first and not run.imported, "a missing server is said before anything heavy is imported"


def test_no_server_on_the_default_directory_suggests_plain_serve(no_server):
    run = cli("status", env={"WEIGHTCACHE_SOCKET_DIR": str(no_server)})
    assert run.code == 1 and run.stderr == [
        f"weightcache: error: no weightcache server at {no_server}/weightcache.sock (no socket); start one with `weightcache serve`"
    ]


def test_without_transformers_the_hf_adapter_says_what_to_install(checkpoint, server):
    run = cli(
        "load", "--model", str(checkpoint), "--socket-dir", str(server.socket_dir), env={"WC_TEST_HIDE_MODULES": "transformers"}
    )
    assert run.code == 1 and run.stderr == [
        "weightcache: error: the hf adapter needs transformers: `pip install 'weightcache[hf]'`"
    ]


def test_a_cuda_device_on_a_machine_without_cuda_is_one_line(checkpoint, server):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    build = "was built without CUDA" if torch.version.cuda is None else "finds no CUDA GPU"
    run = cli("load", "--model", str(checkpoint), "--device", "cuda:0", "--socket-dir", str(server.socket_dir))
    assert run.code == 1 and run.stderr == [
        f"weightcache: error: device 'cuda:0' is not available here: this torch ({torch.__version__}) {build}; "
        "use device 'cpu', or run where that GPU is visible"
    ]
    assert "weightcache.core.load.reader" not in run.imported


def test_verbose_adds_the_traceback_of_a_mistake(no_server):
    plain, verbose = cli("status", "--socket-dir", str(no_server)), cli("--verbose", "status", "--socket-dir", str(no_server))
    assert not any("Traceback" in line for line in plain.stderr)
    assert verbose.first == "Traceback (most recent call last):" and verbose.stderr[-1] == plain.first


# --- load: asks the server first, prints once, shows progress on a terminal -----------------------------


def run_on_terminal(args: list[str], env: dict) -> tuple[int, str, str]:
    """Run ``args`` with stderr on a pseudo-terminal (120 columns); its exit status, stdout and what the terminal showed."""
    import fcntl
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = zygote.popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, cwd=ROOT, env={**os.environ, **env})
    os.close(slave)
    shown = b""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            shown += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    with proc.stdout:
        stdout = proc.stdout.read().decode()
    return proc.wait(timeout=60), stdout, shown.decode(errors="replace").replace("\r\n", "\n")


def test_load_shows_progress_on_a_terminal_then_finds_the_entry_cached_without_loading(model_dir, server, tmp_path):
    path = model_dir("llama")
    digests = {"WEIGHTCACHE_CACHE_DIR": str(tmp_path / "digests")}  # a store of its own: the files are seen for the first time
    code, stdout, shown = run_on_terminal(
        [sys.executable, "-m", "weightcache.core.cli.cli", "load", "--model", str(path), "--socket-dir", str(server.socket_dir)],
        digests,
    )
    assert code == 0, shown
    assert shown.startswith(f"checking {path} ...\n"), "the first thing on the terminal says what is happening"
    assert "first sight of these weight files: their digests are computed from the bytes read, in the same pass" in shown
    assert "hashing" not in shown, "a first load reads each byte once: no hashing pass of its own"
    assert re.search(r"loading: 100%\|.*\| [\d.]+/[\d.]+ MiB \[.*MiB/s\]", shown), shown
    [line] = stdout.splitlines()
    label = f"{path.name} (LlamaForCausalLM, hf)"  # the checkpoint directory's name
    assert re.fullmatch(rf"published [0-9a-f]{{12}}  {re.escape(label)}: \d+ tensors, [\d.]+ MiB in 1 arena, [\d.]+ s", line), (
        line
    )
    assert "published" not in shown, "the result is printed once, on stdout"

    digest = line.split()[1]
    again = cli("load", "--model", str(path), "--socket-dir", str(server.socket_dir), env=digests)
    assert again.code == 0 and again.stderr == [], again
    assert re.fullmatch(rf"already cached: {digest}  {re.escape(label)}, [\d.]+ MiB; nothing was loaded\n", again.stdout), again
    assert "weightcache.core.load.reader" not in again.imported, "a cached entry is not loaded again"


def test_a_model_that_cannot_fit_the_budget_is_refused_before_loading(model_dir, socket_dir):
    from weightcache.core.identity.safetensors_io import check_checkpoint

    path = model_dir("llama")
    needed = sum(t.nbytes for header in check_checkpoint(path) for t in header.tensors)  # float32, loaded as float32
    server = ServerProcess.start(socket_dir, "--byte-budget", "1M")
    try:
        run = cli("load", "--model", str(path), "--socket-dir", str(socket_dir))
        status = cli("status", "--socket-dir", str(socket_dir))
    finally:
        server.close()
    assert run.code == 1 and run.stderr == [
        f"weightcache: error: the model needs at least {format_bytes(needed)} but the server can make room for only 1.0 MiB "
        "(its budget is 1.0 MiB, 0 B of it held by entries engines have attached); nothing was loaded. Restart the server "
        "with a larger --byte-budget, detach engines, or evict entries (`weightcache status` lists them)"
    ]
    assert "weightcache.core.load.reader" not in run.imported
    assert (
        status.stdout.splitlines()[0]
        == f"server pid {server.pid} (weightcache {__version__}): 0 entries, 0 B held of a 1.0 MiB budget"
    )


def test_the_publish_log_does_not_claim_publishing_an_entry_that_existed(model_dir, server):
    path = model_dir("llama")
    code = f"""
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
from weightcache.core.flow.loader import prepare, publish
from weightcache.core.request import LoadRequest
for _ in range(2):
    publish(prepare(LoadRequest(model={str(path)!r})), {str(server.socket_dir)!r})
"""
    proc = zygote.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if f"({path.name} (LlamaForCausalLM, hf))" in line]
    assert proc.returncode == 0 and len(lines) == 2, proc.stdout + proc.stderr
    assert lines[0].startswith("published ") and lines[1].startswith("loaded, but the server already held "), lines


# --- status, evict ----------------------------------------------------------------------------------


def test_status_is_a_readable_table(server):
    entry = publish_host_entry(server.socket_dir, nbytes=1 << 20, label="tiny-llama (LlamaForCausalLM, hf)")
    run = cli("status", "--socket-dir", str(server.socket_dir))
    assert run.code == 0 and run.stderr == []
    lines = [re.sub(r"\d+ s ago", "N s ago", line) for line in run.stdout.splitlines()]
    assert lines == [
        f"server pid {server.pid} (weightcache {__version__}): 1 entry, 1.0 MiB held (no budget)",
        "  since its start N s ago: 0 attaches, 0 misses, 0 fallbacks reported, 0 evictions, 0 refusals",
        "ID            MODEL                              RANK   DEVICE      DTYPE    SIZE     TENSORS  ATTACHED PIDS",
        f"{entry.digest[:12]}  tiny-llama (LlamaForCausalLM, hf)  tp1/2  cpu (host)  float32  1.0 MiB  1        -",
    ]


def test_status_json_fields_are_the_documented_ones(server):
    publish_host_entry(server.socket_dir)
    reply = json.loads(cli("status", "--json", "--socket-dir", str(server.socket_dir)).stdout)
    documented = set(re.findall(r"^\| `([a-z_\[\].]+)` \|", (ROOT / "docs" / "operations.md").read_text(), flags=re.MULTILINE))
    assert {f"entries[].{key}" for key in reply["entries"][0]} | set(reply) == documented


def test_an_entry_published_through_the_api_without_a_label_gets_one(server):
    torch = pytest.importorskip("torch")
    from weightcache.core.flow import api

    fingerprint = make_fingerprint()
    api.publish_state({"w": torch.ones(4)}, fingerprint, socket_dir=server.socket_dir)
    run = cli("status", "--json", "--socket-dir", str(server.socket_dir))
    assert json.loads(run.stdout)["entries"][0]["label"] == "WireTestForCausalLM (wiretest)"


def test_a_closed_pipe_ends_status_quietly(server):
    publish_host_entry(server.socket_dir)
    read_end, write_end = os.pipe()
    os.close(read_end)  # `weightcache status | head -0`: the reader is gone before the first write
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "weightcache.core.cli.cli", "status", "--socket-dir", str(server.socket_dir)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr


# --- help and sizes ---------------------------------------------------------------------------------


def test_every_command_has_a_description_and_every_option_help():
    import argparse

    from weightcache.core.cli.cli import build_parser

    parser = build_parser()
    [commands] = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    for name, command in commands.choices.items():
        assert command.description, f"`weightcache {name}` has no description"
        for action in command._actions:
            assert action.help, f"`weightcache {name} {'/'.join(action.option_strings) or action.dest}` has no help"
    shown = subprocess.run(
        [sys.executable, "-m", "weightcache.core.cli.cli", "load", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "--dtype {auto,bfloat16,float16,float32}" in shown


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("lots", f"'lots' is not a size; write {SIZE_EXAMPLE}"),
        ("0", "'0' is no room at all; give a size above 0 (or leave the option out for no limit)"),
    ],
)
def test_a_byte_budget_that_is_no_size_is_refused(value, problem, no_server):
    run = cli("serve", "--socket-dir", str(no_server), "--byte-budget", value)
    assert run.code == 2 and run.stderr == [
        f"weightcache: error: argument --byte-budget: {problem} (see `weightcache serve --help`)"
    ]


SECONDS_RANGE = "a number of seconds from 0.01 to 86400 (1 day)"
NUMERIC_SERVE_OPTIONS = [
    *(("--frame-deadline", value, f"{value!r} is not {SECONDS_RANGE}") for value in ("nan", "0", "-5", "inf", "1e400", "86401")),
    *(("--idle-timeout", value, f"{value!r} is not {SECONDS_RANGE}, or 0 for never") for value in ("-1", "nan", "inf", "1e9")),
    *(
        ("--max-connections", value, f"{value!r} is not a whole number of connections from 1 to 1048576")
        for value in ("0", "-3", "nan", "1.5", "99999999")
    ),
    *(
        (flag, value, f"{value!r} is not a size; write {SIZE_EXAMPLE}")
        for flag in ("--byte-budget", "--host-budget", "--gpu-budget")
        for value in ("-5", "nan", "inf")
    ),
    ("--gpu-budget", "2000000T", "'2000000T' is more than any machine holds; give a size up to 1 EiB"),
]


@pytest.mark.parametrize(("flag", "value", "problem"), NUMERIC_SERVE_OPTIONS, ids=lambda p: str(p)[:20])
def test_a_numeric_serve_option_out_of_range_is_refused_before_the_socket_is_bound(flag, value, problem, no_server):
    run = cli("serve", "--socket-dir", str(no_server), flag, value, timeout=30)
    assert run.code == 2 and run.stderr == [f"weightcache: error: argument {flag}: {problem} (see `weightcache serve --help`)"]
    assert list(no_server.iterdir()) == [], "the server bound its socket before refusing"


def test_numeric_serve_options_at_their_bounds_are_accepted():
    from weightcache.core.cli.cli import build_parser

    args = build_parser().parse_args(
        ["serve", "--frame-deadline", "0.01", "--idle-timeout", "86400", "--max-connections", "1048576", "--byte-budget", "1"]
    )
    assert (args.frame_deadline, args.idle_timeout, args.max_connections, args.byte_budget) == (0.01, 86400.0, 1 << 20, 1)
    assert build_parser().parse_args(["serve", "--idle-timeout", "0"]).idle_timeout == 0  # never


def test_sizes_read_and_show_in_fitting_units():
    from weightcache.core.cli.cli_options import size

    assert [size(text) for text in ("1M", "1MiB", "64g", "1.5T", "4096")] == [1 << 20, 1 << 20, 64 << 30, 3 << 39, 4096]
    assert [size(text) for text in ("10GiB", "10Gi", "10gi", "10G")] == [10 << 30] * 4
    assert [size(text) for text in ("10GB", "10gb", "1.5TB", "512MB", "2kB")] == [
        10 * 10**9,
        10 * 10**9,
        15 * 10**11,
        512 * 10**6,
        2000,
    ]
    assert [size(text) for text in ("4096B", "4096b")] == [4096, 4096]
    for wrong in ("10Gx", "10iB", "10GBi", "G"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not a size"):
            size(wrong)
    assert [format_bytes(n) for n in (0, 512, 1 << 20, int(86.7 * 2**20), 1023.99 * 1024, 3 << 40)] == [
        "0 B",
        "512 B",
        "1.0 MiB",
        "86.7 MiB",
        "1.0 MiB",
        "3.0 TiB",
    ]


# --- messages: mismatch, demo and benchmark tables -------------------------------------------------------


def test_a_mismatch_names_a_short_digest_and_its_fields_once():
    from weightcache.core.client.attach import fallback_reason

    closest = "c" * 64
    reason = fallback_reason(FingerprintMismatch("a" * 64, ("dtype", "tp_rank"), closest))
    assert reason == (
        f"no cached entry for fingerprint {'a' * 12}: the closest entry, {'c' * 12}, differs in: dtype, tp_rank; "
        "publish one with `weightcache load`"
    )


def test_the_demo_ends_with_commands_that_exist_to_try_next():
    from weightcache.core.cli.cli import build_parser
    from weightcache.core.cli.demo import next_steps

    lines = next_steps("/models/m")
    assert lines[0].startswith("what to try next")
    commands = [shlex.split(line.split("#")[0])[1:] for line in lines if line.strip().startswith("weightcache ")]
    assert [command[0] for command in commands] == ["serve", "load", "status"]
    for command in commands:
        build_parser().parse_args(command)  # each runs as shown
    assert any("load_model(" in line for line in lines)


def test_the_demo_table_says_slower_when_attach_is_slower():
    from weightcache.core.cli.demo import demo_table

    published = {
        "first_sight": True,
        "publish_s": 1.3,
        "timings": {"load_s": 0.2, "identify_s": 0.1, "export_s": 1.0, "publish_s": 0.1},
    }
    lines = demo_table(published, {"load_s": 0.04}, {"load_s": 0.05, "output_sha256": "ab" * 32}, True)
    assert "engine B, mode client: 1.2x slower than engine A's disk load" in lines[5]
    assert "loader: read 200.0 ms, copy into new shared memory 1,000.0 ms, publish 100.0 ms" in lines[3]
    assert "first sight: digested from the bytes read" in lines[2] and "100.0 ms" in lines[2]
    assert format_speedup(1.0, 0.1) == "10.0x faster" and format_speedup(0.8, 1.0) == "1.2x slower"


def test_the_attach_benchmark_table_has_no_fractional_faster_and_no_blown_out_column(capsys):
    spec = importlib.util.spec_from_file_location("bench_attach", ROOT / "benchmarks" / "attach.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = {
        "device": "cpu",
        "gib": 2.0,
        "tensors": 1000,
        "torch": "2.13",
        "safetensors_warm_s": 0.05,
        "safetensors_warm_touched_s": 0.9,
        "weightcache_load_s": 1.7,
        "weightcache_load_cold": False,
        "attach": {
            "median_s": 0.012,
            "tensors": 1000,
            "arenas": 2,
            "touched_median_s": 1.1,
            "phases_ms": {"connect_s": 0.3, "map_s": 2.1, "view_s": 5.0},
        },
    }
    bench.print_table(results, 2 << 30)
    out = capsys.readouterr().out
    assert not re.search(r"\b0\.\d+x faster", out) and "1.2x slower" in out, out
    rule = next(line for line in out.splitlines() if line.startswith("---"))
    assert len(rule.split()[1]) <= 12, f"the time column is blown out:\n{out}"


def test_commands_quote_the_socket_dir_as_given(tmp_path):
    spaced = tmp_path / "my sockets"
    spaced.mkdir(mode=0o700)
    run = cli("status", "--socket-dir", str(spaced))
    assert run.first.endswith(f"start one with `weightcache serve --socket-dir {shlex.quote(str(spaced))}`")


def test_load_publishes_the_same_entry_with_and_without_reading_ahead(model_dir, tmp_path):
    path = model_dir("llama")
    digests = []
    for number, flags in enumerate(([], ["--no-prefetch"])):
        server = ServerProcess.start()
        try:
            env = {"WEIGHTCACHE_CACHE_DIR": str(tmp_path / f"digests-{number}")}  # first sight each time
            run = cli("load", "--model", str(path), "--socket-dir", str(server.socket_dir), *flags, env=env, fork=True)
            assert run.code == 0 and run.stdout.startswith("published "), run
            digests.append(run.stdout.split()[1])
        finally:
            server.close()
    assert digests[0] == digests[1]


def test_a_restart_with_digests_remembered_reads_ahead_too_and_publishes_the_same_entry(model_dir, tmp_path):
    """The prefetch runs on every load, not only on first sight: a restart's read otherwise began
    only once torch and the CUDA context were up."""
    path = model_dir("llama")
    env = {"WEIGHTCACHE_CACHE_DIR": str(tmp_path / "digests")}
    digests = []
    for _ in range(2):  # the second load: a fresh server, the digests remembered
        server = ServerProcess.start()
        try:
            run = cli("-v", "load", "--model", str(path), "--socket-dir", str(server.socket_dir), env=env, fork=True)
            assert run.code == 0 and "published " in run.stdout, run
            assert any("ahead of the load" in line for line in run.stderr), "the weight files are read ahead"
            digests.append(run.stdout.split("published ")[1].split()[0])
        finally:
            server.close()
    assert digests[0] == digests[1]


def test_the_console_script_skips_teardown_only_after_load_and_keeps_the_exit_status(model_dir, tmp_path):
    from weightcache.core.cli.cli import FAST_EXIT_COMMANDS, _subcommand

    assert _subcommand(["-v", "load", "--model", "x"]) == "load" and _subcommand(["--version"]) is None
    assert FAST_EXIT_COMMANDS == {"load"}
    refused = subprocess.run(
        [sys.executable, "-m", "weightcache.core.cli.cli", "load", "--model", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 1 and refused.stderr.startswith("weightcache: error: "), refused


def test_ctrl_c_during_load_says_it_stopped_and_that_nothing_was_published(model_dir, server):
    """The server is held (SIGSTOP) once the load has met it, so the interrupt lands before the publish, every time."""
    import signal

    CLI = [sys.executable, "-m", "weightcache.core.cli.cli"]
    load = subprocess.Popen(
        [*CLI, "-v", "load", "--model", str(model_dir("llama")), "--no-prefetch", "--socket-dir", str(server.socket_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        seen = []
        for line in load.stderr:
            seen.append(line)
            if "load: the server answered" in line:
                break
        server.proc.send_signal(signal.SIGSTOP)
        try:
            load.send_signal(signal.SIGINT)
            stdout, stderr = load.communicate(timeout=120)
        finally:
            server.proc.send_signal(signal.SIGCONT)
    finally:
        if load.poll() is None:
            load.kill()
            load.wait()
    said = f"weightcache: load of {model_dir('llama')} stopped (Ctrl-C); nothing was published"
    assert load.returncode == 130 and said in stderr.splitlines(), "".join(seen) + stderr[-3000:]
    assert "Traceback" not in stderr and stdout == "", stderr[-3000:]
    with Connection(server.socket_dir) as connection:
        assert connection.status()["entries"] == []


# --- an earlier trial's leftovers: each ends in one line ------------------------------------------

_TRUNCATING = """
import os, sys
from weightcache.core.load import reader
original = reader.read_block
def read_block(fd, direct_fd, buffer, start, offset, nbytes):
    os.truncate(os.readlink(f"/proc/self/fd/{fd}"), start + offset + 16)  # another process cuts the file off meanwhile
    reader.read_block = original
    return original(fd, direct_fd, buffer, start, offset, nbytes)
reader.read_block = read_block
from weightcache.core.cli.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_file_cut_off_while_it_is_read_is_one_line(model_dir, tmp_path, server):
    checkpoint = tmp_path / "copy"
    checkpoint.mkdir()
    for file in model_dir("llama").iterdir():
        (checkpoint / file.name).write_bytes(file.read_bytes())
    proc = zygote.run(
        [sys.executable, "-c", _TRUNCATING, "load", "--model", str(checkpoint), "--socket-dir", str(server.socket_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    file = checkpoint / "model.safetensors"
    assert proc.returncode == 1 and proc.stderr.splitlines()[0] == (
        f"weightcache: error: {file} changed while {checkpoint} was being loaded; nothing was published. "
        "Load it again once the checkpoint is written completely"
    ), proc.stderr
    with Connection(server.socket_dir) as connection:
        assert connection.status()["entries"] == [], "nothing is published from a file cut off while read"


def test_a_model_class_of_another_architecture_is_one_line(model_dir, server):
    run = cli(
        "load",
        "--model",
        str(model_dir("llama")),
        "--model-class",
        "GPT2LMHeadModel",
        "--socket-dir",
        str(server.socket_dir),
        fork=True,
    )
    assert run.code == 1 and run.stderr == [
        "weightcache: error: model class GPT2LMHeadModel is built from 'gpt2' configs, but this checkpoint is a 'llama' "
        "model (LlamaForCausalLM); pass a class of its architecture, or leave model_class out"
    ], run


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_an_adapter_whose_engine_is_not_installed_is_one_line_and_not_called_usable(checkpoint, no_server):
    run = cli("load", "--model", str(checkpoint), "--adapter", "vllm", "--socket-dir", str(no_server))
    assert run.code == 1 and run.first.startswith(
        "weightcache: error: the 'vllm' adapter is not usable: it needs vllm, which is not installed here; `pip install vllm`. "
        "Usable adapters: hf"
    ), run
    other = cli("load", "--model", str(checkpoint), "--adapter", "nope", "--socket-dir", str(no_server))
    usable = other.first.rpartition("Usable adapters: ")[2].split(", ")
    assert "vllm" not in usable and ("sglang" in usable) == (importlib.util.find_spec("sglang") is not None), other


def test_a_weight_file_given_as_the_model_is_one_line(model_dir, server):
    file = model_dir("llama") / "model.safetensors"
    run = cli("load", "--model", str(file), "--socket-dir", str(server.socket_dir))
    assert run.code == 1 and run.stderr == [
        f"weightcache: error: {file} is a file; the hf adapter takes the checkpoint directory that holds config.json "
        f"and the weights (here: {file.parent})"
    ], run


@pytest.mark.parametrize("command", ["seed", "standby", "verify"])
def test_help_shows_no_docstring_markup(command):
    run = cli(command, "--help")
    assert run.code == 0 and run.stdout
    for markup in ("``", ":param", ":class:", ":func:"):
        assert markup not in run.stdout, f"`weightcache {command} --help` prints {markup!r}"


def test_every_command_spells_its_deadline_timeout_and_still_takes_timeout_s():
    from weightcache.core.cli.cli import build_parser

    for command in ("seed", "standby"):
        shown = cli(command, "--help").stdout
        assert "--timeout SECONDS" in shown and "--timeout-s" not in shown, shown
    parser = build_parser()
    assert parser.parse_args(["standby", "--model", "m", "--timeout-s", "5"]).timeout == 5.0
    assert parser.parse_args(["standby", "--model", "m", "--timeout", "7"]).timeout == 7.0
    assert parser.parse_args(["seed", "--timeout-s", "9"]).timeout == 9.0


def test_serve_help_lists_its_signals_environment_and_exit_codes():
    run = cli("serve", "--help", fork=True)
    assert run.code == 0
    for text in ("SIGTERM", "SIGHUP", "SIGUSR2", "WEIGHTCACHE_SOCKET_DIR", "NOTIFY_SOCKET", "exit status:", "/healthz"):
        assert text in run.stdout, text


def test_serve_dash_v_says_that_v_goes_before_the_command():
    run = cli("serve", "-v", fork=True)
    assert run.code == 2 and "put it before the command (`weightcache -v serve ...`)" in run.stderr[-1], run
