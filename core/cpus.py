"""How many CPUs this process may run on: what sizes thread pools and decides whether a helper process pays."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which a container or ``taskset`` narrows), else the
    machine's count, at least 1."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
