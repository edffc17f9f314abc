"""A checkpoint a disk load refuses is refused on every path, in one line, and nothing is published.

Each file is written here byte by byte; safetensors' own load (``safetensors.torch.load_file``, what transformers and
the engines call) gives the verdict weightcache's must match. weightcache refuses more in two places only (decision
63): a tensor named twice, and a dtype it does not handle. The paths: ``weightcache load``, ``load_model`` in daemon
and client mode, a server's ``[[warm]]`` list, and a hub id resolved from the local hub cache.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.core.test_cli import cli
from tests.core.test_hub import add_to_hub_cache
from tests.helpers import ServerProcess, wait_until
from weightcache.core.client.client import Connection
from weightcache.core.errors import InvalidCheckpoint, NotRegularFile
from weightcache.core.flow.modes import load_model
from weightcache.core.identity.safetensors_header import ST_DTYPES
from weightcache.core.identity.safetensors_io import read_header

DAMAGED = "the file is damaged; copy or download the checkpoint again"
NOT_REGULAR = "put the weights file itself there (a symlink to one is fine)"


def write_file(path: Path, header: bytes, data: bytes = b"", declared: int | None = None) -> Path:
    """A safetensors file as its bytes: the header's length (``declared``, else its own), the header, the data."""
    path.write_bytes(struct.pack("<Q", len(header) if declared is None else declared) + header + data)
    return path


def safetensors_accepts(path: Path) -> bool:
    import safetensors.torch

    try:
        safetensors.torch.load_file(str(path))
    except Exception:  # SafetensorError, and anything else its load raises: a refusal either way
        return False
    return True


def weightcache_problem(path: Path) -> str | None:
    """None where weightcache accepts the file, else the problem its error names."""
    try:
        read_header(path)
    except InvalidCheckpoint as exc:
        return exc.problem
    return None


def record(dtype: str, shape: list, begin: int, end: int, **extra) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end], **extra}


def header_of(*pairs: tuple[str, object]) -> bytes:
    """A JSON object from ``pairs`` in order, a key repeated as often as it comes (json.dumps cannot write that)."""
    return ("{" + ",".join(f"{json.dumps(key)}:{json.dumps(value)}" for key, value in pairs) + "}").encode()


O_PROJ = "model.layers.0.self_attn.o_proj.weight"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
DEEP = 100_000

