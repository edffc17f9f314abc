#!/usr/bin/env python3
"""How far vLLM's and SGLang's own Python gets on a GPU machine whose torch the engines do not support.

    python3 tests/gpu/engine_probe.py --engines .engines --out $OUT [--device cuda:0] [--only vllm]

The GPU machine has torch 2.11 and no network; vLLM 0.33.0 and SGLang 0.5.23 declare torch 2.14 and ship
compiled kernels for it. ``--engines`` holds what travels there instead (docs/engines.md, "What was run"):

- ``vllm-py.tar.xz``, ``sglang-py.tar.xz``: each engine's ``.py`` files and small data files (json configs,
  templates) with its dist-info (entry points), no compiled extension;
- ``wheels/``: pure-Python wheels of the dependencies the machine lacks; ``wheels-binary/``: the compiled
  wheels of dependencies that do not link torch (pydantic-core, msgspec, pyzmq...; skipped with ``--pure-only``).

It unpacks and installs them (``pip install --no-index --no-deps --target``) under /tmp, puts weightcache on the
path with its entry points (as tests/gpu/run_gpu.sh does), writes a tiny random Llama checkpoint, and then for
each engine runs numbered steps, each in a fresh process with a timeout, stopping at the first failure:

  0-import-unstubbed  import the engine and its CUDA layers as they are (informational: never stops the run)
  1-import            import the engine, with its compiled extensions stubbed (``STUBS``)
  2-modules           the model class, the engine's loader modules and our adapter's
  3-build             the engine's configs and its model on the device (no weights loaded)
  4-own-load          the checkpoint through the engine's own loader; every tensor saved
  5-weightcache       the checkpoint through ``--load-format weightcache`` in daemon mode, with a server of
                      ``ServerProcess``: every tensor compared bit for bit with step 4, and mapped from its arenas
  6-forward           greedy generation through the engine (plain load), eager, Triton attention, native ops
  7-forward-weightcache  the same with ``--load-format weightcache`` (daemon): tokens compared with step 6

Each step records ok, or the exception's type, message, chained cause and the last frames of its traceback
(file:line, with the innermost frame inside the engine), in ``$OUT/engine-probe.json`` (rewritten after every
step, so it exists whatever happens) and ``$OUT/engine-probe.log``. The whole run keeps within ``--budget``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from engine_probe_child import ENGINES, STUBS
from engine_probe_steps import STEP_NAMES, child_main

ROOT = Path(__file__).resolve().parents[2]
STEP_TIMEOUT_S = 90
BUDGET_S = 345

# Environment of every step. Each variable is read by the engine's own code (vllm/envs.py, sglang/srt/environ.py).
ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_TARGET_DEVICE": "cuda",  # vllm/envs.py, vllm/platforms/__init__.py: the platform (cpu for --device cpu)
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # vllm/envs.py: the engine core in this process (no child to hang)
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # vllm/envs.py: the PyTorch sampler, not FlashInfer's compiled one
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "SGLANG_DISABLE_REQUEST_LOGGING": "1",
    "NCCL_NVLS_ENABLE": "0",  # the GPU machines' rule (KINDS.md): NVLink multicast stays off
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}


# What the engines' model-building path imports from the machine itself: versions recorded with the machine.
MACHINE_PACKAGES = (
    "torch", "triton", "transformers", "tokenizers", "huggingface_hub", "safetensors", "torchvision", "numpy",
    "pydantic", "cuda.bindings",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------------- parent side


class Probe:
    """The run: its folders, its record (rewritten after each step) and its deadline."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="wc-engine-probe-"))
        self.started = time.monotonic()
        self.deadline = self.started + args.budget
        self.log_file = open(self.out / "engine-probe.log", "w")
        self.record: dict = {
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "argv": sys.argv,
            "work": str(self.work),
            "env": ENV,
            "stubs": {name: list(mods) for name, mods in STUBS.items()},
            "setup": [],
            "engines": {},
        }
        self.env = dict(os.environ)

    def log(self, text: str) -> None:
        stamp = f"[{time.monotonic() - self.started:6.1f}s] "
        for line in text.rstrip("\n").splitlines() or [""]:
            self.log_file.write(stamp + line + "\n")
        self.log_file.flush()
        print(stamp + text.rstrip("\n"), flush=True)

    def save(self) -> None:
        self.record["seconds"] = round(time.monotonic() - self.started, 1)
        target = self.out / "engine-probe.json"
        scratch = target.with_suffix(".json.tmp")
        scratch.write_text(json.dumps(self.record, indent=1, default=str))
        scratch.replace(target)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    # -- set-up

    def setup_step(self, name: str, action) -> bool:
        start = time.monotonic()
        entry: dict = {"name": name}
        try:
            detail = action()
            entry.update(ok=True, **(detail or {}))
        except Exception as exc:
            entry.update(ok=False, error=type(exc).__name__, message=str(exc)[-3000:])
        entry["seconds"] = round(time.monotonic() - start, 1)
        self.record["setup"].append(entry)
        self.log(f"setup {name}: {'ok' if entry['ok'] else 'FAILED ' + entry['error'] + ': ' + entry['message']}")
        self.save()
        return entry["ok"]

    def unpack(self, engine: str) -> dict:
        archive = Path(self.args.engines) / f"{engine}-py.tar.xz"
        target = self.work / "engines"
        target.mkdir(exist_ok=True)
        subprocess.run(["tar", "-xJf", str(archive), "-C", str(target)], check=True, capture_output=True, timeout=120)
        return {"archive": str(archive), "archive_bytes": archive.stat().st_size}

    def install_wheels(self, folder: str) -> dict:
        wheels = sorted((Path(self.args.engines) / folder).glob("*.whl"))
        if not wheels:
            return {"wheels": []}
        target = self.work / "deps"
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        command += ["--no-cache-dir", "--upgrade", "--target", str(target), *map(str, wheels)]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=180)
        if proc.returncode != 0:
            raise RuntimeError(f"pip install exited {proc.returncode}: {proc.stderr[-2000:]}")
        return {"wheels": [wheel.name for wheel in wheels]}

    def weightcache_shim(self) -> dict:
        """weightcache on sys.path with its entry points (a dist-info beside the package), as run_gpu.sh does."""
        import tomllib

        shim = self.work / "shim"
        (shim / "weightcache").mkdir(parents=True)
        dist = shim / "weightcache-0.0.0.dist-info"
        dist.mkdir()
        for part in ("core", "adapters", "conformance"):
            (shim / "weightcache" / part).symlink_to(ROOT / part)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: weightcache\nVersion: 0.0.0\n")
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        lines = []
        for group, entries in project.get("entry-points", {}).items():
            lines.append(f"[{group}]")
            lines += [f"{name} = {target}" for name, target in entries.items()]
        (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
        paths = [shim, ROOT, self.work / "engines", self.work / "deps"]
        if self.args.installed_engines:  # the dry run against an installed engine: our copies stay out of the way
            paths.remove(self.work / "engines")
        previous = os.environ.get("PYTHONPATH")
        self.env.update(ENV)
        self.env["VLLM_TARGET_DEVICE"] = "cuda" if self.args.device.startswith("cuda") else "cpu"
        self.env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *([previous] if previous else [])])
        return {"pythonpath": self.env["PYTHONPATH"]}

    def python(self, code: str, timeout: float) -> str:
        proc = subprocess.run(
            [sys.executable, "-c", code], env=self.env, cwd=self.work, capture_output=True, text=True, timeout=timeout
        )
        if proc.returncode != 0:
            raise RuntimeError(f"exited {proc.returncode}: {proc.stderr[-3000:]}")
        return proc.stdout

    def machine(self) -> dict:
        code = (
            "import importlib, json, sys, torch\n"
            "info = {'python': sys.version.split()[0], 'torch_cuda': torch.version.cuda,\n"
            "        'cuda_available': torch.cuda.is_available()}\n"
            "if torch.cuda.is_available():\n"
            "    info['gpu'] = torch.cuda.get_device_name(0)\n"
            "    info['capability'] = list(torch.cuda.get_device_capability(0))\n"
            "versions = {}\n"
            f"for name in {MACHINE_PACKAGES!r}:\n"
            "    try:\n"
            "        module = importlib.import_module(name)\n"
            "        versions[name] = getattr(module, '__version__', '?')\n"
            "    except Exception as exc:\n"
            "        versions[name] = f'absent ({type(exc).__name__}: {exc})'\n"
            "info['versions'] = versions\n"
            "print(json.dumps(info))\n"
        )
        info = json.loads(self.python(code, timeout=120).strip().splitlines()[-1])
        self.record["machine"] = info
        return {}

    def checkpoint(self) -> dict:
        directory = self.work / "tiny-llama"
        code = (
            "import sys; from pathlib import Path; from tests.models import save_random_model\n"
            f"save_random_model('llama', Path({str(directory)!r}), dtype='bfloat16')\n"
        )
        self.python(code, timeout=120)
        return {"checkpoint": str(directory), "files": sorted(p.name for p in directory.iterdir())}

    # -- steps

    def run_engine(self, engine: str, share_until: float) -> None:
        steps: list[dict] = []
        self.record["engines"][engine] = {"steps": steps, "first_failure": None}
        for step in STEP_NAMES:
            fatal = step != "0-import-unstubbed"
            left = min(share_until, self.deadline) - time.monotonic()
            if left < 10:
                steps.append({"step": step, "ok": None, "skipped": f"the run's time budget is spent ({left:.0f} s left)"})
                self.log(f"{engine} {step}: skipped, budget spent")
                self.save()
                break
            result = self.run_step(engine, step, timeout=min(self.args.step_timeout, left))
            result["fatal"] = fatal
            steps.append(result)
            self.log_result(engine, result)
            self.save()
            if fatal and not result["ok"]:
                self.record["engines"][engine]["first_failure"] = step
                break

    def run_step(self, engine: str, step: str, timeout: float) -> dict:
        result_path = self.work / "results" / f"{engine}-{step}.json"
        result_path.parent.mkdir(exist_ok=True)
        command = [
            sys.executable, str(Path(__file__).resolve()), "--child", engine, step, "--work", str(self.work),
            "--device", self.args.device,
        ]  # fmt: skip
        start = time.monotonic()
        stdout_path = self.work / "results" / f"{engine}-{step}.out"
        with open(stdout_path, "w") as output:
            proc = subprocess.Popen(
                command, env=self.env, cwd=self.work, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                returncode = proc.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                kill_group(proc.pid)
                returncode = proc.wait()
                timed_out = True
        self.kill_leftover_servers()
        elapsed = round(time.monotonic() - start, 1)
        tail = stdout_path.read_text(errors="replace")[-4000:]
        result = {"step": step, "seconds": elapsed, "returncode": returncode}
        if result_path.exists():
            result.update(json.loads(result_path.read_text()))
        else:
            result["ok"] = False
            if timed_out:
                result.update(error="Timeout", message=f"no result within {timeout:.0f} s; the process group was killed")
            else:
                result.update(error="ProcessDied", message=f"exited {returncode} without a result ({describe_exit(returncode)})")
        if not result["ok"]:
            result["output_tail"] = tail
        return result

    def kill_leftover_servers(self) -> None:
        """SIGKILL any weightcache server a step started (they run in a session of their own) and left behind."""
        for pid_file in (self.work / "pids").glob("*.pid") if (self.work / "pids").exists() else ():
            pid = int(pid_file.read_text())
            pid_file.unlink()
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"weightcache" in cmdline:
                kill_group(pid)

    def log_result(self, engine: str, result: dict) -> None:
        head = f"{engine} {result['step']}: "
        if result["ok"]:
            detail = {k: v for k, v in result.items() if k not in ("step", "ok", "returncode", "fatal")}
            self.log(head + f"ok {json.dumps(detail, default=str)[:1500]}")
            return
        self.log(head + f"FAILED in {result['seconds']} s: {result.get('error')}: {str(result.get('message'))[:1500]}")
        if result.get("engine_frame"):
            self.log(f"    innermost engine frame: {result['engine_frame']}")
        for frame in result.get("frames", []):
            self.log(f"    {frame}")
        if result.get("cause"):
            self.log(f"    caused by: {result['cause']}")
        if not result.get("frames"):
            self.log("    output tail:\n" + result.get("output_tail", "")[-2500:])

    def close(self) -> None:
        self.record["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.save()
        self.log_file.close()
        if not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"status {returncode}"


def parent_main(args: argparse.Namespace) -> int:
    probe = Probe(args)
    try:
        probe.log(f"engine probe: work folder {probe.work}, budget {args.budget} s, steps of at most {args.step_timeout} s")
        engines = [name for name in ENGINES if name in args.only.split(",")]
        ready = True
        if not args.installed_engines:
            for engine in engines:
                ready &= probe.setup_step(f"unpack {engine}", lambda engine=engine: probe.unpack(engine))
        # A failed wheel install stops nothing: the steps then record which import it cost.
        probe.setup_step("install wheels/", lambda: probe.install_wheels("wheels"))
        if not args.pure_only:
            probe.setup_step("install wheels-binary/", lambda: probe.install_wheels("wheels-binary"))
        ready &= probe.setup_step("weightcache on the path", probe.weightcache_shim)
        probe.setup_step("machine", probe.machine)
        ready &= probe.setup_step("tiny llama checkpoint", probe.checkpoint)
        if not ready:
            probe.log("set-up failed: no engine step runs")
            return 1
        for index, engine in enumerate(engines):
            # The first engine gets a fair share of what is left; the last gets all of it.
            later = len(engines) - index - 1
            share_until = time.monotonic() + probe.remaining() * (0.55 if later else 1.0)
            probe.run_engine(engine, share_until)
        for engine, entry in probe.record["engines"].items():
            last_ok = [s["step"] for s in entry["steps"] if s.get("ok") and s.get("fatal")]
            probe.log(f"{engine}: last step passed {last_ok[-1] if last_ok else 'none'}; first failure {entry['first_failure']}")
        return 0
    except BaseException as exc:  # the record is written whatever happens
        probe.record["probe_error"] = "".join(traceback.format_exception(exc))[-4000:]
        probe.log(f"probe error: {type(exc).__name__}: {exc}")
        return 2
    finally:
        probe.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default=".engines", help="folder with the archives, wheels/ and wheels-binary/")
    parser.add_argument("--out", default=os.environ.get("OUT", "out/engine-probe"))
    parser.add_argument("--device", default="cuda:0", help="cuda:0 on the GPU machine; cpu for a dry run")
    parser.add_argument("--only", default=",".join(ENGINES), help="comma-separated engines (default: both)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole run")
    parser.add_argument("--step-timeout", type=float, default=STEP_TIMEOUT_S)
    parser.add_argument("--pure-only", action="store_true", help="install wheels/ only, not wheels-binary/")
    parser.add_argument("--installed-engines", action="store_true", help="dry run: import the installed engines")
    parser.add_argument("--keep", action="store_true", help="keep the work folder under /tmp")
    parser.add_argument("--child", nargs=2, metavar=("ENGINE", "STEP"), help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
