"""The SGLang adapter against SGLang 0.5.23's own code: the class as load format, the plugin route, ABC, fingerprint, refusals, load path.

Runs in the engine venv (``make engine-venv``); the project's own test run
reaches it through test_engine_venv.py.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import json
import pickle

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

sglang = pytest.importorskip("sglang")

from sglang.srt.configs.load_config import LoadConfig  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.model_loader.loader import BaseModelLoader, get_model_loader  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from weightcache.adapters.sglang import identity, plugin  # noqa: E402
from weightcache.adapters.sglang.loader import loader_class  # noqa: E402
from weightcache.core.errors import UnsupportedQuantization  # noqa: E402
from weightcache.core.safetensors_io import checkpoint_identity  # noqa: E402

GPTQ_MARLIN = {"quant_method": "gptq_marlin", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


def model_config(path, dtype="bfloat16") -> ModelConfig:
    return ModelConfig(model_path=str(path), dtype=dtype)


def server_args(path, **kwargs) -> ServerArgs:
    args = ServerArgs(model_path=str(path), device="cpu", dtype="bfloat16", **kwargs)
    args.resolve_once()
    return args


@pytest.fixture(scope="module")
def plugins_loaded():
    """SGLang's own plugin loading, as its CLI, Engine and schedulers run it (restricted to ours)."""
    import os

    import sglang.srt.plugins

    with pytest.raises(ValueError, match="'weightcache' is not a valid LoadFormat"):
        LoadConfig(load_format="weightcache")  # before SGLang runs the plugin
    previous = os.environ.get("SGLANG_PLUGINS")
    os.environ["SGLANG_PLUGINS"] = "weightcache"
    sglang.srt.plugins._plugins_loaded = False  # as in a fresh process
    try:
        sglang.srt.plugins.load_plugins()
    finally:
        if previous is None:
            os.environ.pop("SGLANG_PLUGINS")
        else:
            os.environ["SGLANG_PLUGINS"] = previous


# Registration ----------------------------------------------------------------------------------------------------


def test_the_entry_point_is_installed_in_sglangs_plugin_group():
    entry_points = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")}
    assert entry_points.get("weightcache") == "weightcache.adapters.sglang.plugin:register"


def test_the_class_itself_is_a_load_format(tiny_llama):
    cls = loader_class()
    loader = get_model_loader(LoadConfig(load_format=cls, model_loader_extra_config='{"mode": "client", "strict": true}'))
    assert type(loader) is cls
    assert (loader.options.mode, loader.options.strict, loader.preloaded_weights_bytes) == ("client", True, 0)


def test_the_class_travels_through_server_args_to_the_schedulers(tiny_llama):
    """Engine(load_format=cls): ServerArgs keeps the class, is pickled to the scheduler, and its LoadConfig picks it."""
    from sglang.srt.runtime_context import SpawnRanks, get_model, publish

    cls = loader_class()
    args = server_args(tiny_llama, load_format=cls, model_loader_extra_config='{"mode": "daemon"}')
    shipped = pickle.loads(pickle.dumps(args))  # what a scheduler process receives
    assert shipped.load_format is cls
    publish(shipped, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    bag = get_model()
    loader = get_model_loader(LoadConfig(load_format=bag.load_format, model_loader_extra_config=bag.model_loader_extra_config))
    assert type(loader) is cls and loader.options.mode == "daemon"


def test_the_plugin_route_accepts_the_name_on_the_cli_and_in_load_config(plugins_loaded, tiny_llama):
    from sglang.srt.server_args import LOAD_FORMAT_CHOICES

    assert "weightcache" in LOAD_FORMAT_CHOICES
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args([
        "--model-path", str(tiny_llama), "--device", "cpu", "--load-format", "weightcache",
        "--model-loader-extra-config", '{"mode": "client", "socket_dir": "/x"}',
    ]))
    assert args.load_format == "weightcache"
    load_config = LoadConfig(load_format=args.load_format, model_loader_extra_config=args.model_loader_extra_config)
    assert load_config.load_format is loader_class()
    loader = get_model_loader(load_config)
    assert type(loader) is loader_class() and loader.options.socket_dir == "/x"


def test_other_load_formats_are_untouched(plugins_loaded):
    from sglang.srt.configs.load_config import LoadFormat

    assert LoadConfig(load_format="safetensors").load_format is LoadFormat.SAFETENSORS
    with pytest.raises(ValueError):
        LoadConfig(load_format="weightcache-typo")


