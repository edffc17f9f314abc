#!/usr/bin/env python3
"""Two ``vllm.LLM`` clients serving one weightcache entry at once, and a server SIGKILL while they serve.

    python3 tests/gpu/engine_pair.py MODEL OUT.json --socket-dir DIR [--expect LLM.json] [--eager]

Runs after tests/gpu/engine_llm.py, whose daemon variant left a server in ``--socket-dir`` holding the model's entry.
Two engines start one after the other as strict clients (each in a process of its own, waiting on stdin for
commands), then, with both serving: what each engine's own load took (vLLM's log: "Model loading took"; mapped
weights take none) and its KV cache, the GPU memory in use (``nvidia-smi``: the whole GPU and each process), the
server's view (who has the entry attached), and greedy tokens from each. Then engine A generates in a loop while the
server is SIGKILLed, and both generate again. Every token list must equal the plain load's (``--expect``:
engine_llm.py's JSON) or, without it, engine A's first. OUT.json holds the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_llm import MAX_TOKENS, PROMPTS, build_llm

START_TIMEOUT_S = int(os.environ.get("WC_VARIANT_TIMEOUT_S", "300"))  # as engine_llm.py
LOOPS = 40  # generations in the loop the SIGKILL falls into
TAG = "ENGINE_PAIR "


def child(args: argparse.Namespace) -> None:
    """An engine that maps the entry, then answers ``tokens`` / ``loop`` / ``quit`` lines on stdin."""
    t0 = time.time()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = build_llm(args.model, "client", args.socket_dir, args.eager, args.memory)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in PROMPTS]

    def tokens() -> list:
        return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]

    say = lambda **record: print(TAG + json.dumps(record), flush=True)  # noqa: E731
    say(event="ready", ready_s=round(time.time() - t0, 2), pid=os.getpid())
    for line in sys.stdin:
        command = line.strip()
        if command == "tokens":
            say(event="tokens", tokens=tokens())
        elif command == "loop":
            first = tokens()
            say(event="looping")
            same = sum(tokens() == first for _ in range(LOOPS))
            say(event="looped", tokens=first, same=same, of=LOOPS)
        elif command == "quit":
            break


VLLM_MEMORY = {  # what vLLM's engine core logs (on stdout) about its own memory, in GiB
    "model_loading_gib": re.compile(r"Model loading took ([0-9.]+) GiB"),
    "kv_cache_gib": re.compile(r"Available KV cache memory: ([0-9.]+) GiB"),
}


def vllm_memory(line: str) -> dict:
    """The figures of VLLM_MEMORY that one line of vLLM's log holds."""
    return {key: float(found.group(1)) for key, pattern in VLLM_MEMORY.items() if (found := pattern.search(line))}


class Engine:
    """One child engine: its process, its tagged stdout lines on a queue, vLLM's memory figures (vllm_memory) from
    the rest of its stdout; stdout goes to LOG.out, stderr to LOG."""

    def __init__(self, name: str, args: argparse.Namespace, log: Path):
        command = [sys.executable, __file__, args.model, args.out, "--child", "--socket-dir", args.socket_dir]
        command += ["--memory", str(args.memory)] + (["--eager"] if args.eager else [])
        self.name, self.lines, self.memory = name, queue.Queue(), {}
        self.out = open(log.with_suffix(".out"), "w")
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),
            text=True,
            bufsize=1,
            start_new_session=True,  # its engine-core process too, so that close() can end both
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(TAG):
                self.lines.put(json.loads(line[len(TAG) :]))
            else:
                self.out.write(line)
                self.memory |= vllm_memory(line)
        self.lines.put({"event": "exited", "returncode": self.proc.wait()})

    def expect(self, event: str, timeout: float = START_TIMEOUT_S) -> dict:
        try:
            record = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"engine {self.name}: no {event!r} within {timeout:.0f} s (see its log)") from None
        if record["event"] != event:
            raise RuntimeError(f"engine {self.name}: wanted {event!r}, got {record} (see its log)")
        return record

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        try:
            self.send("quit")
            self.proc.wait(timeout=30)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        try:  # what is left of this engine's own process group (its engine core)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def gpu_memory() -> dict:
    """MiB in use on GPU 0 and per process, as nvidia-smi reports them."""

    def read(*query: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True)
        return [[cell.strip() for cell in row.split(",")] for row in out.stdout.strip().splitlines() if row.strip()]

    used, total = (int(cell) for cell in read("--query-gpu=memory.used,memory.total", "-i", "0")[0])
    per_pid = {row[0]: row[1] for row in read("--query-compute-apps=pid,used_memory") if len(row) == 2}
    return {"used_mib": used, "total_mib": total, "per_pid_mib": per_pid}


