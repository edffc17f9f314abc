"""SGLang's configuration objects for one load: the engine's own, or built here for a single-process load.

Inside SGLang, ``WeightcacheLoader`` puts the scheduler's ModelConfig,
LoadConfig and DeviceConfig, the published ServerArgs and the ranks into
``LoadRequest.state``. Without them (the conformance kit, ``weightcache load
--adapter sglang``, ``load_model(adapter="sglang")``, ``publish_version``) the
hooks build them as a scheduler would for one rank, afresh for every load:
ServerArgs for the request (its tensor-parallel size), published as this
process's SGLang configuration with this rank's place (last publish wins, as
SGLang documents), and SGLang's distributed state on gloo with world size 1,
initialised once per process. A rank K of TP=N builds and loads with SGLang's
tensor-parallel groups standing as rank K of N (``EngineObjects.as_rank``,
``weightcache.adapters.lone_rank``): the same shard, fingerprint and entry as
rank K of a TP=N engine.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import typing

import attrs

from weightcache.adapter import ParallelSpec
from weightcache.adapters import engine_quantization
from weightcache.adapters.lone_rank import quantization_declared, refuse_unproven

if typing.TYPE_CHECKING:
    from weightcache.adapter import LoadRequest

log = logging.getLogger(__name__)

STATE_KEY = "sglang"
"""``LoadRequest.state`` key of the EngineObjects."""

# SGLang's configuration objects, as typing.Any: SGLang is imported inside functions only.
ModelConfig = typing.Any  # sglang.srt.configs.model_config.ModelConfig
LoadConfig = typing.Any  # sglang.srt.configs.load_config.LoadConfig
DeviceConfig = typing.Any  # sglang.srt.configs.device_config.DeviceConfig
ServerArgs = typing.Any  # sglang.srt.server_args.ServerArgs


@attrs.frozen
class Ranks:
    """This process's place in SGLang's parallel layout (``runtime_context.get_parallel()``)."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    dp_size: int = 1
    moe_ep_size: int = 1
    moe_ep_rank: int = 0
    moe_dp_size: int = 1
    moe_dp_rank: int = 0
    attn_dp_size: int = 1
    attn_cp_size: int = 1
    enable_dp_lm_head: bool = False
    moe_dense_tp_size: int | None = None

    @classmethod
    def current(cls) -> "Ranks":
        """The ranks SGLang published for this process (the scheduler does so before loading)."""
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        return cls(**{field.name: getattr(parallel, field.name) for field in attrs.fields(cls)})

    @property
    def parallel(self) -> ParallelSpec:
        return ParallelSpec(
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            pp_size=self.pp_size,
            pp_rank=self.pp_rank,
            dp_size=self.dp_size,
            ep_size=self.moe_ep_size,
            ep_rank=self.moe_ep_rank,
        )


def published_server_args() -> ServerArgs | None:
    """The ServerArgs SGLang published for this process, or None."""
    from sglang.srt.runtime_context import get_server_args

    try:
        return get_server_args()
    except (AttributeError, ValueError, RuntimeError):
        return None


@attrs.frozen
class EngineObjects:
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

    def as_rank(self) -> typing.ContextManager:
        """For a rank of TP>1 loaded alone (``single_process``): SGLang's tensor-parallel widths, ranks and groups
        as that rank's place in the engine's, while the block builds, loads or rebinds; else nothing."""
        import contextlib

        if not self.single_process or self.ranks.tp_size == 1:
            return contextlib.nullcontext()
        return lone_rank(self.ranks.tp_size, self.ranks.tp_rank)

    @classmethod
    def of_engine(cls, load_config: "LoadConfig", model_config: "ModelConfig", device_config: "DeviceConfig") -> "EngineObjects":
        """The objects an SGLang scheduler hands its loader, with what SGLang published for this process."""
        return cls(model_config, plain_load_config(load_config), device_config, published_server_args(), Ranks.current())


TP_GROUPS = ("tp", "attn_tp", "moe_tp")
"""SGLang's groups that span the tensor-parallel ranks when neither attention nor MoE layers are split otherwise
(the one layout a rank loaded alone takes): each is ``NAME_group`` with ``NAME_size`` and ``NAME_rank``."""


def lone_rank(size: int, rank: int) -> typing.ContextManager:
    """SGLang's tensor-parallel widths, ranks and groups (world size 1 here) as rank ``rank`` of ``size``."""
    from sglang.srt.runtime_context import get_parallel

    from weightcache.adapters.lone_rank import LoneRank

    parallel = get_parallel()
    groups = {f"{name}_group": LoneRank(getattr(parallel, f"{name}_group"), size, rank) for name in TP_GROUPS}
    return parallel.override(**tp_widths(size, rank), **groups)


def tp_widths(size: int, rank: int) -> dict[str, int]:
    """``NAME_size`` and ``NAME_rank`` of each of ``TP_GROUPS``, as SGLang's parallel context names them."""
    return {f"{name}_size": size for name in TP_GROUPS} | {f"{name}_rank": rank for name in TP_GROUPS}


