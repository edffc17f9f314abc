"""Example inputs follow the model: non-token inputs of every modality in the weights' dtype, on the model's device."""

from __future__ import annotations

import pytest

from tests.helpers import run_python

_FORWARD = """
import sys, torch, transformers
from weightcache.core.flow.example_inputs import inputs_from_signature, run_with_inputs
model = getattr(transformers, sys.argv[2]).from_pretrained(sys.argv[1], dtype=getattr(torch, sys.argv[3])).eval()
inputs = inputs_from_signature(model)
floating = sorted({str(v.dtype) for v in inputs.values() if v.is_floating_point()})
run_with_inputs(model, inputs, "cpu")
print(" ".join(floating))
"""


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(("kind", "cls"), [("whisper", "WhisperForConditionalGeneration"), ("vit", "ViTModel")])
def test_speech_and_vision_inputs_follow_the_weights_dtype(kind, cls, dtype, model_dir):
    proc = run_python(_FORWARD, str(model_dir(kind, dtype=dtype)), cls, dtype)
    assert proc.stdout.split() == [f"torch.{dtype}"], proc.stderr[-2000:]
