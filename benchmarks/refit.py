"""Refit side by side: a new version of a served model from a trainer's tensors to the engine running on it.

    python benchmarks/refit.py                                         # small Qwen3 (332 MB bf16) on the CPU
    python benchmarks/refit.py --size 8b --device cuda:0 --json OUT.json [--keep-checkpoint DIR]

One process plays the trainer (its state dict on ``--device``, in the checkpoint's naming) and the engine (a model
attached from a ``weightcache serve`` child, ``load_model(mode="client")``); both reach the server over its socket as
two processes would. Each row is one way to get the engine onto the new version, for the bf16 model and with block-FP8
quantisation on publish (``--quantizations``):

- ``weightcache refit``: the engine serves one step (a forward) on the running version, then ``publish_version`` (the adapter's load from the tensors, post-processing, export into
  arenas placed as the previous version, checksums, one publish frame), the engine's ``fetch_version`` (map and
  checksum the new version beside the running one) and ``switch_to`` (the new memory under the same addresses: the
  only time the engine cannot step);
- ``param.copy_()``: the new tensors copied into a running engine's parameters (a disk-loaded model; the engine cannot
  step for the whole copy). With block-FP8 a user would also have to re-run the quantisation: not measured, shown n/a;
- ``reload``: the state dict saved as a checkpoint (safetensors) and the model loaded from it (``mode="off"``); the
  engine serves nothing while it loads.

Each row's last column says whether the engine's logits after it equal those of a disk load of the saved new version,
bit for bit. ``--runs`` refits are timed after one warm-up (versions 2, 3, ...); the table shows their medians and the
slowest. Each case runs on
a server of its own. The reload reads the file it has just written (a warm page cache: its best case). Checkpoints
come from ``benchmarks/restart.py`` (``--size``: small, 1b, 8b); on an 8 B model a case holds up to four copies of
the weights on the device at once (the checkpoint's version 0, the running and the new version, the trainer's tensors).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import restart  # benchmarks/restart.py: checkpoints, the child environment, the machine facts


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def checkpoint_state(model: Path, device: str) -> dict:
    """The checkpoint's tensors on ``device`` (read once; each version is a step away from them)."""
    from safetensors.torch import load_file

    state = {}
    for file in restart.checkpoint_files(model):
        state.update(load_file(str(file), device=device))
    return state


def trainer_state(base: dict, step: int) -> dict:
    """``base`` after a made-up training step (floating tensors scaled; exact, any dtype)."""
    factor = 1.0 + step / 64  # a power-of-two fraction: each step's bytes differ
    return {name: (t * factor).to(t.dtype) if t.dtype.is_floating_point else t for name, t in base.items()}


def logits(model, device: str):
    import torch

    ids = (torch.arange(32, device=device).reshape(2, 16) * 31) % model.config.vocab_size
    with torch.no_grad():
        return model(input_ids=ids).logits