def test_register_is_idempotent(plugins_loaded):
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import LOAD_FORMAT_CHOICES

    plugin.register()
    plugin.register()
    assert LOAD_FORMAT_CHOICES.count("weightcache") == 1
    hooks = [hook for _type, hook, _source in HookRegistry._hooks[plugin.HOOK_TARGET] if hook is plugin.resolve_load_format]
    assert len(hooks) == 1


def test_unknown_extra_config_is_refused():
    with pytest.raises(ValueError, match="unknown keys \\['weight_cache_mode'\\]"):
        get_model_loader(LoadConfig(load_format=loader_class(), model_loader_extra_config={"weight_cache_mode": "client"}))


# The ABC and its signatures ----------------------------------------------------------------------------------------


def test_the_loader_is_a_concrete_base_model_loader():
    cls = loader_class()
    assert issubclass(cls, BaseModelLoader)
    assert not inspect.isabstract(cls), cls.__abstractmethods__
    assert cls.__module__ == "weightcache.adapters.sglang.loader" and cls.__qualname__ == "WeightcacheLoader"


@pytest.mark.parametrize("method", ["__init__", "download_model", "load_model"])
def test_method_signatures_equal_sglangs(method):
    ours, theirs = inspect.signature(getattr(loader_class(), method)), inspect.signature(getattr(BaseModelLoader, method))
    assert ours == theirs, f"{method}: {ours} != SGLang's {theirs}"
    assert method in vars(loader_class()), f"{method} is not overridden"


# Fingerprint from real configs -------------------------------------------------------------------------------------


def fingerprint(path, args, ranks=None, dtype="bfloat16"):
    mc = model_config(path, dtype)
    return identity.fingerprint(mc, LoadConfig(load_format=loader_class()), device="cpu", ranks=ranks or identity.Ranks(),
                                server_args=args)


def test_fingerprint_is_built_from_model_config_and_server_args(tiny_llama):
    from sglang.srt.weight_cache.protocol import hash_quant_config

    args = server_args(tiny_llama)
    fp = fingerprint(tiny_llama, args)
    assert fp.checkpoint == checkpoint_identity(tiny_llama)
    assert (fp.architecture, fp.dtype, fp.quantization) == ("LlamaForCausalLM", "bfloat16", "none")
    assert (fp.adapter, fp.engine, fp.engine_version) == ("sglang", "sglang", sglang.__version__)
    extra = fp.extra
    assert (extra["quant_method"], extra["quant_config_hash"], extra["revision"]) == ("", hash_quant_config(None), "")
    for name in identity.SERVER_ARGS:
        value = getattr(args, name)
        assert extra[f"server_args.{name}"] == (None if value is None else str(getattr(value, "value", value))), name
    json.dumps(fp.to_json())
    assert fingerprint(tiny_llama, server_args(tiny_llama)).digest == fp.digest


def test_fingerprint_names_the_field_that_differs(tiny_llama, tmp_path):
    args = server_args(tiny_llama)
    base = fingerprint(tiny_llama, args, identity.Ranks(tp_size=2, tp_rank=0))
    assert base.mismatched_fields(fingerprint(tiny_llama, args, identity.Ranks(tp_size=2, tp_rank=1))) == ("tp_rank",)
    assert base.mismatched_fields(fingerprint(tiny_llama, args, identity.Ranks(tp_size=2, moe_dp_size=2))) == ("extra.moe_dp_size",)
    assert "dtype" in base.mismatched_fields(fingerprint(tiny_llama, args, identity.Ranks(tp_size=2), dtype="float16"))
    fp8_kv = server_args(tiny_llama, kv_cache_dtype="fp8_e4m3")
    assert base.mismatched_fields(fingerprint(tiny_llama, fp8_kv, identity.Ranks(tp_size=2))) == ("extra.server_args.kv_cache_dtype",)

    block = with_quantization(tiny_llama, tmp_path / "fp8-block", FP8_BLOCK, weights=True)
    quantized = fingerprint(block, args, identity.Ranks(tp_size=2))
    fields = base.mismatched_fields(quantized)
    assert {"quantization", "quantization_config", "extra.quant_method", "extra.quant_config_hash"} <= set(fields)
    assert "checkpoint" not in fields and quantized.quantization == "fp8-block"


