"""The vLLM adapter against vLLM 0.33's own code: plugin registration, ABC and signatures, fingerprint, refusals, load path.

Runs in the engine venv (``make engine-venv``); the project's own test run
reaches it through test_engine_venv.py.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json

import pytest

from tests.engines.support import (
    AWQ,
    FP8_BLOCK,
    FP8_PER_TENSOR,
    assert_same_state,
    run_engine,
    server_status,
    stop_spawned_server,
    with_quantization,
)

vllm = pytest.importorskip("vllm")

from vllm.config import CacheConfig, LoadConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.model_executor.model_loader import get_model_loader  # noqa: E402
from vllm.model_executor.model_loader.base_loader import BaseModelLoader  # noqa: E402

from weightcache.adapters.vllm import identity, plugin  # noqa: E402
from weightcache.adapters.vllm.loader import LOAD_FORMAT, loader_class  # noqa: E402
from weightcache.core.errors import UnsupportedQuantization  # noqa: E402
from weightcache.core.safetensors_io import checkpoint_identity  # noqa: E402

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


def model_config(path, dtype="bfloat16") -> ModelConfig:
    return ModelConfig(model=str(path), dtype=dtype, skip_tokenizer_init=True)


def vllm_config(mc: ModelConfig, extra=None, **kwargs) -> VllmConfig:
    return VllmConfig(model_config=mc, load_config=LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config=extra or {}), **kwargs)


# Registration ----------------------------------------------------------------------------------------------------


def test_the_entry_point_is_installed_in_vllms_plugin_group():
    entry_points = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert entry_points.get("weightcache") == "weightcache.adapters.vllm.plugin:register"


def test_vllms_plugin_loader_registers_the_load_format(monkeypatch):
    import vllm.plugins
    from vllm.model_executor import model_loader

    monkeypatch.delitem(model_loader._LOAD_FORMAT_TO_MODEL_LOADER, LOAD_FORMAT, raising=False)  # as in a fresh process
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setenv("VLLM_PLUGINS", "weightcache")
    with pytest.raises(ValueError, match="Load format `weightcache` is not supported"):
        get_model_loader(LoadConfig(load_format=LOAD_FORMAT))
    vllm.plugins.load_general_plugins()
    loader = get_model_loader(LoadConfig(load_format="weightcache", model_loader_extra_config={"mode": "client", "socket_dir": "/x"}))
    assert type(loader) is loader_class()
    assert (loader.options.mode, loader.options.socket_dir, loader.options.strict) == ("client", "/x", False)


def test_register_is_idempotent_and_keeps_one_class():
    from vllm.model_executor import model_loader

    plugin.register()
    plugin.register()
    assert model_loader._LOAD_FORMAT_TO_MODEL_LOADER[LOAD_FORMAT] is loader_class()
    assert loader_class() is loader_class()


def test_the_cli_flags_reach_our_loader(tiny_llama):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", str(tiny_llama), "--load-format", "weightcache",
                              "--model-loader-extra-config", '{"mode": "daemon", "strict": true}'])
    load_config = EngineArgs.from_cli_args(args).create_load_config()
    loader = get_model_loader(load_config)
    assert type(loader) is loader_class()
    assert (loader.options.mode, loader.options.strict) == ("daemon", True)


def test_unknown_or_malformed_extra_config_is_refused():
    with pytest.raises(ValueError, match="unknown keys \\['socket_path'\\]"):
        get_model_loader(LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config={"socket_path": "/x"}))
    with pytest.raises(ValueError, match="unknown weightcache mode 'zero_copy'"):
        get_model_loader(LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config={"mode": "zero_copy"}))


# The ABC and its signatures ----------------------------------------------------------------------------------------


def test_the_loader_is_a_concrete_base_model_loader():
    cls = loader_class()
    assert issubclass(cls, BaseModelLoader)
    assert not inspect.isabstract(cls), cls.__abstractmethods__
    assert cls.__module__ == "weightcache.adapters.vllm.loader" and cls.__qualname__ == "WeightcacheModelLoader"


@pytest.mark.parametrize("method", ["__init__", "get_external_weight_memory", "download_model", "load_weights", "load_model"])
def test_method_signatures_equal_vllms(method):
    ours, theirs = inspect.signature(getattr(loader_class(), method)), inspect.signature(getattr(BaseModelLoader, method))
    assert ours == theirs, f"{method}: {ours} != vLLM's {theirs}"
    assert method in vars(loader_class()), f"{method} is not overridden"


# Fingerprint from real configs -------------------------------------------------------------------------------------


def test_fingerprint_is_built_from_vllm_config_and_model_config(tiny_llama):
    from vllm.model_executor.model_loader.weight_cache.protocol import hash_rope_parameters

    mc = model_config(tiny_llama)
    fp = identity.fingerprint(vllm_config(mc), mc, device="cpu", ranks=identity.Ranks())
    assert fp.checkpoint == checkpoint_identity(tiny_llama)
    assert (fp.architecture, fp.dtype, fp.quantization) == ("LlamaForCausalLM", "bfloat16", "none")
    assert (fp.adapter, fp.engine, fp.engine_version) == ("vllm", "vllm", vllm.__version__)
    assert (fp.tp_size, fp.tp_rank, fp.pp_size, fp.pp_rank) == (1, 0, 1, 0)
    assert fp.gpu_uuid == "" and fp.torch_version
    extra = fp.extra
    assert extra["rope_parameters_hash"] == hash_rope_parameters(mc)
    assert (extra["kv_cache_dtype"], extra["is_draft"], extra["dp_rank"], extra["moe_backend"]) == ("auto", False, 0, "auto")
    assert not set(extra) & set(identity.COVERED_BY_CORE)
    json.dumps(fp.to_json())  # goes on the wire as it is


def test_fingerprint_is_stable_for_the_same_configs(tiny_llama):
    first, second = model_config(tiny_llama), model_config(tiny_llama)
    a = identity.fingerprint(vllm_config(first), first, device="cpu", ranks=identity.Ranks())
    b = identity.fingerprint(vllm_config(second), second, device="cpu", ranks=identity.Ranks())
    assert a.digest == b.digest


def test_fingerprint_names_the_field_that_differs(tiny_llama, tmp_path):
    mc = model_config(tiny_llama)
    base = identity.fingerprint(vllm_config(mc), mc, device="cpu", ranks=identity.Ranks(tp_size=2, tp_rank=0))

    rank1 = identity.fingerprint(vllm_config(mc), mc, device="cpu", ranks=identity.Ranks(tp_size=2, tp_rank=1))
    assert base.mismatched_fields(rank1) == ("tp_rank",)

    fp16 = model_config(tiny_llama, dtype="float16")
    assert "dtype" in base.mismatched_fields(identity.fingerprint(vllm_config(fp16), fp16, device="cpu", ranks=identity.Ranks(tp_size=2)))

    fp8_kv = identity.fingerprint(vllm_config(mc, cache_config=CacheConfig(cache_dtype="fp8")), mc, device="cpu", ranks=identity.Ranks(tp_size=2))
    assert base.mismatched_fields(fp8_kv) == ("extra.kv_cache_dtype",)

    block = model_config(with_quantization(tiny_llama, tmp_path / "fp8-block", FP8_BLOCK, weights=True))
    quantized = identity.fingerprint(vllm_config(block), block, device="cpu", ranks=identity.Ranks(tp_size=2))
    fields = base.mismatched_fields(quantized)
    assert {"quantization", "quantization_config", "extra.quantization", "extra.quant_config_hash"} <= set(fields)
    assert "checkpoint" not in fields  # same safetensors: the difference is named where it is
    assert quantized.quantization == "fp8-block" and json.loads(quantized.quantization_config)["weight_block_size"] == [128, 128]


def test_the_draft_role_is_part_of_the_fingerprint(tiny_llama):
    mc = model_config(tiny_llama)
    target = identity.fingerprint(vllm_config(mc), mc, device="cpu", ranks=identity.Ranks(), draft=False)
    draft = identity.fingerprint(vllm_config(mc), mc, device="cpu", ranks=identity.Ranks(), draft=True)
    assert target.mismatched_fields(draft) == ("extra.is_draft",)


# Quantization allowlist ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "config", "method"),
    [("awq", AWQ, "awq"), ("gptq", GPTQ, "gptq"), ("fp8-per-tensor", FP8_PER_TENSOR, "fp8"),
     ("fp8-block-64", {**FP8_BLOCK, "weight_block_size": [64, 64]}, "fp8")],
)
@pytest.mark.parametrize("mode", ["client", "daemon"])
def test_unvalidated_quantization_is_refused_before_any_weight_is_read(tiny_llama, tmp_path, name, config, method, mode):
    checkpoint = with_quantization(tiny_llama, tmp_path / name, config, weights=False)  # no weight files at all
    mc = model_config(checkpoint)
    vc = vllm_config(mc, {"mode": mode, "socket_dir": str(tmp_path / "no-server")})
    loader = get_model_loader(vc.load_config)
    with pytest.raises(UnsupportedQuantization) as caught:
        loader.load_model(vllm_config=vc, model_config=mc)
    assert caught.value.method == method
    assert not (tmp_path / "no-server").exists()  # refused before even looking for a server


def test_block_fp8_with_128_blocks_passes_the_allowlist(tiny_llama, tmp_path):
    mc = model_config(with_quantization(tiny_llama, tmp_path / "fp8-block", FP8_BLOCK))
    assert mc.quantization == "fp8"
    method, config = identity.quantization(mc)
    assert method == "fp8-block" and config["weight_block_size"] == [128, 128]


# The load path, across processes -------------------------------------------------------------------------------------


def test_daemon_publishes_vllms_own_load_and_a_client_in_another_process_maps_it_bit_identical(tiny_llama, socket_dir, tmp_path):
    """off (vLLM's plain load) vs daemon (vLLM's load, published, rebound) vs client (meta model, rebound), three processes."""
    missing = str(tmp_path / "nobody-serves-here")
    plain, strict_missing, fallback = run_engine("vllm", tiny_llama, [
        {"extra": {"mode": "off"}, "out": str(tmp_path / "plain.pt")},
        {"extra": {"mode": "client", "socket_dir": missing, "strict": True}, "out": None},
        {"extra": {"mode": "client", "socket_dir": missing}, "out": str(tmp_path / "fallback.pt")},
    ])
    assert plain["source"] == "disk" and plain["external_before"] == 0
    assert strict_missing["error"] == "ServerUnavailable"
    assert fallback["source"] == "disk" and fallback["external_before"] == 0

    try:
        (daemon,) = run_engine("vllm", tiny_llama, [
            {"extra": {"mode": "daemon", "socket_dir": str(socket_dir)}, "out": str(tmp_path / "daemon.pt")},
        ])
        (client,) = run_engine("vllm", tiny_llama, [
            {"extra": {"mode": "client", "socket_dir": str(socket_dir), "strict": True}, "out": str(tmp_path / "client.pt"),
             "try_reload": True},
        ])
        status = server_status(socket_dir)
    finally:
        stop_spawned_server(socket_dir)

    for result in (daemon, client):
        assert result["source"] == "cache", result
        assert result["meta"] == [] and result["unmapped_parameters"] == []
        assert result["parameters"] == plain["parameters"] and result["buffers"] == plain["buffers"]
    assert daemon["external_before"] == 0  # no server yet: the daemon-mode engine started one and allocates the weights itself
    assert client["external_before"] == client["entry_bytes"] == client["external_after"] > 0
    assert daemon["digest"] == client["digest"] and daemon["fingerprint"] == client["fingerprint"] == plain["fingerprint"]
    # Only the one-element attention scales are private copies (vLLM re-stamps them in post-processing).
    assert client["unmapped_buffers"] and all(name.rsplit(".", 1)[1] in {"_k_scale", "_v_scale", "_q_scale", "_prob_scale"}
                                              for name in client["unmapped_buffers"])
    assert client["reload"].startswith("RuntimeError") and "read-only" in client["reload"]
    (entry,) = status["entries"]
    assert entry["digest"] == client["digest"] and "vllm" in entry["label"] and entry["bytes"] == client["entry_bytes"]

    assert_same_state(tmp_path / "fallback.pt", tmp_path / "plain.pt", "client fallback vs vLLM's plain load")
    assert_same_state(tmp_path / "daemon.pt", tmp_path / "plain.pt", "daemon vs vLLM's plain load")
    assert_same_state(tmp_path / "client.pt", tmp_path / "plain.pt", "client vs vLLM's plain load")