# (header, data, the problem weightcache names, or None where the file is good)
CASES = {
    "good": (header_of((O_PROJ, record("F32", [2, 2], 0, 16)), (Q_PROJ, record("F32", [2, 2], 16, 32))), bytes(32), None),
    "q_proj_at_o_proj_bytes": (
        header_of((O_PROJ, record("F32", [2, 2], 0, 16)), (Q_PROJ, record("F32", [2, 2], 0, 16))),
        bytes(16),
        f"tensor {Q_PROJ!r} starts at byte 0 of the data, inside tensor {O_PROJ!r} (bytes 0..16): their offsets overlap",
    ),
    "partly_overlapping": (
        header_of((O_PROJ, record("F32", [2, 2], 0, 16)), (Q_PROJ, record("F32", [2, 2], 8, 24))),
        bytes(24),
        f"tensor {Q_PROJ!r} starts at byte 8 of the data, inside tensor {O_PROJ!r} (bytes 0..16): their offsets overlap",
    ),
    "offsets_past_the_end": (
        header_of((O_PROJ, record("F32", [2, 2], 0, 16)), (Q_PROJ, record("F32", [2, 2], 16, 32))),
        bytes(16),
        "it is 16 bytes shorter than its header says (cut off?)",
    ),
    "duplicate_name_leaving_a_hole": (
        header_of((O_PROJ, record("F32", [2, 2], 0, 16)), (O_PROJ, record("F32", [2, 2], 16, 32))),
        bytes(32),
        f"its header names tensor {O_PROJ!r} twice",
    ),
    "hole_between_tensors": (
        header_of((O_PROJ, record("F32", [2, 2], 0, 16)), (Q_PROJ, record("F32", [2, 2], 80, 96))),
        bytes(96),
        f"64 bytes after tensor {O_PROJ!r} belong to no tensor (a hole before tensor {Q_PROJ!r})",
    ),
    "hole_at_the_start": (
        header_of((Q_PROJ, record("F32", [2, 2], 64, 80))),
        bytes(80),
        f"64 bytes at the start of the data belong to no tensor (a hole before tensor {Q_PROJ!r})",
    ),
    "gap_at_the_end": (
        header_of((O_PROJ, record("F32", [2, 2], 0, 16))),
        bytes(16 + 64),
        "it is 64 bytes longer than its header says",
    ),
    "metadata_not_a_map": (
        header_of(("__metadata__", ["format", "pt"]), (O_PROJ, record("F32", [2, 2], 0, 16))),
        bytes(16),
        "its header's __metadata__ is not a map of strings to strings",
    ),
    "metadata_value_not_a_string": (
        header_of(("__metadata__", {"format": "pt", "step": 3}), (O_PROJ, record("F32", [2, 2], 0, 16))),
        bytes(16),
        "its header's __metadata__ is not a map of strings to strings",
    ),
    "metadata_twice": (
        header_of(("__metadata__", {}), ("__metadata__", {}), (O_PROJ, record("F32", [2, 2], 0, 16))),
        bytes(16),
        "its header has __metadata__ twice",
    ),
    "deep_json": (
        b'{"a":' + b"[" * DEEP + b"]" * DEEP + b"}",
        b"",
        "its header's JSON nests deeper than 127 levels, more than safetensors reads",
    ),
    "deepest_json_safetensors_reads": (
        header_of((O_PROJ, record("F32", [2, 2], 0, 16, note=[[[[[[[[[[]]]]]]]]]]))).replace(
            b"[[[[[[[[[[]]]]]]]]]]", b"[" * 125 + b"]" * 125
        ),
        bytes(16),
        None,
    ),
    "one_level_deeper": (
        header_of((O_PROJ, record("F32", [2, 2], 0, 16, note=[]))).replace(b"[]", b"[" * 126 + b"]" * 126),
        bytes(16),
        "its header's JSON nests deeper than 127 levels, more than safetensors reads",
    ),
    "header_longer_than_safetensors_reads": (
        b"{}",
        b"",
        "it declares a 100,000,001-byte header, more than safetensors reads (100,000,000): not a safetensors file",
    ),
    "not_utf8": (b'{"\xff":{}}', b"", "its header is not UTF-8 text"),
    "nan_in_the_header": (
        header_of((O_PROJ, record("F32", [2, 2], 0, 16))).replace(b"}}", b',"x":NaN}}'),
        bytes(16),
        "its header is not a safetensors JSON object",
    ),
    "lone_surrogate": (
        header_of((O_PROJ, record("F32", [2, 2], 0, 16))).replace(b'"F32"', b'"F32","x":"\\ud800"'),
        bytes(16),
        "its header holds a lone UTF-16 surrogate escape (\\ud800-\\udfff), which is no character",
    ),
    "boolean_in_a_shape": (
        header_of((O_PROJ, record("U8", [True], 0, 1))),
        bytes(1),
        f"the header's record of tensor {O_PROJ!r} is malformed (it needs dtype, shape and data_offsets)",
    ),
    "minus_zero_in_a_shape": (
        header_of((O_PROJ, record("U8", [0], 0, 0))).replace(b"[0]", b"[-0]"),
        b"",
        f"the header's record of tensor {O_PROJ!r} is malformed (it needs dtype, shape and data_offsets)",
    ),
    "shape_overflowing_64_bits": (
        header_of((O_PROJ, record("U8", [1 << 32, 1 << 32, 0], 0, 0))),
        b"",
        f"tensor {O_PROJ!r} has shape [4294967296, 4294967296, 0], whose size overflows 64 bits",
    ),
    "dtype_field_twice": (
        header_of((O_PROJ, record("F32", [2, 2], 0, 16))).replace(b'"F32"', b'"F32","dtype":"F32"'),
        bytes(16),
        f"the header's record of tensor {O_PROJ!r} gives dtype twice",
    ),
    "unknown_fields_and_serde_dtype_spelling": (
        header_of((O_PROJ, {"dtype": {"F32": None}, "shape": [2, 2], "data_offsets": [0, 16], "note": {"x": [1, -0.0, 1e300]}})),
        bytes(16),
        None,
    ),
}
REFUSED = [name for name, (_, _, problem) in CASES.items() if problem is not None]


def checkpoint_with(directory: Path, case: str, config_from: Path) -> Path:
    """A checkpoint directory: a real model's config.json and the case's model.safetensors."""
    header, data, _ = CASES[case]
    directory.mkdir(parents=True)
    shutil.copy(config_from / "config.json", directory / "config.json")
    declared = 100_000_001 if case == "header_longer_than_safetensors_reads" else None
    write_file(directory / "model.safetensors", header, data, declared)
    return directory


