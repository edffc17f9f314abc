"""Whether another thread of this process is importing (an adapter's warm-up): the reader then reads whole pieces.

Each of the block mode's reads returns to the interpreter lock, and while a thread imports each such return waits:
512 KiB blocks slowed a read beside transformers' imports from 8.92 s to 13.15 s, and the imports by half (decision
49). This module imports nothing heavy, so a command that ends before its load (no server, a cached entry) has not
imported the reader.
"""

from __future__ import annotations

import contextlib
import threading
import typing

_count = 0
_lock = threading.Lock()


@contextlib.contextmanager
def importing() -> typing.Iterator[None]:
    """Mark a stretch in which this thread imports; a read that starts meanwhile takes whole pieces."""
    global _count
    with _lock:
        _count += 1
    try:
        yield
    finally:
        with _lock:
            _count -= 1


def under_way() -> bool:
    """Whether some thread is inside :func:`importing` now."""
    return _count > 0
