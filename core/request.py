"""What an engine asks for (LoadRequest) and what an adapter says of a model before loading it."""

from __future__ import annotations

import re
import typing

import attrs

from weightcache.core.device import Device, to_device
from weightcache.core.dtypes import dtype_name
from weightcache.core.fingerprint import ParallelSpec


def _frozen_options(value) -> tuple:
    return tuple(sorted(dict(value or {}).items()))


def _optional_dtype(value):
    return None if value in (None, "", "auto") else dtype_name(value)


def _optional_method(value):
    return None if value in (None, "") else str(value).lower()


@attrs.frozen
class LoadRequest:
    """One engine rank's request for a model, parsed and checked where it enters weightcache.

    :param model: checkpoint directory, or a hub id (``org/name``) that ``prepare`` resolves from the local
        hub cache (``weightcache.core.identity.hub``); one the cache does not hold stays as given, for the engine's own load.
    :param revision: the hub revision (branch, tag or commit) of a hub id; None: ``main``.
    :param adapter: adapter name, as registered in the ``weightcache.adapters`` entry points.
    :param dtype: dtype of unquantized weights (None: as the checkpoint stores them; the
        adapter resolves it in ``weightcache_describe``, so both spellings make one entry).
    :param device: where the weights live (see ``weightcache.core.device``).
    :param quantization: method to apply when loading (``fp8-block``), None for the checkpoint's own.
    :param parallel: this rank's place in tensor/pipeline/expert parallelism.
    :param options: adapter options (``model_class`` for hf), as sorted key/value pairs; the
        adapter declares which it takes (``weightcache_options``) and others are refused.
    :param state: per-load scratch space for the adapter, never compared or published: an engine
        integration puts its live configuration objects here, and an adapter keeps what its hooks
        share within one load (e.g. the engine objects it built for a plain disk load).
    """

    model: str = attrs.field(converter=str)
    adapter: str = "hf"
    dtype: str | None = attrs.field(default=None, converter=_optional_dtype)
    device: Device = attrs.field(default=Device("cpu"), converter=to_device)
    quantization: str | None = attrs.field(default=None, converter=_optional_method)
    parallel: ParallelSpec = attrs.field(factory=ParallelSpec)
    options: tuple = attrs.field(factory=tuple, converter=_frozen_options)
    revision: str | None = attrs.field(default=None, converter=attrs.converters.optional(str))
    state: dict = attrs.field(factory=dict, eq=False, repr=False)

    def option(self, name: str, default: typing.Any = None) -> typing.Any:
        return dict(self.options).get(name, default)

    @property
    def is_cuda(self) -> bool:
        return self.device.is_cuda


@attrs.frozen
class ModelDescription:
    """What an adapter learns from a model's configs, before reading any weight.

    :param architecture: the model class or architecture name.
    :param config: the model's configuration (hashed into the fingerprint).
    :param dtype: the dtype unquantized weights will have, resolved (the request's, else the
        checkpoint's own): one set of bytes is one entry whichever way it was asked for.
        Required: the core refuses a description without it, naming the adapter.
    :param quantization: canonical method name (``none``, ``fp8-block``, or what
        the checkpoint declares, e.g. ``awq``) — checked against the allowlist.
    :param quantization_config: the method's configuration, JSON-able.
    :param extra: further fingerprint fields: every option or engine setting that changes the
        published tensors (a scale folded into the weights, a repacking) belongs here. A runtime-only
        setting (a kernel backend that reads the same tensors) may stay out if rebind re-applies it
        from the request; the conformance kit flips each option to tell the two apart.
    """

    architecture: str
    config: dict
    dtype: str | None = attrs.field(default=None, converter=attrs.converters.optional(dtype_name))
    quantization: str = "none"
    quantization_config: dict = attrs.field(factory=dict)
    adapter_version: str = "0"
    engine: str = ""
    engine_version: str = ""
    extra: dict = attrs.field(factory=dict)

    def resolved_dtype(self) -> str:
        """``dtype``, which the core requires (``Plugins.describe`` refuses a description without one)."""
        if self.dtype is None:
            raise ValueError(f"the description of {self.architecture} names no dtype; the adapter's describe must resolve it")
        return self.dtype


