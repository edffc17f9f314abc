"""benchmarks/cold.py's rows: each method that loads the checkpoint in a child process, and what it gets."""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import os
import threading
import time
from pathlib import Path

from cold_checkpoint import MARKER, Entry, tensorizer_path

PIECE_BYTES = 64 << 20


ALIGN = 4096


DEFAULT_THREADS = 16


SLLM_STORE_REASON = (
    "serverless-llm-store 0.8.0 pins torch 2.7 and ships a cp310-only wheel; this machine has Python {python}, torch {torch}"
)


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
