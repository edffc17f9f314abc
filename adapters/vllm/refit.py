"""vLLM's workers switching to a new weight version, driven as RL frameworks drive vLLM: a worker extension.

    llm = LLM(model, load_format="weightcache", model_loader_extra_config={"mode": "client"},
              worker_extension_cls="weightcache.adapters.vllm.refit.WeightcacheWorkerExtension")
    llm.collective_rpc("weightcache_update_weights", args=(shared(state_dict, workers=2), 1))  # build v1 on every rank
    llm.collective_rpc("weightcache_prefetch", args=(1,))  # or: v1 as a trainer published it, checksummed meanwhile
    llm.collective_rpc("weightcache_refit", args=(1,))  # ... then the swap alone
    llm.reset_prefix_cache()  # keys and values cached on the old weights

Each worker (every TP and PP rank) switches its own rank's entry in place
(``weightcache.adapters.engine_refit``); vLLM calls the methods between two
steps. vLLM's RPC carries control messages (its msgpack turns tensors into
lists), so the tensors travel as ``shared`` makes them: handles to their
memory (shared memory on the CPU, CUDA IPC on a GPU), one payload per worker,
as SGLang's ``update_weights_from_tensor`` sends them; the caller keeps them
alive until the call returns. vLLM is not imported here.
"""

from __future__ import annotations

import io
import typing

from weightcache.adapters import engine_refit

if typing.TYPE_CHECKING:
    import torch

EXTENSION = "weightcache.adapters.vllm.refit.WeightcacheWorkerExtension"
"""What to pass as ``worker_extension_cls`` (``--worker-extension-cls`` of ``vllm serve``)."""


def shared(named_tensors: engine_refit.NamedTensors, workers: int) -> list[bytes]:
    """``named_tensors`` as handles to their memory for ``collective_rpc``, one payload per worker (a handle opens
    once; ``workers``: the engine's TP size times its PP size)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions: handles to the memory, not copies)

    items = list(named_tensors.items() if isinstance(named_tensors, typing.Mapping) else named_tensors)
    payloads = []
    for _ in range(workers):
        buffer = io.BytesIO()
        ForkingPickler(buffer).dump(items)
        payloads.append(buffer.getvalue())
    return payloads


def received(payloads: "list[bytes] | engine_refit.NamedTensors", rank: int) -> engine_refit.NamedTensors:
    """The tensors ``shared`` sent to worker ``rank`` (tensors as given, where an in-process executor passed them)."""
    if not (isinstance(payloads, list | tuple) and payloads and isinstance(payloads[0], bytes | bytearray)):
        return typing.cast(engine_refit.NamedTensors, payloads)
    if rank >= len(payloads):
        raise ValueError(f"{len(payloads)} payloads came for worker {rank}: call shared() with workers=TP size x PP size")
    import pickle

    import torch.multiprocessing  # noqa: F401  (registers the reductions that rebuild shared tensors)

    return pickle.loads(payloads[rank])  # the engine's own RPC brought it, from the process that drives the engine


class WeightcacheWorkerExtension:
    """Methods vLLM mixes into its worker class; ``LLM.collective_rpc`` calls them on every worker."""

    model_runner: typing.Any  # the worker's; vLLM sets them
    rank: int

    def weightcache_update_weights(
        self, named_tensors: "list[bytes] | engine_refit.NamedTensors", version: int | None = None
    ) -> int:
        """Build version ``version`` (None: the next) of this rank's entry from ``named_tensors`` (every tensor of the
        checkpoint, in its naming; ``shared`` makes them), publish it and switch to it; returns the version this rank
        runs on now."""
        return engine_refit.update_weights(self._weightcache_model(), received(named_tensors, self.rank), version)

    def weightcache_refit(self, version: int | None = None) -> int:
        """Switch to version ``version`` (None: the newest) as the server holds it; returns the version now served."""
        return engine_refit.update_weights(self._weightcache_model(), None, version)

    def weightcache_prefetch(self, version: int | None = None) -> int:
        """Start fetching version ``version`` (None: the newest) as the server holds it, beside the running one, and
        return at once (the version served now): it is mapped and checksummed while the engine steps, and the
        ``weightcache_refit`` of the same version then stalls the engine for the swap alone."""
        return engine_refit.prefetch(self._weightcache_model(), version)

    def weightcache_version(self) -> int:
        """The version of the weights this rank serves (0: as published from the checkpoint)."""
        return engine_refit.attachment_of(self._weightcache_model()).version

    def _weightcache_model(self) -> "torch.nn.Module":
        return self.model_runner.get_model()