@pytest.mark.parametrize("case", list(CASES))
def test_weightcache_refuses_exactly_what_safetensors_refuses(case, tmp_path):
    header, data, problem = CASES[case]
    declared = 100_000_001 if case == "header_longer_than_safetensors_reads" else None
    file = write_file(tmp_path / "model.safetensors", header, data, declared)
    assert safetensors_accepts(file) == (problem is None)
    assert weightcache_problem(file) == problem


def disk_load_error(checkpoint: Path) -> BaseException:
    """What the adapter's own disk load (``mode="off"``: transformers, safetensors) raises for ``checkpoint``."""
    with pytest.raises(Exception) as failed:
        load_model(str(checkpoint), mode="off")
    return failed.value


def without_names(error: BaseException | str) -> str:
    """``error``'s message without the tensor names safetensors quotes in backticks: of two tensors at one offset it
    names either, as its hash map's order of the run has it."""
    return re.sub(r"`[^`]*`", "`NAME`", str(error))


def assert_fails_like_the_disk_load(checkpoint: Path, mode: str, socket_dir: Path, expected: str, caplog) -> None:
    """``mode`` gives up on the cache with one warning naming ``expected``, then errors exactly as the disk load does."""
    disk = disk_load_error(checkpoint)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="weightcache"), pytest.raises(type(disk)) as failed:
        load_model(str(checkpoint), mode=mode, socket_dir=socket_dir)
    assert without_names(failed.value) == without_names(disk)
    said = [r.getMessage() for r in caplog.records if r.name.startswith("weightcache") and r.levelno >= logging.WARNING]
    assert said == [f"weightcache: loading {checkpoint} from disk: {expected}"], said


@pytest.mark.parametrize("case", REFUSED)
def test_the_cli_refuses_it_in_one_line_and_daemon_mode_fails_like_the_disk_load(case, tmp_path, model_dir, server, caplog):
    checkpoint = checkpoint_with(tmp_path / "ckpt", case, model_dir("llama"))
    file = checkpoint / "model.safetensors"
    expected = f"{file}: {CASES[case][2]}; {DAMAGED}"
    run = cli("load", "--model", str(checkpoint), "--socket-dir", str(server.socket_dir), fork=True, timeout=120)
    assert run.code == 1 and run.stderr == [f"weightcache: error: {expected}"]
    assert_fails_like_the_disk_load(checkpoint, "daemon", server.socket_dir, expected, caplog)
    with Connection(server.socket_dir) as connection:
        assert connection.status()["entries"] == []


def test_an_identical_duplicate_is_refused_though_safetensors_keeps_the_last_record(tmp_path):
    """One of the two places weightcache refuses more than safetensors: the header's meaning would
    depend on which record a reader keeps."""
    same = record("F32", [2, 2], 0, 16)
    file = write_file(tmp_path / "model.safetensors", header_of((O_PROJ, same), (O_PROJ, same)), bytes(16))
    assert safetensors_accepts(file)
    assert weightcache_problem(file) == f"its header names tensor {O_PROJ!r} twice"


# --- the wrong-weights case through a real server and a client ------------------------------------------------------


def _overlapping_copy(source: Path, target: Path) -> tuple[str, str]:
    """``source`` copied to ``target`` with q_proj's offsets pointing at o_proj's bytes (same shape and dtype); the
    names of the two tensors."""
    shutil.copytree(source, target)
    file = target / "model.safetensors"
    raw = file.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    q = next(name for name in header if name.endswith("layers.0.self_attn.q_proj.weight"))
    o = q.replace("q_proj", "o_proj")
    assert header[q]["shape"] == header[o]["shape"] and header[q]["dtype"] == header[o]["dtype"]
    header[q]["data_offsets"] = header[o]["data_offsets"]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (size - len(text))  # the same length: every other tensor keeps its bytes and place
    assert len(text) == size
    file.write_bytes(raw[:8] + text + raw[8 + size :])
    return q, o


def test_q_proj_pointing_at_o_proj_is_never_published_nor_served(tmp_path, model_dir, server, caplog):
    good = model_dir("llama")
    bad = tmp_path / "bad"
    q, o = _overlapping_copy(good, bad)
    assert not safetensors_accepts(bad / "model.safetensors")
    published = load_model(str(good), mode="daemon", socket_dir=server.socket_dir)  # the server holds the good one
    try:
        with Connection(server.socket_dir) as connection:
            held = [entry["digest"] for entry in connection.status()["entries"]]
        assert len(held) == 1 and published.source == "cache"

        run = cli("load", "--model", str(bad), "--socket-dir", str(server.socket_dir), fork=True, timeout=120)
        file = bad / "model.safetensors"
        data = 8 + struct.unpack("<Q", file.read_bytes()[:8])[0]
        assert run.code == 1 and len(run.stderr) == 1, run.stderr
        (problem,) = run.stderr
        assert (
            problem.startswith(f"weightcache: error: {file}: tensor {q!r} starts at byte ") and "their offsets overlap" in problem
        )
        assert f"inside tensor {o!r}" in problem and data > 0
        expected = problem.removeprefix("weightcache: error: ")
        for mode in ("client", "daemon"):  # the attach a client would make finds nothing; the disk load errors
            assert_fails_like_the_disk_load(bad, mode, server.socket_dir, expected, caplog)
        with Connection(server.socket_dir) as connection:
            assert [entry["digest"] for entry in connection.status()["entries"]] == held, "nothing more was published"
    finally:
        published.close()


