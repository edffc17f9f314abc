"""The SGLang adapter against SGLang 0.5.23's own code.

- SGLang's plugin points: the class as load format, the plugin route, ServerArgs
  pickling, the loader ABC and its signatures;
- the hooks (``weightcache.adapters.sglang.hooks``): fingerprint facts from real
  configs and ranks, refusals before any weight is read, the private SGLang names used;
- the conformance kit on a Llama (every check), a Qwen3-MoE, a DeepSeek-V3
  (MLA: ``w_kc``/``w_vc`` tensor attributes) and a block-FP8 Llama (parity checks);
- SGLang's own loader path across processes: ``--load-format weightcache`` in
  off/daemon/client on those four models, bit-identical to SGLang's plain load,
  and a server started by a daemon-mode engine surviving SGLang's shutdown of that engine.

Runs in the engine venv (``make engine-venv``); the project's own test run
reaches it through test_engine_venv.py.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import attrs
import pytest

from tests.engines.support import (
    AWQ,
    FP8_BLOCK,
    FP8_PER_TENSOR,
    ROOT,
    assert_same_state,
    run_engine,
    server_status,
    stop_spawned_server,
    with_quantization,
    write_fp8_block,
    write_tiny_model,
)

sglang = pytest.importorskip("sglang")

from sglang.srt.configs.device_config import DeviceConfig  # noqa: E402
from sglang.srt.configs.load_config import LoadConfig  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.model_loader.loader import BaseModelLoader, get_model_loader  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from weightcache.adapters.sglang import engine, identity, internals, plugin  # noqa: E402
from weightcache.adapters.sglang.engine import STATE_KEY, EngineObjects  # noqa: E402
from weightcache.adapters.sglang.loader import loader_class  # noqa: E402
from weightcache.conformance import ConformanceFixtures, ConformanceTests, ParityTests, RefitTests  # noqa: E402
from weightcache.core.client.client import server_is_running  # noqa: E402
from weightcache.core.errors import UnsupportedQuantization  # noqa: E402
from weightcache.core.flow.loader import prepare  # noqa: E402
from weightcache.core.identity.safetensors_io import checkpoint_identity  # noqa: E402
from weightcache.core.request import LoadRequest  # noqa: E402
from weightcache.core.socket_dir import SocketDir  # noqa: E402

GPTQ_MARLIN = {"quant_method": "gptq_marlin", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
MLA_ATTRIBUTES = ("model.layers.0.self_attn.w_kc", "model.layers.0.self_attn.w_vc")


def model_config(path, dtype="bfloat16") -> ModelConfig:
    return ModelConfig(model_path=str(path), dtype=dtype)


def server_args(path, **kwargs) -> ServerArgs:
    args = ServerArgs(model_path=str(path), device="cpu", dtype="bfloat16", **kwargs)
    args.resolve_once()
    return args


# Checkpoints ---------------------------------------------------------------------------------------------------------


DEEPSEEK_V3_RELEASED = {
    "rope_parameters": {
        "rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
    },
    "max_position_embeddings": 163840,
    "moe_layer_freq": 1,
    "ep_size": 1,
}  # fmt: skip
"""Fields of DeepSeek-V3's released config.json that SGLang reads on the CPU: its MLA rotary embedding
there is YaRN only (``deepseek_yarn``), and its layer builder reads ``moe_layer_freq``."""


def with_released_deepseek_fields(checkpoint: Path) -> Path:
    path = checkpoint / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **DEEPSEEK_V3_RELEASED}))
    return checkpoint


@pytest.fixture(scope="module")
def checkpoints(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    """The four model families the adapter is verified on: Llama, Qwen3-MoE, DeepSeek-V3 (MLA), block-FP8 Llama."""
    blocks = write_tiny_model("llama_blocks", tmp_path_factory.mktemp("llama-blocks"))
    return {
        "llama": tiny_llama,
        "qwen3-moe": write_tiny_model("qwen3_moe", tmp_path_factory.mktemp("qwen3-moe")),
        "deepseek-v3": with_released_deepseek_fields(write_tiny_model("deepseek_v3", tmp_path_factory.mktemp("deepseek-v3"))),
        "llama-fp8-block": write_fp8_block(blocks, tmp_path_factory.mktemp("llama-fp8-block")),
    }


@pytest.fixture(scope="module")
def plugins_loaded():
    """SGLang's own plugin loading, as its CLI, Engine and schedulers run it (restricted to ours)."""
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


