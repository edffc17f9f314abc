"""Where the suite's CPU goes: each test's CPU seconds, its children's included (tests/conftest.py loads this).

Opt-in, for measuring: ``WEIGHTCACHE_TEST_CPU_REPORT=DIR make test`` (or pytest) writes one
JSON line per test to ``DIR/<worker>.jsonl``: the node id, the CPU seconds (user and system) of this process and of the
children it waited for, the zygote children's (tests/zygote.py counts them as it reads their status) and the zygotes'
own (read from ``/proc`` while they live), and the wall seconds, over the test's setup, call and teardown, and when it
started. CPU seconds are the measure on a shared machine: other work stretches wall time, not them (much). A child
nobody waits for (a double-forked daemon) is not counted.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest

from tests import zygote

TICK = os.sysconf("SC_CLK_TCK")


def _zygotes_cpu() -> float:
    total = 0.0
    for each in list(zygote._zygotes):
        try:
            fields = Path(f"/proc/{each.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14 and 15 of stat(5))
    return total


def _cpu() -> float:
    self_, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return self_.ru_utime + self_.ru_stime + children.ru_utime + children.ru_stime + zygote.child_cpu_seconds() + _zygotes_cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    directory = os.environ.get("WEIGHTCACHE_TEST_CPU_REPORT")
    if not directory:
        yield
        return
    cpu, start, wall = _cpu(), time.time(), time.monotonic()
    yield
    record = {
        "nodeid": item.nodeid,
        "cpu": round(_cpu() - cpu, 3),
        "wall": round(time.monotonic() - wall, 3),
        "start": round(start, 3),
    }
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(Path(directory) / f"{worker}.jsonl", "a") as out:
        out.write(json.dumps(record) + "\n")
