"""What an engine asks for (LoadRequest) and what an adapter says of a model before loading it."""

from __future__ import annotations

import attrs

from weightcache.core.fingerprint import ParallelSpec

MODES = ("off", "daemon", "client")


def _frozen_dict(value) -> tuple:
    return tuple(sorted(dict(value or {}).items()))


@attrs.frozen
class LoadRequest:
    """One engine rank's request for a model.

    :param model: checkpoint directory (or a name the adapter resolves).
    :param adapter: adapter name, as registered in the ``weightcache.adapters`` entry points.
    :param dtype: dtype of unquantized weights (None: as the checkpoint stores them).
    :param device: ``cpu``, ``cuda`` or ``cuda:N``.
    :param quantization: method to apply when loading (``fp8-block``), None for the checkpoint's own.
    :param options: adapter options (``model_class`` for hf), as sorted key/value pairs.
    """

    model: str = attrs.field(converter=str)
    adapter: str = "hf"
    dtype: str | None = None
    device: str = "cpu"
    quantization: str | None = None
    parallel: ParallelSpec = attrs.field(factory=ParallelSpec)
    options: tuple = attrs.field(factory=tuple, converter=_frozen_dict)

    def option(self, name: str, default=None):
        return dict(self.options).get(name, default)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")


@attrs.frozen
class ModelDescription:
    """What an adapter learns from a model's configs, before reading any weight.

    :param quantization: canonical method name (``none``, ``fp8-block``, or what
        the checkpoint declares, e.g. ``awq``) — checked against the allowlist.
    :param quantization_config: the method's configuration, JSON-able.
    :param extra: further fingerprint fields (kernel backends, engine flags).
    """

    architecture: str
    config: dict
    quantization: str = "none"
    quantization_config: dict = attrs.field(factory=dict)
    adapter_version: str = "0"
    engine: str = ""
    engine_version: str = ""
    extra: dict = attrs.field(factory=dict)
