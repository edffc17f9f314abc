"""Each family's TP=2 ranks loaded outside the engine against the engine's own, by hand (docs/engines.md records runs).

    python -m tests.engines.family_tp2 --engine vllm|sglang [--families qwen3-moe,deepseek-v3]

Per family, two fresh servers: in A a TP=2 engine loads from disk (no weightcache), then publishes both ranks in mode
daemon; in B ``weightcache load --tp-size 2 --tp-rank 0`` publishes rank 0 and ``load_model`` (``parallel`` rank 1
of 2) rank 1, then a TP=2 engine as a strict client generates from them. Then, per rank, ``load_model`` as a strict
client of A and of B maps each entry and every tensor is compared (names, dtypes, shapes, bytes). One JSON line per
family: the digests, the tokens and the differences.

    python -m tests.engines.family_tp2 compare --adapter E --model DIR --a SOCKET_DIR --b SOCKET_DIR

is the comparison alone (one process: the adapter's imports once).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

TP = 2
DTYPE = "bfloat16"


def write_family(engine: str, family: str, directory: Path) -> Path:
    from tests.engines.support import write_tiny_model, write_word_tokenizer
    from tests.engines.test_entry_points import DEEPSEEK_FOR
    from tests.engines.test_sglang import with_released_deepseek_fields

    if family == "llama":
        from tests.engines.support import write_tiny_llama

        return write_tiny_llama(directory)
    if family == "qwen3-moe":
        path = write_tiny_model("qwen3_moe", directory)
    else:
        path = with_released_deepseek_fields(write_tiny_model("deepseek_v3", directory, **DEEPSEEK_FOR[engine][0]))
    write_word_tokenizer(path, json.loads((path / "config.json").read_text())["vocab_size"])
    return path


def engine_args(engine: str, family: str) -> dict:
    """The engine arguments ``family`` needs on the CPU (tests/engines/test_entry_points.py DEEPSEEK_FOR)."""
    from tests.engines.test_entry_points import DEEPSEEK_FOR

    return DEEPSEEK_FOR[engine][1] if family == "deepseek-v3" else {}


def one_family(engine: str, family: str, work: Path) -> dict:
    from tests.engines.support import private_dir, run_entry_points, server_status
    from tests.engines.test_one_identity import cli_rank, engine_start, library_steps
    from weightcache.core.server.server_process import ServerProcess

    model = write_family(engine, family, work / family)
    args = engine_args(engine, family)
    out: dict = {"engine": engine, "family": family, "seconds": {}}
    a, b = private_dir("wc-fam-a-"), private_dir("wc-fam-b-")
    servers = [ServerProcess.start(a), ServerProcess.start(b)]
    try:
        start = time.monotonic()
        runs = [{**engine_start(model, None, "none", TP), "engine_args": args}]
        runs.append({**engine_start(model, a, "daemon", TP), "engine_args": args})
        done = run_entry_points(engine, runs, timeout=1800, expect_exit=False)
        out["disk"], out["daemon"] = (done.results + [{"error": "missing", "message": done.output[-4000:]}] * 2)[:2]
        out["seconds"]["engine_a"] = round(time.monotonic() - start, 1)
        start = time.monotonic()
        out["cli0"] = cli_rank(engine, model, b, 0)
        out["cli0"]["output"] = out["cli0"]["output"][-1500:]
        out["publish1"] = library_steps(engine, model, b, ["publish@1"], TP)["publish@1"]
        out["seconds"]["outside_b"] = round(time.monotonic() - start, 1)
        start = time.monotonic()
        client = [{**engine_start(model, b, "client", TP), "engine_args": args}]
        done = run_entry_points(engine, client, timeout=1800, expect_exit=False)
        out["client"] = done.results[0] if done.results else {"error": "missing", "message": done.output[-4000:]}
        out["seconds"]["engine_b"] = round(time.monotonic() - start, 1)
        out["entries"] = {
            name: sorted((e["rank"], e["digest"][:12]) for e in server_status(d)["entries"]) for name, d in (("a", a), ("b", b))
        }
        start = time.monotonic()
        out["compare"] = compare_in_child(engine, model, a, b)
        out["seconds"]["compare"] = round(time.monotonic() - start, 1)
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(a, ignore_errors=True)
        shutil.rmtree(b, ignore_errors=True)
    tokens = out["disk"].get("tokens")
    out["verdict"] = {
        "daemon_tokens_equal_disk": out["daemon"].get("tokens") == tokens,
        "client_of_outside_tokens_equal_disk": out["client"].get("tokens") == tokens,
        "entries_equal": out["compare"].get("equal"),
    }
    return out


def compare_in_child(engine: str, model: Path, a: Path, b: Path) -> dict:
    import os
    import subprocess

    from tests.engines.support import ENTRY_POINT_ENV, ROOT

    command = [sys.executable, "-m", "tests.engines.family_tp2", "compare", "--adapter", engine, "--model", str(model)]
    proc = subprocess.run(
        [*command, "--a", str(a), "--b", str(b)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, **ENTRY_POINT_ENV},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("COMPARE ")]
    if proc.returncode != 0 or not lines:
        return {"equal": None, "error": f"exit {proc.returncode}", "message": (proc.stdout + proc.stderr)[-4000:]}
    return json.loads(lines[-1][len("COMPARE ") :])


def compare(adapter: str, model: str, a: str, b: str) -> dict:
    """Per rank: ``load_model`` as a strict client of A and of B; every tensor of the two entries compared."""
    import torch

    from weightcache import ParallelSpec, load_model

    ranks = {}
    for rank in range(TP):
        parallel = ParallelSpec(tp_size=TP, tp_rank=rank)
        loaded = {}
        try:
            for name, socket_dir in (("a", a), ("b", b)):
                loaded[name] = load_model(
                    model, adapter=adapter, mode="client", dtype=DTYPE, parallel=parallel, socket_dir=socket_dir, strict=True
                )
            ta, tb = (dict(loaded[n].attachment.tensors) for n in ("a", "b"))
            differ = []
            for name in sorted(set(ta) | set(tb)):
                x, y = ta.get(name), tb.get(name)
                if x is None or y is None:
                    differ.append(f"{name}: only in {'b' if x is None else 'a'}")
                elif x.dtype != y.dtype or x.shape != y.shape:
                    differ.append(f"{name}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}")
                elif not torch.equal(as_bytes(x), as_bytes(y)):
                    differ.append(f"{name}: {tuple(x.shape)} content differs")
                elif x.stride() != y.stride():
                    differ.append(f"{name}: strides {x.stride()} vs {y.stride()}")
            ranks[rank] = {
                "digests": [loaded[n].attachment.digest[:12] for n in ("a", "b")],
                "tensors": len(ta),
                "bytes": sum(t.numel() * t.element_size() for t in ta.values()),
                "differ": differ,
            }
        except Exception as exc:
            ranks[rank] = {"error": type(exc).__name__, "message": str(exc)[-2000:]}
        finally:
            for one in loaded.values():
                one.close()
    equal = all("error" not in r and not r["differ"] for r in ranks.values())
    return {"equal": equal, "ranks": ranks}


def as_bytes(tensor):
    """The tensor's bytes in its logical order (bit-exact, NaNs included)."""
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        parser = argparse.ArgumentParser()
        for flag in ("--adapter", "--model", "--a", "--b"):
            parser.add_argument(flag, required=True)
        args = parser.parse_args(argv[1:])
        print("COMPARE " + json.dumps(compare(args.adapter, args.model, args.a, args.b)), flush=True)
        return 0
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    parser.add_argument("--families", default="qwen3-moe,deepseek-v3")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="wc-fam-models-"))
    try:
        for family in args.families.split(","):
            print("FAMILY " + json.dumps(one_family(args.engine, family, work)), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
