"""Hub ids (``org/name``, a revision) work wherever a path does, resolved offline from a local hub cache as transformers does.

Each test builds a hub cache layout of its own (``models--org--name/snapshots/<commit>``, ``refs/main``)
under a temporary ``HF_HUB_CACHE`` with ``HF_HUB_OFFLINE=1``; nothing is downloaded. Loads run in fresh
processes, since huggingface_hub reads its cache directory when it is imported.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.core.test_cli import cli
from tests.helpers import run_python, wait_until
from weightcache.core.client.client import Connection

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def add_to_hub_cache(cache: Path, repo_id: str, checkpoint: Path, commit: str = COMMIT, ref: str = "main") -> Path:
    """Lay ``checkpoint``'s files out as huggingface_hub caches them (blobs linked from a snapshot) under ``cache``."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in checkpoint.iterdir():
        blob = repo / "blobs" / f"{commit[:8]}-{file.name}"
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def hub_env(cache: Path) -> dict:
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, model_dir) -> Path:
    """One hub cache for the module: the tests only read it, and their children then share one environment, so all
    but the first are forked from one test zygote (tests/zygote.py) instead of a fresh interpreter or zygote per test."""
    cache = tmp_path_factory.mktemp("hub")
    add_to_hub_cache(cache, "org/tiny", model_dir("llama"))
    add_to_hub_cache(cache, "org/tiny", model_dir("llama"), commit=OTHER, ref="v2")
    return cache


def resolve_in_child(cache: Path, model: str, revision: str | None = None) -> dict:
    code = textwrap.dedent(
        """
        import json, sys
        from weightcache.core.identity.hub import resolve
        where = resolve(sys.argv[1], sys.argv[2] or None)
        print(json.dumps({"path": where.path, "cached": where.cached, "commit": where.commit}))
        """
    )
    proc = run_python(code, model, revision or "", env=hub_env(cache))
    return json.loads(proc.stdout)


def test_a_hub_id_resolves_to_the_snapshot_huggingface_hub_itself_finds(hub_cache):
    main = resolve_in_child(hub_cache, "org/tiny")
    assert main["cached"] and main["commit"] == COMMIT and Path(main["path"]).parent.name == "snapshots"
    assert resolve_in_child(hub_cache, "org/tiny", "v2")["commit"] == OTHER
    assert resolve_in_child(hub_cache, "org/tiny", OTHER)["commit"] == OTHER
    assert not resolve_in_child(hub_cache, "org/tiny", "v3")["cached"]
    assert not resolve_in_child(hub_cache, "org/absent")["cached"]


def test_a_local_path_is_never_taken_for_a_hub_id(tmp_path, monkeypatch):
    from weightcache.core.identity.hub import looks_like_hub_id, resolve

    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    assert not looks_like_hub_id("org/tiny") and looks_like_hub_id("org/other")
    assert not looks_like_hub_id("model.safetensors") and not looks_like_hub_id("./x")
    assert resolve("org/tiny").path == "org/tiny"
    with pytest.raises(ValueError, match="applies to hub ids"):
        resolve("org/tiny", "main")


def test_load_takes_a_hub_id_and_labels_the_entry_with_its_snapshot(hub_cache, server):
    run = cli("load", "--model", "org/tiny", "--revision", "v2", "--socket-dir", str(server.socket_dir), env=hub_env(hub_cache))
    assert run.code == 0, run
    assert f"org/tiny@{OTHER[:12]} (LlamaForCausalLM, hf)" in run.stdout, run.stdout
    again = cli(
        "load", "--model", "org/tiny", "--revision", OTHER, "--socket-dir", str(server.socket_dir), env=hub_env(hub_cache)
    )
    assert again.code == 0 and again.stdout.startswith("already cached"), again


def test_load_of_a_hub_id_the_cache_lacks_is_one_line(hub_cache, socket_dir):
    run = cli("load", "--model", "org/absent", "--socket-dir", str(socket_dir), env=hub_env(hub_cache))
    assert run.code == 1 and run.stderr == [
        f"weightcache: error: org/absent is no directory here and not in the local hub cache ({hub_cache}); download it first "
        "(`hf download org/absent`), point HF_HUB_CACHE or HF_HOME at the cache that holds it, or pass the checkpoint directory"
    ], run


_CLIENT = """
import sys, logging
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
from weightcache.core.flow.modes import load_model
loaded = load_model(sys.argv[1], mode=sys.argv[2], socket_dir=sys.argv[3])
print(loaded.source, loaded.fallback_reason is not None, type(loaded.model).__name__)
"""


