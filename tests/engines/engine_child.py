"""One engine process (vLLM or SGLang) loading a checkpoint through ``--load-format weightcache``, step by step.

    python -m tests.engines.engine_child --engine vllm --model DIR --steps JSON

Each step is ``{"extra": {...model_loader_extra_config...}, "out": PATH or null, "try_reload": bool, "model": PATH}``
(``model``: another checkpoint than ``--model``, for this step; vLLM also takes ``load_format``, see ``run_vllm``;
SGLang ``shutdown``, see ``run_sglang``):
a fresh engine config, the engine's own ``get_model_loader`` (the plugin
registered the format), ``load_model``; the model's parameters, buffers and
tensor attributes go to ``out`` (torch.save) and a ``WCRESULT {json}`` line to stdout describes it.
The engine's distributed state is set up once (gloo, world size 1), as a
worker does before loading.
"""

from __future__ import annotations

import argparse
import functools
import json
import socket
import sys

from tests.engines import shims

RESULT = "WCRESULT "


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", required=True, help="JSON list of steps")
    args = parser.parse_args(argv)
    shims.install()
    steps = json.loads(args.steps)
    run = run_vllm if args.engine == "vllm" else run_sglang
    run(args.model, steps)
    return 0


def emit(result: dict) -> None:
    print(RESULT + json.dumps(result, default=str), flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def describe(model, out) -> dict:
    """Where the model's tensors came from, whether they are mapped, and a copy of them in ``out``.

    Tensors: parameters, buffers and tensor attributes of modules (MLA's ``w_kc``).
    """
    import torch

    from weightcache.core.flow.modes import ATTACHMENT_ATTR
    from weightcache.core.load.export import tensor_attributes

    attachment = getattr(model, ATTACHMENT_ATTR, None)
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    attributes = {name: tensor for name, _owner, _leaf, tensor in tensor_attributes(model)}
    ranges = []
    if attachment is not None:
        for arena in attachment.arenas:
            view = arena.bytes_view()
            ranges.append((view.data_ptr(), view.data_ptr() + view.numel()))

    def mapped(tensor) -> bool:
        return any(start <= tensor.data_ptr() < end for start, end in ranges)

    every = {**params, **buffers, **attributes}
    if out:
        torch.save({name: tensor.detach().clone() for name, tensor in every.items()}, out)
    return {
        "source": "cache" if attachment is not None else "disk",
        "parameters": sorted(params),
        "buffers": sorted(buffers),
        "attributes": sorted(attributes),
        "meta": sorted(name for name, t in every.items() if t.device.type == "meta") + held_on_meta(model),
        "unmapped_parameters": sorted(name for name, t in params.items() if not mapped(t)),
        "unmapped_buffers": sorted(name for name, t in buffers.items() if not mapped(t)),
        "unmapped_attributes": sorted(name for name, t in attributes.items() if not mapped(t)),
        "entry_bytes": attachment.manifest.nbytes if attachment is not None else 0,
        "digest": attachment.digest if attachment is not None else None,
    }


def held_on_meta(model) -> list[str]:
    """Tensors on meta that modules keep in helper objects (SGLang's TopKConfig, vLLM's MoE router): ``module.helper.attr``."""
    import torch

    found = []
    for module_name, module in model.named_modules():
        for helper_name, helper in vars(module).items():
            if isinstance(helper, (torch.nn.Module, torch.Tensor, type)) or not hasattr(helper, "__dict__"):
                continue
            for attribute, value in vars(helper).items():
                if isinstance(value, torch.Tensor) and value.device.type == "meta":
                    found.append(f"{module_name}.{helper_name}.{attribute}")
    return found


def python_attributes(model) -> dict:
    """The JSON-able Python attributes engines hang on each parameter and buffer (``format_ue8m0``), by tensor name."""
    from weightcache.core.load.export import json_attributes

    named = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    return {name: json_attributes(tensor) for name, tensor in named.items() if json_attributes(tensor)}


def attempt(result: dict, load) -> object:
    try:
        return load()
    except Exception as exc:  # reported to the test, which checks the type
        result.update(error=type(exc).__name__, message=str(exc), fields=list(getattr(exc, "fields", ())))
        return None


def try_reload(result: dict, reload) -> None:
    try:
        reload()
        result["reload"] = "ok"
    except Exception as exc:
        result["reload"] = f"{type(exc).__name__}: {exc}"


def run_vllm(model_path: str, steps: list) -> None:
    """vLLM's steps; ``load_format`` (default ``weightcache``) may be ``auto``: vLLM's own ``DefaultModelLoader``; a step
    may name another checkpoint (``model``)."""
    from vllm.config import LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    from weightcache.adapters.vllm.loader import load_request
    from weightcache.core.flow.loader import prepare

    load_general_plugins()
    initialised = False
    for step in steps:
        model_config = ModelConfig(model=step.get("model", model_path), dtype="bfloat16", skip_tokenizer_init=True)
        load_format = step.get("load_format", "weightcache")
        load_config = LoadConfig(load_format=load_format, model_loader_extra_config=step.get("extra") or {})
        vllm_config = VllmConfig(model_config=model_config, load_config=load_config)
        with set_current_vllm_config(vllm_config):
            if not initialised:
                init_distributed_environment(
                    world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}", local_rank=0, backend="gloo"
                )
                ensure_model_parallel_initialized(1, 1)
                initialised = True
            loader = get_model_loader(load_config)
            result = {"loader": f"{type(loader).__module__}.{type(loader).__qualname__}"}
            if load_format == "weightcache":
                result["fingerprint"] = prepare(load_request(load_config, vllm_config, model_config)).fingerprint.digest
                result["external_before"] = loader.get_external_weight_memory(vllm_config)
            model = attempt(result, functools.partial(loader.load_model, vllm_config=vllm_config, model_config=model_config))
            if model is not None:
                result.update(describe(model, step.get("out")))
                result["python_attributes"] = python_attributes(model)
                result["external_after"] = loader.get_external_weight_memory(vllm_config)
                if step.get("try_reload"):
                    try_reload(result, functools.partial(loader.load_weights, model, model_config))
        emit(result)


