"""Where the bytes come from is decided once (``core/flow/plan.py``): a plan made from one server exchange, executed by
the CLI, ``load_model`` and refit; nothing reads a weight file before the plan says the disk."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from weightcache.core.flow.loader import Published, plan_for, prepare, publish
from weightcache.core.request import LoadRequest

ROOT = Path(__file__).resolve().parents[2]

# Two loads of one checkpoint in one process, the second finding the entry held; the kernel's count of the bytes this
# process passed to read() (rchar, /proc/self/io: page-cache hits count) around each. The first load imported what a
# load imports, so the second's count is the load's own reads.
_TWICE = textwrap.dedent(
    """
    import sys
    from weightcache.core.cli.cli import main

    def rchar():
        with open("/proc/self/io") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))

    counts = []
    for _ in range(2):
        before = rchar()
        code = main(sys.argv[1:])
        counts.append(rchar() - before)
        assert code == 0, code
    print("READ", *counts)
    """
)


def test_the_cli_reads_no_weight_bytes_of_an_entry_held_already(minilm_dir, server, tmp_path):
    """An entry the server holds is one source the plan names: the CLI's read-ahead of the weight files never starts
    (it read the whole checkpoint while the process imported, before it learned the entry was held)."""
    weights = sum(file.stat().st_size for file in minilm_dir.glob("*.safetensors"))
    assert weights > 16 << 20, "the checkpoint must dwarf what a load reads besides its weights"
    proc = subprocess.run(
        [sys.executable, "-c", _TWICE, "load", "--model", str(minilm_dir), "--socket-dir", str(server.socket_dir)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "WEIGHTCACHE_CACHE_DIR": str(tmp_path / "digests")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, again = (int(n) for n in proc.stdout.split("READ", 1)[1].split())
    published, cached = proc.stdout.splitlines()[:2]
    assert published.startswith("published ") and cached.startswith("already cached: "), proc.stdout
    assert first >= weights, f"the first load read {first} bytes of a {weights}-byte checkpoint: rchar does not count reads"
    assert again <= 1 << 20, f"a load of an entry held already read {again} bytes (the checkpoint holds {weights})"


_CONNECTS = textwrap.dedent(
    """
    import sys
    from weightcache.core.flow.loader import plan_for, prepare
    from weightcache.core.request import LoadRequest

    prepared = prepare(LoadRequest(model=sys.argv[1]))
    prepared.remembered()
    connects = []
    sys.addaudithook(lambda event, args: connects.append(args[1]) if event == "socket.connect" else None)
    plan = plan_for(prepared, sys.argv[2])
    print("CONNECTS", len(connects), plan.describe())
    """
)


def _printed(script: str, path, socket_dir, marker: str) -> str:
    """What ``script`` (run in a fresh interpreter with ``path`` and ``socket_dir``) printed after ``marker``."""
    proc = subprocess.run(
        [sys.executable, "-c", script, str(path), str(socket_dir)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split(marker, 1)[1].strip()


def test_the_plan_is_made_from_one_server_exchange(model_dir, server, monkeypatch, tmp_path):
    """One connection, one question, whether the entry is new (the disk) or held (nothing to load)."""
    monkeypatch.setenv("WEIGHTCACHE_CACHE_DIR", str(tmp_path / "digests"))
    path = model_dir("llama")
    for state, expected in (("first sight", "from disk"), ("held", "held already: nothing to load")):
        count, described = _printed(_CONNECTS, path, server.socket_dir, "CONNECTS").split(" ", 1)
        assert (count, described) == ("1", expected), state
        publish(prepare(LoadRequest(model=str(path))), server.socket_dir)


def test_a_plan_names_each_tier_and_its_sources(model_dir, server, monkeypatch, tmp_path):
    monkeypatch.setenv("WEIGHTCACHE_CACHE_DIR", str(tmp_path / "digests"))
    prepared = prepare(LoadRequest(model=str(model_dir("llama"))))
    plan = plan_for(prepared, server.socket_dir)
    assert plan.fingerprint is None and plan.device is not None and plan.host is None
    assert [source.origin.kind for source in plan.sources] == ["disk"] and plan.reads_disk_first
    published = publish(prepared, server.socket_dir, plan=plan)
    assert published.created and published.origin.kind == "disk"
    again = plan_for(prepared, server.socket_dir)
    assert again.fingerprint == published.fingerprint and again.settled
    assert again.device is not None and again.device.digest == published.digest and again.device.held
    assert not plan_for(prepared, server.socket_dir, disk=False).reads_disk_first


def test_every_publish_returns_one_type(model_dir, server, tmp_path, monkeypatch):
    """``publish_version`` returns ``Published`` like every other publish; ``PublishedVersion`` is its old name."""
    import torch
    from safetensors.torch import load_file

    from weightcache.core.refit import PublishedVersion, publish_version

    monkeypatch.setenv("WEIGHTCACHE_CACHE_DIR", str(tmp_path / "digests"))
    path = model_dir("llama")
    publish(prepare(LoadRequest(model=str(path))), server.socket_dir)
    state = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(file))
    state = {name: tensor + torch.ones_like(tensor) for name, tensor in state.items()}
    version = publish_version(str(path), state, 1, socket_dir=server.socket_dir)
    assert type(version) is Published and PublishedVersion is Published
    assert version.version == 1 and version.created and version.origin.kind == "memory"
    assert version.manifest.tensors, "the manifest published comes back, as from every other publish"


_STAGES = textwrap.dedent(
    """
    import sys
    import torch
    from safetensors.torch import load_file
    from weightcache.core.flow.loader import prepare
    from weightcache.core.refit import stage_version
    from weightcache.core.request import LoadRequest

    path, socket_dir = sys.argv[1:3]
    prepared = prepare(LoadRequest(model=path))
    prepared.fingerprint
    state = {name: tensor + 1 for name, tensor in load_file(path + "/model.safetensors").items()}
    connects = []
    sys.addaudithook(lambda event, args: connects.append(args[1]) if event == "socket.connect" else None)
    with stage_version(prepared, state, 1, socket_dir) as staged:
        kinds = [source.origin.kind for source in staged.plan.sources]
        staging = len(connects)
        published = staged.publish()
    print("STAGED", staging, published.origin.kind, *kinds, "|", staged.plan.describe())
    """
)


def test_a_refit_executes_a_plan_made_on_the_connection_it_asks_for_versions(model_dir, server, monkeypatch, tmp_path):
    """``stage_version`` makes its plan (the trainer's tensors: no node copy, no fleet) on the one connection it asks
    the versions on, fills from it, and ``publish`` runs the plan's last step, as every publish."""
    monkeypatch.setenv("WEIGHTCACHE_CACHE_DIR", str(tmp_path / "digests"))
    path = model_dir("llama")
    assert [file.name for file in path.glob("*.safetensors")] == ["model.safetensors"]
    publish(prepare(LoadRequest(model=str(path))), server.socket_dir)
    staged = _printed(_STAGES, path, server.socket_dir, "STAGED")
    assert staged == "1 memory memory | from this process's tensors", staged
