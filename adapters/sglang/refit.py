"""SGLang's schedulers switching to a new weight version through SGLang's own weight-update path.

    engine = sglang.Engine(model_path=..., load_format="weightcache", model_loader_extra_config='{"mode": "client"}',
                           custom_weight_loader=[UPDATE_WEIGHTS])
    engine.begin_weight_update()
    engine.update_weights_from_tensor(list(state_dict.items()), load_format=UPDATE_WEIGHTS)  # build the next version
    # or: engine.update_weights_from_tensor([], load_format=UPDATE_WEIGHTS)  # switch to the newest one published
    engine.end_weight_update()

SGLang calls ``update_weights`` in every TP rank's scheduler between two
batches, and flushes its radix cache afterwards (``flush_cache``). With tensors
(every tensor of the checkpoint, in its naming) each rank builds the version
after the one it serves, publishes it and switches; with none, each
switches to the newest version published (by a trainer, or by another replica).
SGLang is not imported here.
"""

from __future__ import annotations

import typing

from weightcache.adapters import engine_refit

if typing.TYPE_CHECKING:
    import torch

UPDATE_WEIGHTS = "weightcache.adapters.sglang.refit.update_weights"
"""The import path to pass as ``custom_weight_loader`` and as ``load_format`` of ``update_weights_from_tensor``."""


def update_weights(model: "torch.nn.Module", named_tensors: "list[tuple[str, torch.Tensor]]") -> None:
    """SGLang's custom weight loader: switch ``model`` in place to a new version (see the module docstring)."""
    engine_refit.update_weights(model, named_tensors)
