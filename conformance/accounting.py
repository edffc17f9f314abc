"""Every tensor of the checkpoint's files accounted for: published, consumed by a published tensor, or unused with a reason.

A tensor the model keeps outside its parameters and buffers (a plain dict or
list attribute) never reaches export: a client rebinds the model without it and
computes with whatever ``__init__`` put there. One process cannot see it when the
example inputs never reach the code that reads it, so the kit reads the names of
the checkpoint's tensors from the safetensors headers and requires each to be
in the published manifest, held by a published tensor of another name (the
adapter's ``CheckpointConventions.consumed_tensors``: a fused projection, a
quantization scale folded in), or declared unused with a reason
(``CheckpointConventions.unused_tensors``).
"""

from __future__ import annotations

import re
import typing

if typing.TYPE_CHECKING:
    from weightcache.core.layout.manifest import Manifest
    from weightcache.core.request import CheckpointConventions

ADVICE = (
    "register it on the model as a parameter or buffer (a tensor in a plain dict or list attribute is never "
    "published, and a client computes with its __init__ values); if a published tensor of another name holds it "
    "(a fused projection, a folded scale), declare it in CheckpointConventions.consumed_tensors; if the model never "
    "reads it, declare it in CheckpointConventions.unused_tensors with the reason (weightcache_checkpoint_conventions)"
)


def published_names(manifest: "Manifest") -> set[str]:
    """The names a client can rebind: every tensor of the manifest and every alias."""
    return {record.name for record in manifest.tensors} | set(manifest.aliases)


def unaccounted(
    checkpoint_names: "typing.Iterable[tuple[str, str]]", published: set[str], conventions: "CheckpointConventions"
) -> list[str]:
    """One problem per checkpoint tensor ``(name, where)`` not accounted for, naming it and what to do."""
    holder_of = consumer(conventions.consumed_tensors)
    unused = [re.compile(pattern) for pattern, _ in conventions.unused_tensors]
    problems = []
    for name, where in checkpoint_names:
        if name in published or any(pattern.fullmatch(name) for pattern in unused):
            continue
        holder = holder_of(name)
        if holder is None:
            problems.append(f"{name} ({where}) is neither published, nor consumed by a published tensor, nor declared unused")
        elif holder not in published:
            problems.append(f"{name} ({where}) is declared consumed by {holder}, which is not published")
    return problems


def consumer(declared: typing.Any) -> "typing.Callable[[str], str | None]":
    """``f(checkpoint_name)`` -> the published tensor holding it, or None: the adapter's function, or its regex pairs applied."""
    if callable(declared):
        return declared
    rules = [(re.compile(pattern), replacement) for pattern, replacement in declared]

    def holder(name: str) -> str | None:
        # The whole name's match expanded, never re.sub: a pattern's empty match at the end would be replaced again.
        return next((match.expand(replacement) for pattern, replacement in rules if (match := pattern.fullmatch(name))), None)

    return holder
