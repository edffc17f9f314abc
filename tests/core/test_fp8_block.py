"""Block-wise FP8 quantization: numerics, layout, determinism, model conversion, configs."""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch
from torch import nn

from weightcache.core.errors import RebindError, UnsupportedQuantization
from weightcache.core.quantization.fp8_block import (
    DEFAULT_EXCLUDE,
    FP8_DTYPE,
    Fp8BlockConfig,
    Fp8BlockLinear,
    convert_model_to_fp8_skeleton,
    dequantize_weight,
    is_excluded,
    is_prequantized_state,
    load_prequantized,
    prequantized_modules,
    quantize_model,
    quantize_weight,
)

transformers = pytest.importorskip("transformers")


# ---------------------------------------------------------------- helpers


def _describe(name: str, actual: torch.Tensor, expected: torch.Tensor) -> str:
    diff = (actual.double() - expected.double()).abs()
    return (
        f"{name}: {actual.dtype} on {actual.device} vs {expected.dtype} on {expected.device}, "
        f"shape {tuple(actual.shape)}, largest difference {diff.max().item():.6g} "
        f"at {tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))}"
    )


def assert_within(name: str, actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor | float) -> None:
    """Every element of ``actual`` lies within ``bound`` (elementwise or scalar) of ``expected``."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    ok = (actual.double() - expected.double()).abs() <= torch.as_tensor(bound, dtype=torch.float64)
    assert bool(ok.all()), _describe(name, actual, expected) + f"; {int((~ok).sum())} elements out of bound"


def assert_same_bytes(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype, shape and bytes (compared as uint8, so fp8 and nan compare bitwise)."""
    assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), (
        f"{name}: {actual.dtype} {tuple(actual.shape)} on {actual.device} != "
        f"{expected.dtype} {tuple(expected.shape)} on {expected.device}"
    )
    a, e = actual.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8)
    assert torch.equal(a, e), _describe(name, actual.float(), expected.float()) + f"; {int((a != e).sum())} bytes differ"


def spread(scale_inv: torch.Tensor, shape, block_size=(128, 128)) -> torch.Tensor:
    """``scale_inv`` repeated over its tiles, cropped to ``shape``."""
    full = scale_inv.repeat_interleave(block_size[0], 0).repeat_interleave(block_size[1], 1)
    return full[: shape[0], : shape[1]]


def tiny_llama(**overrides) -> nn.Module:
    cfg = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        **overrides,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def param_signature(model: nn.Module) -> dict:
    return {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters()}


LLAMA_LINEARS = {
    f"model.layers.{i}.{part}"
    for i in range(2)
    for part in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
}


