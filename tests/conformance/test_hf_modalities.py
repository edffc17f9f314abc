"""The conformance kit on models users bring beyond text decoders: speech (Whisper, an encoder-decoder fed
audio features), vision (ViT, fed pixels) and a state-space model (Mamba), each in bfloat16 and float32.

A bf16 Whisper failed the kit before its example features followed the weights' dtype (issue 25).
The architecture-independent checks (``AdapterTests``) run once per quantization, on the Llama (test_hf_conformance.py).
"""

from __future__ import annotations

import pytest

from tests.conformance.test_hf_conformance import HfFixtures
from weightcache.conformance import ArchitectureTests


class Modality(HfFixtures):
    weights = "float32"

    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, model_dir):
        return model_dir(cls.kind, dtype=cls.weights)


class TestWhisperBf16(Modality, ArchitectureTests):
    kind, weights = "whisper", "bfloat16"


class TestWhisperFp32(Modality, ArchitectureTests):
    kind = "whisper"


class TestVitBf16(Modality, ArchitectureTests):
    kind, weights = "vit", "bfloat16"


class TestVitFp32(Modality, ArchitectureTests):
    kind = "vit"


class TestMambaBf16(Modality, ArchitectureTests):
    kind, weights = "mamba", "bfloat16"


class TestMambaFp32(Modality, ArchitectureTests):
    kind = "mamba"
