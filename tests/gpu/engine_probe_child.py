"""tests/gpu/engine_probe.py's child side: the stubs of compiled extensions, a failure's record, what a step gets and the
checks steps share (tensors against the engine's own load, tokens against its own generation)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import sys
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


ENGINES = ("vllm", "sglang")


PROMPT_IDS = [1, 15, 27, 99, 3, 42, 7, 300]


# Compiled extension modules each engine imports unconditionally on CUDA, replaced by a module whose attributes
# raise when called (``StubFinder``): vllm/platforms/cuda.py imports vllm._C_stable_libtorch at its top (92 MB,
# built for torch 2.14); SGLang's CUDA layers import sgl_kernel (the sglang-kernel wheel). Step 0 shows what
# happens without them. Every other compiled module the engines import inside try/except, and they stay absent.
STUBS = {"vllm": ("vllm._C_stable_libtorch",), "sglang": ("sgl_kernel",)}


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


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
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


def same_tokens(ctx: StepContext, tokens: list[int], entries: list) -> dict:
    plain = json.loads(ctx.tokens.read_text())
    if tokens != plain:
        raise AssertionError(f"greedy tokens differ: weightcache {tokens}, the engine's own load {plain}")
    return {"tokens": tokens, "identical_to_plain": True, "server_entries": entries}
