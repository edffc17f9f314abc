"""SGLang's configuration objects for one load: the engine's own, or built here for a single-process load.

Inside SGLang, ``WeightcacheLoader`` puts the scheduler's ModelConfig,
LoadConfig and DeviceConfig, the published ServerArgs and the ranks into
``LoadRequest.state``. Without them (the conformance kit, ``weightcache load
--adapter sglang``, ``load_model(adapter="sglang")``) the hooks build them as
a scheduler would for one rank, afresh for every load: ServerArgs for the
request, published as this process's SGLang configuration (last publish
wins, as SGLang documents), and SGLang's distributed state on gloo with
world size 1, initialised once per process.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import typing

import attrs

from weightcache.adapters.sglang.identity import Ranks
from weightcache.core.fingerprint import ParallelSpec

if typing.TYPE_CHECKING:
    from weightcache.adapters.sglang.identity import DeviceConfig, LoadConfig, ModelConfig
    from weightcache.core.request import LoadRequest

log = logging.getLogger(__name__)

STATE_KEY = "sglang"
"""``LoadRequest.state`` key of the EngineConfigs."""


@attrs.frozen
class EngineConfigs:
    """SGLang's objects for one model rank.

    :param model_config: SGLang's ModelConfig.
    :param load_config: a LoadConfig for SGLang's ``auto`` format (weightcache's keys removed).
    :param device_config: SGLang's DeviceConfig.
    :param server_args: the ServerArgs SGLang published (None when it published none).
    :param ranks: this process's ranks.
    :param single_process: built here for a single-process load (not handed over by SGLang).
    """

    model_config: typing.Any
    load_config: typing.Any
    device_config: typing.Any
    server_args: typing.Any
    ranks: Ranks
    single_process: bool = False

    @classmethod
    def of_engine(cls, load_config: "LoadConfig", model_config: "ModelConfig", device_config: "DeviceConfig") -> "EngineConfigs":
        """The objects an SGLang scheduler hands its loader, with what SGLang published for this process."""
        from weightcache.adapters.sglang.identity import published_server_args

        return cls(model_config, plain_load_config(load_config), device_config, published_server_args(), Ranks.current())


def plain_load_config(load_config: "LoadConfig") -> "LoadConfig":
    """``load_config`` for SGLang's ``auto`` format, without weightcache's keys."""
    from sglang.srt.configs.load_config import LoadFormat

    return dataclasses.replace(load_config, load_format=LoadFormat.AUTO, model_loader_extra_config={})


def configs_for(request: "LoadRequest") -> EngineConfigs:
    """The request's SGLang objects: the engine's (``request.state``), else those ``start_load`` built."""
    configs = request.state.get(STATE_KEY)
    if configs is None:
        configs = start_load(request)
    return configs


def start_load(request: "LoadRequest") -> EngineConfigs:
    """The SGLang objects for a load that starts now (``weightcache_describe``): the engine's, else new ones.

    Objects built here are built again for every load, even when a caller
    reuses one request (and its ``state``) for several: a load edits its
    ModelConfig (DeepSeek's rope_type), which must not reach the next load's fingerprint.
    """
    configs = request.state.get(STATE_KEY)
    if configs is None or configs.single_process:
        configs = request.state[STATE_KEY] = single_process_configs(request)
    return configs


def single_process_configs(request: "LoadRequest") -> EngineConfigs:
    """ServerArgs, ModelConfig, LoadConfig and DeviceConfig for one rank in this process, published as a scheduler does."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig, LoadFormat
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    from weightcache.adapters.sglang.identity import check_declared_quantization

    if request.parallel != ParallelSpec():
        raise ValueError(
            f"a single-process SGLang load is one rank (tp1 pp1 ep1), not {request.parallel.label}: for tensor, pipeline "
            "or expert parallelism run SGLang itself with --load-format weightcache"
        )
    check_declared_quantization(request.model)
    gpu_id = request.device.torch_index() if request.device.is_cuda else 0
    server_args = ServerArgs(model_path=request.model, device=request.device.kind, dtype=request.dtype or "auto")
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=gpu_id))
    initialize_moe_config()
    _initialise_distributed_once(request.device.kind)
    model_config = ModelConfig.from_server_args(server_args)
    load_config = LoadConfig(load_format=LoadFormat.AUTO, download_dir=server_args.download_dir)
    return EngineConfigs(
        model_config, load_config, DeviceConfig(request.device.kind, gpu_id), server_args, Ranks.current(), single_process=True
    )


def _initialise_distributed_once(device_kind: str) -> None:
    """SGLang's process groups for world size 1 (gloo), as a scheduler sets them up before loading; once per process."""
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )

    if model_parallel_is_initialized():
        return
    backend = "gloo" if device_kind == "cpu" else "nccl"
    init_distributed_environment(
        world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{_free_port()}", local_rank=0, backend=backend
    )
    initialize_model_parallel()
    log.info("weightcache: SGLang's process groups initialised for a single-process load (%s, world size 1)", backend)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
