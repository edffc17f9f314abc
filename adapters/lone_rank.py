"""One rank of a tensor-parallel engine, loaded in a process of its own (``weightcache load --tp-size N --tp-rank K``,
``load_model`` or ``publish_version`` with ``parallel=ParallelSpec(tp_size=N, tp_rank=K)``).

The engines' layers and weight loaders shard by the tensor-parallel group's ``world_size`` and ``rank_in_group``; a
process that loads one rank alone has a group of world size 1. ``LoneRank`` stands for that group while the adapter
builds, loads, post-processes or rebinds the rank: it reports the rank's place in the engine's group, so every layer
keeps the shard rank K of an N-rank engine keeps, and refuses every collective (a lone rank has no peers; a load
that needs one must run inside the engine, ``--load-format weightcache``).

Layers keep handles of the group for their forward (SGLang's logits processor its ``cpu_group``): those are the
process's own (world size 1). A model built here is exported to, or rebound from, the cache and never runs a forward
(the engine's own model is rebound to the entry inside the engine).
"""

from __future__ import annotations

import typing


class LoneRank:
    """An engine's process group (``group``, world size 1 in this process) as rank ``rank`` of ``size`` sees it.

    Other attributes (name, device, local rank, process-group handles) are the group's own; its methods (the
    collectives) raise a RuntimeError that says what to do instead.
    """

    def __init__(self, group: typing.Any, size: int, rank: int):
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} does not fit size {size}")
        self._group = group
        self.world_size = size
        self.rank_in_group = rank
        self.ranks = list(range(size))
        self.first_rank, self.last_rank = 0, size - 1
        self.is_first_rank, self.is_last_rank = rank == 0, rank == size - 1

    def __getattr__(self, name: str) -> typing.Any:
        if name.startswith("__"):
            raise AttributeError(name)
        found = getattr(self._group, name)
        if callable(found):
            raise RuntimeError(
                f"tensor-parallel rank {self.rank_in_group} of {self.world_size} is loaded in a process of its own, "
                f"which has no peers for {type(self._group).__name__}.{name}: this model's load needs the other "
                "ranks, so load it inside the engine (--load-format weightcache) at this tensor-parallel size"
            )
        return found

    def __repr__(self) -> str:
        return f"LoneRank(rank {self.rank_in_group} of {self.world_size}, standing for {self._group!r})"


PROVEN_ARCHITECTURES = {
    "vllm": ("LlamaForCausalLM",),
    "sglang": ("LlamaForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"),
}
"""Per engine, the architectures whose rank K of TP=2 loaded with ``LoneRank`` was compared tensor by tensor with the
engine's own rank K (same fingerprint, same bytes; tests/engines/test_one_identity.py, docs/engines.md). A layer may
read its rank from somewhere the stand-in does not cover (an expert- or data-parallel group, torch.distributed) and
build another shard under rank K's fingerprint, so other architectures load their TP>1 ranks inside the engine only.
vLLM's rank K of a MoE model is also expert-parallel rank K of N in its fingerprint, which a load outside the engine
does not compute (its entries would never be the engine's)."""


def refuse_unproven(
    engine: str, architectures: typing.Sequence[str] | None, size: int, rank: int, quantization: str | None = None
) -> None:
    """Raise ValueError, before any weight is read, unless rank ``rank`` of ``size`` of a model of ``architectures`` is
    proven to load outside ``engine`` as the engine's rank (``PROVEN_ARCHITECTURES``, unquantized: no quantized rank
    was compared); a single rank (size 1) always loads.

    :param quantization: the method requested or the checkpoint declares, None or ``none`` for none.
    """
    if size == 1:
        return
    if quantization not in (None, "none"):
        raise ValueError(
            f"the {engine} adapter loads tensor-parallel rank {rank} of {size} outside the engine only unquantized (no "
            f"quantized rank was compared with the engine's own), not {quantization}: load it inside the engine "
            f"(--load-format weightcache) at tensor-parallel size {size}, or outside at size 1"
        )
    proven = PROVEN_ARCHITECTURES[engine]
    found = tuple(architectures or ())
    if found and all(name in proven for name in found):
        return
    raise ValueError(
        f"the {engine} adapter loads tensor-parallel rank {rank} of {size} outside the engine only for architectures "
        f"checked to make the engine's own rank tensor by tensor ({', '.join(proven)}), not {', '.join(found) or 'an unnamed one'}: "
        f"load it inside the engine (--load-format weightcache) at tensor-parallel size {size}, or outside at size 1"
    )


def quantization_declared(hf_config: typing.Any) -> str | None:
    """The method a model's HF config declares (``quantization_config.quant_method``), else None."""
    declared = getattr(hf_config, "quantization_config", None)
    if not declared:
        return None
    method = declared.get("quant_method") if isinstance(declared, dict) else getattr(declared, "quant_method", None)
    return str(method or "declared")