def test_the_entry_points_are_installed_in_both_groups():
    sglang_plugins = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")}
    adapters = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="weightcache.adapters")}
    assert sglang_plugins.get("weightcache") == "weightcache.adapters.sglang.plugin:register"
    assert adapters.get("sglang") == "weightcache.adapters.sglang.hooks"


def test_the_adapter_passes_the_core_checks_and_warm_up_imports_the_models_class(tiny_llama):
    import sys

    from weightcache.core.flow.plugins import installed_plugins

    plugins = installed_plugins()
    assert "sglang" in plugins.names() and "sglang" not in plugins.broken, plugins.broken
    plugins.adapter("sglang").warm_up(LoadRequest(model=str(tiny_llama), adapter="sglang"))
    assert "sglang.srt.models.llama" in sys.modules


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
    args = ServerArgs.from_cli_args(
        parser.parse_args(
            [
                "--model-path", str(tiny_llama), "--device", "cpu", "--load-format", "weightcache",
                "--model-loader-extra-config", '{"mode": "client", "socket_dir": "/x"}',
            ]
        )
    )  # fmt: skip
    assert args.load_format == "weightcache"
    load_config = LoadConfig(load_format=args.load_format, model_loader_extra_config=args.model_loader_extra_config)
    assert load_config.load_format is loader_class()
    loader = get_model_loader(load_config)
    assert type(loader) is loader_class() and loader.options.socket_dir == SocketDir("/x")


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
    with pytest.raises(ValueError, match="unknown keys \\['weight_cache_mode'\\] in --model-loader-extra-config"):
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


# The private SGLang names the adapter uses -------------------------------------------------------------------------


@pytest.mark.parametrize("name", internals.PRIVATE_NAMES, ids=lambda name: name.dotted)
def test_each_private_sglang_name_the_adapter_uses_is_there(name):
    name.lookup()  # ImportError naming it, the version it was checked with and what to do


def test_a_missing_private_name_is_reported_by_name_and_version():
    gone = attrs.evolve(internals.ROPE_CACHE, path="_ROPE_DICT_RENAMED")
    with pytest.raises(ImportError) as caught:
        gone.lookup()
    message = str(caught.value)
    assert f"sglang {sglang.__version__} lacks sglang.srt.layers.rotary_embedding.factory._ROPE_DICT_RENAMED" in message
    assert f"install sglang=={internals.CHECKED_WITH}" in message


def private_sglang_names_in(text: str) -> set[str]:
    """Private names reached through an SGLang module or class (``factory._ROPE_DICT``, ``from sglang.x import _y``)."""
    import re

    found = set(
        re.findall(
            r"\b(?:sglang[\w.]*|factory|loader|ipc_loader|HookRegistry|LoadConfig|IpcModelLoader|DefaultModelLoader)\.(_[A-Za-z]\w*)",
            text,
        )
    )
    return found | set(re.findall(r"from sglang[\w.]* import [^\n]*?\b(_[A-Za-z]\w*)", text))


def test_the_adapter_names_no_private_sglang_name_outside_internals():
    """Only ``adapters/sglang/internals.py`` names private SGLang attributes; the rest of the adapter goes through it."""
    assert private_sglang_names_in("from sglang.a import b, _c\nx = HookRegistry._hooks") == {"_c", "_hooks"}
    found = {
        path.name: private_sglang_names_in(path.read_text())
        for path in (ROOT / "adapters" / "sglang").glob("*.py")
        if path.name != "internals.py"
    }
    assert not any(found.values()), (
        f"private SGLang names outside adapters/sglang/internals.py: { {k: v for k, v in found.items() if v} }"
    )


def test_docs_list_every_private_name_with_the_version():
    text = (ROOT / "docs" / "engines.md").read_text()
    missing = [name.dotted for name in internals.PRIVATE_NAMES if f"`{name.dotted}`" not in text]
    assert not missing, f"docs/engines.md does not list these private SGLang names: {missing}"
    assert f"SGLang {internals.CHECKED_WITH}" in text


# Fingerprint from real configs -------------------------------------------------------------------------------------