# ---------------------------------------------------------------- tensors


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (1, 1), (129, 127)])
def test_round_trip_within_e4m3_precision(shape):
    torch.manual_seed(1)
    weight = torch.randn(shape) * torch.logspace(-3, 2, shape[1])  # columns of very different magnitude
    qweight, scale_inv = quantize_weight(weight)
    expected_grid = (-(-shape[0] // 128), -(-shape[1] // 128))
    assert (qweight.dtype, tuple(qweight.shape)) == (FP8_DTYPE, shape)
    assert (scale_inv.dtype, tuple(scale_inv.shape)) == (torch.float32, expected_grid)
    restored = dequantize_weight(qweight, scale_inv, (128, 128), torch.float32)
    # e4m3: 3 mantissa bits, so half an ulp is 2**-4 relative for normals; subnormal steps are 2**-9 of scale.
    bound = weight.abs() * 2.0**-4 + spread(scale_inv, shape) * 2.0**-10 + 1e-12
    assert_within("dequantized weight", restored, weight, bound)


def test_tile_amax_maps_to_fp8_max():
    torch.manual_seed(2)
    weight = torch.randn(300, 200, dtype=torch.bfloat16)
    qweight, scale_inv = quantize_weight(weight)
    tiles_max = qweight.float().abs().reshape(300, 200)
    for r in range(3):
        for c in range(2):
            tile = tiles_max[r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128]
            assert tile.max().item() == 448.0, f"tile ({r}, {c}) max {tile.max().item()}"
    amax = torch.stack([weight.float()[r * 128 : (r + 1) * 128].abs().amax() for r in range(3)])
    assert_within("weight_scale_inv vs amax/448", scale_inv.max(dim=1).values, amax / 448, amax * 1e-6)


def test_zero_tiles_get_unit_scale_and_exact_zeros():
    weight = torch.randn(300, 200)
    weight[128:256, :128] = 0  # one whole tile
    weight[256:, 128:] = 0  # the partial corner tile
    qweight, scale_inv = quantize_weight(weight)
    assert scale_inv[1, 0].item() == 1.0 and scale_inv[2, 1].item() == 1.0, f"scale_inv {scale_inv}"
    restored = dequantize_weight(qweight, scale_inv, (128, 128), torch.float32)
    assert_same_bytes("zero tile", restored[128:256, :128], weight[128:256, :128])
    assert_same_bytes("zero corner tile", restored[256:, 128:], weight[256:, 128:])


def test_all_zero_weight():
    qweight, scale_inv = quantize_weight(torch.zeros(64, 64))
    assert_same_bytes("scale_inv", scale_inv, torch.ones(1, 1))
    assert_same_bytes("qweight", qweight, torch.zeros(64, 64, dtype=FP8_DTYPE))


def test_non_finite_weight_raises():
    weight = torch.ones(10, 10)
    weight[3, 4] = float("nan")
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_weight(weight)


def test_quantization_is_deterministic():
    torch.manual_seed(3)
    weight = torch.randn(300, 200, dtype=torch.bfloat16)
    first, second = quantize_weight(weight), quantize_weight(weight.clone())
    assert_same_bytes("qweight", first[0], second[0])
    assert_same_bytes("weight_scale_inv", first[1], second[1])


def test_quantized_bytes_are_pinned():
    """Same input, same bytes, across runs, machines and devices: a fixed digest of a fixed input."""
    weight = ((torch.arange(300 * 200) % 997 - 498).float() / 37).reshape(300, 200)
    qweight, scale_inv = quantize_weight(weight)
    digest = hashlib.sha256(qweight.view(torch.uint8).numpy().tobytes() + scale_inv.numpy().tobytes()).hexdigest()
    assert digest == "03b67936db647e427d4e40dd48c05efa27fcabb7df1539982fc60efd478bfab1"


def float32_form(weight: torch.Tensor, block_size=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantization as its docstring states it, step by step in float32 (the implementation before 2026-12-04):
    what ``quantize_weight``'s fewer passes must give byte for byte."""
    rows, cols = -(-weight.shape[0] // block_size[0]), -(-weight.shape[1] // block_size[1])
    buf = torch.zeros(rows * block_size[0], cols * block_size[1], dtype=torch.float32)
    buf[: weight.shape[0], : weight.shape[1]].copy_(weight)
    tiles = buf.view(rows, block_size[0], cols, block_size[1])
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, 448.0 / amax.clamp(min=2.0**-100), torch.ones_like(amax))
    tiles.mul_(scale[:, None, :, None]).clamp_(-448.0, 448.0)
    return buf[: weight.shape[0], : weight.shape[1]].to(FP8_DTYPE).contiguous(), (1.0 / scale).to(torch.float32)


def every_finite_value(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a 16-bit float type, shuffled, as a (256, 256) weight (four 128x128 tiles)."""
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    values = values[torch.isfinite(values)]
    values = values[torch.randperm(len(values), generator=torch.Generator().manual_seed(7))]
    return torch.cat([values, values[: 2**16 - len(values)]]).reshape(256, 256)


def edge_weights() -> list[torch.Tensor]:
    """Weights whose tiles sit at the edges: every finite bfloat16 and float16 value, tiles of one huge or one tiny
    value among zeros, tiny tiles below the scale's floor, values one step below their tile's maximum, -0.0,
    partial tiles, float64 and a transposed (non-contiguous) weight."""
    generator = torch.Generator().manual_seed(11)
    found = [every_finite_value(torch.bfloat16), every_finite_value(torch.float16)]
    spread = torch.randn(300, 200, generator=generator) * torch.logspace(-30, 30, 200)
    narrow = torch.randn(300, 200, generator=generator) * torch.logspace(-7, 4, 200)  # within float16's range
    found += [spread, spread.to(torch.bfloat16), narrow.to(torch.float16), spread.double(), spread.t()]
    lone = torch.zeros(256, 256)
    lone[0, 0], lone[130, 3], lone[5, 200], lone[140, 140] = 3.0e38, -1.0e-38, 2.0**-110, -0.0
    found.append(lone)
    below = torch.rand(256, 256, generator=generator) * 1000
    below[:128, :128] = torch.nextafter(below[:128, :128].amax(), torch.tensor(0.0))  # a tile of one value, near max
    found += [below, below.to(torch.bfloat16)]
    return found


def test_the_fewer_passes_give_the_float32_forms_bytes():
    for index, weight in enumerate(edge_weights()):
        qweight, scale_inv = quantize_weight(weight)
        expected_q, expected_s = float32_form(weight)
        assert_same_bytes(f"qweight of edge weight {index}", qweight, expected_q)
        assert_same_bytes(f"weight_scale_inv of edge weight {index}", scale_inv, expected_s)


def test_the_clamp_changes_no_cast_for_any_tile_maximum():
    """The largest ``|w * scale|`` a tile can give is ``amax * fl(448 / amax)``: over a million maxima spread over
    float32 from the floor of 2**-100 (the scale of a tile below it is that of 2**-100), it casts to float8 as its clamp to 448 does."""
    generator = torch.Generator().manual_seed(5)
    amax = torch.exp2(torch.rand(1_000_000, generator=generator) * 227 - 100) * (1 + torch.rand(1_000_000, generator=generator))
    scaled = amax * (448.0 / amax)
    assert float(scaled.max()) < 464.0
    for signed in (scaled, -scaled):
        assert_same_bytes("the cast", signed.to(FP8_DTYPE), signed.clamp(-448, 448).to(FP8_DTYPE))


def test_quantize_does_not_touch_its_input():
    weight = torch.randn(130, 130)
    before = weight.clone()
    quantize_weight(weight)
    assert_same_bytes("input weight", weight, before)


def test_other_block_sizes():
    weight = torch.randn(100, 70)
    qweight, scale_inv = quantize_weight(weight, (32, 64))
    assert tuple(scale_inv.shape) == (4, 2)
    restored = dequantize_weight(qweight, scale_inv, (32, 64), torch.float32)
    assert_within(
        "dequantized weight", restored, weight, weight.abs() * 2.0**-4 + spread(scale_inv, weight.shape, (32, 64)) * 2.0**-10
    )


def test_dequantize_refuses_wrong_scale_grid():
    qweight, scale_inv = quantize_weight(torch.randn(300, 200))
    with pytest.raises(ValueError, match="check the block size"):
        dequantize_weight(qweight, scale_inv, (64, 64), torch.float32)


# ---------------------------------------------------------------- module


def test_fp8_linear_on_meta_has_the_layout():
    layer = Fp8BlockLinear(200, 300, bias=True, block_size=(128, 128), dtype=torch.bfloat16, device="meta")
    assert param_signature(layer) == {
        "weight": ((300, 200), FP8_DTYPE),
        "weight_scale_inv": ((3, 2), torch.float32),
        "bias": ((300,), torch.bfloat16),
    }
    assert all(p.is_meta and not p.requires_grad for p in layer.parameters())


def test_fp8_linear_forward_matches_dequantized_linear():
    torch.manual_seed(4)
    linear = nn.Linear(200, 300, dtype=torch.bfloat16)
    layer = Fp8BlockLinear.from_linear(linear, (128, 128))
    x = torch.randn(5, 200, dtype=torch.bfloat16)
    reference = nn.functional.linear(
        x, dequantize_weight(layer.weight, layer.weight_scale_inv, (128, 128), torch.bfloat16), linear.bias
    )
    assert_same_bytes("forward output", layer(x), reference)
    assert_same_bytes("forward output, second call", layer(x), reference)
    assert layer.bias.data_ptr() == linear.bias.data_ptr(), "bias must be shared, not copied"


# ---------------------------------------------------------------- models


def test_quantize_model_converts_linears_but_not_head_or_embeddings():
    reference = tiny_llama()
    model = copy.deepcopy(reference)
    embed_before = model.model.embed_tokens.weight.clone()
    head_before = model.lm_head.weight.clone()

    converted = quantize_model(model, Fp8BlockConfig())

    assert set(converted) == LLAMA_LINEARS
    assert all(isinstance(model.get_submodule(n), Fp8BlockLinear) for n in LLAMA_LINEARS)
    assert type(model.lm_head) is nn.Linear
    assert_same_bytes("lm_head.weight", model.lm_head.weight, head_before)
    assert_same_bytes("embed_tokens.weight", model.model.embed_tokens.weight, embed_before)
    leftovers = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert leftovers == ["lm_head"]

    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = reference(ids).logits
        actual = model(ids).logits
    scale = expected.abs().max()
    assert_within("logits", actual, expected, 0.15 * scale)  # measured: 0.046
    with torch.no_grad():
        assert_same_bytes("logits, second run", model(ids).logits, actual)


def test_skeleton_matches_quantized_model():
    quantized = tiny_llama()
    converted = quantize_model(quantized, Fp8BlockConfig())
    with torch.device("meta"):
        skeleton = tiny_llama()
    skeleton_converted = convert_model_to_fp8_skeleton(skeleton, Fp8BlockConfig())

    assert skeleton_converted == converted
    assert param_signature(skeleton) == param_signature(quantized)
    assert [(n, type(m)) for n, m in skeleton.named_modules()] == [(n, type(m)) for n, m in quantized.named_modules()]
    assert all(skeleton.get_submodule(n).weight.is_meta for n in converted)


def test_skeleton_of_a_real_model_puts_new_parameters_on_meta():
    model = tiny_llama()
    converted = convert_model_to_fp8_skeleton(model, Fp8BlockConfig())
    assert set(converted) == LLAMA_LINEARS
    assert all(p.is_meta for n in converted for p in model.get_submodule(n).parameters())


def test_tied_head_is_never_quantized():
    model = tiny_llama(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    converted = quantize_model(model, Fp8BlockConfig(exclude=()))
    assert "lm_head" not in converted and set(converted) == LLAMA_LINEARS
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_shared_linear_module_is_skipped():
    shared = nn.Linear(8, 8)
    model = nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(8, 4))
    assert quantize_model(model, Fp8BlockConfig(exclude=())) == ["3"]
    assert model[0] is model[2]


def test_quantize_model_refuses_meta_weights_and_names_the_layer():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(ValueError, match="convert_model_to_fp8_skeleton") as info:
        quantize_model(model, Fp8BlockConfig(exclude=()))
    assert "while quantizing 0.weight" in info.value.__notes__


def test_quantize_model_names_the_first_layer_holding_inf_or_nan():
    """The layers' counts are read once all are quantized (one wait for the device); the error still names the first
    bad one."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    with torch.no_grad():
        model[1].weight[2, 3] = float("inf")
        model[2].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"weight of shape \(8, 8\) holds inf or nan in 1 tiles") as info:
        quantize_model(model, Fp8BlockConfig(exclude=()))
    assert info.value.__notes__ == ["while quantizing 1.weight"]


def test_gpt2_conv1d_is_left_unquantized():
    cfg = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=100, n_positions=32)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert quantize_model(model, Fp8BlockConfig()) == []
    assert not any(isinstance(m, Fp8BlockLinear) for m in model.modules())


def test_excluded_patterns_are_respected():
    model = tiny_llama()
    converted = quantize_model(model, Fp8BlockConfig(exclude=("lm_head", "*embed*", "model.layers.1", "*.down_proj")))
    assert set(converted) == {n for n in LLAMA_LINEARS if n.startswith("model.layers.0.") and "down_proj" not in n}


@pytest.mark.parametrize(
    ("name", "patterns", "excluded"),
    [
        ("lm_head", ("lm_head",), True),
        ("model.lm_head", ("lm_head",), True),
        ("model.lm_head_x", ("lm_head",), False),
        ("model.embed_tokens", ("*embed*",), True),
        ("model.visual.blocks.0.qkv", ("model.visual",), True),
        ("model.layers.11.mlp", ("model.layers.1",), False),
        ("model.layers.11.mlp", ("model.layers.1*",), True),
        ("transformer.wte", DEFAULT_EXCLUDE, True),
        ("model.layers.0.self_attn.q_proj", DEFAULT_EXCLUDE, False),
    ],
)
def test_exclude_rules(name, patterns, excluded):
    assert is_excluded(name, patterns) is excluded


# ---------------------------------------------------------------- pre-quantized checkpoints


def test_prequantized_checkpoint_loads_bytes_unchanged():
    source = tiny_llama()
    quantize_model(source, Fp8BlockConfig())
    state = dict(source.state_dict())
    assert is_prequantized_state(state)
    assert set(prequantized_modules(state)) == LLAMA_LINEARS

    target = tiny_llama()
    converted = load_prequantized(target, state, Fp8BlockConfig())
    assert set(converted) == LLAMA_LINEARS
    for name in converted:
        layer = target.get_submodule(name)
        assert layer.weight.data_ptr() == state[name + ".weight"].data_ptr(), f"{name}.weight was copied"
        assert layer.weight_scale_inv.data_ptr() == state[name + ".weight_scale_inv"].data_ptr()
    target.load_state_dict(state)
    ids = torch.arange(16).reshape(1, 16)
    with torch.no_grad():
        assert_same_bytes("logits", target(ids).logits, source(ids).logits)


def test_prequantized_detection_from_header_dtypes():
    header = {"a.weight": "F8_E4M3", "a.weight_scale_inv": "F32", "b.weight": "BF16", "c.weight": "F8_E4M3"}
    assert prequantized_modules(header) == ["a"]
    assert not is_prequantized_state({"a.weight": torch.bfloat16, "a.weight_scale_inv": torch.float32})


def test_prequantized_for_a_missing_module_raises():
    model = nn.Sequential(nn.Linear(8, 8))
    qweight, scale_inv = quantize_weight(torch.randn(8, 8))
    with pytest.raises(RebindError, match="lacks"):
        load_prequantized(model, {"5.weight": qweight, "5.weight_scale_inv": scale_inv})
    with pytest.raises(RebindError, match="needs"):
        load_prequantized(model, {"0.weight": qweight, "0.weight_scale_inv": scale_inv.expand(2, 2)})


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(("out_features", "in_features"), [(128, 128), (129, 127), (300, 200), (1, 1), (257, 1000)])
def test_default_block_is_128_by_128_with_one_scale_per_started_block(out_features, in_features):
    """The validated layout (DeepSeek-V3, FineGrainedFP8): 128x128 blocks, scales of shape (ceil(out/128), ceil(in/128))."""
    config = Fp8BlockConfig()
    assert config.block_size == (128, 128)
    grid = (-(-out_features // 128), -(-in_features // 128))
    model = nn.Sequential(nn.Linear(in_features, out_features, bias=False))
    assert quantize_model(model, config) == ["0"]
    assert (model[0].block_size, tuple(model[0].weight_scale_inv.shape)) == ((128, 128), grid)
    skeleton = Fp8BlockLinear(in_features, out_features, bias=False, device="meta")
    assert (skeleton.block_size, tuple(skeleton.weight_scale_inv.shape)) == ((128, 128), grid)
    assert tuple(quantize_weight(torch.randn(out_features, in_features))[1].shape) == grid


def test_config_json_round_trip():
    config = Fp8BlockConfig(block_size=(64, 128), exclude=("lm_head", "x.*"))
    assert Fp8BlockConfig.from_json(config.to_json()) == config


@pytest.mark.parametrize(
    "variant",
    [
        {"block_size": (64, 128)},
        {"block_size": (128, 64)},
        {"exclude": ("lm_head",)},
        {"exclude": ()},
        {"exclude": (*Fp8BlockConfig().exclude, "model.layers.0.*")},
    ],
)
def test_config_json_changes_with_every_field(variant):
    base = Fp8BlockConfig()
    assert Fp8BlockConfig(**variant).to_json() != base.to_json()


def test_config_json_is_canonical():
    assert Fp8BlockConfig(exclude=("b", "a", "b")).to_json() == Fp8BlockConfig(exclude=("a", "b")).to_json()


@pytest.mark.parametrize("block_size", [(0, 128), (128,), (128.0, 128), (True, 128), (-1, 2)])
def test_config_refuses_bad_block_sizes(block_size):
    with pytest.raises(ValueError, match="positive ints"):
        Fp8BlockConfig(block_size=block_size)


def test_static_activation_scheme_is_unsupported():
    with pytest.raises(UnsupportedQuantization) as info:
        Fp8BlockConfig(activation_scheme="static")
    assert info.value.method == "fp8" and "static" in info.value.reason


def test_from_hf_quantization_config_deepseek_v3():
    config = Fp8BlockConfig.from_hf_quantization_config(
        {
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "modules_to_not_convert": ["model.layers.0.mlp.gate"],
        }
    )
    assert config.block_size == (128, 128)
    assert "model.layers.0.mlp.gate" in config.exclude and "lm_head" in config.exclude


@pytest.mark.parametrize(
    ("qc", "match"),
    [
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "static"),
        ({"quant_method": "fp8", "weight_block_size": None}, "per-tensor"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, "ue8m0"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": ["(a|b)"]}, "regex"),
        ({"quant_method": "gptq", "bits": 4}, "only quant_method"),
    ],
)
def test_from_hf_quantization_config_refuses_unvalidated_variants(qc, match):
    with pytest.raises(UnsupportedQuantization, match=match):
        Fp8BlockConfig.from_hf_quantization_config(qc)


def test_config_from_json_refuses_other_methods():
    data = dict(Fp8BlockConfig().to_json(), format_version=99)
    with pytest.raises(UnsupportedQuantization, match="re-publish"):
        Fp8BlockConfig.from_json(data)