def saved(model: Path, state: dict, directory: Path) -> Path:
    """A checkpoint of ``state`` beside ``model``'s configs (what a reload reads)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    for file in model.iterdir():
        if file.is_file() and file.suffix == ".json" and not file.name.endswith(".index.json"):
            shutil.copy(file, directory / file.name)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    os.sync()
    return directory


def measure(model: Path, device: str, quantization: str | None, work: Path, runs: int) -> dict:
    """One case on a server of its own (its versions are gone when it stops): the refit rows, then the baselines."""
    from weightcache.core.flow.loader import prepare, publish
    from weightcache.core.flow.modes import load_model
    from weightcache.core.request import LoadRequest
    from weightcache.core.server.server_process import ServerProcess

    options = {"device": device, "quantization": quantization}
    case = quantization or "bf16"
    server = ServerProcess.start(work / f"sock-{case}")
    try:
        publish(prepare(LoadRequest(model=str(model), **options)), server.socket_dir)
        engine = load_model(str(model), mode="client", socket_dir=server.socket_dir, strict=True, **options)
        base = checkpoint_state(model, device)
        refits = [refit_once(engine, model, base, version, server.socket_dir, options) for version in range(1, runs + 2)]
        timed = refits[1:]
        result: dict = {
            "refit": {k: statistics.median(r[k] for r in timed) for k in timed[0]},
            "refit_slowest": {k: max(r[k] for r in timed) for k in ("end_to_end_s", "cannot_step_s")},
            "refit_runs": refits,
        }
        refitted = logits(engine.model, device)
        engine.close()
    finally:
        server.close()
    state = trainer_state(base, runs + 1)  # the version the engine ran last
    del base
    result.update(baselines(model, state, options, work / f"saved-{case}", refitted))
    return result


def refit_once(engine, model: Path, base: dict, version: int, socket_dir: Path, options: dict) -> dict:
    """One refit of a running engine to ``version``: a step before, publish, fetch, switch, the first step after."""
    from weightcache.core.refit import publish_version

    device = options["device"]
    state = trainer_state(base, version)
    begun = time.perf_counter()
    logits(engine.model, device)  # the engine serves a step on the running version (its pages are mapped)
    _sync(device)
    step_s = time.perf_counter() - begun
    start = time.perf_counter()
    published = publish_version(str(model), state, version, socket_dir=socket_dir, **options)
    publishing = time.perf_counter()
    pending = engine.attachment.fetch_version(version)
    fetched = time.perf_counter()
    engine.attachment.switch_to(pending)  # the engine's thread is in here: it cannot step
    _sync(device)
    done = time.perf_counter()
    logits(engine.model, device)
    _sync(device)
    first_step_s = time.perf_counter() - done
    return {
        "end_to_end_s": done - start,
        "publish_s": publishing - start,
        "fetch_s": fetched - publishing,
        "cannot_step_s": done - fetched,
        "remap_s": engine.attachment.timings["switch_s"],
        "step_before_s": step_s,
        "first_step_after_s": first_step_s,
        **{f"publish.{k}": v for k, v in published.timings.items()},
    }


def baselines(model: Path, state: dict, options: dict, directory: Path, refitted) -> dict:
    """The ways without refit, each checked against a disk load of the new version (as the refit's ``refitted`` logits
    are): the state dict saved and loaded, and (bf16) ``param.copy_()`` into a running engine."""
    import torch

    from weightcache.core.flow.modes import load_model

    device = options["device"]
    result: dict = {}
    # the reload baseline: the state dict saved as a checkpoint, then loaded (the engine serves nothing meanwhile)
    start = time.perf_counter()
    saved(model, {name: t.cpu() for name, t in state.items()}, directory)
    save_s = time.perf_counter() - start
    start = time.perf_counter()
    reloaded = load_model(str(directory), mode="off", **options)
    _sync(device)
    reload_s = time.perf_counter() - start
    reference = logits(reloaded.model, device)  # a disk load of the new version: what every row must equal
    del reloaded
    shutil.rmtree(directory)
    result["refit_identical"] = bool(torch.equal(refitted, reference))
    result["reload"] = {"end_to_end_s": save_s + reload_s, "save_s": save_s, "cannot_step_s": reload_s}
    result["reload_identical"] = True
    if options["quantization"] is None:  # param.copy_() into a running engine (a disk load of the previous version)
        running = load_model(str(model), mode="off", **options)
        params = dict(running.model.state_dict())
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            for name, tensor in state.items():
                params[name].copy_(tensor)
        _sync(device)
        copy_s = time.perf_counter() - start
        result["copy"] = {"end_to_end_s": copy_s, "cannot_step_s": copy_s}
        result["copy_identical"] = bool(torch.equal(logits(running.model, device), reference))
        del running, params
    return result


def table(results: dict) -> str:
    lines = [
        f"{'case':<10} {'way':<18} {'end to end':>11} {'cannot step':>12} {'bit-identical':>14}",
        "-" * 69,
    ]
    for case, result in results.items():
        for way, key in (("weightcache refit", "refit"), ("param.copy_()", "copy"), ("reload", "reload")):
            if key not in result:
                lines.append(f"{case:<10} {way:<18} {'n/a':>11} {'n/a':>12} {'-':>14}")
                continue
            row = result[key]
            same = "yes" if result[f"{key}_identical"] else "NO"
            lines.append(
                f"{case:<10} {way:<18} {row['end_to_end_s'] * 1e3:>8.1f} ms {row['cannot_step_s'] * 1e3:>9.2f} ms {same:>14}"
            )
        refit = result["refit"]
        steps = ", ".join(f"{k.removeprefix('publish.')} {v * 1e3:.1f}" for k, v in refit.items() if k.startswith("publish."))
        slowest = result["refit_slowest"]
        lines.append(
            f"{'':<10} refit: publish {refit['publish_s'] * 1e3:.1f} ms ({steps}), fetch {refit['fetch_s'] * 1e3:.1f} ms; "
            f"slowest of {len(result['refit_runs']) - 1}: {slowest['end_to_end_s'] * 1e3:.1f} ms end to end, "
            f"{slowest['cannot_step_s'] * 1e3:.2f} ms cannot step"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(restart.SIZES), default="small", help="8b: 16.4 GB (a GPU); small: 332 MB")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quantizations", default="none,fp8-block", help="comma-separated: none, fp8-block")
    parser.add_argument("--runs", type=int, default=5, help="timed refits after one warm-up (default 5)")
    parser.add_argument("--keep-checkpoint", help="keep (or reuse) the checkpoint in this directory")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="wc-refit-"))
    try:
        env, model = restart.checkpoint_here(args.size, args.device, args.keep_checkpoint, work)
        results = {}
        for quantization in [q.strip() for q in args.quantizations.split(",") if q.strip()]:
            case = "bf16" if quantization == "none" else quantization
            print(f"measuring {case} ...", flush=True)
            results[case] = measure(model, args.device, None if quantization == "none" else quantization, work, args.runs)
        report = {
            "size": args.size,
            "machine": restart.machine(args.device, env),
            "model": json.loads((model / restart.MARKER).read_text()),
            "results": results,
        }
        print(table(results))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
