"""What the vLLM and SGLang adapters share beside the core's mode runner: engine tables, refusals, lazy classes.

No engine is imported here.
"""

from __future__ import annotations

import contextlib
import typing

from weightcache.core.modes import ATTACHMENT_ATTR


class Registrations:
    """Keys a model build adds to an engine's process-wide tables (layer names, cached rotary embeddings).

    Daemon mode builds the model twice in one process: once to load and
    publish, once on meta to rebind. The published model's entries must go
    before the second build (the engines clear these tables themselves when
    they drop a model), or it would reuse a rotary cache whose buffers were
    freed once copied into the arenas, or refuse a duplicate layer name.
    """

    def __init__(self, tables: "typing.Iterable[dict]"):
        self.tables = tuple(tables)
        self.added: list[tuple[dict, object]] = []

    @contextlib.contextmanager
    def recorded(self):
        """Record the keys added while the block runs."""
        before = [set(table) for table in self.tables]
        try:
            yield
        finally:
            for table, keys in zip(self.tables, before, strict=True):
                self.added += [(table, key) for key in table if key not in keys]

    def forget(self) -> None:
        """Remove the recorded keys."""
        for table, key in self.added:
            table.pop(key, None)
        self.added = []


def refuse_reload(model) -> None:
    """Raise if ``model`` maps a cached entry: writing weights in place would change them for every engine attached."""
    if getattr(model, ATTACHMENT_ATTR, None) is not None:
        raise RuntimeError(
            "this model's weights are mapped from weightcache and shared read-only with other engines; "
            "reload weights in place only in a model loaded with mode 'off'"
        )


def lazy_class(namespace: dict, name: str, build):
    """``namespace[name]``, built by ``build()`` on first use: the engine is imported only then."""
    cls = namespace.get(name)
    if cls is None:
        cls = namespace[name] = build()
    return cls


def check_publishable(model) -> None:
    """Refuse a model whose post-processing emptied parameters (their weight now lives in a kernel handle held in Python).

    vLLM's CPU backend, for one, repacks linear weights into oneDNN handles and
    leaves an empty parameter behind: mapped elsewhere, it would compute with nothing.
    """
    empty = [name for name, param in model.named_parameters() if param.numel() == 0]
    if empty:
        shown = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        raise RuntimeError(
            f"post-processing left {len(empty)} parameters empty ({shown}): the engine moved these weights into "
            "Python-side kernel state that weightcache cannot share; load this model with mode 'off'"
        )