@attrs.frozen
class ForwardUnavailable:
    """What ``weightcache_example_inputs`` returns when the model cannot run a forward pass here, and why.

    The conformance kit then skips its forward checks with ``reason`` (never passes them).
    """

    reason: str


def _groups(value) -> tuple:
    return tuple(tuple(str(name) for name in group) for group in value or ())


def _pairs_or_function(value) -> typing.Any:
    """A function as it is, else ``_pairs(value)``."""
    return value if callable(value) else _pairs(value)


def _renaming(value) -> typing.Any:
    """``_pairs_or_function(value)``, each pattern a regular expression that cannot match the empty string."""
    pairs = _pairs_or_function(value)
    for pattern, _replacement in () if callable(pairs) else pairs:
        try:
            empty = re.fullmatch(pattern, "") is not None
        except re.error as exc:
            raise ValueError(f"consumed_tensors pattern {pattern!r} is not a regular expression ({exc})") from None
        if empty:
            raise ValueError(
                f"consumed_tensors pattern {pattern!r} matches the empty string, so it names no tensor: "
                f"write it to match a whole tensor name, e.g. {pattern.replace('*', '+')!r}"
            )
    return pairs


def _pairs(value) -> tuple:
    """``(pattern, text)`` pairs from pairs or a mapping, each checked to be two strings."""
    items = value.items() if isinstance(value, typing.Mapping) else (value or ())
    pairs = tuple(tuple(item) for item in items)
    for pair in pairs:
        if len(pair) != 2 or not all(isinstance(part, str) for part in pair):
            raise ValueError(f"expected (pattern, text) pairs of strings, got {pair!r}")
    return pairs


@attrs.frozen
class CheckpointConventions:
    """What the conformance kit needs to know of an adapter's checkpoints (``weightcache_checkpoint_conventions``).

    :param quantization_declaration: how a checkpoint declares a quantization method, so that
        the kit can make a weightless copy declare each refused one: ``hf-config`` (transformers'
        ``quantization_config`` in ``config.json``, the default), ``none`` (the adapter has no
        such notion), ``MODULE:FUNCTION`` or a callable ``f(checkpoint_dir, method)`` that
        writes the declaration into the copy.
    :param tied: groups of tensor names that must share memory in every load (e.g.
        ``(("lm_head.weight", "embed.weight"),)``).
    :param consumed_tensors: checkpoint tensors a published tensor of another name holds, as
        ``(pattern, replacement)`` pairs: a checkpoint name matching the regular expression ``pattern``
        (whole name) is held by the published tensor ``re.sub(pattern, replacement, name)``, e.g. a fused
        projection ``(("(.*)[.][qkv]_proj[.]weight", "\\1.qkv_proj.weight"),)``; or a function
        ``f(checkpoint_name)`` giving that published name, None where it names none (the hf adapter
        asks transformers' own renaming).
    :param unused_tensors: checkpoint tensors no published tensor holds, as ``(pattern, reason)`` pairs
        (the model class never reads them; an engine's own loader maps them into its parameters).
        The kit accounts for every tensor of the checkpoint's files: published under its own name,
        consumed, or unused with a reason.
    :param unused_config: config.json fields that cannot change the published tensors, as
        ``(pattern, reason)`` pairs; ``pattern`` is a glob over the field's path (``text_config.use_cache``,
        ``*.use_cache``; a list item is its index: ``layer_types.0``). The kit changes every other scalar
        of config.json and requires another fingerprint or the same tensors and outputs.
    """

    quantization_declaration: typing.Any = "hf-config"
    tied: tuple = attrs.field(default=(), converter=_groups)
    consumed_tensors: typing.Any = attrs.field(default=(), converter=_renaming)
    unused_tensors: tuple = attrs.field(default=(), converter=_pairs)
    unused_config: tuple = attrs.field(default=(), converter=_pairs)


ExampleInputs = typing.Union[dict, tuple, typing.Any, ForwardUnavailable]  # noqa: UP007  (X | typing.Any fails on Python 3.10)