def server_status(socket_dir: str) -> dict:
    from weightcache.core.client.client import Connection

    with Connection(socket_dir) as connection:
        return connection.status()


def run(args: argparse.Namespace, results: dict) -> None:
    before = server_status(args.socket_dir)
    entries = before["entries"]
    if len(entries) != 1:
        raise RuntimeError(f"the server in {args.socket_dir} holds {len(entries)} entries, not the model's one")
    results |= {"server_pid": before["pid"], "entry_bytes": entries[0].get("bytes"), "gpu_server_only": gpu_memory()}
    engines: list[Engine] = []
    try:
        serve_pair(args, results, engines)
    finally:
        for engine in engines:
            engine.close()


def serve_pair(args: argparse.Namespace, results: dict, engines: list) -> None:
    for name in ("A", "B"):  # one after the other: vLLM's memory profiling wants the GPU quiet while it measures
        engines.append(Engine(name, args, Path(args.out).with_name(f"pair-{name}.log")))
        results[f"ready_{name}"] = engines[-1].expect("ready") | {"vllm": dict(engines[-1].memory)}
    results["gpu_both_serving"] = gpu_memory()
    results["attached_pids"] = server_status(args.socket_dir)["entries"][0]["attached_pids"]
    for engine in engines:
        engine.send("tokens")
    results["tokens_both"] = [engine.expect("tokens", 120)["tokens"] for engine in engines]
    engines[0].send("loop")
    engines[0].expect("looping", 120)
    time.sleep(0.3)
    os.kill(results["server_pid"], signal.SIGKILL)
    results["killed_at"] = time.time()
    looped = engines[0].expect("looped", 180)
    results["loop_during_kill"] = {"same": looped["same"], "of": looped["of"], "tokens": looped["tokens"]}
    for engine in engines:
        engine.send("tokens")
    results["tokens_after_kill"] = [engine.expect("tokens", 120)["tokens"] for engine in engines]
    results["alive_after_kill"] = [engine.proc.poll() is None for engine in engines]
    results["gpu_after_kill"] = gpu_memory()


def verdict(results: dict, expect: list | None) -> dict:
    """What must hold. One copy: neither engine's own load took memory for weights (vLLM's "Model loading took"
    below half the entry: they map the server's), while vLLM sized its KV cache with the weights counted."""
    want = expect or (results.get("tokens_both") or [None])[0]
    lists = results.get("tokens_both", []) + results.get("tokens_after_kill", [])
    loop = results.get("loop_during_kill", {})
    server, both = (results.get(key, {}).get("used_mib", 0) * 2**20 for key in ("gpu_server_only", "gpu_both_serving"))
    results["engines_added_bytes"] = both - server  # a figure: vLLM fills its budget either way
    entry = results.get("entry_bytes") or 0
    loads = [results.get(f"ready_{name}", {}).get("vllm", {}).get("model_loading_gib") for name in ("A", "B")]
    return {
        "tokens_equal": bool(lists) and want is not None and all(tokens == want for tokens in lists),
        "loop_unchanged": bool(loop) and loop["same"] == loop["of"] and loop["tokens"] == want,
        "both_attached": len(results.get("attached_pids", [])) >= 2,
        "one_copy": entry > 0 and all(gib is not None and gib * 2**30 < entry / 2 for gib in loads),
        "alive_after_kill": all(results.get("alive_after_kill", [False])),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--socket-dir", required=True)
    parser.add_argument("--expect", help="engine_llm.py's JSON: its plain load's tokens are the reference")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--memory", type=float, default=0.3, help="gpu_memory_utilization of each engine")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    expect = None
    if args.expect and Path(args.expect).exists():
        expect = json.loads(Path(args.expect).read_text())["variants"].get("plain", {}).get("tokens")
    results: dict = {"model": args.model, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    try:
        run(args, results)
    except Exception as exc:  # the figures so far still go to OUT.json
        results["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if results.get("server_pid") and "killed_at" not in results:
            try:  # the next step starts its own server: leave no entry of this one on the GPU
                os.kill(results["server_pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    results["verdict"] = verdict(results, expect)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print("engine pair: " + json.dumps({k: v for k, v in results.items() if not k.startswith("tokens")})[:4000])
    return 0 if "error" not in results and all(results["verdict"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
