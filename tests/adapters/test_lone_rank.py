"""``LoneRank`` (an engine's tensor-parallel group as rank K of N, for a rank loaded outside the engine) and
``PrivateName.replaced`` (how the vLLM adapter puts it in place). The engines' own groups: tests/engines (test_vllm.py,
test_sglang.py, test_one_identity.py at TP=2)."""

from __future__ import annotations

import pytest

from weightcache.adapters.engine_support import PrivateName
from weightcache.adapters.lone_rank import LoneRank


class WorldOfOne:
    """What an engine's group coordinator holds in a process of world size 1."""

    world_size, rank_in_group, ranks = 1, 0, [0]
    unique_name, cpu_group = "tp:0", object()

    def all_reduce(self, tensor):
        return tensor


GROUP = WorldOfOne()


def test_a_lone_rank_is_its_place_in_the_engines_group_and_keeps_the_rest():
    group = LoneRank(GROUP, 2, 1)
    assert (group.world_size, group.rank_in_group, group.ranks) == (2, 1, [0, 1])
    assert (group.is_first_rank, group.is_last_rank) == (False, True)
    assert group.unique_name == "tp:0" and group.cpu_group is GROUP.cpu_group  # layers keep handles for their forward


def test_a_lone_rank_refuses_every_collective_saying_what_to_do():
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 .* no peers for WorldOfOne.all_reduce: .* inside the engine"):
        LoneRank(GROUP, 2, 1).all_reduce(None)


def test_a_lone_rank_must_fit_its_size():
    with pytest.raises(ValueError, match="rank 2 does not fit size 2"):
        LoneRank(GROUP, 2, 2)


def test_a_private_name_is_replaced_inside_the_block_only():
    name = PrivateName("pytest", "0", __name__, "GROUP", "a test")
    stand_in = LoneRank(GROUP, 2, 0)
    with name.replaced(stand_in):
        assert globals()["GROUP"] is stand_in
    assert globals()["GROUP"] is not stand_in and isinstance(GROUP, WorldOfOne)
    with pytest.raises(RuntimeError), name.replaced(stand_in):
        raise RuntimeError("a failed load")
    assert isinstance(GROUP, WorldOfOne)


def test_a_rank_of_tp_over_1_loads_outside_the_engine_only_for_a_proven_architecture():
    from weightcache.adapters.lone_rank import PROVEN_ARCHITECTURES, refuse_unproven

    refuse_unproven("vllm", ["LlamaForCausalLM"], 2, 1)
    refuse_unproven("sglang", ["DeepseekV3ForCausalLM"], 2, 0)
    refuse_unproven("vllm", ["Qwen3MoeForCausalLM"], 1, 0)  # a single rank is the whole model
    assert "Qwen3MoeForCausalLM" not in PROVEN_ARCHITECTURES["vllm"]  # its entries were never the engine's
    for engine, architectures in (("vllm", ["Qwen3MoeForCausalLM"]), ("sglang", ["MistralForCausalLM"]), ("sglang", None)):
        with pytest.raises(
            ValueError, match=r"load it inside the engine \(--load-format weightcache\) at tensor-parallel size 2"
        ):
            refuse_unproven(engine, architectures, 2, 1)


def test_a_quantized_rank_of_tp_over_1_is_refused_outside_the_engine():
    from types import SimpleNamespace

    from weightcache.adapters.lone_rank import quantization_declared, refuse_unproven

    assert quantization_declared(SimpleNamespace()) is None
    fp8 = quantization_declared(SimpleNamespace(quantization_config={"quant_method": "fp8"}))
    assert fp8 == "fp8"
    refuse_unproven("vllm", ["LlamaForCausalLM"], 1, 0, fp8)
    for method in (fp8, "fp8-block"):
        with pytest.raises(ValueError, match=r"only unquantized .* not fp8"):
            refuse_unproven("vllm", ["LlamaForCausalLM"], 2, 1, method)
