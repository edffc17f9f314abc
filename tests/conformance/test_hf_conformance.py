"""The hf adapter through the conformance kit, exactly as a third party runs it on theirs.

The real MiniLM checkpoint and random-weight Llama, Qwen2, GPT-2 (Conv1D layers,
tied head), Gemma (tied embeddings) and Mixtral (MoE), each unquantized and
block-FP8 where the architecture has nn.Linear layers (GPT-2 has none: its
Conv1D layers stay unquantized and its head is tied, so block-FP8 would change nothing).

The whole kit (``ConformanceTests``) runs on the random-weight Llama, unquantized and block-FP8;
MiniLM and the other architectures run the checks their architecture decides (``ArchitectureTests``):
the fingerprint and quantization-refusal checks (``AdapterTests``) perturb the fingerprint or the
declared method, not the model, so another architecture would repeat them with the same outcome
(docs/adapter-guide.md), and each of the 46 fallbacks among them loads the model from disk again:
on the 2-layer Llama, not on MiniLM's 90 MB.
"""

from __future__ import annotations

import pytest

from weightcache.conformance import ArchitectureTests, ConformanceFixtures, ConformanceTests


class HfFixtures(ConformanceFixtures):
    """The hf adapter on one of tests/models.py's random-weight architectures (``kind``)."""

    kind = "llama"

    @pytest.fixture(scope="class")
    @classmethod
    def adapter_name(cls):
        return "hf"

    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, model_dir):
        return model_dir(cls.kind)


class Fp8:
    """Mix-in: the same model, quantized to block-wise FP8 while loading."""

    @pytest.fixture(scope="class")
    @classmethod
    def quantization(cls):
        return "fp8-block"


class TestMiniLM(HfFixtures, ArchitectureTests):
    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, minilm_dir):
        return minilm_dir


class TestMiniLMFp8(Fp8, TestMiniLM):
    pass


class TestLlama(HfFixtures, ConformanceTests):
    kind = "llama"


class TestLlamaFp8(Fp8, TestLlama):
    pass


class TestQwen2(HfFixtures, ArchitectureTests):
    kind = "qwen2"


class TestQwen2Fp8(Fp8, TestQwen2):
    pass


class TestGpt2(HfFixtures, ArchitectureTests):
    kind = "gpt2"

    @pytest.fixture(scope="class")
    @classmethod
    def expected_tied(cls):
        return (("lm_head.weight", "transformer.wte.weight"),)


class TestGemma(HfFixtures, ArchitectureTests):
    kind = "gemma"

    @pytest.fixture(scope="class")
    @classmethod
    def expected_tied(cls):
        return (("lm_head.weight", "model.embed_tokens.weight"),)


class TestGemmaFp8(Fp8, TestGemma):
    pass


class TestMixtral(HfFixtures, ArchitectureTests):
    kind = "mixtral"


class TestMixtralFp8(Fp8, TestMixtral):
    pass


class TestT5(HfFixtures, ArchitectureTests):
    """An encoder-decoder: the kit's inputs carry decoder ids too (built from T5's forward signature)."""

    kind = "t5"

    @pytest.fixture(scope="class")
    @classmethod
    def expected_tied(cls):
        return (("encoder.embed_tokens.weight", "shared.weight", "decoder.embed_tokens.weight"),)


class TestBart(HfFixtures, ArchitectureTests):
    kind = "bart"
