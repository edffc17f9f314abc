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
import importlib.abc
import importlib.machinery
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ("vllm", "sglang")
STEP_TIMEOUT_S = 90
BUDGET_S = 345
PROMPT_IDS = [1, 15, 27, 99, 3, 42, 7, 300]

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

# Compiled extension modules each engine imports unconditionally on CUDA, replaced by a module whose attributes
# raise when called (``_StubFinder``): vllm/platforms/cuda.py imports vllm._C_stable_libtorch at its top (92 MB,
# built for torch 2.14); SGLang's CUDA layers import sgl_kernel (the sglang-kernel wheel). Step 0 shows what
# happens without them. Every other compiled module the engines import inside try/except, and they stay absent.
STUBS = {"vllm": ("vllm._C_stable_libtorch",), "sglang": ("sgl_kernel",)}

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


# ----------------------------------------------------------------------------------------------------- child side


class _CompiledStub:
    """Stands in for one function of a compiled extension: importing it works, calling it says what is missing."""

    def __init__(self, qualname: str):
        self.qualname = qualname

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self.qualname} is a compiled kernel, stubbed by engine_probe (not on this machine)")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _CompiledStub(f"{self.qualname}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Supplies a stub module for each of ``names`` (and its submodules) that the real search does not find."""

    def __init__(self, names):
        self.names = tuple(names)
        self.created: list[str] = []

    def find_spec(self, fullname, path=None, target=None):
        if not any(fullname == name or fullname.startswith(name + ".") for name in self.names):
            return None
        if importlib.machinery.PathFinder.find_spec(fullname, path) is not None:
            return None  # the real extension is there: use it
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda name, qual=spec.name: _attribute_stub(qual, name)
        self.created.append(spec.name)
        return module

    def exec_module(self, module):
        pass


def _attribute_stub(module: str, name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _CompiledStub(f"{module}.{name}")


def failure_record(exc: BaseException, engines_dir: str) -> dict:
    frames = traceback.extract_tb(exc.__traceback__)

    def where(frame) -> str:
        return f"{short_path(frame.filename, engines_dir)}:{frame.lineno} in {frame.name}"

    engine_frames = [f for f in frames if is_engine_file(f.filename, engines_dir)]
    record = {
        "ok": False,
        "error": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        "message": str(exc)[:3000],
        "frames": [where(f) for f in frames[-10:]],
        "engine_frame": where(engine_frames[-1]) if engine_frames else None,
    }
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if cause is not None:
        cause_frames = traceback.extract_tb(cause.__traceback__)
        record["cause"] = f"{type(cause).__name__}: {str(cause)[:1500]}" + (
            f" at {where(cause_frames[-1])}" if cause_frames else ""
        )
    return record


def is_engine_file(filename: str, engines_dir: str) -> bool:
    return filename.startswith(engines_dir) or any(f"/{name}/" in filename for name in ENGINES)


def short_path(filename: str, engines_dir: str) -> str:
    for marker in (engines_dir + "/", "/site-packages/", "/dist-packages/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename.replace(str(ROOT) + "/", "")


def child_main(args: argparse.Namespace) -> int:
    engine, step = args.child
    work = Path(args.work)
    result_path = work / "results" / f"{engine}-{step}.json"
    stubs = _StubFinder(STUBS[engine] if step != "0-import-unstubbed" else ())
    sys.meta_path.insert(0, stubs)
    try:
        from tests.engines import shims

        shims.install()  # the engine suite's CPU shims: a no-op where torch has CUDA
        context = StepContext(engine, work, args.device)
        detail = STEPS[engine][step](context) or {}
        result = {"ok": True, **detail}
    except BaseException as exc:
        result = failure_record(exc, str(work / "engines"))
    result["stubbed_modules_imported"] = stubs.created
    result_path.write_text(json.dumps(result, default=str))
    sys.stdout.flush()
    os._exit(0)  # engines leave threads and process groups behind: do not wait for them


class StepContext:
    """What a step needs: its engine, the work folder (checkpoint, saved tensors, server folders) and the device."""

    def __init__(self, engine: str, work: Path, device: str):
        self.engine = engine
        self.work = work
        self.device = device
        self.checkpoint = str(work / "tiny-llama")
        self.own_state = work / f"{engine}-own.pt"
        self.tokens = work / f"{engine}-tokens.json"

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def start_server(self):
        """A weightcache server (``ServerProcess``) whose pid the parent kills if this step dies before closing it."""
        from weightcache.core.server.server_process import ServerProcess

        server = ServerProcess.start()
        pids = self.work / "pids"
        pids.mkdir(exist_ok=True)
        (pids / f"{server.pid}.pid").write_text(str(server.pid))
        return server

    def module_file(self, name: str) -> str:
        module = sys.modules[name]
        return short_path(str(getattr(module, "__file__", "?")), str(self.work / "engines"))


def compare_with_own(state: dict, own_path: Path) -> dict:
    """Every tensor of ``state`` against the engine's own load (step 4): names, dtypes, shapes, bits."""
    import torch

    from tests.helpers import assert_tensors_equal

    own = torch.load(own_path, weights_only=True)
    differences = []
    for name in sorted(set(own) & set(state)):
        try:
            assert_tensors_equal(name, state[name], own[name])
        except AssertionError as exc:
            differences.append(str(exc))
    only_own, only_ours = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if differences or only_own or only_ours:
        raise AssertionError(
            f"weightcache's load differs from the engine's own: {len(differences)} tensors differ {differences[:10]}, "
            f"only in the engine's load {only_own[:10]}, only in ours {only_ours[:10]}"
        )
    return {"tensors_compared": len(own), "identical": True}


