"""benchmarks/cold.py's helper processes: a row (one method in a fresh process, its bytes checked against safetensors'
own load), the reference holder, the checkpoint writer, the tensorizer conversion, the digest filler."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import pickle
import sys
import traceback
from pathlib import Path

import restart  # benchmarks/restart.py: the Qwen3 sizes and builder, the child environment, page-cache helpers
from cold_checkpoint import convert_to_tensorizer, make_llama, read_entries
from cold_methods import METHODS, RUNNERS, Clock, Context, Skip

REFERENCE_SHARED = "safetensors load_file by the reference process, mapped through CUDA IPC"


REFERENCE_RELOADED = "safetensors load_file in the row's own process"


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


def tail(text, limit: int = 3000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-limit:]


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
        report = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "stderr": tail(traceback.format_exc())}
    print(json.dumps(report, default=str), flush=True)
    return 0
