"""tests/gpu/engine_probe.py's steps, per engine, each run by ``child_main`` in a fresh process: import, modules, build,
the engine's own load, ``--load-format weightcache``, generation plain and through weightcache."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from engine_probe_child import (
    PROMPT_IDS,
    STUBS,
    StepContext,
    StubFinder,
    attachment_devices,
    compare_with_own,
    failure_record,
    loaded_summary,
    same_tokens,
    server_entries,
)


def child_main(args: argparse.Namespace) -> int:
    engine, step = args.child
    work = Path(args.work)
    result_path = work / "results" / f"{engine}-{step}.json"
    stubs = StubFinder(STUBS[engine] if step != "0-import-unstubbed" else ())
    sys.meta_path.insert(0, stubs)
    try:
        from tests.engines import shims

        shims.install()  # the engine suite's CPU shims: a no-op where torch has CUDA
        context = StepContext(engine, work, args.device)
        detail = STEPS[engine][step](context) or {}
        result = {"ok": True, **detail}
    except BaseException as exc:
        result = failure_record(exc, str(work / "engines"))
    result["stubbed_modules_imported"] = stubs.created
    result_path.write_text(json.dumps(result, default=str))
    sys.stdout.flush()
    os._exit(0)  # engines leave threads and process groups behind: do not wait for them


def built_summary(model) -> dict:
    """A model the engine built (no weights loaded): its class, how many parameters and on which devices."""
    return {
        "model": type(model).__name__,
        "parameters": sum(1 for _ in model.parameters()),
        "devices": sorted({str(p.device) for p in model.parameters()}),
    }


def weightcache_summary(ctx: StepContext, loader, model, server) -> dict:
    """A ``--load-format weightcache`` load: its loader, where the tensors came from, each tensor against the engine's own
    load (step 4), the devices of the arenas it maps and the server's entries."""
    import torch

    saved = ctx.work / f"{ctx.engine}-weightcache.pt"
    summary = loaded_summary(model, saved)
    comparison = compare_with_own(torch.load(saved, weights_only=True), ctx.own_state)
    return {
        "loader": type(loader).__name__,
        **summary,
        **comparison,
        "arena_devices": attachment_devices(model),
        "server_entries": server_entries(server),
    }


# --- vLLM


def vllm_import_unstubbed(ctx: StepContext) -> dict:
    """vLLM as it is: resolving ``current_platform`` imports vllm/platforms/cuda.py and its compiled ops."""
    import vllm
    import vllm.config
    from vllm.platforms import current_platform

    return {"vllm": vllm.__version__, "platform": type(current_platform).__name__, "file": ctx.module_file("vllm")}


def vllm_import(ctx: StepContext) -> dict:
    import torch
    import vllm
    from vllm.platforms import current_platform

    return {
        "vllm": vllm.__version__,
        "file": ctx.module_file("vllm"),
        "torch": torch.__version__,
        "platform": type(current_platform).__name__,
        "device_type": current_platform.device_type,
    }


def vllm_modules(ctx: StepContext) -> dict:
    import vllm.config
    import vllm.model_executor.model_loader.default_loader
    import vllm.model_executor.model_loader.utils
    import vllm.model_executor.models.llama
    import vllm.v1.attention.backends.triton_attn  # noqa: F401

    import weightcache.adapters.vllm.engine
    import weightcache.adapters.vllm.loader
    import weightcache.adapters.vllm.loading  # noqa: F401

    return {"llama": ctx.module_file("vllm.model_executor.models.llama")}


def vllm_configs(ctx: StepContext, load_format: str, extra: dict | None = None):
    """vLLM's configs for the tiny checkpoint: eager, native custom ops, Triton attention on CUDA."""
    import torch
    from vllm.config import CompilationConfig, LoadConfig, ModelConfig, VllmConfig

    from weightcache.adapters.vllm.engine import init_single_process

    model_config = ModelConfig(model=ctx.checkpoint, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True)
    load_config = LoadConfig(load_format=load_format, model_loader_extra_config=extra or {})
    kwargs = {"compilation_config": CompilationConfig(mode=0, custom_ops=["none"])}
    if ctx.cuda:
        from vllm.config import AttentionConfig

        kwargs["attention_config"] = AttentionConfig(backend="TRITON_ATTN")
    vllm_config = VllmConfig(model_config=model_config, load_config=load_config, **kwargs)
    init_single_process(torch.device(ctx.device))  # the adapter's: vLLM's own calls, world size 1
    return vllm_config, model_config, load_config


