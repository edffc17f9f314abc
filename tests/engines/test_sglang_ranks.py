"""SGLang's tensor-parallel ranks loaded one at a time outside the engine (``weightcache load --tp-size N --tp-rank K``,
``load_model``, ``publish_version``; adapters/lone_rank.py): a rank holds the engine's shard, an architecture or
quantization no rank was compared for is refused before a weight is read, pipeline and expert ranks are refused. The
same through vLLM: tests/engines/test_vllm.py; against running engines: tests/engines/test_one_identity.py.
"""

from __future__ import annotations

import json

import pytest

from tests.engines.support import assert_an_unproven_rank_is_refused, assert_ranks_hold_their_shards, write_tiny_model

pytest.importorskip("sglang")

from weightcache.core.flow.loader import prepare
from weightcache.core.request import LoadRequest


def test_a_single_process_load_refuses_pipeline_and_expert_ranks(tiny_llama):
    from weightcache.core.fingerprint import ParallelSpec

    request = LoadRequest(model=str(tiny_llama), adapter="sglang", parallel=ParallelSpec(pp_size=2, pp_rank=1))
    with pytest.raises(ValueError, match=r"a single-process SGLang load is one tensor-parallel rank .* not tp0/1 pp1/2"):
        prepare(request)


def test_a_tensor_parallel_rank_loaded_alone_holds_the_engines_shard(tiny_llama):
    """``weightcache load --tp-size 2 --tp-rank K``, ``load_model`` and ``publish_version`` of rank K: SGLang's weight
    loaders keep rank K's slice (its fingerprint against the engine's: tests/engines/test_one_identity.py)."""
    assert_ranks_hold_their_shards("sglang", tiny_llama)


def test_a_tensor_parallel_rank_of_an_unproven_architecture_is_refused_outside_the_engine(tmp_path):
    """A Mistral (a Llama's weights under another architecture, none compared with the engine's ranks) at TP=2."""
    model = write_tiny_model("llama_blocks", tmp_path / "mistral")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    assert_an_unproven_rank_is_refused("sglang", model, "MistralForCausalLM")
