"""Bulk object creation without the cyclic garbage collector's passes over the whole heap."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for the block (it is re-enabled after, if it was enabled).

    Making tens of thousands of tensors and Parameters triggers full collections that walk
    every object of the process again and again: at tens of thousands of tensors they cost more
    than the tensors themselves.
    The objects made form no cycles, so nothing is left for the collector to free later.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