def vllm_build(ctx: StepContext) -> dict:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    vllm_config, model_config, _ = vllm_configs(ctx, "dummy")
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(model_config.dtype), torch.device(ctx.device):
        model = initialize_model(vllm_config=vllm_config, model_config=model_config)
    return {**built_summary(model), "attention_backend": str(vllm_config.attention_config.backend) if ctx.cuda else None}


def vllm_own_load(ctx: StepContext) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    vllm_config, model_config, load_config = vllm_configs(ctx, "auto")
    with set_current_vllm_config(vllm_config):
        loader = get_model_loader(load_config)
        model = loader.load_model(vllm_config=vllm_config, model_config=model_config)
    return {"loader": type(loader).__name__, **loaded_summary(model, ctx.own_state)}


def vllm_weightcache(ctx: StepContext) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    server = ctx.start_server()
    try:
        extra = {"mode": "daemon", "socket_dir": str(server.socket_dir), "strict": True}
        vllm_config, model_config, load_config = vllm_configs(ctx, "weightcache", extra)
        with set_current_vllm_config(vllm_config):
            loader = get_model_loader(load_config)
            model = loader.load_model(vllm_config=vllm_config, model_config=model_config)
        return weightcache_summary(ctx, loader, model, server)
    finally:
        server.close()


def vllm_generate(ctx: StepContext, load_format: str, extra: dict | None) -> list[int]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {"attention_backend": "TRITON_ATTN"} if ctx.cuda else {}
    llm = LLM(
        model=ctx.checkpoint,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        enforce_eager=True,
        compilation_config={"mode": 0, "custom_ops": ["none"]},
        gpu_memory_utilization=0.15,
        max_model_len=128,
        max_num_seqs=4,
        load_format=load_format,
        model_loader_extra_config=extra or {},
        **kwargs,
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=PROMPT_IDS)], params, use_tqdm=False)
    return list(outputs[0].outputs[0].token_ids)


def vllm_forward(ctx: StepContext) -> dict:
    tokens = vllm_generate(ctx, "auto", None)
    ctx.tokens.write_text(json.dumps(tokens))
    return {"tokens": tokens}


def vllm_forward_weightcache(ctx: StepContext) -> dict:
    server = ctx.start_server()
    try:
        tokens = vllm_generate(ctx, "weightcache", {"mode": "daemon", "socket_dir": str(server.socket_dir), "strict": True})
        entries = server_entries(server)
    finally:
        server.close()
    return same_tokens(ctx, tokens, entries)


# --- SGLang


def sglang_import_unstubbed(ctx: StepContext) -> dict:
    """SGLang as it is: its layers' CUDA branches import sgl_kernel (sglang/srt/layers/layernorm.py)."""
    import sglang
    import sglang.srt.layers.layernorm
    import sglang.srt.models.llama

    return {"sglang": sglang.__version__, "file": ctx.module_file("sglang")}


def sglang_import(ctx: StepContext) -> dict:
    import sglang
    import torch

    return {"sglang": sglang.__version__, "file": ctx.module_file("sglang"), "torch": torch.__version__}


def sglang_modules(ctx: StepContext) -> dict:
    import sglang.srt.configs.model_config
    import sglang.srt.layers.attention.triton_backend
    import sglang.srt.model_loader.loader
    import sglang.srt.models.llama
    import sglang.srt.server_args  # noqa: F401

    return {"llama": ctx.module_file("sglang.srt.models.llama")}


SGLANG_RUNTIME = {"attention_backend": "triton", "sampling_backend": "pytorch", "disable_cuda_graph": True}
"""SGLang's server arguments for Triton attention, the PyTorch sampler and no CUDA graphs (sglang/srt/server_args.py)."""


