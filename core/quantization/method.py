"""A quantization method as a plugin: one protocol (:class:`QuantizationMethod`), one module per method, one registry.

A method accepts or refuses a load (``accept``: the config it quantizes with, which the fingerprint hashes), quantizes
a loaded model's tensors (``quantize``), describes what a rebind needs of the quantized layout (``layout``, kept in the
entry's manifest) and rebuilds its layers on a meta skeleton so the mapped weights and scales rebind (``rebind``);
``load_stored`` binds a checkpoint stored in the method as it is. The built-ins are ``none`` (``none.py``) and
``fp8-block`` (``fp8_block.py``); an installed package adds one through the ``weightcache.quantization`` entry-point
group (``name = "module:Class"``), and adapters ask :func:`quantization_method` for it by name. Methods nobody registered are
refused with the reason the table of refusals (``methods.py``) gives.
"""

from __future__ import annotations

import abc
import functools
import typing

from weightcache.core import entry_points
from weightcache.core.errors import UnsupportedQuantization

if typing.TYPE_CHECKING:
    import torch

ENTRY_POINT_GROUP = "weightcache.quantization"

BUILTIN: typing.Final[dict[str, str]] = {
    "none": "weightcache.core.quantization.none:NoQuantization",
    "fp8-block": "weightcache.core.quantization.fp8_block:Fp8Block",
}
"""The built-in methods, as ``module:class``; outside packages add theirs through :data:`ENTRY_POINT_GROUP`."""


class QuantizationMethod(abc.ABC):
    """One way to store a model's weights that weightcache caches as raw bytes; ``name`` is its registry key."""

    name: typing.ClassVar[str]
    convertible: typing.ClassVar[str] = ""
    """Which layers the method converts, said when a model has none of them."""

    def declared_by(self, quantization_config: typing.Mapping[str, typing.Any]) -> bool:
        """Whether a checkpoint's ``quantization_config`` (Hugging Face's spelling) declares this method."""
        return False

    @abc.abstractmethod
    def accept(self, declared: typing.Mapping[str, typing.Any] | None, options: typing.Mapping[str, typing.Any]) -> dict:
        """Accept a load with this method: the config it quantizes with (JSON; the fingerprint hashes it), or raise
        UnsupportedQuantization to refuse it.

        :param declared: the checkpoint's ``quantization_config`` when it is stored in this method, None when the
            model is quantized while loading.
        :param options: the adapter's options for the load (``block_size``, ``exclude``, ...).
        """

    @abc.abstractmethod
    def quantize(self, model: "torch.nn.Module", config: typing.Mapping[str, typing.Any]) -> list[str]:
        """Quantize ``model``'s tensors in place, as ``config`` says; the names of the modules converted."""

    def layout(self, model: "torch.nn.Module") -> dict:
        """What a rebind needs of ``model``'s quantized layout beyond the tensors' names (kept in the manifest's
        ``extra``); empty when ``model`` holds none of the method's layers."""
        return {}

    def rebind(self, model: "torch.nn.Module", names: typing.Iterable[str], layout: typing.Mapping[str, typing.Any]) -> list[str]:
        """Turn the modules of a meta skeleton whose quantized tensors an entry holds (``names``, every tensor's) into
        the method's layers, so its weights and scales rebind; the names of the modules converted."""
        return []

    def load_stored(
        self,
        model: "torch.nn.Module",
        tensors: typing.Mapping[str, "torch.Tensor"],
        config: typing.Mapping[str, typing.Any],
    ) -> list[str]:
        """Bind a checkpoint stored in this method as it is stored (never quantized again); the modules converted."""
        raise UnsupportedQuantization(self.name, "a checkpoint stored in this method cannot be loaded as it is stored")


@functools.cache
def table() -> dict[str, str]:
    """Each registered method's name and the ``module:class`` that holds it (read once a process; nothing imported)."""
    return entry_points.registered(ENTRY_POINT_GROUP, BUILTIN)


@functools.cache
def _made(name: str) -> QuantizationMethod:
    where = table()[name]
    made = entry_points.load(where)
    instance = made() if isinstance(made, type) else made
    if not isinstance(instance, QuantizationMethod) or instance.name != name:
        raise TypeError(f"{ENTRY_POINT_GROUP} entry point {name!r} ({where}) is not a QuantizationMethod named {name!r}")
    return instance


def quantization_names() -> tuple[str, ...]:
    """The registered methods' names (nothing imported)."""
    return tuple(table())


def quantization_methods() -> dict[str, QuantizationMethod]:
    """Every registered method by name: the built-ins and the installed packages'."""
    return {name: _made(name) for name in table()}


def quantization_method(name: str | None) -> QuantizationMethod:
    """The registered method ``name`` (None: ``none``; any case); UnsupportedQuantization with the reason for one
    nobody registered."""
    from weightcache.core.quantization.methods import method_named

    canonical = (name or "none").lower()
    if canonical not in table():
        raise UnsupportedQuantization(canonical, method_named(canonical).refused)
    return _made(canonical)


def declared_quantization(quantization_config: typing.Mapping[str, typing.Any] | None) -> str:
    """The method a checkpoint's ``quantization_config`` declares: a registered one's name if one claims it, else the
    config's own ``quant_method`` (``none`` without a config)."""
    if not quantization_config:
        return "none"
    for name, found in quantization_methods().items():
        if found.declared_by(quantization_config):
            return name
    return str(quantization_config.get("quant_method", "unknown")).lower()