def fingerprint(path, args, ranks=None, dtype="bfloat16"):
    """The fingerprint the core computes for SGLang's objects (as WeightcacheLoader hands them over)."""
    ranks = ranks or engine.Ranks()
    configs = EngineObjects(model_config(path, dtype), LoadConfig(load_format="auto"), DeviceConfig("cpu", 0), args, ranks)
    return prepare(
        LoadRequest(model=str(path), adapter="sglang", parallel=ranks.parallel, state={STATE_KEY: configs})
    ).fingerprint


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
    base = fingerprint(tiny_llama, args, engine.Ranks(tp_size=2, tp_rank=0))
    assert base.mismatched_fields(fingerprint(tiny_llama, args, engine.Ranks(tp_size=2, tp_rank=1))) == ("tp_rank",)
    assert base.mismatched_fields(fingerprint(tiny_llama, args, engine.Ranks(tp_size=2, moe_dp_size=2))) == ("extra.moe_dp_size",)
    assert "dtype" in base.mismatched_fields(fingerprint(tiny_llama, args, engine.Ranks(tp_size=2), dtype="float16"))
    fp8_kv = server_args(tiny_llama, kv_cache_dtype="fp8_e4m3")
    assert base.mismatched_fields(fingerprint(tiny_llama, fp8_kv, engine.Ranks(tp_size=2))) == (
        "extra.server_args.kv_cache_dtype",
    )

    block = with_quantization(tiny_llama, tmp_path / "fp8-block", FP8_BLOCK, weights=True)
    quantized = fingerprint(block, args, engine.Ranks(tp_size=2))
    fields = base.mismatched_fields(quantized)
    # the same safetensors: "checkpoint" differs only because config.json is one of its declared files (decision 104)
    assert set(fields) == {
        "checkpoint",
        "config",
        "quantization",
        "quantization_config",
        "extra.quant_method",
        "extra.quant_config_hash",
    }
    assert quantized.quantization == "fp8-block"


def test_ranks_come_from_sglangs_parallel_context(tiny_llama):
    from sglang.srt.runtime_context import get_parallel

    from weightcache.core.fingerprint import ParallelSpec

    engine.publish_rank(server_args(tiny_llama), ParallelSpec(), gpu_id=0)  # as a scheduler publishes before it loads
    parallel = get_parallel()
    with parallel.override(tp_size=1, tp_rank=0, pp_size=1, pp_rank=0):
        ranks = engine.Ranks.current()
    assert (ranks.tp_size, ranks.tp_rank, ranks.pp_size, ranks.moe_ep_size) == (1, 0, 1, 1)


# Quantization allowlist ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "config", "method"),
    [
        ("awq", AWQ, "awq"),
        ("gptq-marlin", GPTQ_MARLIN, "gptq"),
        ("fp8-per-tensor", FP8_PER_TENSOR, "fp8"),
        ("fp8-block-64", {**FP8_BLOCK, "weight_block_size": [64, 64]}, "fp8"),
    ],
)
@pytest.mark.parametrize("mode", ["client", "daemon"])
def test_sglangs_loader_refuses_unvalidated_quantization_before_any_weight_is_read(
    tiny_llama, tmp_path, name, config, method, mode
):
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


def test_block_fp8_is_refused_for_a_checkpoint_that_is_not_stored_so(tiny_llama):
    with pytest.raises(UnsupportedQuantization, match="SGLang quantizes online only per tensor") as caught:
        prepare(LoadRequest(model=str(tiny_llama), adapter="sglang", quantization="fp8-block"))
    assert caught.value.method == "fp8-block"


# The conformance kit -------------------------------------------------------------------------------------------------


class SGLangKit(ConformanceFixtures):
    """The kit on the ``sglang`` adapter (SGLang's objects built for a single-process load, as the kit gives none)."""

    family = "llama"

    @pytest.fixture(scope="class")
    @classmethod
    def adapter_name(cls):
        return "sglang"

    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, checkpoints):
        return str(checkpoints[cls.family])

    @pytest.fixture(scope="class")
    @classmethod
    def supports_fp8(cls):
        return False  # SGLang quantizes online only per tensor: fp8-block requests are refused


class TestKitLlama(SGLangKit, ConformanceTests):
    family = "llama"


class TestKitQwen3Moe(SGLangKit, ParityTests, RefitTests):
    family = "qwen3-moe"


class TestKitDeepseekV3(SGLangKit, ParityTests, RefitTests):
    family = "deepseek-v3"

    def test_mla_tensor_attributes_are_mapped(self, mapped_model):
        from weightcache.conformance.assertions import model_tensors

        tensors = model_tensors(mapped_model.model)
        for name in MLA_ATTRIBUTES:
            assert name in tensors and tensors[name].kind == "attribute", f"{name} is not a mapped tensor attribute"