def sglang_configs(ctx: StepContext, load_format: str, extra: dict | None = None):
    """SGLang's configs for the tiny checkpoint, published as a scheduler does (tests/engines/engine_child.py)."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    from weightcache.adapters.sglang.engine import _initialise_distributed_once

    kind = "cuda" if ctx.cuda else "cpu"
    runtime = SGLANG_RUNTIME if ctx.cuda else {}
    server_args = ServerArgs(model_path=ctx.checkpoint, device=kind, dtype="bfloat16", load_format=load_format, **runtime)
    server_args.resolve_once()
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    initialize_moe_config()
    _initialise_distributed_once(kind)  # the adapter's: SGLang's own calls, world size 1
    model_config = ModelConfig.from_server_args(server_args)
    load_config = LoadConfig(load_format=load_format, model_loader_extra_config=json.dumps(extra or {}))
    return model_config, load_config, DeviceConfig(kind, 0)


def sglang_build(ctx: StepContext) -> dict:
    import torch
    from sglang.srt.model_loader.loader import _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    model_config, load_config, device_config = sglang_configs(ctx, "dummy")
    with set_default_torch_dtype(model_config.dtype), torch.device(device_config.device):
        model = _initialize_model(model_config, load_config)
    return built_summary(model)


def sglang_own_load(ctx: StepContext) -> dict:
    from sglang.srt.model_loader.loader import get_model_loader

    model_config, load_config, device_config = sglang_configs(ctx, "auto")
    loader = get_model_loader(load_config, model_config)
    model = loader.load_model(model_config=model_config, device_config=device_config)
    return {"loader": type(loader).__name__, **loaded_summary(model, ctx.own_state)}


def sglang_weightcache(ctx: StepContext) -> dict:
    from sglang.srt.model_loader.loader import get_model_loader
    from sglang.srt.plugins import load_plugins

    load_plugins()
    server = ctx.start_server()
    try:
        extra = {"mode": "daemon", "socket_dir": str(server.socket_dir), "strict": True}
        model_config, load_config, device_config = sglang_configs(ctx, "weightcache", extra)
        loader = get_model_loader(load_config, model_config)
        model = loader.load_model(model_config=model_config, device_config=device_config)
        return weightcache_summary(ctx, loader, model, server)
    finally:
        server.close()


def sglang_generate(ctx: StepContext, load_format: str, extra: dict | None, server=None) -> tuple[list[int], list]:
    """Greedy tokens, and ``server``'s entries read before the engine's shutdown (which kills this process's
    children, a server started here among them: sglang.Engine.shutdown -> kill_process_tree)."""
    import sglang

    runtime = SGLANG_RUNTIME if ctx.cuda else {"device": "cpu"}
    engine = sglang.Engine(
        model_path=ctx.checkpoint,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        mem_fraction_static=0.15,
        context_length=128,
        load_format=load_format,
        model_loader_extra_config=json.dumps(extra or {}),
        log_level="error",
        **runtime,
    )
    try:
        output = engine.generate(input_ids=PROMPT_IDS, sampling_params={"temperature": 0.0, "max_new_tokens": 8})
        entries = server_entries(server) if server is not None else []
    finally:
        engine.shutdown()
    return list(output["output_ids"]), entries


def sglang_forward(ctx: StepContext) -> dict:
    tokens, _ = sglang_generate(ctx, "auto", None)
    ctx.tokens.write_text(json.dumps(tokens))
    return {"tokens": tokens}


def sglang_forward_weightcache(ctx: StepContext) -> dict:
    server = ctx.start_server()
    try:
        extra = {"mode": "daemon", "socket_dir": str(server.socket_dir), "strict": True}
        tokens, entries = sglang_generate(ctx, "weightcache", extra, server)
    finally:
        server.close()
    return same_tokens(ctx, tokens, entries)


STEPS = {
    "vllm": {
        "0-import-unstubbed": vllm_import_unstubbed,
        "1-import": vllm_import,
        "2-modules": vllm_modules,
        "3-build": vllm_build,
        "4-own-load": vllm_own_load,
        "5-weightcache": vllm_weightcache,
        "6-forward": vllm_forward,
        "7-forward-weightcache": vllm_forward_weightcache,
    },
    "sglang": {
        "0-import-unstubbed": sglang_import_unstubbed,
        "1-import": sglang_import,
        "2-modules": sglang_modules,
        "3-build": sglang_build,
        "4-own-load": sglang_own_load,
        "5-weightcache": sglang_weightcache,
        "6-forward": sglang_forward,
        "7-forward-weightcache": sglang_forward_weightcache,
    },
}


STEP_NAMES = tuple(STEPS["vllm"])
