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

``install()`` must run before anything imports transformers or the engines.
"""

from __future__ import annotations

import os
import sys

_libraries: list = []  # a torch.library.Library deregisters its ops when collected: keep them


def install() -> None:
    """Apply the shims this machine needs (idempotent): only with a CPU-only torch."""
    import torch

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu" if torch.version.cuda is None else "cuda")
    if torch.version.cuda is not None or torch.accelerator.is_available():
        return
    if not _libraries and "torchvision" not in sys.modules:
        library = torch.library.Library("torchvision", "DEF")
        library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _libraries.append(library)
    torch.accelerator.empty_cache = _no_accelerator_cache


def _no_accelerator_cache() -> None:
    """``torch.accelerator.empty_cache`` where no accelerator exists: nothing to free."""