class TestKitFp8BlockLlama(SGLangKit, ParityTests, RefitTests):
    family = "llama-fp8-block"

    @pytest.fixture(scope="class")
    @classmethod
    def quantization(cls):
        return "fp8-block"

    @pytest.fixture(scope="class")
    @classmethod
    def supports_fp8(cls):
        return True  # stored as block FP8


# SGLang's own loader path, across processes ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_runs(checkpoints, tmp_path_factory):
    """Two SGLang processes loading every family through ``--load-format weightcache``.

    The first: a strict client and a client without a server (llama), then per
    family SGLang's plain load (``off``) and ``daemon`` (the first starts
    ``weightcache serve`` itself), and finally SGLang's own shutdown of its
    process tree (``kill_process_tree``, as ``sglang.Engine.shutdown``). The
    second: a strict client per family.
    """
    out = tmp_path_factory.mktemp("states")
    socket_dir = Path(tempfile.mkdtemp(prefix="wc-"))
    socket_dir.chmod(0o700)
    missing = str(out / "nobody-serves-here")
    daemon = {"mode": "daemon", "socket_dir": str(socket_dir)}
    first = [
        {"extra": {"mode": "client", "socket_dir": missing, "strict": True}, "out": None},
        {"extra": {"mode": "client", "socket_dir": missing}, "out": str(out / "llama.fallback.pt")},
    ]
    for family, path in checkpoints.items():
        first.append({"model": str(path), "extra": {"mode": "off"}, "out": str(out / f"{family}.plain.pt")})
        first.append({"model": str(path), "extra": daemon, "out": str(out / f"{family}.daemon.pt")})
    first[-1]["shutdown"] = True
    second = [
        {"model": str(path), "extra": {**daemon, "mode": "client", "strict": True}, "out": str(out / f"{family}.client.pt")}
        for family, path in checkpoints.items()
    ]
    try:
        strict_missing, fallback, *loads = run_engine("sglang", checkpoints["llama"], first)
        server_after_shutdown = server_status(socket_dir) if server_is_running(socket_dir) else None
        clients = run_engine("sglang", checkpoints["llama"], second)
        status = server_status(socket_dir) if server_is_running(socket_dir) else None
    finally:
        stop_spawned_server(socket_dir)
        shutil.rmtree(socket_dir, ignore_errors=True)
    families = list(checkpoints)
    yield {
        "out": out,
        "strict_missing": strict_missing,
        "fallback": fallback,
        "plain": dict(zip(families, loads[0::2], strict=True)),
        "daemon": dict(zip(families, loads[1::2], strict=True)),
        "client": dict(zip(families, clients, strict=True)),
        "server_after_shutdown": server_after_shutdown,
        "status": status,
    }


def test_a_client_without_a_server_raises_when_strict_else_loads_sglangs_plain_load(engine_runs):
    assert engine_runs["strict_missing"]["error"] == "ServerUnavailable"
    fallback, plain = engine_runs["fallback"], engine_runs["plain"]["llama"]
    assert fallback["source"] == "disk" and fallback["preloaded_weights_bytes"] == 0
    assert_same_state(engine_runs["out"] / "llama.fallback.pt", engine_runs["out"] / "llama.plain.pt", "client fallback")
    assert plain["source"] == "disk" and plain["preloaded_weights_bytes"] == 0


@pytest.mark.parametrize("family", ["llama", "qwen3-moe", "deepseek-v3", "llama-fp8-block"])
def test_daemon_and_client_engines_equal_sglangs_plain_load_bit_for_bit(engine_runs, family):
    """Every parameter, buffer and tensor attribute (MLA's w_kc/w_vc) of daemon and client is SGLang's plain load's."""
    plain, daemon, client = (engine_runs[mode][family] for mode in ("plain", "daemon", "client"))
    assert plain["source"] == "disk", plain
    for label, result in (("daemon", daemon), ("client", client)):
        assert result["source"] == "cache", result
        assert result["meta"] == [], f"{label}: left on meta: {result['meta']}"
        unmapped = result["unmapped_parameters"] + result["unmapped_buffers"] + result["unmapped_attributes"]
        assert unmapped == [], f"{label}: not in the mapped arenas: {unmapped}"
        for kind in ("parameters", "buffers", "attributes"):
            assert result[kind] == plain[kind], f"{label}: {kind} differ from the plain load's"
        assert_same_state(
            engine_runs["out"] / f"{family}.{label}.pt", engine_runs["out"] / f"{family}.plain.pt", f"{family} {label}"
        )
    assert daemon["preloaded_weights_bytes"] == 0  # this process allocated the arenas after SGLang's baseline
    assert client["preloaded_weights_bytes"] == client["entry_bytes"] > 0  # resident before the baseline
    assert daemon["digest"] == client["digest"] and daemon["fingerprint"] == client["fingerprint"] == plain["fingerprint"]
    if family == "deepseek-v3":
        assert set(MLA_ATTRIBUTES) <= set(plain["attributes"]), plain["attributes"]