# --- files that are no regular file: refused at once, never waited on -----------------------------------------------


def _not_regular(kind: str, file: Path) -> str:
    if kind == "fifo":
        os.mkfifo(file)
        return "a FIFO (named pipe)"
    if kind == "device":
        file.symlink_to("/dev/zero")
        return "a character device"
    if kind == "socket":
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(file))
        listener.close()
        return "a socket"
    file.mkdir()
    return "a directory"


@pytest.mark.parametrize("kind", ["fifo", "device", "socket", "directory"])
def test_a_weight_file_that_is_no_regular_file_is_refused_at_once(kind, tmp_path, model_dir, server):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    shutil.copy(model_dir("llama") / "config.json", checkpoint / "config.json")
    file = checkpoint / "model.safetensors"
    what = _not_regular(kind, file)
    expected = f"{file}: it is {what}, not a regular file; {NOT_REGULAR}"
    began = time.monotonic()
    run = cli("load", "--model", str(checkpoint), "--socket-dir", str(server.socket_dir), fork=True, timeout=60)
    assert run.code == 1 and run.stderr == [f"weightcache: error: {expected}"]
    with pytest.raises(NotRegularFile) as refused:
        load_model(str(checkpoint), mode="daemon", socket_dir=server.socket_dir)
    assert str(refused.value) == expected
    assert time.monotonic() - began < 60


