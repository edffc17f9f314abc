"""Which tensor of the model holds each tensor of a transformers checkpoint: transformers' own renaming, for the kit.

transformers renames checkpoint keys while it loads (legacy names, a module tree
reorganised, experts fused into one tensor, the base model's prefix added or
stripped). The conformance kit accounts for every tensor of the checkpoint's files
(``CheckpointConventions.consumed_tensors``); this gives it the name each one has
in the model, from the same conversion mapping and the same rule transformers
applies, on the model's meta skeleton.
"""

from __future__ import annotations

import typing
from collections.abc import Callable

import attrs

if typing.TYPE_CHECKING:
    from weightcache.adapter import LoadRequest


@attrs.define(eq=False)
class TransformersNames:
    """``f(checkpoint_name)``: the model's name for it where transformers renames it, else None (built on first call)."""

    request: "LoadRequest"
    _rename: Callable[[str], str] | None = attrs.field(default=None, init=False)

    def __call__(self, name: str) -> str | None:
        if self._rename is None:
            self._rename = renamer(self.request)
        renamed = self._rename(name)
        return renamed if renamed != name else None


def renamer(request: "LoadRequest") -> Callable[[str], str]:
    """transformers' renaming of checkpoint keys for the model ``request`` loads (its meta skeleton's conversion mapping)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    from weightcache.adapters.hf.identity import load_dtype, read_config
    from weightcache.adapters.hf.loading import skeleton

    model = skeleton(request, True, load_dtype(request, read_config(request.model, request.revision)))
    transforms = get_model_conversion_mapping(model)
    converters = [transform for transform in transforms if isinstance(transform, WeightConverter)]
    renamings = [transform for transform in transforms if isinstance(transform, WeightRenaming)]
    names = dict.fromkeys(model.state_dict())
    prefix = model.base_model_prefix or None
    return lambda name: rename_source_key(name, renamings, converters, prefix, names)[0]