def test_the_server_a_daemon_engine_started_survives_sglangs_shutdown_of_that_engine(engine_runs, checkpoints):
    """SGLang's Engine.shutdown kills its whole process tree; the server is no descendant, so the next engine maps the cache."""
    assert engine_runs["daemon"]["llama-fp8-block"]["shutdown"] == "kill_process_tree"
    survivor = engine_runs["server_after_shutdown"]
    assert survivor is not None, "the weightcache server died with the engine's process tree: it was a descendant of the engine"
    assert len(survivor["entries"]) == len(checkpoints), survivor
    assert engine_runs["status"]["pid"] == survivor["pid"]
    digests = {entry["digest"] for entry in engine_runs["status"]["entries"]}
    for family in checkpoints:
        client = engine_runs["client"][family]
        assert client["source"] == "cache" and client["digest"] in digests, client
        assert client["digest"] == engine_runs["daemon"][family]["digest"]
    assert all("sglang" in entry["label"] for entry in engine_runs["status"]["entries"])


# Drift: SGLang's own load_model against the steps the adapter replays ------------------------------------------------

REPLAY_STRUCTURE = {
    "engine_only": {
        "sglang.srt.model_loader.loader:DefaultModelLoader.load_model": 1,
        "sglang.srt.model_loader.loader:DefaultModelLoader.load_weights_and_postprocess": 1,
    },
    "replay_only": {
        "sglang.srt.model_loader.loader:DefaultModelLoader.initialize_model_for_startup": 1,
        "sglang.srt.model_loader.utils:set_default_torch_dtype": 4,  # two more `with` blocks: entered, left
    },
}
"""How the adapter's replay (``loading.load`` + ``loading.post_process``) differs from ``DefaultModelLoader.load_model``
by construction: it builds through the public ``initialize_model_for_startup``, enters ``set_default_torch_dtype``
once per step, and calls ``load_weights_only`` and ``postprocess_weights`` itself (load_model composes them in
``load_weights_and_postprocess``). Anything else is a step SGLang added or dropped."""


def test_the_adapters_replay_makes_every_call_sglangs_own_load_model_makes(tiny_llama):
    """SGLang's ``DefaultModelLoader.load_model`` run itself, traced call by call, against mode ``off``'s replay."""
    from tests.engines.calltrace import calls, difference
    from weightcache.adapters.sglang import loading
    from weightcache.adapters.sglang.engine import start_load

    def configs():
        return start_load(LoadRequest(model=str(tiny_llama), adapter="sglang", dtype="bfloat16", device="cpu"))

    engine_configs = configs()
    loader = loading.default_loader(engine_configs)
    # once untraced: SGLang initialises some kernels' state on first use
    loader.load_model(model_config=engine_configs.model_config, device_config=engine_configs.device_config)
    with loading.own_rope_cache():  # as in a fresh scheduler: no rotary module cached yet (the replay isolates its own)
        engine = calls(
            "sglang",
            lambda: loader.load_model(model_config=engine_configs.model_config, device_config=engine_configs.device_config),
        )
    replay_configs = configs()
    replay = calls(
        "sglang",
        lambda: loading.post_process(replay_configs, loading.load(replay_configs)),
        skip={"get_model_loader"},  # the adapter asks SGLang which loader --load-format auto picks
    )
    assert len(engine) > 100, engine  # the trace saw SGLang's code
    found = difference(engine, replay)
    assert found == REPLAY_STRUCTURE, (
        "SGLang's DefaultModelLoader.load_model and the adapter's replay of it (adapters/sglang/loading.py) no longer "
        "make the same calls: update the replay for the steps named here:\n" + json.dumps(found, indent=1)
    )
