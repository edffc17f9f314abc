"""The vLLM objects one load works with (``VllmConfig``, ``ModelConfig``, prefix, device, ranks), carried in ``LoadRequest.state``.

Inside vLLM, ``WeightcacheModelLoader`` puts the engine's own objects there.
Without them (the conformance kit, ``weightcache load --adapter vllm``,
``load_model``, ``publish_version``) the adapter builds the load of one rank
in this process itself: a ``ModelConfig`` for the checkpoint directory, a
``VllmConfig`` at the request's tensor-parallel size, world size 1 over gloo
(NCCL on a GPU), initialised once per process as a vLLM worker does before
loading. A rank K of TP=N builds and loads with vLLM's tensor-parallel group
standing as rank K of N (``weightcache.adapters.lone_rank``): the same shard,
fingerprint and entry as rank K of a TP=N engine.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import typing

import attrs

from weightcache.adapter import ParallelSpec
from weightcache.adapters.engine_support import Registrations
from weightcache.adapters.lone_rank import quantization_declared, refuse_unproven

if typing.TYPE_CHECKING:
    import torch

    from weightcache.adapter import LoadRequest

# vLLM's objects, as typing.Any: vLLM is imported inside functions only.
VllmConfig = typing.Any  # vllm.config.VllmConfig
ModelConfig = typing.Any  # vllm.config.ModelConfig
LoadConfig = typing.Any  # vllm.config.load.LoadConfig
GroupCoordinator = typing.Any  # vllm.distributed.parallel_state.GroupCoordinator

STATE_KEY = "vllm"
"""The key of the engine objects in ``LoadRequest.state``."""


@attrs.frozen
class Ranks:
    """This process's place in vLLM's parallel groups."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0

    @classmethod
    def current(cls) -> "Ranks":
        """The ranks of vLLM's initialised process groups (the worker has set them up before loading)."""
        from vllm.distributed import (
            get_dp_group,
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        pp, dp, ep = get_pp_group(), get_dp_group(), expert_group()
        return cls(
            tp_size=get_tensor_model_parallel_world_size(),
            tp_rank=get_tensor_model_parallel_rank(),
            pp_size=pp.world_size,
            pp_rank=pp.rank_in_group,
            dp_size=dp.world_size,
            dp_rank=dp.rank_in_group,
            ep_size=ep.world_size if ep is not None else 1,
            ep_rank=ep.rank_in_group if ep is not None else 0,
        )

    @property
    def parallel(self) -> ParallelSpec:
        """The fingerprint's part of these ranks (the DP rank is left out: replicas share an entry)."""
        return ParallelSpec(**{field.name: getattr(self, field.name) for field in attrs.fields(ParallelSpec)})


def expert_group() -> GroupCoordinator | None:
    """vLLM's expert-parallel group, or None: vLLM creates it only for MoE models with expert parallelism."""
    from vllm.distributed import get_ep_group

    try:
        return get_ep_group()
    except AssertionError:  # vLLM's public getter asserts that the group exists
        return None


@attrs.define
class EngineObjects:
    """What vLLM hands its model loader, plus the ranks and this load's entries in vLLM's per-config tables.

    :param device: where the weights go (``torch.device``, with its index on a GPU).
    :param draft: whether ``model_config`` is the speculative draft.
    """

    vllm_config: typing.Any
    model_config: typing.Any
    device: "torch.device"
    ranks: Ranks
    prefix: str = ""
    draft: bool = False
    alone: bool = False
    """Built here for one rank loaded in this process (not handed over by vLLM): at TP>1 its builds and loads run
    with vLLM's tensor-parallel group as that rank of the engine's (``current``)."""
    registrations: Registrations = attrs.field(init=False)

    def __attrs_post_init__(self):
        # Attention and MoE layers register under their names in the config's forward context.
        self.registrations = Registrations([self.vllm_config.compilation_config.static_forward_context])

    @contextlib.contextmanager
    def current(self) -> typing.Iterator[None]:
        """``set_current_vllm_config`` (vLLM's layers read the current config while they are built); for a rank of
        TP>1 loaded alone, vLLM's tensor-parallel group is that rank's place in the engine's meanwhile."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), self.as_rank():
            yield

    def as_rank(self) -> contextlib.AbstractContextManager:
        """For a rank of TP>1 loaded alone: vLLM's tensor-parallel group (world size 1 here) replaced by one standing
        as that rank of the engine's (``LoneRank``) while the block runs; else nothing."""
        if not self.alone or self.ranks.tp_size == 1:
            return contextlib.nullcontext()
        from vllm.distributed import get_tp_group

        from weightcache.adapters.lone_rank import LoneRank
        from weightcache.adapters.vllm.internals import TP_GROUP

        return TP_GROUP.replaced(LoneRank(get_tp_group(), self.ranks.tp_size, self.ranks.tp_rank))


_BUILDING = threading.Lock()
"""Held while single-process objects are built: vLLM's process groups are process-wide, initialised once (a load
may describe its model while another thread warms the adapter up)."""


def engine_objects(request: "LoadRequest") -> EngineObjects:
    """The engine objects of ``request`` (built for a plain single-process load, once per request, when absent)."""
    with _BUILDING:
        objects = request.state.get(STATE_KEY)
        if objects is None:
            objects = request.state[STATE_KEY] = standalone_objects(request)
        return objects


def standalone_objects(request: "LoadRequest") -> EngineObjects:
    """vLLM's objects for loading one rank of ``request.model`` in this process alone (world size 1): the whole
    model, or rank K of a tensor-parallel size N (``request.parallel``)."""
    from vllm.config import LoadConfig, ModelConfig, ParallelConfig, VllmConfig

    parallel = request.parallel
    if attrs.evolve(parallel, tp_size=1, tp_rank=0) != ParallelSpec():
        raise ValueError(
            f"the vllm adapter loads {parallel.label} only inside a vLLM engine (--load-format weightcache); "
            "on its own it loads one tensor-parallel rank (tpK/N pp0/1 ep0/1)"
        )
    device = request.device.torch()
    model_config = ModelConfig(model=request.model, dtype=request.dtype or "auto", skip_tokenizer_init=True)
    quantization = request.quantization or quantization_declared(model_config.hf_config)
    refuse_unproven("vllm", model_config.architectures, parallel.tp_size, parallel.tp_rank, quantization)
    load_config = LoadConfig(load_format="auto", device=str(device))
    vllm_config = VllmConfig(
        model_config=model_config,
        load_config=load_config,
        parallel_config=ParallelConfig(tensor_parallel_size=parallel.tp_size),
    )
    init_single_process(device)
    ranks = Ranks(tp_size=parallel.tp_size, tp_rank=parallel.tp_rank)
    return EngineObjects(vllm_config, model_config, device, ranks, alone=True)


def init_single_process(device: "torch.device") -> None:
    """vLLM's process groups for world size 1, once per process (a worker does this before loading).

    They are made for no model in particular, so that the expert-parallel group
    exists too (vLLM makes it only for MoE models): later loads in this process
    may be of any model, dense or MoE.
    """
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            local_rank=0 if device.index is None else device.index,
            backend="gloo" if device.type == "cpu" else "nccl",
        )
        ensure_model_parallel_initialized(1, 1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