def run_sglang(model_path: str, steps: list) -> None:
    """SGLang's steps; a step may name another checkpoint (``model``), as in vLLM's, and end with the engine's shutdown
    (``shutdown``).

    ``shutdown``: after the load, kill this process's whole tree with SGLang's own
    ``kill_process_tree(os.getpid(), include_parent=False)``, as ``sglang.Engine.shutdown`` does.
    """
    import os

    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.model_loader.loader import get_model_loader
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    initialised = False
    for step in steps:
        server_args = ServerArgs(
            model_path=step.get("model", model_path), device="cpu", dtype="bfloat16", load_format="weightcache"
        )
        server_args.resolve_once()
        publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
        initialize_moe_config()
        if not initialised:
            init_distributed_environment(
                world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}", local_rank=0, backend="gloo"
            )
            initialize_model_parallel()
            initialised = True
        model_config = ModelConfig.from_server_args(server_args)
        load_config = LoadConfig(load_format=server_args.load_format, model_loader_extra_config=json.dumps(step["extra"]))
        device_config = DeviceConfig("cpu", 0)
        loader = get_model_loader(load_config, model_config)
        result = {"loader": f"{type(loader).__module__}.{type(loader).__qualname__}"}
        result["fingerprint"] = attempt(result, functools.partial(sglang_digest, load_config, model_config, device_config))
        model = attempt(result, functools.partial(loader.load_model, model_config=model_config, device_config=device_config))
        if model is not None:
            result.update(describe(model, step.get("out")))
            result["preloaded_weights_bytes"] = loader.preloaded_weights_bytes
        if step.get("shutdown"):
            kill_process_tree(os.getpid(), include_parent=False, wait_timeout=60)
            result["shutdown"] = "kill_process_tree"
        emit(result)


def sglang_digest(load_config, model_config, device_config) -> str:
    """The fingerprint digest the SGLang adapter computes for these objects, before loading."""
    from weightcache.adapters.sglang.loader import load_request
    from weightcache.core.flow.loader import prepare

    return prepare(load_request(load_config, model_config, device_config)).fingerprint.digest


if __name__ == "__main__":
    sys.exit(main())
