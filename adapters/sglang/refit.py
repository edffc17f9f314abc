"""SGLang's schedulers switching to a new weight version through SGLang's own weight-update path.

    engine = sglang.Engine(model_path=..., load_format="weightcache", model_loader_extra_config='{"mode": "client"}',
                           custom_weight_loader=[UPDATE_WEIGHTS, PREFETCH])
    # a version a trainer published (publish_version): fetched and checksummed while the engine serves, then swapped
    start_fetch(engine, 1)  # returns at once; the engine keeps serving
    ...
    switch(engine, 1)  # the swap alone; returns 1
    # or build the next version from a state dict on every rank:
    # engine.update_weights_from_tensor(list(state_dict.items()), load_format=UPDATE_WEIGHTS)

SGLang calls a custom weight loader in every TP rank's scheduler between two batches, and flushes its radix cache
afterwards (``flush_cache``). With tensors (every tensor of the checkpoint, in its naming) each rank builds the version
after the one it serves, publishes it and switches; with ``version_request(N)`` (or none: the newest) each switches
to version N as published already (by a trainer, or by another replica). ``start_fetch`` and ``switch`` make those
calls (each in a weight-update session: ``begin_weight_update``, the update, ``end_weight_update``); ``switch`` returns
the version the engine serves afterwards (SGLang's own entry returns its ``(True, "Success")``). SGLang is not imported
here.
"""

from __future__ import annotations

import typing

from weightcache.adapters import engine_refit

if typing.TYPE_CHECKING:
    import torch

UPDATE_WEIGHTS = "weightcache.adapters.sglang.refit.update_weights"
"""The import path to pass as ``custom_weight_loader`` and as ``load_format`` of ``update_weights_from_tensor``."""
PREFETCH = "weightcache.adapters.sglang.refit.prefetch"
"""The same for the fetch of a published version beside the running one (``engine_refit.prefetch``)."""
VERSION_NAME = "weightcache.version"
"""The name under which ``version_request`` hands a version number to the custom weight loaders."""


def version_request(version: int) -> "list[tuple[str, torch.Tensor]]":
    """What to pass as ``named_tensors`` to switch to (or prefetch) version ``version`` as published already."""
    import torch

    return [(VERSION_NAME, torch.tensor(int(version), dtype=torch.int64))]


def _split(named_tensors) -> "tuple[int | None, list[tuple[str, torch.Tensor]]]":
    """The version asked for (None: none) and the tensors of a state dict."""
    items = list(named_tensors or [])
    versions = [int(tensor.item()) for name, tensor in items if name == VERSION_NAME]
    return (versions[0] if versions else None), [(name, tensor) for name, tensor in items if name != VERSION_NAME]


def update_weights(model: "torch.nn.Module", named_tensors: "list[tuple[str, torch.Tensor]]") -> None:
    """SGLang's custom weight loader: switch ``model`` in place to a new version (see the module docstring)."""
    version, state = _split(named_tensors)
    engine_refit.update_weights(model, state, version)


def prefetch(model: "torch.nn.Module", named_tensors: "list[tuple[str, torch.Tensor]]") -> None:
    """SGLang's custom weight loader that starts fetching a published version and returns at once (the scheduler
    keeps serving while the version is mapped and checksummed)."""
    version, _ = _split(named_tensors)
    engine_refit.prefetch(model, version)


def start_fetch(engine: typing.Any, version: int) -> None:
    """Have every rank of a running ``sglang.Engine`` fetch version ``version`` as published already (mapped beside the
    running one, every arena checksummed) in a thread of its own; returns at once, and the engine keeps serving.
    A ``switch`` to that version afterwards stalls the engine for the swap alone (and for what is left of the fetch,
    if it has not ended yet). The engine needs ``custom_weight_loader=[UPDATE_WEIGHTS, PREFETCH]``."""
    engine.begin_weight_update()  # SGLang accepts weight updates only inside its weight-update session
    try:
        _checked(engine.update_weights_from_tensor(version_request(version), load_format=PREFETCH, flush_cache=False))
    finally:
        engine.end_weight_update()


def switch(engine: typing.Any, version: int) -> int:
    """Switch a running ``sglang.Engine`` to version ``version`` as published already, through SGLang's weight-update
    session (its radix cache flushed); returns ``version`` once every rank serves it (SGLang's own entry returns its
    ``(True, "Success")``). Without a ``start_fetch`` before, each rank fetches and checksums it here, while the
    engine waits. RuntimeError with SGLang's message when SGLang refuses the update."""
    engine.begin_weight_update()
    try:
        _checked(engine.update_weights_from_tensor(version_request(version), load_format=UPDATE_WEIGHTS))
    finally:
        engine.end_weight_update()
    return version


def _checked(result) -> None:
    success, message = (result[0], result[1]) if isinstance(result, tuple | list) else (bool(result), str(result))
    if not success:
        raise RuntimeError(f"SGLang refused the weight update: {message}")
