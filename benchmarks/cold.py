"""Cold load of one checkpoint to a device: weightcache against the loaders its users would pick instead.

    python benchmarks/cold.py --make-checkpoint /tmp/ck --gib 0.05 --device cpu          # a smoke test on a CPU
    python benchmarks/cold.py --make-checkpoint /root/cold-ckpt --gib 16 --json OUT.json  # the H200: 16.06 GB Llama
    python benchmarks/cold.py --make-checkpoint /root/cold-8b --size 8b --json OUT.json   # restart.py's 8 B Qwen3
    python benchmarks/cold.py --model DIR --methods raw-direct,wc-publish-first --runs 3  # a subset, medians of 3

Side by side in one run, every method loads the same checkpoint in a fresh process (interpreter, torch
and the method's own package imported and the CUDA context made before the clock starts; the clock
stops after the device is synchronised) with the page cache dropped first (``sync; echo 3 >
/proc/sys/vm/drop_caches``; where that is refused, e.g. without root, ``posix_fadvise(DONTNEED)`` on
the files, and the table's ``cache`` column says so and gives the share ``mincore`` still finds
resident):

- ``raw-direct`` / ``raw-buffered``: the disk's limit: 16 threads ``preadv`` 64 MiB pieces (O_DIRECT
  into page-aligned buffers, or through the page cache) into pinned buffers, then to the device;
- ``safetensors-safe-open`` / ``safetensors-load-file``: ``safe_open(device=...)`` tensor by tensor,
  ``load_file(device=...)`` file by file;
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(dtype=bfloat16, device_map=device)``;
- ``fastsafetensors``, ``runai``, ``tensorizer`` (its own format: the checkpoint is converted first,
  untimed), ``instanttensor``: skipped, with the import error as the reason, where not installed;
  ``serverless-llm-store``: a row saying why it cannot run here (it is not attempted);
- ``wc-reader``: weightcache's reader alone (``read_checkpoint`` into an ``ArenaBuilder``);
- ``wc-publish-first`` / ``wc-publish-remembered``: ``loader.prepare`` + ``loader.publish`` to a fresh
  server, with an empty digest store (first sight: ``WEIGHTCACHE_CACHE_DIR`` an empty directory) and
  with the digests remembered (the store a first-sight run left, or one filled beforehand, untimed);
  the adapter and its framework are imported before the clock, as the issue's target says;
- ``wc-cli`` / ``wc-cli-remembered``: the whole ``weightcache load --model DIR --dtype bfloat16
  --device D`` (``python -m weightcache.core.cli.cli``), from exec to exit, timed by this process, under a
  pseudo-terminal so that the CLI prints its notes; the arrival time of each note splits the wall
  clock into phases: start + checks (exec -> ``hashing ...`` or ``loading ...``), hashing, read +
  publish (-> ``published ...``), exit. Its clock includes the imports, so after a whole-cache drop a
  throwaway process imports the same libraries first (untimed; the checkpoint stays cold): a node that
  loads a new model has used its Python environment before (torch, transformers, and what transformers
  imports to read this model's config and build its class: 2,350 modules more on the H200 machine);
- ``wc-cli-layout``: the CLI on first sight of the checkpoint's bytes (no digest remembered) with the
  architecture's layout remembered (copied from the first-sight row's store), as for a fine-tune of a
  model this node has loaded before: the hf adapter then builds the model without transformers.

Every method's bytes are checked, outside the timed region, against safetensors' own load of the same
files, tensor by tensor on the device (``torch.equal`` on the bytes; dtype and shape too where the
method returns typed tensors; a tensor on another device counts as wrong). On a GPU the reference is
loaded once by a helper process and shared with every row through CUDA IPC (a row that cannot map it
reloads it and says so); on a CPU each row reloads it. weightcache's published rows are checked
through an attach of the published entry. A mismatch makes the row's ``verified`` column ``NO``, is
listed after the table and makes the exit status 1; ``--methods control-flip`` (buffered reads with
one byte changed after the clock) shows the check bites.

``--make-checkpoint DIR --gib 16`` writes a Llama-3-8B-shaped bf16 checkpoint (hidden 4096, 32 layers,
vocabulary 128256: 291 tensors, 16.06 GB, random N(0, 0.02) weights generated on ``--device``) as
transformers' ``save_pretrained`` lays it out (4 shards ``model-0000i-of-00004.safetensors``, their
index, ``config.json``), written with ``safetensors.torch.save_file`` for speed; other ``--gib``
values scale the width (32 layers, 291 tensors, about gib/16 x 16 GB). ``--size 8b`` (or any size of
``benchmarks/restart.py``) builds that benchmark's Qwen3-shaped model with its own builder
(``save_pretrained``). A checkpoint already in DIR with the same marker is reused.

On the GPU machine (Python 3.12, no network), the peers travel as wheels in ``.whl/`` (carry
``.whl``; see docs/benchmarks.md); install them first:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site

``tests/gpu/run_gpu.sh $OUT cold`` (16.06 GB Llama in /root/cold-ckpt) and ``... cold-8b`` do that and run
every row, one 10-minute device call each (carry ``.whl``); ``WC_COLD_ARGS`` adds options. The JSON is
rewritten after every row, so a call cut short keeps what it measured.

fastsafetensors looks up ``libcudart.so`` and ``libcufile.so.0``, names torch's CUDA wheels do not
provide: for its row this script links the nvidia-* packages' libraries (found with a glob under
site-packages) into a private folder on that process's ``LD_LIBRARY_PATH``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import math
import mmap
import os
import pickle
import re
import shutil
import site
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import restart  # benchmarks/restart.py: the Qwen3 sizes and builder, the child environment, page-cache helpers

ROOT = Path(__file__).resolve().parents[1]
MARKER = "weightcache-cold-benchmark.json"
PIECE_BYTES = 64 << 20
ALIGN = 4096
DEFAULT_THREADS = 16
SHARDS = 4
# Llama-3-8B's shape: 8.03 B parameters, 291 tensors, 16.06 GB in bf16 (``--gib 16``).
LLAMA_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
)
REFERENCE_SHARED = "safetensors load_file by the reference process, mapped through CUDA IPC"
REFERENCE_RELOADED = "safetensors load_file in the row's own process"
SLLM_STORE_REASON = (
    "serverless-llm-store 0.8.0 pins torch 2.7 and ships a cp310-only wheel; this machine has Python {python}, torch {torch}"
)


# --- methods -----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Method:
    """One row: how it is run (``child``: a fresh process of this script; ``cli``: ``weightcache load``; ``none``: not run)."""

    name: str
    label: str
    kind: str = "child"
    package: str | None = None  # the distribution whose version the row names
    server: bool = False  # needs a fresh weightcache server
    store: str | None = None  # the digest store: "empty", "layout" (no digest, the model's layout) or "remembered"
    needs_cuda: bool = False
    default: bool = True


METHODS = {
    m.name: m
    for m in (
        Method("raw-direct", "raw reads, O_DIRECT"),
        Method("raw-buffered", "raw reads, buffered"),
        Method("safetensors-safe-open", "safetensors safe_open", package="safetensors"),
        Method("safetensors-load-file", "safetensors load_file", package="safetensors"),
        Method("transformers", "transformers from_pretrained", package="transformers"),
        Method("fastsafetensors", "fastsafetensors", package="fastsafetensors"),
        Method("runai", "runai-model-streamer", package="runai-model-streamer"),
        Method("tensorizer", "tensorizer (its own format)", package="tensorizer"),
        Method("instanttensor", "instanttensor", package="instanttensor", needs_cuda=True),
        Method("serverless-llm-store", "serverless-llm-store", kind="none"),
        Method("wc-reader", "weightcache reader alone (read_checkpoint)"),
        Method("wc-publish-first", "weightcache publish, first sight", server=True, store="empty"),
        Method("wc-publish-remembered", "weightcache publish, digests remembered", server=True, store="remembered"),
        Method("wc-cli", "weightcache load, whole CLI, first sight", kind="cli", server=True, store="empty"),
        Method(
            "wc-cli-layout",
            "weightcache load, whole CLI, first sight, the architecture's layout remembered",
            kind="cli",
            server=True,
            store="layout",
        ),
        Method(
            "wc-cli-remembered", "weightcache load, whole CLI, digests remembered", kind="cli", server=True, store="remembered"
        ),
        Method("control-flip", "control: buffered reads, one byte flipped", default=False),
    )
}


class Skip(Exception):
    """The method cannot run here; the message says why."""


class Clock:
    """Times the region inside ``with clock:``, synchronising the device at both ends."""

    def __init__(self, synchronize):
        self.synchronize = synchronize
        self.seconds: float | None = None
        self.started = False

    def __enter__(self) -> "Clock":
        self.synchronize()
        self.started = True
        self.start = time.perf_counter()
        return self

    def __exit__(self, kind, *rest) -> None:
        if kind is None:
            self.synchronize()
            self.seconds = time.perf_counter() - self.start


@dataclasses.dataclass
class Context:
    """What a child's method gets: the checkpoint, the device, a place for notes and objects to keep alive."""

    args: argparse.Namespace
    model: Path
    files: list[str]
    entries: list["Entry"]
    device: object  # torch.device
    notes: list[str] = dataclasses.field(default_factory=list)
    phases: dict = dataclasses.field(default_factory=dict)
    keep: list = dataclasses.field(default_factory=list)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def run_raw(ctx: Context, clock: Clock, direct: bool) -> dict:
    """``--threads`` threads read 64 MiB pieces (O_DIRECT or buffered) into per-thread pinned buffers and copy them to the device."""
    import torch

    threads = ctx.args.threads
    pin = ctx.is_cuda
    local = threading.local()
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    sizes = {file: os.path.getsize(file) for file in ctx.files}

    def staging():
        state = getattr(local, "state", None)
        if state is None:
            raw = torch.empty(PIECE_BYTES + ALIGN, dtype=torch.uint8, pin_memory=pin)
            skip = (-raw.data_ptr()) % ALIGN  # O_DIRECT needs an aligned buffer
            buffer = raw[skip : skip + PIECE_BYTES]
            stream = torch.cuda.Stream(ctx.device) if pin else None
            state = local.state = (raw, buffer, memoryview(buffer.numpy()), stream)
        return state

    def read(piece) -> None:
        file, offset, nbytes = piece
        _, buffer, view, stream = staging()
        want = min(PIECE_BYTES, -(-nbytes // ALIGN) * ALIGN) if direct else nbytes  # O_DIRECT: whole blocks
        done = 0
        while done < nbytes:
            got = os.preadv(fds[file], [view[done:want]], offset + done)
            if got == 0:
                raise EOFError(f"{file} ended at {offset + done}, before {offset + nbytes}")
            done += got
        target = targets[file][offset : offset + nbytes]
        if stream is None:
            target.copy_(buffer[:nbytes])
            return
        with torch.cuda.device(ctx.device), torch.cuda.stream(stream):
            target.copy_(buffer[:nbytes], non_blocking=True)
        stream.synchronize()  # the buffer is reused by this thread's next piece

    with clock:
        fds = {file: os.open(file, flags) for file in ctx.files}
        try:
            targets = {file: torch.empty(sizes[file], dtype=torch.uint8, device=ctx.device) for file in ctx.files}
            pieces = [
                (file, offset, min(PIECE_BYTES, size - offset))
                for file, size in sizes.items()
                for offset in range(0, size, PIECE_BYTES)
            ]
            with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
                for _ in pool.map(read, pieces):
                    pass
        finally:
            for fd in fds.values():
                os.close(fd)
    ctx.notes.append(f"{threads} threads, {PIECE_BYTES >> 20} MiB pieces" + (", pinned staging" if pin else ""))
    return {e.name: targets[e.file][e.begin : e.end] for e in ctx.entries}


def run_raw_direct(ctx: Context, clock: Clock) -> dict:
    return run_raw(ctx, clock, direct=True)


def run_raw_buffered(ctx: Context, clock: Clock) -> dict:
    return run_raw(ctx, clock, direct=False)


def run_control_flip(ctx: Context, clock: Clock) -> dict:
    """Buffered reads, then one byte of the middle tensor changed: the verification must say NO."""
    tensors = run_raw(ctx, clock, direct=False)
    victim = tensors[ctx.entries[len(ctx.entries) // 2].name]
    victim[victim.numel() // 2] ^= 0x01
    ctx.notes.append("one byte flipped after the clock: must read NO")
    return tensors


def run_safe_open(ctx: Context, clock: Clock) -> dict:
    from safetensors import safe_open

    tensors = {}
    with clock:
        for file in ctx.files:
            with safe_open(file, framework="pt", device=str(ctx.device)) as opened:
                for name in opened.keys():
                    tensors[name] = opened.get_tensor(name)
    return tensors


def run_load_file(ctx: Context, clock: Clock) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    with clock:
        for file in ctx.files:
            tensors.update(load_file(file, device=str(ctx.device)))
    return tensors


def run_transformers(ctx: Context, clock: Clock) -> dict:
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(ctx.model)
    for architecture in config.architectures or []:
        getattr(transformers, architecture, None)  # the model's module, imported before the clock
    kwargs = {"dtype": torch.bfloat16}
    if ctx.is_cuda:
        kwargs["device_map"] = str(ctx.device)
    with clock:
        model = transformers.AutoModelForCausalLM.from_pretrained(ctx.model, **kwargs)
    ctx.keep.append(model)
    return dict(model.state_dict())


def run_fastsafetensors(ctx: Context, clock: Clock) -> dict:
    from fastsafetensors import fastsafe_open

    gds = ctx.args.fastsafetensors_gds
    with clock:
        opened = fastsafe_open(ctx.files, framework="pt", device=str(ctx.device), nogds=not gds)
        tensors = {name: opened.get_tensor(name) for name in opened.keys()}
    ctx.keep.append(opened)
    copier = getattr(getattr(opened, "loader", None), "copier_class", None)
    ctx.notes.append(f"{'GDS asked' if gds else 'nogds'}; copier {getattr(copier, '__name__', '?')}")
    return tensors


def run_runai(ctx: Context, clock: Clock) -> dict:
    from runai_model_streamer import SafetensorsStreamer

    tensors = {}
    with clock:
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(ctx.files, device=str(ctx.device))
            for name, tensor in streamer.get_tensors():
                tensors[name] = tensor
    return tensors


def run_tensorizer(ctx: Context, clock: Clock) -> dict:
    from tensorizer import TensorDeserializer

    path = tensorizer_path(ctx.model)
    if not (path.parent / MARKER).exists():
        raise Skip(f"no converted checkpoint at {path} (the conversion failed or was skipped)")
    with clock:
        deserializer = TensorDeserializer(str(path), device=str(ctx.device))
        tensors = {name: deserializer[name] for name in deserializer.keys()}
    ctx.keep.append(deserializer)
    ctx.notes.append(f"a {path.stat().st_size / 1e9:.2f} GB .tensors file")
    return tensors


def run_instanttensor(ctx: Context, clock: Clock) -> dict:
    if not ctx.is_cuda:
        raise Skip("instanttensor loads to CUDA devices only")
    from instanttensor import safe_open

    tensors = {}
    with clock:
        with safe_open(ctx.files, framework="pt", device=ctx.device) as opened:
            for name, tensor in opened.tensors():
                tensors[name] = tensor
    return tensors


def run_wc_reader(ctx: Context, clock: Clock) -> dict:
    from weightcache.core.load.export import ArenaBuilder
    from weightcache.core.load.reader import default_direct, read_checkpoint

    with _reader_notes(ctx), clock:
        builder = ArenaBuilder(str(ctx.device))
        placed = read_checkpoint(ctx.model, builder)
    ctx.keep.append(builder)
    ctx.notes.append(f"{builder.read_mode.describe()}{', O_DIRECT where not cached' if default_direct() else ''}")
    ctx.notes.append(f"{len(builder.arenas)} arenas")
    return {name: builder.view(slot) for name, (_, slot) in placed.items()}


def run_wc_publish(ctx: Context, clock: Clock) -> dict:
    """``prepare`` + ``publish`` to a fresh server (its adapter and framework imported first), then attach to check."""
    from weightcache.core.flow.loader import prepare, publish
    from weightcache.core.flow.plugins import installed_plugins
    from weightcache.core.request import LoadRequest

    request = LoadRequest(model=str(ctx.model), dtype="bfloat16", device=str(ctx.device))
    installed_plugins().adapter(request.adapter).warm_up(request)
    with _reader_notes(ctx), clock:
        published = publish(prepare(request), ctx.args.socket_dir)
    ctx.phases.update({key: round(value, 3) for key, value in published.timings.items()})
    ctx.notes.append(", ".join(f"{key.removesuffix('_s')} {value:.2f}" for key, value in published.timings.items()))
    return _attached(ctx, published.fingerprint)


@contextlib.contextmanager
def _reader_notes(ctx: Context):
    """The reader's own lines on how it read (its mode, where its time went) and the hf adapter's on the read against
    the skeleton, added to the row's notes."""
    import logging

    class Notes(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            ctx.notes.append(record.getMessage())

    handler = Notes(logging.DEBUG)
    loggers = [logging.getLogger(name) for name in ("weightcache.core.load.reader", "weightcache.adapters.hf.loading")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)


def run_wc_entry(ctx: Context, clock: Clock) -> dict:
    """No load: attach the entry ``weightcache load`` published (its fingerprint from the remembered digests)."""
    from weightcache.core.flow.loader import prepare
    from weightcache.core.request import LoadRequest

    request = LoadRequest(model=str(ctx.model), dtype="bfloat16", device=str(ctx.device))
    return _attached(ctx, prepare(request).fingerprint)


def _attached(ctx: Context, fingerprint) -> dict:
    from weightcache.core.flow.api import attach

    attachment = attach(fingerprint, ctx.args.socket_dir)
    ctx.keep.append(attachment)
    return dict(attachment.tensors)


RUNNERS = {
    "raw-direct": run_raw_direct,
    "raw-buffered": run_raw_buffered,
    "control-flip": run_control_flip,
    "safetensors-safe-open": run_safe_open,
    "safetensors-load-file": run_load_file,
    "transformers": run_transformers,
    "fastsafetensors": run_fastsafetensors,
    "runai": run_runai,
    "tensorizer": run_tensorizer,
    "instanttensor": run_instanttensor,
    "wc-reader": run_wc_reader,
    "wc-publish-first": run_wc_publish,
    "wc-publish-remembered": run_wc_publish,
    "wc-entry": run_wc_entry,
}


# --- the checkpoint ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: its bytes are ``file[begin:end]``."""

    file: str
    name: str
    dtype: str
    shape: tuple
    begin: int
    end: int


def read_entries(files: list[str]) -> list[Entry]:
    """Every tensor of ``files``, from their headers (no torch)."""
    entries = []
    for file in files:
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, info in header.items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                entries.append(Entry(file, name, info["dtype"], tuple(info["shape"]), 8 + length + begin, 8 + length + end))
    return entries


def llama_shape(gib: float) -> dict:
    """Llama-3-8B's shape at ``gib`` 16; otherwise its width scaled so the bf16 weights take about gib/16 x 16.06 GB."""
    if gib <= 0:
        raise ValueError(f"--gib must be positive, not {gib}")
    if gib == 16:
        return dict(LLAMA_8B)
    hidden = max(64, round(4096 * math.sqrt(gib / 16) / 64) * 64)
    head_dim = 128 if hidden >= 1024 and hidden % 128 == 0 else 64
    heads = hidden // head_dim
    return dict(
        vocab_size=max(256, round(hidden * 128256 / 4096 / 64) * 64),
        hidden_size=hidden,
        intermediate_size=round(hidden * 3.5 / 64) * 64,
        num_hidden_layers=32,
        num_attention_heads=heads,
        num_key_value_heads=heads // 4 if heads % 4 == 0 else 1,
        head_dim=head_dim,
    )


def llama_tensors(shape: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors of a LlamaForCausalLM of ``shape`` (untied head), in the order its ``state_dict`` lists them."""
    hidden, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    tensors = [("model.embed_tokens.weight", (vocab, hidden))]
    for layer in range(shape["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        tensors += [
            (f"{prefix}.self_attn.q_proj.weight", (q, hidden)),
            (f"{prefix}.self_attn.k_proj.weight", (kv, hidden)),
            (f"{prefix}.self_attn.v_proj.weight", (kv, hidden)),
            (f"{prefix}.self_attn.o_proj.weight", (hidden, q)),
            (f"{prefix}.mlp.gate_proj.weight", (inter, hidden)),
            (f"{prefix}.mlp.up_proj.weight", (inter, hidden)),
            (f"{prefix}.mlp.down_proj.weight", (hidden, inter)),
            (f"{prefix}.input_layernorm.weight", (hidden,)),
            (f"{prefix}.post_attention_layernorm.weight", (hidden,)),
        ]
    return [*tensors, ("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def shard_of(tensors: list[tuple[str, tuple[int, ...]]], shards: int = SHARDS) -> list[int]:
    """Which of ``shards`` files each tensor goes to: consecutive runs of about equal bytes, in order."""
    sizes = [math.prod(shape) for _, shape in tensors]
    total, start, out = sum(sizes), 0, []
    for size in sizes:
        out.append(min(shards - 1, start * shards // total))
        start += size
    return out


def make_llama(directory: Path, gib: float, device: str) -> dict:
    """Write the Llama checkpoint of ``gib`` into ``directory`` as ``save_pretrained`` lays it out (random bf16 weights)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    shape = llama_shape(gib)
    tensors = llama_tensors(shape)
    shards = shard_of(tensors)
    names = [f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors" for i in range(SHARDS)]
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.safetensors"):
        stale.unlink()
    (directory / MARKER).unlink(missing_ok=True)
    on = torch.device(device if device.startswith("cuda") else "cpu")
    generator = torch.Generator(device=on).manual_seed(0)
    start = time.perf_counter()
    total = 0
    for index, name in enumerate(names):
        part = {}
        for (tensor, dims), shard in zip(tensors, shards, strict=True):
            if shard == index:
                mean = 1.0 if tensor.endswith("norm.weight") else 0.0
                part[tensor] = torch.empty(dims, dtype=torch.bfloat16, device=on).normal_(mean, 0.02, generator=generator).cpu()
                total += part[tensor].nbytes
        save_file(part, str(directory / name), metadata={"format": "pt"})
        del part
    weight_map = {tensor: names[shard] for (tensor, _), shard in zip(tensors, shards, strict=True)}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = transformers.LlamaConfig(
        **shape,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        dtype="bfloat16",  # as save_pretrained records a bf16 model
    )
    config.save_pretrained(directory)
    os.sync()
    marker = {
        "kind": "llama",
        "gib": gib,
        "bytes": total,
        "tensors": len(tensors),
        "write_s": round(time.perf_counter() - start, 2),
    }
    (directory / MARKER).write_text(json.dumps(marker) + "\n")
    return marker


def ensure_checkpoint(args, env: dict) -> Path:
    """``--make-checkpoint DIR``: the checkpoint of ``--gib`` or ``--size`` there, reused when its marker matches."""
    directory = Path(args.make_checkpoint).resolve()
    if args.size:
        return restart.ensure_checkpoint(args.size, args.device, directory, env)
    marker = directory / MARKER
    if marker.exists() and json.loads(marker.read_text()).get("gib") == args.gib:
        print(f"reusing the checkpoint in {directory}", flush=True)
        return directory
    print(f"writing a Llama checkpoint of about {args.gib * 16.06 / 16:.2f} GB into {directory} ...", flush=True)
    command = [*_self(), "--role", "make", "--make-checkpoint", str(directory), "--gib", repr(args.gib), "--device", args.device]
    subprocess.run(command, env=env, check=True)
    return directory


def tensorizer_path(model: Path) -> Path:
    """Where the tensorizer copy of ``model`` lives: beside it, so that weightcache never sees it in the checkpoint."""
    return Path(str(model) + ".tensorizer") / "model.tensors"


def convert_to_tensorizer(model: Path) -> dict:
    """Serialize the checkpoint with tensorizer (untimed); reused while the checkpoint's files are unchanged."""
    from safetensors.torch import load_file
    from tensorizer import TensorSerializer

    path = tensorizer_path(model)
    source = {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in restart.checkpoint_files(model)}
    marker = path.parent / MARKER
    if marker.exists() and json.loads(marker.read_text()).get("source") == source:
        return {"reused": str(path)}
    path.parent.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    start = time.perf_counter()
    serializer = TensorSerializer(str(path))
    for file in restart.checkpoint_files(model):
        serializer.write_state_dict(load_file(str(file)))
    serializer.close()
    os.sync()
    marker.write_text(json.dumps({"source": source}) + "\n")
    return {"converted": str(path), "seconds": round(time.perf_counter() - start, 2)}


# --- the child: one method, one process -------------------------------------------------------------------------------


def child(args) -> dict:
    """Run one method in this fresh process and verify its bytes; the report is the last line printed."""
    report: dict = {"method": args.method}
    model = Path(args.model)
    files = [str(f) for f in restart.checkpoint_files(model)]
    method = METHODS.get(args.method)
    if method and method.package:
        try:
            report["version"] = importlib.metadata.version(method.package)
        except importlib.metadata.PackageNotFoundError:
            pass
    import torch

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else 0)
        torch.cuda.set_device(device)
        torch.empty(1, device=device)  # the CUDA context, before any clock
    synchronize = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    ctx = Context(args, model, files, read_entries(files), device)
    clock = Clock(synchronize)
    try:
        tensors = RUNNERS[args.method](ctx, clock)
    except Skip as exc:
        return {**report, "status": "skipped", "reason": str(exc)}
    except ImportError as exc:
        if clock.started:
            raise
        return {**report, "status": "skipped", "reason": f"not installed here: {exc}"}
    report.update(status="ran", seconds=clock.seconds, notes=ctx.notes, phases=ctx.phases)
    reference, how = reference_tensors(args, files, device)
    report["verify"] = {**compare(tensors, reference, device), "reference": how}
    for kept in reversed(ctx.keep):
        close = getattr(kept, "close", None)
        if callable(close):
            with contextlib.suppress(Exception):
                close()
    return report


def reference_tensors(args, files: list[str], device) -> tuple[dict, str]:
    """safetensors' own load of the files: mapped from the reference process (CUDA IPC) where there is one, else loaded here."""
    from safetensors.torch import load_file

    note = REFERENCE_RELOADED
    if args.reference:
        try:
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            shared = pickle.loads(Path(args.reference).read_bytes())  # written by our own reference process
            return {name: rebuild_cuda_tensor(*fields) for name, fields in shared.items()}, REFERENCE_SHARED
        except Exception as exc:  # any failure: reload, and say so in the row
            note = f"reference not mapped ({type(exc).__name__}: {exc}); reloaded with safetensors in this process"
    tensors = {}
    for file in files:
        tensors.update(load_file(file, device=str(device)))
    return tensors, note


def compare(tensors: dict, reference: dict, device) -> dict:
    """Each reference tensor against the method's, on the device: bytes equal, and dtype and shape where the method typed it."""
    import torch

    problems: dict[str, list[str]] = {"differ": [], "missing": [], "wrong_device": [], "wrong_dtype_or_shape": []}
    checked = 0
    for name, want in reference.items():
        got = tensors.get(name)
        if got is None:
            problems["missing"].append(name)
            continue
        if got.device != want.device or got.device != device:
            problems["wrong_device"].append(f"{name} on {got.device}")
            continue
        typed = not (got.dtype == torch.uint8 and want.dtype != torch.uint8)  # raw readers return the file's bytes
        if typed and (got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape)):
            problems["wrong_dtype_or_shape"].append(
                f"{name}: {got.dtype} {tuple(got.shape)}, not {want.dtype} {tuple(want.shape)}"
            )
            continue
        a, b = _bytes(got), _bytes(want)
        if a.numel() != b.numel() or not torch.equal(a, b):
            at = "" if a.numel() != b.numel() else f" first at byte {int(torch.nonzero(a != b)[0])}"
            problems["differ"].append(f"{name} ({a.numel()} vs {b.numel()} bytes{at})")
            continue
        checked += int(b.numel())
    extra = sorted(set(tensors) - set(reference))
    ok = not any(problems.values())
    return {
        "ok": ok,
        "tensors": len(reference),
        "bytes_checked": checked,
        "extra": extra[:10],
        "extra_count": len(extra),
        **problems,
    }


def _bytes(tensor):
    import torch

    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def hold_reference(args) -> None:
    """Load the reference once on the GPU and share it (CUDA IPC handles in a file) until the parent closes stdin."""
    import torch
    from safetensors.torch import load_file
    from torch.multiprocessing.reductions import reduce_tensor

    device = torch.device(args.device)
    tensors = {}
    for file in restart.checkpoint_files(Path(args.model)):
        tensors.update(load_file(str(file), device=str(device)))
    torch.cuda.synchronize(device)
    shared = {name: reduce_tensor(tensor)[1] for name, tensor in tensors.items()}
    path = Path(args.reference)
    path.with_suffix(".tmp").write_bytes(pickle.dumps(shared))
    path.with_suffix(".tmp").rename(path)
    print(json.dumps({"ready": len(tensors)}), flush=True)
    sys.stdin.read()  # hold until the parent is done (or gone)


# --- the parent ------------------------------------------------------------------------------------------------------


def _self() -> list[str]:
    return [sys.executable, str(Path(__file__).resolve())]


def rotated(names: list[str], run: int) -> list[tuple[int, str]]:
    """``(position, name)`` in run ``run``'s order: the rows rotated by the run's number, so no method is always first
    after the checkpoint was written; a bracketing row at the end (raw-direct again) stays last."""
    numbered = list(enumerate(names))
    closing = [numbered.pop()] if len(names) > 2 and names[-1] in names[:-1] else []
    shift = run % len(numbered) if numbered else 0
    return numbered[shift:] + numbered[:shift] + closing


def prime_disk(paths: list[Path]) -> float:
    """Read every file once with O_DIRECT (buffered where refused), untimed: a VM's virtual disk may hold freshly
    written bytes in its host's cache, which no drop inside the guest reaches; after one full read every row finds
    the disk in the same state. Returns the seconds it took."""
    start = time.monotonic()
    buffer = mmap.mmap(-1, PIECE_BYTES)  # page-aligned, as O_DIRECT needs
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except OSError:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            offset = 0
            while got := os.preadv(fd, [buffer], offset):
                offset += got
        finally:
            os.close(fd)
    buffer.close()
    return time.monotonic() - start


def drop_page_cache(paths: list[Path], rewarm: list[str] | None = None, env: dict | None = None) -> dict:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``, else fadvise(DONTNEED) per file; then what ``mincore`` finds resident.

    ``rewarm``: a command run after a whole-cache drop (it imports the libraries again, not the checkpoint),
    for rows whose clock includes the imports: a node loading a new model has used its Python libraries before.
    """
    os.sync()
    how = "drop_caches"
    try:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
    except OSError as exc:
        how = f"fadvise (drop_caches refused: {exc.strerror or exc})"
        restart.drop_from_page_cache(paths)
    rewarmed = None
    if rewarm and how == "drop_caches":
        start = time.monotonic()
        subprocess.run(rewarm, env=env, check=True, capture_output=True, timeout=300)
        rewarmed = round(time.monotonic() - start, 2)
    try:
        resident = restart.resident_fraction(paths)
    except OSError:
        resident = None
    return {"how": how, "resident": resident, "libraries_rewarmed_s": rewarmed}


def cache_cell(cache: dict | None) -> str:
    if cache is None:
        return ""
    resident = cache["resident"]
    if resident is None:
        return "unknown"
    if resident > 0.01:
        return f"WARM {resident:.0%}"
    return "dropped" if cache["how"] == "drop_caches" else "fadvise"


def cuda_libraries(directory: Path, cuda: str | None) -> tuple[dict, list[str]]:
    """Link libcudart.so and libcufile.so.0 from the nvidia-* wheels into ``directory`` (fastsafetensors dlopens those names).

    Where several CUDA majors are installed, the one torch was built with (``cuda``, e.g. ``13.0``) wins.
    """
    roots = [Path(p) for p in {*site.getsitepackages(), site.getusersitepackages(), *sys.path} if p and Path(p).is_dir()]
    major = f".so.{cuda.split('.')[0]}" if cuda else None
    notes = []
    for link, pattern in (("libcudart.so", "libcudart.so*"), ("libcufile.so.0", "libcufile.so*")):
        found = sorted({hit.resolve() for root in roots for hit in (root / "nvidia").glob(f"**/{pattern}")})
        found = [hit for hit in found if major and major in hit.name] or found
        if not found:
            notes.append(f"no {pattern} under nvidia/ in site-packages")
            continue
        directory.mkdir(parents=True, exist_ok=True)
        (directory / link).unlink(missing_ok=True)
        (directory / link).symlink_to(found[-1])
        notes.append(f"{link} -> {found[-1]}")
    env = {"LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(directory), os.environ.get("LD_LIBRARY_PATH")]))}
    return env, notes


class Parent:
    """Runs each row in a fresh process, one after the other, and keeps what they report."""

    def __init__(self, args, model: Path, env: dict, work: Path):
        self.args = args
        self.facts = restart.machine(args.device, env)
        self.skips: dict[str, str] = {}
        self.model = model
        self.env = env
        self.work = work
        self.files = restart.checkpoint_files(model)
        self.entries = read_entries([str(f) for f in self.files])
        self.nbytes = sum(e.end - e.begin for e in self.entries)
        self.reference_file: Path | None = None
        self.holder: subprocess.Popen | None = None
        self.stores: dict[str, Path] = {}
        self.extra_env: dict[str, dict] = {}
        self.extra_notes: dict[str, list[str]] = {}
        self.cache_paths = list(self.files)

    # the reference on the GPU, shared by every row
    def start_reference(self) -> None:
        if not self.args.device.startswith("cuda"):
            return
        self.reference_file = self.work / "reference.pickle"
        command = [*_self(), "--role", "reference", "--model", str(self.model), "--device", self.args.device]
        self.holder = subprocess.Popen(
            [*command, "--reference", str(self.reference_file)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=self.env,
        )
        line = self.holder.stdout.readline()
        if not line:
            print(f"the reference process exited ({self.holder.wait()}); every row reloads the reference itself", flush=True)
            self.reference_file = None

    def stop_reference(self) -> None:
        if self.holder is not None:
            with contextlib.suppress(OSError):
                self.holder.stdin.close()
            try:
                self.holder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.holder.kill()
                self.holder.wait()

    def prepare_tensorizer(self) -> str | None:
        """Convert the checkpoint for tensorizer (untimed); None, or why the row is skipped."""
        record = self.spawn(["--role", "convert"], timeout=self.args.row_timeout * 2)
        if record.get("status") == "converted":
            self.cache_paths.append(tensorizer_path(self.model))
            self.extra_notes["tensorizer"] = [f"converted untimed in {record['seconds']:.1f} s"] if "seconds" in record else []
            return None
        return record.get("reason") or record.get("error") or "the conversion failed"

    def prepare_fastsafetensors(self) -> None:
        env, notes = cuda_libraries(self.work / "cuda-libs", self.facts.get("cuda"))
        self.extra_env["fastsafetensors"] = env
        self.extra_notes["fastsafetensors"] = notes

    def store_for(self, method: Method, run: int) -> Path:
        """An empty digest store (first sight), or the remembered one (copied from a first-sight run, else filled untimed)."""
        if method.store == "empty":
            path = Path(tempfile.mkdtemp(prefix=f"digests-{method.name}-{run}-", dir=self.work))  # a variant's row too
            self.stores["last-first-sight"] = path
            return path
        if method.store == "layout":  # no digest, but the model's layout (a fine-tune of an architecture seen before)
            learned = self.stores.get("last-first-sight")
            layouts = sorted(learned.glob("layout-*.json")) if learned else []
            if not layouts:
                raise RuntimeError(f"{method.name} needs a first-sight row (wc-cli, wc-publish-first) to run before it")
            path = Path(tempfile.mkdtemp(prefix=f"digests-{method.name}-{run}-", dir=self.work))
            for layout in layouts:
                shutil.copy2(layout, path / layout.name)
            return path
        remembered = self.work / "digests-remembered"
        if not remembered.exists():
            if "last-first-sight" in self.stores:
                shutil.copytree(self.stores["last-first-sight"], remembered)
            else:
                remembered.mkdir(mode=0o700)
                record = self.spawn(["--role", "remember"], env={"WEIGHTCACHE_CACHE_DIR": str(remembered)})
                if record.get("status") != "remembered":
                    raise RuntimeError(f"could not fill the digest store: {record.get('error', record)}")
        return remembered

    def spawn(self, extra: list[str], env: dict | None = None, timeout: float | None = None) -> dict:
        """A fresh process of this script; its report is its last stdout line (an error record if it has none)."""
        command = [
            *_self(),
            *extra,
            "--model",
            str(self.model),
            "--device",
            self.args.device,
            "--threads",
            str(self.args.threads),
        ]
        if self.reference_file is not None:
            command += ["--reference", str(self.reference_file)]
        if self.args.fastsafetensors_gds:
            command.append("--fastsafetensors-gds")
        try:
            proc = subprocess.run(
                command, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout or self.args.row_timeout
            )
        except subprocess.TimeoutExpired as exc:
            return {"status": "error", "error": f"timed out after {exc.timeout:.0f} s", "stderr": _tail(exc.stderr)}
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode == 0 and lines:
            return json.loads(lines[-1])
        return {"status": "error", "error": f"exit status {proc.returncode}", "stderr": _tail(proc.stderr)}

    def row(self, method: Method, run: int, variant_env: dict | None = None) -> dict:
        """One run of one method (with ``variant_env`` added to its environment): drop the page cache, run it in a fresh
        process, and return what it reported."""
        if method.kind == "none":
            return {"status": "not run", "reason": self.sllm_reason()}
        if method.needs_cuda and not self.args.device.startswith("cuda"):
            return {"status": "skipped", "reason": f"{method.name} loads to CUDA devices only"}
        if method.name in self.skips:
            return {"status": "skipped", "reason": self.skips[method.name]}
        env = {**self.extra_env.get(method.name, {}), **(variant_env or {})}
        server = None
        try:
            if method.store:
                env["WEIGHTCACHE_CACHE_DIR"] = str(self.store_for(method, run))
            if method.server:
                from weightcache.core.server.server_process import ServerProcess

                server = ServerProcess.start()
            extra = ["--socket-dir", str(server.socket_dir)] if server else []
            rewarm = self.rewarm_command() if method.kind == "cli" else None
            cache = drop_page_cache(self.cache_paths, rewarm, self.env)
            if method.kind == "cli":
                record = self.cli_row(env, server.socket_dir)
            else:
                record = self.spawn(["--role", "child", "--method", method.name, *extra], env=env)
            record["cache"] = cache
            if cache["libraries_rewarmed_s"] is not None:
                record.setdefault("notes", []).append("Python libraries re-read after the drop, untimed (checkpoint cold)")
        except Exception as exc:  # one broken row must not lose the others
            record = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "stderr": _tail(traceback.format_exc())}
        finally:
            if server is not None:
                server.close()
        record.setdefault("notes", [])
        record["notes"] = self.extra_notes.get(method.name, []) + record["notes"]
        return record

    def cli_row(self, env: dict, socket_dir: Path) -> dict:
        """``weightcache load`` from exec to exit under a pseudo-terminal (its notes give the phases), then attach to check."""
        verbose = ["-v"] if self.args.cli_verbose else []
        command = [
            sys.executable,
            "-m",
            "weightcache.core.cli.cli",
            *verbose,
            "load",
            "--model",
            str(self.model),
            "--dtype",
            "bfloat16",
        ]
        command += ["--device", self.args.device, "--socket-dir", str(socket_dir)]
        status, wall, lines = run_on_terminal(command, {**self.env, **env, "COLUMNS": "120"}, self.args.row_timeout)
        text = [line for _, line in lines]
        if status != 0:
            return {"status": "error", "error": f"weightcache load exited with {status}", "stderr": _tail("\n".join(text))}
        record = {"status": "ran", "seconds": wall, "phases": cli_phases(lines, wall), "output": text[-5:]}
        record["notes"] = [phase_text(record["phases"])]
        if verbose:
            record["timeline"] = [f"{seconds:7.2f} {line[:200]}" for seconds, line in lines[:400]]
        check = self.spawn(["--role", "child", "--method", "wc-entry", "--socket-dir", str(socket_dir)], env=env)
        record["verify"] = check.get("verify") or {
            "ok": False,
            "error": check.get("error") or check.get("reason"),
            "stderr": check.get("stderr"),
        }
        return record

    def rewarm_command(self) -> list[str]:
        """Import what ``weightcache load`` imports (torch, transformers, safetensors, weightcache and its adapters)."""
        code = "import torch, transformers, safetensors, weightcache.core.cli.cli, weightcache.core.flow.loader\n"
        code += "from weightcache.core.flow.plugins import installed_plugins; installed_plugins()\n"
        # What transformers imports to read this model's config and build its class (its config.json only: ~2,350
        # modules more on the H200 machine, pandas, scipy.stats and torch._dynamo among them).
        code += f"config = transformers.AutoConfig.from_pretrained({str(self.model)!r})\n"
        code += "getattr(transformers, config.architectures[0])\n"
        if self.args.device.startswith("cuda"):
            code += f"torch.empty(1, device={self.args.device!r})\n"
        return [sys.executable, "-c", code]

    def sllm_reason(self) -> str:
        facts = self.facts
        return SLLM_STORE_REASON.format(python=facts.get("python", "?"), torch=facts.get("torch", "?"))


def run_on_terminal(command: list[str], env: dict, timeout: float) -> tuple[int, float, list[tuple[float, str]]]:
    """Run ``command`` with stdout and stderr on a pseudo-terminal; its exit status, wall seconds and each line's arrival time."""
    import pty
    import select

    master, slave = pty.openpty()
    start = time.monotonic()
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    lines: list[tuple[float, str]] = []
    pending = b""
    try:
        while True:
            if time.monotonic() - start > timeout:
                proc.kill()
                break
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: the terminal's other side is closed
                break
            if not data:
                break
            now = time.monotonic() - start
            *complete, pending = re.split(rb"[\r\n]", pending + data)
            lines += [(now, text) for text in map(_clean, complete) if text]
        status = proc.wait()
        wall = time.monotonic() - start
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if _clean(pending):
        lines.append((wall, _clean(pending)))
    return status, wall, lines


def _clean(raw: bytes) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw.decode(errors="replace")).strip()


def cli_phases(lines: list[tuple[float, str]], wall: float) -> dict:
    """Split ``weightcache load``'s wall clock at its notes: checking, hashing (first sight only), loading, published."""

    def first(prefix: str) -> float | None:
        return next((t for t, text in lines if text.startswith(prefix)), None)

    checking, hashing, loading = first("checking "), first("hashing "), first("loading ")
    published = first("published ") or first("already cached")
    work = hashing if hashing is not None else loading
    phases = {
        "first_output_s": checking,
        "start_and_checks_s": work,
        "hashing_s": loading - hashing if hashing is not None and loading is not None else None,
        "read_and_publish_s": published - loading if published is not None and loading is not None else None,
        "exit_s": wall - published if published is not None else None,
    }
    said = next((text for _, text in lines if text.startswith("published ")), "")
    reported = re.search(r"([0-9.]+) s\b", said)
    phases["cli_reported_s"] = float(reported.group(1)) if reported else None
    return phases


def phase_text(phases: dict) -> str:
    names = (
        ("start_and_checks_s", "imports+checks"),
        ("hashing_s", "hashing"),
        ("read_and_publish_s", "read+publish"),
        ("exit_s", "exit"),
    )
    return (
        ", ".join(f"{label} {phases[key]:.2f}" for key, label in names if phases.get(key) is not None)
        or "no phases (notes not seen)"
    )


def _tail(text, limit: int = 3000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-limit:]


# --- the table ---------------------------------------------------------------------------------------------------------


def summarize(method: Method, runs: list[dict]) -> dict:
    """The median of a method's runs, whether every run's bytes matched, its notes and page-cache state."""
    ran = [r for r in runs if r.get("status") == "ran"]
    summary = {"label": method.label, "runs": runs}
    version = next((r["version"] for r in runs if r.get("version")), None)
    if version:
        summary["label"] = f"{method.label} {version}"
    if not ran or len(ran) != len(runs):
        bad = next(r for r in runs if r.get("status") != "ran")
        summary["status"] = bad.get("status", "error")
        summary["reason"] = bad.get("reason") or bad.get("error") or "?"
        return summary
    summary["status"] = "ran"
    summary["seconds"] = statistics.median(r["seconds"] for r in ran)
    summary["verified"] = all(r.get("verify", {}).get("ok") for r in ran)
    summary["cache"] = ran[0].get("cache")
    caches = {cache_cell(r.get("cache")) for r in ran}
    summary["cache_cell"] = " / ".join(sorted(caches))
    notes = list(dict.fromkeys(n for r in ran for n in r.get("notes", [])))
    references = {r.get("verify", {}).get("reference") for r in ran} - {None, REFERENCE_SHARED, REFERENCE_RELOADED}
    summary["notes"] = notes + sorted(references)
    return summary


def verified_cell(summary: dict) -> str:
    if summary["status"] != "ran":
        return "—"
    if summary["verified"]:
        return "yes"
    runs = [r.get("verify", {}) for r in summary["runs"]]
    counts = {k: max(len(v.get(k) or []) for v in runs) for k in ("differ", "missing", "wrong_device", "wrong_dtype_or_shape")}
    said = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in counts.items() if n)
    return f"NO ({said or next((v.get('error') for v in runs if v.get('error')), 'not checked')})"


def table(result: dict) -> str:
    """The rows as a Markdown table, then the verification failures and the issue's targets."""
    nbytes = result["checkpoint"]["bytes"]
    rows = [("method", "seconds", "GB/s", "verified", "cache", "notes")]
    for summary in result["methods"].values():
        if summary["status"] == "ran":
            seconds = summary["seconds"]
            rows.append(
                (
                    summary["label"],
                    f"{seconds:.2f}",
                    f"{nbytes / seconds / 1e9:.2f}",
                    verified_cell(summary),
                    summary["cache_cell"],
                    "; ".join(summary["notes"]),
                )
            )
        else:
            rows.append((summary["label"], "—", "—", "—", "", f"{summary['status']}: {summary['reason']}"))
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    c = result["checkpoint"]
    m = result["machine"]
    head = (
        f"cold load of {c['name']} ({c['bytes'] / 1e9:.2f} GB, {c['tensors']} tensors in {c['files']} files) to {m['device']}; "
        f"{m.get('gpu', 'no GPU')}, torch {m.get('torch')}, Python {m.get('python')}; {m['date']}; "
        f"median of {result['runs']} run(s), each row a fresh process, page cache dropped before each (column cache); "
        f"bytes checked against {result['reference']}"
    )
    out = [head, "", *lines]
    failures = [
        f"BYTES DIFFER: {s['label']}: {json.dumps({k: v for k, v in r['verify'].items() if v and k not in ('ok', 'tensors', 'bytes_checked', 'reference')})[:600]}"
        for s in result["methods"].values()
        for r in s["runs"]
        if r.get("status") == "ran" and not r.get("verify", {}).get("ok")
    ]
    out += ["", *failures] if failures else []
    out += ["", *result["targets"]] if result.get("targets") else []
    return "\n".join(out)


def targets(methods: dict) -> list[str]:
    """Issue 20's targets: first-sight and remembered publish no slower than the fastest peer; the CLI within +6 s of it."""
    peers = {
        name: s["seconds"]
        for name, s in methods.items()
        if s["status"] == "ran" and s.get("verified") and not name.startswith(("raw-", "wc-", "control-"))
    }
    if not peers:
        return []
    fastest = min(peers, key=peers.get)
    best = peers[fastest]
    lines = [f"fastest peer: {methods[fastest]['label']}, {best:.2f} s"]
    for name, limit, text in (
        ("wc-publish-first", best, "first-sight publish <= fastest peer"),
        ("wc-publish-remembered", best, "remembered publish <= fastest peer"),
        ("wc-cli", best + 6, "whole CLI (first sight) <= fastest peer + 6 s"),
        ("wc-cli-layout", best + 6, "whole CLI (first sight, layout remembered) <= fastest peer + 6 s"),
        ("wc-cli-remembered", best + 6, "whole CLI (digests remembered) <= fastest peer + 6 s"),
    ):
        s = methods.get(name)
        if s and s["status"] == "ran":
            verdict = "met" if s["seconds"] <= limit and s["verified"] else "MISSED"
            lines.append(f"target {text}: {s['seconds']:.2f} s vs {limit:.2f} s: {verdict}")
    return lines


# --- main -------------------------------------------------------------------------------------------------------------


def parse_variant(text: str) -> tuple[str, dict]:
    """``[METHOD@]LABEL:ENV=VALUE[,ENV=VALUE]`` -> ``("METHOD [LABEL]", {ENV: VALUE})``; METHOD defaults to wc-reader.

    A malformed one, or a METHOD that is not one of METHODS: ValueError.
    """
    method, at, rest = text.partition("@")
    if not at:
        method, rest = "wc-reader", text
    label, _, assignments = rest.partition(":")
    pairs = [item.partition("=") for item in assignments.split(",") if item.strip()]
    if not label.strip() or not pairs or any(not key.strip() or not sep for key, sep, _ in pairs):
        raise ValueError(f"--reader-variant {text!r}: write [METHOD@]LABEL:ENV=VALUE[,ENV=VALUE]")
    if method.strip() not in METHODS or METHODS[method.strip()].kind == "none":
        raise ValueError(
            f"--reader-variant {text!r}: {method.strip()!r} is not a method that runs; choose from {', '.join(METHODS)}"
        )
    return f"{method.strip()} [{label.strip()}]", {key.strip(): value.strip() for key, _, value in pairs}


def parse_methods(text: str) -> list[str]:
    """``all``, or a comma-separated list of METHODS' names, in the order given (unknown names: ValueError)."""
    if text.strip() == "all":
        return [name for name, m in METHODS.items() if m.default]
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", metavar="DIR", help="an existing safetensors checkpoint directory")
    where.add_argument(
        "--make-checkpoint", metavar="DIR", help="write the checkpoint of --gib/--size here (reused if there), then run"
    )
    parser.add_argument("--gib", type=float, default=16.0, help="Llama size for --make-checkpoint: 16 is Llama-3-8B (16.06 GB)")
    parser.add_argument(
        "--size", choices=sorted(restart.SIZES), help="instead: benchmarks/restart.py's Qwen3 of this size (8b: 16.4 GB)"
    )
    parser.add_argument("--device", default="cuda:0", help="cuda:N (default cuda:0) or cpu")
    parser.add_argument(
        "--methods", default="all", help=f"'all' or a comma-separated subset of: {', '.join(METHODS)}; 'none': only make"
    )
    parser.add_argument("--runs", type=int, default=1, help="runs of each method (fresh processes); the table shows medians")
    parser.add_argument(
        "--threads",
        type=int,
        default=DEFAULT_THREADS,
        help="threads of the raw readers (default 16, as weightcache's reader on a 16-core machine)",
    )
    parser.add_argument("--row-timeout", type=float, default=300.0, help="seconds one row may take (default 300)")
    parser.add_argument(
        "--no-bracket", action="store_true", help="do not repeat raw-direct (when it comes first) at the end of the run"
    )
    parser.add_argument(
        "--fastsafetensors-gds", action="store_true", help="let fastsafetensors try GPUDirect Storage (default: nogds)"
    )
    parser.add_argument("--json", metavar="PATH", help="write the full record as JSON")
    parser.add_argument(
        "--cli-verbose",
        action="store_true",
        help="run the wc-cli rows with -v and keep their timed debug lines (the JSON's 'timeline') to see where they wait",
    )
    parser.add_argument(
        "--reader-variant",
        action="append",
        default=[],
        metavar="[METHOD@]LABEL:ENV=VALUE[,ENV=VALUE]",
        help="one more row of METHOD (default wc-reader), run with these environment variables "
        "(e.g. 'wc-publish-first@pieces:WEIGHTCACHE_READ_BLOCK_KIB=0'); repeatable",
    )
    parser.add_argument(
        "--no-prime",
        action="store_true",
        help="do not read the checkpoint once before the first row (a fresh checkpoint may then sit in the VM host's cache)",
    )
    parser.add_argument("--role", choices=["child", "make", "reference", "convert", "remember"], help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--socket-dir", help=argparse.SUPPRESS)
    parser.add_argument("--reference", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        return run_role(args)
    try:
        names = [] if args.methods.strip() == "none" else parse_methods(args.methods)
        variants = dict(parse_variant(text) for text in args.reader_variant)
        names += list(variants)
    except ValueError as exc:
        parser.error(str(exc))
    if args.size and args.model:
        parser.error("--size goes with --make-checkpoint")
    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="wc-cold-"))
    parent = None
    try:
        env = restart.weightcache_env(work)
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        model = ensure_checkpoint(args, env) if args.make_checkpoint else Path(args.model).resolve()
        print(f"checkpoint ready after {time.monotonic() - began:.1f} s", flush=True)
        if not names:
            return 0
        if names[0] == "raw-direct" and len(names) > 2 and not args.no_bracket:
            names.append("raw-direct")  # again at the end: did the disk drift during the run?
        parent = Parent(args, model, env, work)
        parent.start_reference()
        if "tensorizer" in names:
            reason = parent.prepare_tensorizer()
            if reason:
                parent.skips["tensorizer"] = reason
        if "fastsafetensors" in names and args.device.startswith("cuda"):
            parent.prepare_fastsafetensors()
        print(f"set-up done after {time.monotonic() - began:.1f} s", flush=True)
        command = " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])
        results: dict[str, list[dict]] = {}
        if not args.no_prime:
            print(f"primed the disk: {prime_disk(parent.files):.1f} s (untimed)", flush=True)
        for run in range(args.runs):
            for position, name in rotated(names, run):
                key = name if name not in names[:position] else f"{name} (end of run)"
                record = parent.row(METHODS[name.split(" ")[0]], run, variants.get(name))
                results.setdefault(key, []).append(record)
                said = (
                    f"{record['seconds']:.2f} s"
                    if record.get("status") == "ran"
                    else f"{record.get('status')}: {record.get('reason') or record.get('error')}"
                )
                print(f"[{time.monotonic() - began:6.1f} s] run {run + 1}/{args.runs} {key}: {said}", flush=True)
                if args.json:  # so far: a device call cut short still leaves the rows it measured
                    result = record_of(parent, results, command, time.monotonic() - began)
                    Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
        result = record_of(parent, results, command, time.monotonic() - began)
        text = table(result)
        result["table"] = text
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
        print("\n" + text, flush=True)
        methods = result["methods"]
        mismatched = any(s["status"] == "ran" and not s["verified"] for s in methods.values())
        broken = any(s["status"] == "error" for s in methods.values())
        return 1 if mismatched or broken else 0
    finally:
        if parent is not None:
            parent.stop_reference()
        shutil.rmtree(work, ignore_errors=True)


def record_of(parent: Parent, results: dict[str, list[dict]], command: str, wall: float) -> dict:
    """The full record of the rows run so far: checkpoint, machine, each method's runs and summary, the targets."""
    methods = {}
    for key, runs in results.items():
        method = METHODS[key.split(" ")[0]]
        summary = summarize(method, runs)
        if key != method.name:
            summary["label"] += key[len(method.name) :]  # " (end of run)", or a reader variant's " [label]"
        methods[key] = summary
    return {
        "checkpoint": {
            "name": restart_name(parent.model),
            "path": str(parent.model),
            "bytes": parent.nbytes,
            "tensors": len(parent.entries),
            "files": len(parent.files),
        },
        "machine": {**parent.facts, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")},
        "runs": parent.args.runs,
        "command": command,
        "reference": REFERENCE_SHARED if parent.reference_file else REFERENCE_RELOADED,
        "methods": methods,
        "targets": targets(methods),
        "wall_s": round(wall, 1),
    }


def restart_name(model: Path) -> str:
    marker = model / MARKER
    if marker.exists():
        return f"Llama-shaped bf16 checkpoint {model.name}"
    if (model / restart.MARKER).exists():
        return f"Qwen3 {json.loads((model / restart.MARKER).read_text())['size']} bf16 checkpoint {model.name}"
    return model.name


def run_role(args) -> int:
    """The helper processes: a row (``child``), the checkpoint writer, the reference holder, the tensorizer conversion."""
    if args.role == "make":
        print(json.dumps(make_llama(Path(args.make_checkpoint), args.gib, args.device)), flush=True)
        return 0
    if args.role == "reference":
        hold_reference(args)
        return 0
    try:
        if args.role == "child":
            report = child(args)
        elif args.role == "convert":
            try:
                report = {"status": "converted", **convert_to_tensorizer(Path(args.model))}
            except ImportError as exc:
                report = {"status": "skipped", "reason": f"not installed here: {exc}"}
        else:  # remember: hash the checkpoint once so that its digests are remembered
            from weightcache.core.flow.loader import prepare
            from weightcache.core.request import LoadRequest

            _ = prepare(LoadRequest(model=args.model, dtype="bfloat16", device=args.device)).fingerprint
            report = {"status": "remembered"}
    except Exception as exc:  # reported as the row's error, with its traceback
        report = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "stderr": _tail(traceback.format_exc())}
    print(json.dumps(report, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