def publish_rank(server_args: "ServerArgs", parallel: ParallelSpec, gpu_id: int) -> None:
    """Publish ``server_args`` as this process's SGLang configuration, with the place of ``parallel``'s rank.

    Once the process's groups (world size 1) are built, SGLang checks every publish against them: the publish then
    runs with them standing as that rank of the request's tensor-parallel size (``lone_rank``)."""
    import contextlib

    from sglang.srt.distributed.parallel_state import model_parallel_is_initialized
    from sglang.srt.runtime_context import SpawnRanks, publish

    scope = lone_rank(parallel.tp_size, parallel.tp_rank) if model_parallel_is_initialized() else contextlib.nullcontext()
    with scope:
        publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=parallel.tp_rank, gpu_id=gpu_id))


def plain_load_config(load_config: "LoadConfig") -> "LoadConfig":
    """``load_config`` for SGLang's ``auto`` format, without weightcache's keys."""
    from sglang.srt.configs.load_config import LoadFormat

    return dataclasses.replace(load_config, load_format=LoadFormat.AUTO, model_loader_extra_config={})


_BUILDING = threading.RLock()
"""Held while single-process objects are built: ``weightcache load`` warms the adapter up (``engine_objects``) in a
thread beside the one that describes the model (``start_load``), and SGLang's process groups, its published
ServerArgs and MoE config are process-wide: two builds at once initialised the groups twice."""


def engine_objects(request: "LoadRequest") -> EngineObjects:
    """The request's SGLang objects: the engine's (``request.state``), else those ``start_load`` built."""
    with _BUILDING:
        configs = request.state.get(STATE_KEY)
        if configs is None:
            configs = start_load(request)
        return configs


def start_load(request: "LoadRequest") -> EngineObjects:
    """The SGLang objects for a load that starts now (``weightcache_describe``): the engine's, else new ones.

    Objects built here are built again for every load, even when a caller
    reuses one request (and its ``state``) for several: a load edits its
    ModelConfig (DeepSeek's rope_type), which must not reach the next load's fingerprint.
    """
    with _BUILDING:
        configs = request.state.get(STATE_KEY)
        if configs is None or configs.single_process:
            configs = request.state[STATE_KEY] = standalone_objects(request)
        return configs


def standalone_objects(request: "LoadRequest") -> EngineObjects:
    """ServerArgs, ModelConfig, LoadConfig and DeviceConfig for one rank in this process, published as a scheduler does."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig, LoadFormat
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.server_args import ServerArgs

    parallel = request.parallel
    if attrs.evolve(parallel, tp_size=1, tp_rank=0) != ParallelSpec():
        raise ValueError(
            f"a single-process SGLang load is one tensor-parallel rank (tpK/N pp0/1 ep0/1), not {parallel.label}: for "
            "pipeline or expert parallelism run SGLang itself with --load-format weightcache"
        )
    engine_quantization.declared_method(request.model)  # refused before SGLang parses it (its own error would differ)
    gpu_id = request.device.torch_index() if request.device.is_cuda else 0
    server_args = ServerArgs(
        model_path=request.model, device=request.device.kind, dtype=request.dtype or "auto", tp_size=parallel.tp_size
    )
    publish_rank(server_args, parallel, gpu_id)
    initialize_moe_config()
    _initialise_distributed_once(request.device.kind)
    model_config = ModelConfig.from_server_args(server_args)
    quantization = request.quantization or quantization_declared(model_config.hf_config)
    refuse_unproven("sglang", model_config.hf_config.architectures, parallel.tp_size, parallel.tp_rank, quantization)
    load_config = LoadConfig(load_format=LoadFormat.AUTO, download_dir=server_args.download_dir)
    model_config = as_model_runner_adjusts(model_config, load_config, request.device.kind, tp_size=parallel.tp_size)
    return EngineObjects(
        model_config, load_config, DeviceConfig(request.device.kind, gpu_id), server_args, Ranks.current(), single_process=True
    )


CPU_CONFIG_FIELDS = ("original_num_attention_heads", "original_total_num_kv_heads")
"""The fields SGLang's ModelRunner adds to a model's HF config on the CPU before it loads (whatever the TP size); it
also pads head counts and intermediate sizes the TP size does not divide. ``tests/engines/test_sglang.py`` fails when
an SGLang release changes this list or the step that makes it."""


def as_model_runner_adjusts(
    model_config: "ModelConfig", load_config: "LoadConfig", device_kind: str, tp_size: int
) -> "ModelConfig":
    """``model_config`` as SGLang's ModelRunner edits it before it loads (on the CPU: ``adjust_config_with_unaligned_cpu_tp``).

    The engine's own load fingerprints the edited config; a load outside the engine (``weightcache load``,
    ``load_model``, ``publish_version``) must fingerprint, and load, the same one.
    """
    if device_kind != "cpu":
        return model_config
    from sglang.srt.configs.update_config import adjust_config_with_unaligned_cpu_tp

    return adjust_config_with_unaligned_cpu_tp(model_config, load_config, tp_size)


def _initialise_distributed_once(device_kind: str) -> None:
    """SGLang's process groups for world size 1 (gloo), as a scheduler sets them up before loading; once per process."""
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.srt.runtime_context import get_parallel

    if model_parallel_is_initialized():
        return
    backend = "gloo" if device_kind == "cpu" else "nccl"
    with get_parallel().override(**tp_widths(1, 0)):  # whatever rank this load is for, the process itself is world size 1
        init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{_free_port()}", local_rank=0, backend=backend
        )
        initialize_model_parallel()
    log.info("weightcache: SGLang's process groups initialised for a single-process load (%s, world size 1)", backend)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
