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


def test_a_plain_image_module_gets_pixels_for_its_first_convolution():
    """No config: 64 × 64 pixels with the first Conv2d's input channels, and the forward runs on them."""
    import torch

    from weightcache.core.flow.example_inputs import inputs_from_signature, run_with_inputs

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 4, 3, stride=2)
            self.head = torch.nn.Linear(4, 10)

        def forward(self, pixel_values):
            return self.head(self.conv(pixel_values).mean(dim=(2, 3)))

    model = Classifier().eval()
    inputs = inputs_from_signature(model)
    assert list(inputs) == ["pixel_values"] and tuple(inputs["pixel_values"].shape) == (2, 1, 64, 64)
    assert tuple(run_with_inputs(model, inputs).shape) == (2, 10)


def test_a_forward_it_cannot_fill_names_the_hook_to_write_in_that_adapter():
    import torch

    from weightcache.core.flow.example_inputs import inputs_from_signature
    from weightcache.core.request import ForwardUnavailable

    class PointCloud(torch.nn.Module):
        def forward(self, points):
            return points

    found = inputs_from_signature(PointCloud(), "my-adapter")
    assert isinstance(found, ForwardUnavailable)
    assert "PointCloud.forward(points)" in found.reason, found.reason
    assert "write the hook weightcache_example_inputs(request, model) in adapter 'my-adapter'" in found.reason, found.reason
