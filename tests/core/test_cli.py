"""The ``weightcache`` command as a user meets it: each mistake ends in one line and a non-zero exit.

Every test runs the CLI in a fresh process and asserts on its exit status and the exact
first line of stderr. A small wrapper reports which heavy modules the process imported:
a check that must happen before any weight is read must not even import torch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from tests import zygote
from tests.helpers import ServerProcess
from weightcache.core import __version__
from weightcache.core.client.client import Connection
from weightcache.core.errors import FingerprintMismatch, UnsupportedQuantization
from weightcache.core.progress import format_bytes
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


# --- load: the budget ----------------------------------------------------------------------------------------


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


# --- serve's numeric options -------------------------------------------------------------------------


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


# --- messages: a mismatch; load reading ahead, its exit, Ctrl-C -----------------------------------------


def test_a_mismatch_names_a_short_digest_and_its_fields_once():
    from weightcache.core.client.attach import fallback_reason

    closest = "c" * 64
    reason = fallback_reason(FingerprintMismatch("a" * 64, ("dtype", "tp_rank"), closest))
    assert reason == (
        f"no cached entry for fingerprint {'a' * 12}: the closest entry, {'c' * 12}, differs in: dtype, tp_rank; "
        "publish one with `weightcache load`"
    )


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
        # Ctrl-C at a terminal: SIGINT not ignored, whatever this run's caller ignores (a background job ignores it,
        # and Python installs no KeyboardInterrupt handler for a signal ignored at its start).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
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