def loaded_summary(model, out: Path | None = None) -> dict:
    """Where the tensors came from and whether they are mapped (tests/engines/engine_child.describe), trimmed."""
    from tests.engines.engine_child import describe

    summary = describe(model, str(out) if out else None)
    devices = sorted({str(t.device) for t in list(model.parameters()) + list(model.buffers())})
    short = {key: summary[key] for key in ("source", "entry_bytes", "digest")}
    for key in ("parameters", "buffers", "attributes", "meta", "unmapped_parameters", "unmapped_buffers"):
        short[key] = len(summary[key])
    short["unmapped_parameter_names"] = summary["unmapped_parameters"][:10]
    short["devices"] = devices
    return short


def attachment_devices(model) -> list[str]:
    from weightcache.core.flow.modes import ATTACHMENT_ATTR

    attachment = getattr(model, ATTACHMENT_ATTR, None)
    if attachment is None:
        return []
    return sorted({str(arena.bytes_view().device) for arena in attachment.arenas})


def server_entries(server) -> list:
    from weightcache.core.client.client import Connection

    with Connection(server.socket_dir, timeout=5.0) as connection:
        status = connection.status()
    return [
        {k: v for k, v in entry.items() if not isinstance(v, (dict, list)) or k == "attached_pids"} for entry in status["entries"]
    ]


# --- vLLM


def vllm_import_unstubbed(ctx: StepContext) -> dict:
    """vLLM as it is: resolving ``current_platform`` imports vllm/platforms/cuda.py and its compiled ops."""
    import vllm
    import vllm.config
    from vllm.platforms import current_platform

    return {"vllm": vllm.__version__, "platform": type(current_platform).__name__, "file": ctx.module_file("vllm")}


def vllm_import(ctx: StepContext) -> dict:
    import torch
    import vllm
    from vllm.platforms import current_platform

    return {
        "vllm": vllm.__version__,
        "file": ctx.module_file("vllm"),
        "torch": torch.__version__,
        "platform": type(current_platform).__name__,
        "device_type": current_platform.device_type,
    }


def vllm_modules(ctx: StepContext) -> dict:
    import vllm.config
    import vllm.model_executor.model_loader.default_loader
    import vllm.model_executor.model_loader.utils
    import vllm.model_executor.models.llama
    import vllm.v1.attention.backends.triton_attn  # noqa: F401

    import weightcache.adapters.vllm.engine
    import weightcache.adapters.vllm.loader
    import weightcache.adapters.vllm.loading  # noqa: F401

    return {"llama": ctx.module_file("vllm.model_executor.models.llama")}


def vllm_configs(ctx: StepContext, load_format: str, extra: dict | None = None):
    """vLLM's configs for the tiny checkpoint: eager, native custom ops, Triton attention on CUDA."""
    import torch
    from vllm.config import CompilationConfig, LoadConfig, ModelConfig, VllmConfig

    from weightcache.adapters.vllm.engine import init_single_process

    model_config = ModelConfig(model=ctx.checkpoint, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True)
    load_config = LoadConfig(load_format=load_format, model_loader_extra_config=extra or {})
    kwargs = {"compilation_config": CompilationConfig(mode=0, custom_ops=["none"])}
    if ctx.cuda:
        from vllm.config import AttentionConfig

        kwargs["attention_config"] = AttentionConfig(backend="TRITON_ATTN")
    vllm_config = VllmConfig(model_config=model_config, load_config=load_config, **kwargs)
    init_single_process(torch.device(ctx.device))  # the adapter's: vLLM's own calls, world size 1
    return vllm_config, model_config, load_config


