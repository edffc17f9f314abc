"""The kit's flips: a request field or an adapter option changed to another value, against a published entry.

A flip is sound in one of two ways:

- the fingerprint changes: a client asking for the other value misses the entry
  and loads its own (the value changes what is published, and says so);
- the fingerprint stays, and a client asking for the other value attaches the
  entry and gets tensors and outputs bit-identical to its own disk load (the
  value is runtime only, and rebind re-applies it).

Anything else is the bug no other check sees: a value that changes the
published tensors but not the fingerprint (an option left out of
``ModelDescription.extra``, a request's dtype that load honours and describe
ignores). A client asking for it would attach another value's weights.

Request fields (``dtype``, ``quantization``, ``device``) may also be refused
before any weight is read (a clear error is safe); an option value the adapter
declares (``AdapterOption``) may not.
"""

from __future__ import annotations

import typing

import attrs

from weightcache.conformance.assertions import assert_same_model
from weightcache.conformance.fixtures import FP8_BLOCK, fresh, load
from weightcache.core.errors import WeightCacheError
from weightcache.core.old_paths import REMOVED_IN
from weightcache.core.socket_dir import SocketDirLike

if typing.TYPE_CHECKING:
    from weightcache.core.flow.loader import Published
    from weightcache.core.flow.plugins import Plugins
    from weightcache.core.options import AdapterOption
    from weightcache.core.request import LoadRequest, ModelDescription

REQUEST_FIELDS = ("dtype", "quantization", "device")
"""The request's own fields the kit flips (an adapter could ignore each)."""


@attrs.frozen
class Flip:
    """One changed request: ``label`` names what changed (``option 'scale' = 2.0``), ``declared`` whether the adapter declared the value."""

    label: str
    request: "LoadRequest" = attrs.field(eq=False)
    declared: bool


def field_flips(field: str, request: "LoadRequest", description: "ModelDescription", supports_fp8: bool) -> list[Flip]:
    """The flips of request field ``field`` away from what the published entry holds (empty: none possible here)."""
    if field == "dtype":
        values: list[typing.Any] = [dtype for dtype in ("bfloat16", "float32") if dtype != description.dtype][:1]
    elif field == "quantization":
        if description.quantization == "none":
            values = [FP8_BLOCK] if supports_fp8 else []
        else:
            values = ["none"] if description.quantization == FP8_BLOCK else []
    elif field == "device":
        values = [device for device in _devices() if device != str(request.device)][:1]
    else:
        raise ValueError(f"the kit flips only {', '.join(REQUEST_FIELDS)}, not {field!r}")
    return [Flip(f"{field} = {value!r}", attrs.evolve(request, **{field: value}), declared=False) for value in values]


def _devices() -> list[str]:
    import torch

    return ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])


def option_flips(request: "LoadRequest", options: "typing.Mapping[str, AdapterOption]") -> tuple[list[Flip], list[str]]:
    """Every declared option flipped to each of its other values; and a warning for each option the kit cannot flip.

    An option declared by its help text alone has no type, so no other value to flip to: the kit warns (a
    ``DeprecationWarning``) for one minor version, and fails it from the next.
    """
    flips, unflippable = [], []
    for name, option in sorted(options.items()):
        if not option.typed:
            unflippable.append(
                f"option {name!r} is declared by its help text alone, so the kit cannot flip it: declare it as "
                "AdapterOption(help, type=..., alternatives=...) (from weightcache.adapter import AdapterOption); the kit "
                f"fails an untyped option from weightcache {REMOVED_IN}"
            )
            continue
        for value in option.flips(request.option(name)):
            changed = attrs.evolve(request, options={**dict(request.options), name: value})
            flips.append(Flip(f"option {name!r} = {value!r}", changed, declared=True))
    return flips, unflippable


def judge(
    flip: Flip,
    published: "Published",
    plugins: "Plugins | None",
    socket_dir: SocketDirLike,
    run_model: "typing.Callable",
    example_inputs: typing.Any,
) -> str | None:
    """None if ``flip`` is sound (see the module docstring), else one line naming it and what to do."""
    from weightcache.core.flow.loader import prepare

    try:
        fingerprint = prepare(fresh(flip.request), plugins).fingerprint
    except Exception as exc:
        if not flip.declared and isinstance(exc, (WeightCacheError, ValueError)):
            return None  # refused before any weight was read: a clear error, never wrong weights
        return (
            f"{flip.label}: refused before loading, though the adapter declares the value "
            f"({type(exc).__name__}: {exc}); drop it from the option's alternatives or accept it"
        )
    if fingerprint.digest == published.fingerprint.digest:
        return _same_fingerprint_problem(flip, plugins, socket_dir, run_model, example_inputs)
    return None


def _same_fingerprint_problem(
    flip: Flip, plugins: "Plugins | None", socket_dir: SocketDirLike, run_model: "typing.Callable", example_inputs: typing.Any
) -> str | None:
    advice = (
        "if it changes the published tensors, put it into ModelDescription.extra (weightcache_describe); "
        "if it is runtime only, re-apply it in weightcache_rebind"
    )
    try:
        attached = load(flip.request, "client", plugins, socket_dir, strict=True)
    except Exception as exc:
        return (
            f"{flip.label} leaves the fingerprint unchanged, yet a client asking for it cannot use the published entry "
            f"({type(exc).__name__}: {exc}); {advice}"
        )
    try:
        own = load(flip.request, "off", plugins)
        try:
            assert_same_model(attached.model, own.model, run_model, example_inputs, f"{flip.label} attached", label="attached")
        finally:
            own.close()
    except AssertionError as exc:
        first = str(exc).strip().splitlines()
        detail = " ".join(line.strip() for line in first[:2])
        return (
            f"{flip.label} leaves the fingerprint unchanged, but a client asking for it attaches the published entry "
            f"and gets other weights than its own disk load ({detail}); {advice}"
        )
    finally:
        attached.close()
    return None
