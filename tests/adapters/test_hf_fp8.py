"""Block-wise FP8 through the hf adapter: quantize once in the loader, never in a client."""

from __future__ import annotations

import json

import pytest

from tests.helpers import assert_tensors_equal, run_python
from weightcache.core.errors import UnsupportedQuantization
from weightcache.core.flow.loader import prepare, publish
from weightcache.core.flow.modes import load_model
from weightcache.core.request import LoadRequest


def logits(model):
    import torch

    input_ids = torch.arange(32, dtype=torch.long).reshape(2, 16) * 31 % model.config.vocab_size
    with torch.no_grad():
        return model(input_ids=input_ids)[0]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mixtral"])
def test_fp8_cached_model_equals_the_disk_quantized_model_bit_for_bit(server, model_dir, kind):
    from weightcache.core.quantization.fp8_block import Fp8BlockLinear

    path = model_dir(kind, "bfloat16")
    published = publish(prepare(LoadRequest(model=str(path), quantization="fp8-block")), server.socket_dir)
    assert any(r.name.endswith("weight_scale_inv") for r in published.manifest.tensors), "scales must be cached"
    disk = load_model(str(path), quantization="fp8-block")
    cached = load_model(str(path), mode="client", socket_dir=server.socket_dir, quantization="fp8-block", strict=True)
    try:
        layers = [m for m in cached.model.modules() if isinstance(m, Fp8BlockLinear)]
        assert layers and all(str(m.weight.dtype) == "torch.float8_e4m3fn" for m in layers)
        disk_state = disk.model.state_dict()
        for name, tensor in cached.model.state_dict().items():
            assert_tensors_equal(name, tensor, disk_state[name])
        assert_tensors_equal("logits", logits(cached.model), logits(disk.model))
    finally:
        cached.close()


def test_a_client_never_quantizes(server, model_dir):
    """The quantizer raises inside the client process, and the attach still works."""
    path = model_dir("llama", "bfloat16")
    publish(prepare(LoadRequest(model=str(path), quantization="fp8-block")), server.socket_dir)
    code = """
import sys, json
import weightcache.core.quantization.fp8_block as fp8
def refuse(*a, **k):
    raise AssertionError("a client must not quantize")
fp8.quantize_weight = fp8.quantize_model = refuse
from weightcache.core.flow.modes import load_model
loaded = load_model(sys.argv[1], mode="client", socket_dir=sys.argv[2], quantization="fp8-block", strict=True)
print(json.dumps({"source": loaded.source}))
"""
    out = run_python(code, str(path), str(server.socket_dir)).stdout.strip().splitlines()[-1]
    assert json.loads(out)["source"] == "cache"


def test_changing_the_fp8_configuration_is_a_fingerprint_mismatch(model_dir):
    path = str(model_dir("llama", "bfloat16"))
    base = prepare(LoadRequest(model=path, quantization="fp8-block")).fingerprint
    other_blocks = prepare(LoadRequest(model=path, quantization="fp8-block", options={"block_size": [64, 64]})).fingerprint
    other_exclude = prepare(LoadRequest(model=path, quantization="fp8-block", options={"exclude": ["lm_head"]})).fingerprint
    plain = prepare(LoadRequest(model=path)).fingerprint
    assert base.mismatched_fields(other_blocks) == ("quantization_config",)
    assert base.mismatched_fields(other_exclude) == ("quantization_config",)
    assert base.mismatched_fields(plain) == ("quantization", "quantization_config")


def _prequantized_checkpoint(source, target):
    """Save a block-FP8 checkpoint (weights + weight_scale_inv) in the DeepSeek-V3 / FineGrainedFP8 layout."""
    import shutil

    import transformers

    from weightcache.core.quantization.fp8_block import Fp8BlockConfig, quantize_model

    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    quantize_model(model, Fp8BlockConfig())
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items() if "lm_head" not in k}
    save_file(state, target / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
        "modules_to_not_convert": ["lm_head"],
    }
    (target / "config.json").write_text(json.dumps(config))
    shutil.copy(source / "generation_config.json", target / "generation_config.json")
    return target


def test_a_prequantized_checkpoint_loads_without_requantizing(server, model_dir, tmp_path):
    source = model_dir("gemma", "bfloat16")  # tied embeddings: lm_head is not stored
    path = _prequantized_checkpoint(source, tmp_path)
    description = prepare(LoadRequest(model=str(path))).description
    assert description.quantization == "fp8-block"
    code = """
import sys
import weightcache.core.quantization.fp8_block as fp8
def refuse(*a, **k):
    raise AssertionError("a pre-quantized checkpoint must not be quantized again")
fp8.quantize_weight = fp8.quantize_model = refuse
from weightcache.core.flow.loader import prepare, publish
from weightcache.core.request import LoadRequest
publish(prepare(LoadRequest(model=sys.argv[1])), sys.argv[2])
"""
    run_python(code, str(path), str(server.socket_dir))
    disk = load_model(str(path))
    cached = load_model(str(path), mode="client", socket_dir=server.socket_dir, strict=True)
    try:
        from safetensors.torch import load_file

        stored = load_file(path / "model.safetensors")
        name = next(k for k in stored if k.endswith("q_proj.weight"))
        assert_tensors_equal(name, cached.model.state_dict()[name], stored[name])
        assert_tensors_equal("logits", logits(cached.model), logits(disk.model))
    finally:
        cached.close()


@pytest.mark.parametrize(
    "method,config",
    [
        ("fp8", {"quant_method": "fp8", "activation_scheme": "dynamic"}),
        ("awq", {"quant_method": "awq", "bits": 4, "group_size": 128}),
        ("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 128}),
        ("marlin", {"quant_method": "marlin"}),
        ("bitsandbytes", {"quant_method": "bitsandbytes", "load_in_4bit": True}),
        ("mystery", {"quant_method": "mystery"}),
    ],
)
def test_unvalidated_methods_are_refused_before_any_weight_is_read(tmp_path, model_dir, method, config):
    """The checkpoint keeps its header but no weight bytes: any read of a weight would fail, so the error proves none happened."""
    import os

    source = model_dir("llama")
    raw = json.loads((source / "config.json").read_text())
    raw["quantization_config"] = config
    (tmp_path / "config.json").write_text(json.dumps(raw))
    header = (source / "model.safetensors").read_bytes()
    length = int.from_bytes(header[:8], "little")
    (tmp_path / "model.safetensors").write_bytes(header[: 8 + length])  # the header only: no weight bytes exist
    for mode in ("off", "daemon", "client"):
        with pytest.raises(UnsupportedQuantization) as caught:
            load_model(str(tmp_path), mode=mode, socket_dir=tmp_path / "nosock")
        assert caught.value.method == method and caught.value.reason
    assert not os.path.exists(tmp_path / "nosock"), "no server may be started for a refused model"


def test_requesting_an_unvalidated_method_is_refused(model_dir):
    with pytest.raises(UnsupportedQuantization, match="'awq'"):
        load_model(str(model_dir("llama")), quantization="awq")


def test_fp8_on_a_model_without_eligible_layers_is_refused_not_silently_skipped(model_dir):
    with pytest.raises(UnsupportedQuantization, match="Conv1D"):
        load_model(str(model_dir("gpt2")), quantization="fp8-block")