def vllm_build(ctx: StepContext) -> dict:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    vllm_config, model_config, _ = vllm_configs(ctx, "dummy")
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(model_config.dtype), torch.device(ctx.device):
        model = initialize_model(vllm_config=vllm_config, model_config=model_config)
    return {
        "model": type(model).__name__,
        "parameters": sum(1 for _ in model.parameters()),
        "devices": sorted({str(p.device) for p in model.parameters()}),
        "attention_backend": str(vllm_config.attention_config.backend) if ctx.cuda else None,
    }


def vllm_own_load(ctx: StepContext) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    vllm_config, model_config, load_config = vllm_configs(ctx, "auto")
    with set_current_vllm_config(vllm_config):
        loader = get_model_loader(load_config)
        model = loader.load_model(vllm_config=vllm_config, model_config=model_config)
    return {"loader": type(loader).__name__, **loaded_summary(model, ctx.own_state)}


def vllm_weightcache(ctx: StepContext) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    server = ctx.start_server()
    try:
        extra = {"mode": "daemon", "socket_dir": str(server.socket_dir), "strict": True}
        vllm_config, model_config, load_config = vllm_configs(ctx, "weightcache", extra)
        with set_current_vllm_config(vllm_config):
            loader = get_model_loader(load_config)
            model = loader.load_model(vllm_config=vllm_config, model_config=model_config)
        summary = loaded_summary(model, ctx.work / "vllm-weightcache.pt")
        import torch

        comparison = compare_with_own(torch.load(ctx.work / "vllm-weightcache.pt", weights_only=True), ctx.own_state)
        return {
            "loader": type(loader).__name__,
            **summary,
            **comparison,
            "arena_devices": attachment_devices(model),
            "server_entries": server_entries(server),
        }
    finally:
        server.close()


def vllm_generate(ctx: StepContext, load_format: str, extra: dict | None) -> list[int]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {"attention_backend": "TRITON_ATTN"} if ctx.cuda else {}
    llm = LLM(
        model=ctx.checkpoint,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        enforce_eager=True,
        compilation_config={"mode": 0, "custom_ops": ["none"]},
        gpu_memory_utilization=0.15,
        max_model_len=128,
        max_num_seqs=4,
        load_format=load_format,
        model_loader_extra_config=extra or {},
        **kwargs,
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=PROMPT_IDS)], params, use_tqdm=False)
    return list(outputs[0].outputs[0].token_ids)


def vllm_forward(ctx: StepContext) -> dict:
    tokens = vllm_generate(ctx, "auto", None)
    ctx.tokens.write_text(json.dumps(tokens))
    return {"tokens": tokens}


def vllm_forward_weightcache(ctx: StepContext) -> dict:
    server = ctx.start_server()
    try:
        tokens = vllm_generate(ctx, "weightcache", {"mode": "daemon", "socket_dir": str(server.socket_dir), "strict": True})
        entries = server_entries(server)
    finally:
        server.close()
    return same_tokens(ctx, tokens, entries)


def same_tokens(ctx: StepContext, tokens: list[int], entries: list) -> dict:
    plain = json.loads(ctx.tokens.read_text())
    if tokens != plain:
        raise AssertionError(f"greedy tokens differ: weightcache {tokens}, the engine's own load {plain}")
    return {"tokens": tokens, "identical_to_plain": True, "server_entries": entries}


# --- SGLang


def sglang_import_unstubbed(ctx: StepContext) -> dict:
    """SGLang as it is: its layers' CUDA branches import sgl_kernel (sglang/srt/layers/layernorm.py)."""
    import sglang
    import sglang.srt.layers.layernorm
    import sglang.srt.models.llama

    return {"sglang": sglang.__version__, "file": ctx.module_file("sglang")}


def sglang_import(ctx: StepContext) -> dict:
    import sglang
    import torch

    return {"sglang": sglang.__version__, "file": ctx.module_file("sglang"), "torch": torch.__version__}


def sglang_modules(ctx: StepContext) -> dict:
    import sglang.srt.configs.model_config
    import sglang.srt.layers.attention.triton_backend
    import sglang.srt.model_loader.loader
    import sglang.srt.models.llama
    import sglang.srt.server_args  # noqa: F401

    return {"llama": ctx.module_file("sglang.srt.models.llama")}


SGLANG_RUNTIME = {"attention_backend": "triton", "sampling_backend": "pytorch", "disable_cuda_graph": True}
"""SGLang's server arguments for Triton attention, the PyTorch sampler and no CUDA graphs (sglang/srt/server_args.py)."""