def test_client_mode_attaches_a_hub_id_the_loader_published(hub_cache, server):
    assert cli("load", "--model", "org/tiny", "--socket-dir", str(server.socket_dir), env=hub_env(hub_cache)).code == 0
    proc = run_python(_CLIENT, "org/tiny", "client", str(server.socket_dir), env=hub_env(hub_cache))
    assert proc.stdout.split() == ["cache", "False", "LlamaForCausalLM"], proc.stderr


_OFFLINE_CHILD = """
import json, socket, sys, time
attempts = []
def refuse(*args, **kwargs):
    attempts.append(repr(args)[:80])
    raise OSError("this test allows no network access")
_connect = socket.socket.connect
def connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6):
        refuse(address)
    return _connect(self, address)
socket.socket.connect = connect
socket.getaddrinfo = refuse
import huggingface_hub  # its import is no part of the answer's time
from weightcache.core.flow.modes import load_model
began = time.monotonic()
try:
    load_model(sys.argv[1], mode=sys.argv[2], socket_dir=sys.argv[3])
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - began, "attempts": attempts}))
"""


@pytest.mark.parametrize("mode", ["off", "client", "daemon"])
def test_load_model_of_a_hub_id_an_empty_cache_lacks_is_the_clis_one_line_at_once_offline(mode, tmp_path, socket_dir):
    """HOME and HF_HOME empty, no HF_HUB_OFFLINE: still no request, no retry, no huggingface_hub traceback."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "TRANSFORMERS_", "HUGGINGFACE"))}
    env.update(HOME=str(tmp_path / "home"), HF_HOME=str(tmp_path / "hf"))
    (tmp_path / "home").mkdir()
    (tmp_path / "hf").mkdir()
    began = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _OFFLINE_CHILD, "org/absent", mode, str(socket_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.stdout, proc.stderr
    outcome = json.loads(proc.stdout)
    line = subprocess.run(
        [sys.executable, "-m", "weightcache.core.cli.cli", "load", "--model", "org/absent", "--socket-dir", str(socket_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    ).stderr.splitlines()
    assert line == [f"weightcache: error: {outcome['message']}"] and outcome["error"] == "ModelNotCached"
    assert f"({tmp_path / 'hf' / 'hub'})" in outcome["message"], outcome["message"]
    assert outcome["attempts"] == [] and "Traceback" not in proc.stderr, proc.stderr
    assert outcome["seconds"] < 10 and time.monotonic() - began < 60, outcome  # at once: no retries, no timeouts


@pytest.mark.parametrize("mode", ["client", "daemon"])
def test_a_bin_only_checkpoint_falls_back_to_the_engines_load_with_one_line(mode, tmp_path, model_dir, server):
    source, target = model_dir("llama"), tmp_path / "bin-only"
    target.mkdir()
    shutil.copyfile(source / "config.json", target / "config.json")
    import safetensors.torch
    import torch

    # The older format transformers still reads: a pickled state dict (written here; the engine runs in a child).
    torch.save(safetensors.torch.load_file(source / "model.safetensors"), target / "pytorch_model.bin")
    assert not list((tmp_path / "bin-only").glob("*.safetensors"))
    proc = run_python(_CLIENT, str(tmp_path / "bin-only"), mode, str(server.socket_dir))
    assert proc.stdout.split() == ["disk", "True", "LlamaForCausalLM"], proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING weightcache")]  # transformers warns too
    assert len(warnings) == 1 and "holds no *.safetensors file" in warnings[0], proc.stderr


def test_a_checkpoint_weightcache_cannot_read_falls_back_in_daemon_mode(tmp_path, model_dir, socket_dir):
    """A tensor of a dtype weightcache does not handle (U32) beside the weights: transformers loads it, weightcache not."""
    target = tmp_path / "u32"
    shutil.copytree(model_dir("llama"), target)
    import safetensors.torch
    import torch

    tensors = safetensors.torch.load_file(target / "model.safetensors")
    tensors["extra_counter"] = torch.zeros(4, dtype=torch.uint32)
    safetensors.torch.save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    proc = run_python(_CLIENT, str(target), "daemon", str(socket_dir))
    assert proc.stdout.split() == ["disk", "True", "LlamaForCausalLM"], proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING weightcache")]  # transformers warns too
    assert len(warnings) == 1 and "which weightcache does not handle" in warnings[0], proc.stderr
    with Connection(socket_dir) as connection:  # the server daemon mode started counted the engine's report
        status = connection.status()
    assert status["metrics"]["fallbacks"]["not_cacheable"] == 1 and status["entries"] == []
    os.kill(status["pid"], signal.SIGTERM)  # daemon mode left its server running
    assert wait_until(lambda: not (socket_dir / "weightcache.sock").exists())