def test_ranks_come_from_sglangs_parallel_context():
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    with parallel.override(tp_size=1, tp_rank=0, pp_size=1, pp_rank=0):
        ranks = identity.Ranks.current()
    assert (ranks.tp_size, ranks.tp_rank, ranks.pp_size, ranks.moe_ep_size) == (1, 0, 1, 1)


# Quantization allowlist ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "config", "method"),
    [("awq", AWQ, "awq"), ("gptq-marlin", GPTQ_MARLIN, "gptq"), ("fp8-per-tensor", FP8_PER_TENSOR, "fp8"),
     ("fp8-block-64", {**FP8_BLOCK, "weight_block_size": [64, 64]}, "fp8")],
)
@pytest.mark.parametrize("mode", ["client", "daemon"])
def test_unvalidated_quantization_is_refused_before_any_weight_is_read(tiny_llama, tmp_path, name, config, method, mode):
    from sglang.srt.configs.device_config import DeviceConfig

    checkpoint = with_quantization(tiny_llama, tmp_path / name, config, weights=False)  # no weight files at all
    mc = model_config(checkpoint)
    extra = json.dumps({"mode": mode, "socket_dir": str(tmp_path / "no-server")})
    loader = get_model_loader(LoadConfig(load_format=loader_class(), model_loader_extra_config=extra), mc)
    with pytest.raises(UnsupportedQuantization) as caught:
        loader.load_model(model_config=mc, device_config=DeviceConfig("cpu", 0))
    assert caught.value.method == method
    assert not (tmp_path / "no-server").exists()


def test_block_fp8_with_128_blocks_passes_the_allowlist(tiny_llama, tmp_path):
    mc = model_config(with_quantization(tiny_llama, tmp_path / "fp8-block", FP8_BLOCK))
    method, config = identity.quantization(mc)
    assert method == "fp8-block" and config["weight_block_size"] == [128, 128]


# The load path, across processes -------------------------------------------------------------------------------------


def test_daemon_publishes_sglangs_own_load_and_a_client_in_another_process_maps_it_bit_identical(tiny_llama, socket_dir, tmp_path):
    """off (SGLang's plain load) vs daemon (SGLang's load, published, rebound) vs client (meta model, rebound)."""
    missing = str(tmp_path / "nobody-serves-here")
    plain, strict_missing, fallback = run_engine("sglang", tiny_llama, [
        {"extra": {"mode": "off"}, "out": str(tmp_path / "plain.pt")},
        {"extra": {"mode": "client", "socket_dir": missing, "strict": True}, "out": None},
        {"extra": {"mode": "client", "socket_dir": missing}, "out": str(tmp_path / "fallback.pt")},
    ])
    assert plain["source"] == "disk" and plain["preloaded_weights_bytes"] == 0
    assert strict_missing["error"] == "ServerUnavailable"
    assert fallback["source"] == "disk" and fallback["preloaded_weights_bytes"] == 0

    try:
        (daemon,) = run_engine("sglang", tiny_llama, [{"extra": {"mode": "daemon", "socket_dir": str(socket_dir)}, "out": str(tmp_path / "daemon.pt")}])
        (client,) = run_engine("sglang", tiny_llama, [
            {"extra": {"mode": "client", "socket_dir": str(socket_dir), "strict": True}, "out": str(tmp_path / "client.pt")},
        ])
        status = server_status(socket_dir)
    finally:
        stop_spawned_server(socket_dir)

    for result in (daemon, client):
        assert result["source"] == "cache", result
        assert result["meta"] == [] and result["unmapped_parameters"] == [] and result["unmapped_buffers"] == []
        assert result["parameters"] == plain["parameters"] and result["buffers"] == plain["buffers"]
    assert daemon["preloaded_weights_bytes"] == 0  # this process allocated the arenas after SGLang's baseline
    assert client["preloaded_weights_bytes"] == client["entry_bytes"] > 0  # resident before the baseline
    assert daemon["digest"] == client["digest"] and daemon["fingerprint"] == client["fingerprint"] == plain["fingerprint"]
    (entry,) = status["entries"]
    assert entry["digest"] == client["digest"] and "sglang" in entry["label"]

    assert_same_state(tmp_path / "fallback.pt", tmp_path / "plain.pt", "client fallback vs SGLang's plain load")
    assert_same_state(tmp_path / "daemon.pt", tmp_path / "plain.pt", "daemon vs SGLang's plain load")
    assert_same_state(tmp_path / "client.pt", tmp_path / "plain.pt", "client vs SGLang's plain load")
