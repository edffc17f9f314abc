"""The CUDA driver API through cuda-bindings: imported on first use, every call's result checked.

Both ``arena/cuda.py`` (VMM arenas) and ``device.py`` (GPU UUIDs) call the
driver through here, so neither imports the other.
"""

from __future__ import annotations

import types
import typing

from weightcache.core.errors import BackendUnavailable, CudaError

_HINTS = {
    "CUDA_ERROR_OUT_OF_MEMORY": "free GPU memory (evict cached entries or stop an engine) and retry",
    "CUDA_ERROR_NOT_SUPPORTED": "this GPU, driver or container cannot share VMM memory as POSIX fds; use the host backend",
    "CUDA_ERROR_NOT_PERMITTED": "the driver refused; check the container's access to /dev/nvidia* and the driver version",
    "CUDA_ERROR_INVALID_VALUE": "the fd, size or spec does not match the allocation; fetch the arena again from the server",
    "CUDA_ERROR_INVALID_DEVICE": "the arena's GPU is not usable here; check CUDA_VISIBLE_DEVICES",
}


def driver() -> types.ModuleType:
    """The ``cuda.bindings.driver`` module, imported on first use."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as exc:
        raise BackendUnavailable(
            "cuda", f"cuda-bindings is not importable ({exc}); `pip install cuda-bindings` for this CUDA major version"
        ) from None
    return cu


def check(result: typing.Any, call: str) -> typing.Any:
    """The outputs of a cuda-bindings call (None, one value or a tuple); raises CudaError on failure."""
    err, *out = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        name = getattr(err, "name", str(err))
        raise CudaError(call, name, _HINTS.get(name, ""))
    if not out:
        return None
    return out[0] if len(out) == 1 else tuple(out)