def test_a_fifo_named_by_a_sharded_index_is_refused_not_called_missing(tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-00001.safetensors"}}))
    os.mkfifo(checkpoint / "model-00001.safetensors")
    with pytest.raises(NotRegularFile, match="a FIFO"):
        read_header(checkpoint / "model-00001.safetensors")
    from weightcache.core.identity.safetensors_io import check_checkpoint

    with pytest.raises(NotRegularFile, match="a FIFO"):
        check_checkpoint(checkpoint)


def test_the_warm_list_fails_a_fifo_and_a_malformed_checkpoint_and_loads_the_next(socket_dir, tmp_path, model_dir):
    fifo = tmp_path / "fifo-ckpt"
    fifo.mkdir()
    shutil.copy(model_dir("llama") / "config.json", fifo / "config.json")
    os.mkfifo(fifo / "model.safetensors")
    overlapping = tmp_path / "overlapping"
    _overlapping_copy(model_dir("llama"), overlapping)
    path = tmp_path / "serve.toml"
    path.write_text("".join(f'[[warm]]\nmodel = "{model}"\n' for model in (fifo, overlapping, model_dir("llama"))))
    server = ServerProcess.start(socket_dir, "--config", str(path))
    try:

        def warm() -> list:
            with Connection(socket_dir, timeout=10) as connection:
                return connection.status()["warm"]

        assert wait_until(lambda: warm()[2]["state"] == "done", timeout=180), warm()
        rows = warm()
        assert rows[0]["state"] == "failed" and "it is a FIFO (named pipe), not a regular file" in rows[0]["detail"], rows
        assert rows[1]["state"] == "failed" and "self_attn.q_proj.weight' starts at byte" in rows[1]["detail"], rows
        with Connection(socket_dir) as connection:
            assert len(connection.status()["entries"]) == 1, "only the good checkpoint is published"
    finally:
        server.close()
    assert "Traceback" not in server.log()


# --- hub ids: the snapshot the local hub cache holds is checked like a directory -------------------------------------


_API_CHILD = """
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
from weightcache.core.flow.modes import load_model
try:
    load_model(sys.argv[1], mode=sys.argv[2], socket_dir=sys.argv[3])
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_a_hub_id_whose_cached_snapshot_is_malformed_is_refused_on_every_path(tmp_path, model_dir, server):
    hub = tmp_path / "hub"
    q, _ = _overlapping_copy(model_dir("llama"), tmp_path / "bad")
    snapshot = add_to_hub_cache(hub, "org/bad", tmp_path / "bad")
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    run = cli("load", "--model", "org/bad", "--socket-dir", str(server.socket_dir), env=env, timeout=120)
    assert run.code == 1 and len(run.stderr) == 1 and f"tensor {q!r}" in run.first and str(snapshot) in run.first
    outcomes = {}
    for mode in ("off", "daemon", "client"):
        child = subprocess.run(
            [sys.executable, "-c", _API_CHILD, "org/bad", mode, str(server.socket_dir)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        outcomes[mode] = without_names(child.stdout.strip())
        ours = [line for line in child.stderr.splitlines() if line.startswith("WARNING weightcache")]
        said = run.first.removeprefix("weightcache: error: ")
        assert ours == ([] if mode == "off" else [f"WARNING weightcache: loading {snapshot} from disk: {said}"]), child.stderr
    assert outcomes["off"].startswith("SafetensorError") and outcomes["daemon"] == outcomes["client"] == outcomes["off"]
    with Connection(server.socket_dir) as connection:
        assert connection.status()["entries"] == []


# --- generated headers: weightcache's verdict is safetensors' --------------------------------------------------------

_DTYPES = [*sorted(ST_DTYPES), "U16", "F8_E8M0", "f32", "C64"]
_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "U16": 2, "C64": 8}


@st.composite
def headers(draw) -> tuple[bytes, bytes]:
    """A header and data, mostly well-formed, with the mistakes a damaged or hostile file makes drawn in."""
    count = draw(st.integers(0, 4))
    pairs: list[tuple[str, object]] = []
    offset = 0
    for index in range(count):
        dtype = draw(st.sampled_from(_DTYPES))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        nbytes = _SIZES.get(dtype, 1) * math.prod(shape)
        begin = offset + draw(st.sampled_from([0] * 24 + [1, -1, 4, -4]))
        end = begin + nbytes + draw(st.sampled_from([0] * 24 + [1, -1]))
        offset = max(offset, end)
        name = draw(st.sampled_from([f"t{index}"] * 12 + ["t0", "__metadata__", "w"]))
        value: dict = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        if draw(st.integers(0, 5)) == 0:
            value["extra"] = draw(st.sampled_from([1, "x", None, [1, [2]], {"k": -0.5}]))
        if draw(st.integers(0, 24)) == 0:
            del value[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))]
        pairs.append((name, value))
    if draw(st.booleans()):
        metadata = draw(st.sampled_from([None, {}, {"format": "pt"}, {"format": "pt"}, {"n": 1}, [], "pt"]))
        pairs.insert(draw(st.integers(0, len(pairs))), ("__metadata__", metadata))
    raw = header_of(*pairs)
    mutation = draw(st.integers(0, 9))
    if mutation == 0 and raw:  # one byte replaced: broken JSON, a changed digit, a changed name
        at = draw(st.integers(0, len(raw) - 1))
        raw = raw[:at] + bytes([draw(st.sampled_from(b'{}[]",:0-9 \\eE.'))]) + raw[at + 1 :]
    elif mutation == 1:
        raw += b" " * draw(st.integers(0, 7))  # safetensors' own padding
    data = bytes(max(offset, 0) + draw(st.sampled_from([0] * 12 + [1, 8])))
    return raw, data


def _twice(raw: bytes) -> bool:
    """Whether the top-level JSON object of ``raw`` gives a key twice (json keeps the last, as safetensors does)."""
    found: list = []

    def hook(pairs):
        found.append([key for key, _ in pairs])
        return dict(pairs)

    try:
        json.loads(raw, object_pairs_hook=hook)
    except (ValueError, RecursionError):
        return False
    keys = found[-1] if found else []
    return len(keys) != len(set(keys))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(drawn=headers())
def test_generated_headers_get_safetensors_verdict(drawn, tmp_path):
    raw, data = drawn
    file = write_file(tmp_path / "generated.safetensors", raw, data)
    accepted = safetensors_accepts(file)
    problem = weightcache_problem(file)
    event("safetensors accepts" if accepted else "safetensors refuses")
    if not accepted:
        assert problem is not None, f"weightcache accepts what safetensors refuses: {raw!r} + {len(data)} bytes"
        return
    if problem is None:
        return
    # Where safetensors accepts, weightcache refuses only a name given twice or a dtype it does not handle.
    import safetensors

    with safetensors.safe_open(str(file), "pt") as handle:
        dtypes = {handle.get_slice(name).get_dtype() for name in handle.keys()}
    unhandled = sorted(dtypes - set(ST_DTYPES))
    if "which weightcache does not handle" in problem:
        assert unhandled, problem
    else:
        assert "twice" in problem and _twice(raw), f"{problem}: {raw!r}"
