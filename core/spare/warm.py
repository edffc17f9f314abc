"""CUDA set-up that overlaps the framework's import, for engines that start fast and for warm spares.

A fresh engine process waits for ``import torch``, its framework's import
(transformers, the engine) and the CUDA context, one after the other. The
CUDA side needs only torch, so it can run while the framework imports:
``start_cuda_early(device)`` starts it in a background thread at once —
torch's CUDA context on the device and weightcache's own driver-binding
set-up (the primary context, the VMM granularity, the GPU facts of the
fingerprint), each done once per process — and ``wait()`` joins it before the
first load. The thread then runs a transformer's ops once on small tensors on the
device (kernel modules, cuBLAS's handle), which the model's first forward would
otherwise pay; ``wait()`` does not wait for that part. On the CPU it does nothing.

    from weightcache.core.spare.warm import start_cuda_early

    cuda = start_cuda_early("cuda:0")   # first thing in the process
    import transformers                  # the framework's import runs meanwhile
    cuda.wait()
    loaded = load_model(model, mode="client", device="cuda:0")

``weightcache standby`` and ``benchmarks/restart.py`` start this way.
"""

from __future__ import annotations

import logging
import threading
import time

from weightcache.core.device import Device

log = logging.getLogger(__name__)


class EarlyCuda:
    """CUDA set-up for one device, running in a background thread (or nothing to do, on the CPU).

    ``seconds`` is how long the set-up took in its thread; ``wait()`` returns
    how long the caller still had to wait for it, and raises what it raised.
    """

    def __init__(self, device: "Device | str", warm_kernels: bool = True):
        self.device = Device.parse(device)
        self.seconds = 0.0
        self.warm_seconds: float | None = None
        self.warm_kernels = warm_kernels
        self._error: BaseException | None = None
        self._set = threading.Event()
        self._thread: threading.Thread | None = None
        if self.device.is_cuda:
            self._thread = threading.Thread(target=self._set_up, name="weightcache-early-cuda", daemon=True)
            self._thread.start()

    def _set_up(self) -> None:
        start = time.perf_counter()
        try:
            set_up_context(self.device)
        except BaseException as exc:  # handed to the thread that waits
            self._error = exc
        finally:
            self.seconds = time.perf_counter() - start
            self._set.set()
        if self._error is None and self.warm_kernels:
            self._warm_kernels()

    def _warm_kernels(self) -> None:
        """The first-call costs of the device's kernels, paid here while the caller attaches (never an error)."""
        start = time.perf_counter()
        try:
            warm_device_kernels(self.device)
            self.warm_seconds = time.perf_counter() - start
        except Exception as exc:  # a warm-up that fails leaves the first forward to pay its costs, as without it
            log.debug("warming %s's kernels failed: %s", self.device, exc)

    @property
    def done(self) -> bool:
        """The set-up (not the kernels' warm-up after it) has finished."""
        return self._thread is None or self._set.is_set()

    def wait(self, timeout: float | None = None) -> float:
        """Join the set-up; returns the seconds waited here. Raises what the set-up raised (e.g. BackendUnavailable)."""
        start = time.perf_counter()
        if self._thread is not None:
            if not self._set.wait(timeout):
                raise TimeoutError(f"CUDA set-up on {self.device} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return time.perf_counter() - start


def set_up_context(device: Device) -> None:
    """torch's CUDA context on ``device``, the driver's primary context, the VMM granularity and the GPU facts of the
    fingerprint (each once per process)."""
    from weightcache.core.arena.cuda import CudaArenaBackend
    from weightcache.core.identity.identity import Environment

    CudaArenaBackend().granularity(str(device))
    Environment.of(device)


def warm_device_kernels(device: Device) -> None:
    """A transformer's ops once on small tensors on ``device``: its kernel modules and cuBLAS's handle."""
    import torch

    from weightcache.core.spare.kernel_warmup import run_transformer_ops

    run_transformer_ops(device.torch(), (torch.bfloat16,), heads=8, length=32, head_dim=128)
    torch.cuda.synchronize(device.torch())


def prepare_cuda(device: "Device | str") -> float:
    """``set_up_context`` then ``warm_device_kernels``, in the calling thread (a launcher's child forked ahead of its request,
    ``weightcache launcher --cuda-ready``); the seconds it took. Raises what the set-up raised."""
    start = time.perf_counter()
    parsed = Device.parse(device)
    set_up_context(parsed)
    warm_device_kernels(parsed)
    return time.perf_counter() - start


def start_cuda_early(device: "Device | str", warm_kernels: bool = True) -> EarlyCuda:
    """Start creating the CUDA context and weightcache's driver set-up for ``device`` in a background thread, then
    (``warm_kernels``) warming its kernels there.

    Call it before importing the framework; call ``wait()`` on the result before loading.
    """
    early = EarlyCuda(device, warm_kernels)
    if early.device.is_cuda:
        log.debug("setting up CUDA on %s in the background", early.device)
    return early