def sglang_configs(ctx: StepContext, load_format: str, extra: dict | None = None):
    """SGLang's configs for the tiny checkpoint, published as a scheduler does (tests/engines/engine_child.py)."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    from weightcache.adapters.sglang.engine import _initialise_distributed_once

    kind = "cuda" if ctx.cuda else "cpu"
    runtime = SGLANG_RUNTIME if ctx.cuda else {}
    server_args = ServerArgs(model_path=ctx.checkpoint, device=kind, dtype="bfloat16", load_format=load_format, **runtime)
    server_args.resolve_once()
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    initialize_moe_config()
    _initialise_distributed_once(kind)  # the adapter's: SGLang's own calls, world size 1
    model_config = ModelConfig.from_server_args(server_args)
    load_config = LoadConfig(load_format=load_format, model_loader_extra_config=json.dumps(extra or {}))
    return model_config, load_config, DeviceConfig(kind, 0)


def sglang_build(ctx: StepContext) -> dict:
    import torch
    from sglang.srt.model_loader.loader import _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    model_config, load_config, device_config = sglang_configs(ctx, "dummy")
    with set_default_torch_dtype(model_config.dtype), torch.device(device_config.device):
        model = _initialize_model(model_config, load_config)
    return {
        "model": type(model).__name__,
        "parameters": sum(1 for _ in model.parameters()),
        "devices": sorted({str(p.device) for p in model.parameters()}),
    }


def sglang_own_load(ctx: StepContext) -> dict:
    from sglang.srt.model_loader.loader import get_model_loader

    model_config, load_config, device_config = sglang_configs(ctx, "auto")
    loader = get_model_loader(load_config, model_config)
    model = loader.load_model(model_config=model_config, device_config=device_config)
    return {"loader": type(loader).__name__, **loaded_summary(model, ctx.own_state)}


def sglang_weightcache(ctx: StepContext) -> dict:
    import torch
    from sglang.srt.model_loader.loader import get_model_loader
    from sglang.srt.plugins import load_plugins

    load_plugins()
    server = ctx.start_server()
    try:
        extra = {"mode": "daemon", "socket_dir": str(server.socket_dir), "strict": True}
        model_config, load_config, device_config = sglang_configs(ctx, "weightcache", extra)
        loader = get_model_loader(load_config, model_config)
        model = loader.load_model(model_config=model_config, device_config=device_config)
        summary = loaded_summary(model, ctx.work / "sglang-weightcache.pt")
        comparison = compare_with_own(torch.load(ctx.work / "sglang-weightcache.pt", weights_only=True), ctx.own_state)
        return {
            "loader": type(loader).__name__,
            **summary,
            **comparison,
            "arena_devices": attachment_devices(model),
            "server_entries": server_entries(server),
        }
    finally:
        server.close()


def sglang_generate(ctx: StepContext, load_format: str, extra: dict | None, server=None) -> tuple[list[int], list]:
    """Greedy tokens, and ``server``'s entries read before the engine's shutdown (which kills this process's
    children, a server started here among them: sglang.Engine.shutdown -> kill_process_tree)."""
    import sglang

    runtime = SGLANG_RUNTIME if ctx.cuda else {"device": "cpu"}
    engine = sglang.Engine(
        model_path=ctx.checkpoint,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        mem_fraction_static=0.15,
        context_length=128,
        load_format=load_format,
        model_loader_extra_config=json.dumps(extra or {}),
        log_level="error",
        **runtime,
    )
    try:
        output = engine.generate(input_ids=PROMPT_IDS, sampling_params={"temperature": 0.0, "max_new_tokens": 8})
        entries = server_entries(server) if server is not None else []
    finally:
        engine.shutdown()
    return list(output["output_ids"]), entries


def sglang_forward(ctx: StepContext) -> dict:
    tokens, _ = sglang_generate(ctx, "auto", None)
    ctx.tokens.write_text(json.dumps(tokens))
    return {"tokens": tokens}


def sglang_forward_weightcache(ctx: StepContext) -> dict:
    server = ctx.start_server()
    try:
        extra = {"mode": "daemon", "socket_dir": str(server.socket_dir), "strict": True}
        tokens, entries = sglang_generate(ctx, "weightcache", extra, server)
    finally:
        server.close()
    return same_tokens(ctx, tokens, entries)


STEPS = {
    "vllm": {
        "0-import-unstubbed": vllm_import_unstubbed,
        "1-import": vllm_import,
        "2-modules": vllm_modules,
        "3-build": vllm_build,
        "4-own-load": vllm_own_load,
        "5-weightcache": vllm_weightcache,
        "6-forward": vllm_forward,
        "7-forward-weightcache": vllm_forward_weightcache,
    },
    "sglang": {
        "0-import-unstubbed": sglang_import_unstubbed,
        "1-import": sglang_import,
        "2-modules": sglang_modules,
        "3-build": sglang_build,
        "4-own-load": sglang_own_load,
        "5-weightcache": sglang_weightcache,
        "6-forward": sglang_forward,
        "7-forward-weightcache": sglang_forward_weightcache,
    },
}
STEP_NAMES = tuple(STEPS["vllm"])


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
