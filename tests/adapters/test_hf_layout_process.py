"""The layout learned in a process of its own: the same layout as this process learns, a CLI that never imports
transformers on first sight, and a load that builds the skeleton itself wherever the child fails.

Real checkpoints (save_pretrained, random weights), real child processes, a real private store directory.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from tests.adapters.test_hf_checkpoints import assert_attaches_like_from_pretrained
from tests.adapters.test_hf_layout import _entries, cli_load, layout_entries, publish_view
from weightcache.adapters.hf import identity, layout_process
from weightcache.adapters.hf.layout_key import layout_key
from weightcache.adapters.hf.loading import skeleton_and_layout
from weightcache.core.request import LoadRequest


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    directory = tmp_path / "store"
    monkeypatch.setenv("WEIGHTCACHE_CACHE_DIR", str(directory))
    return directory


@pytest.mark.parametrize("kind", ["llama", "t5", "whisper"])
def test_the_child_learns_the_layout_this_process_learns(model_dir, kind):
    request = LoadRequest(model=str(model_dir(kind)))
    dtype = identity.load_dtype(request, identity.read_config(request.model))
    child = layout_process.LayoutProcess(request)
    learned = child.result(timeout=240)
    assert learned is not None
    assert learned.to_json() == skeleton_and_layout(request, dtype)[1].to_json()


def test_a_load_given_the_childs_layout_publishes_what_the_skeleton_publishes(store_dir, model_dir):

    path = model_dir("gemma")
    request = LoadRequest(model=str(path))
    config = identity.read_config(str(path))
    key = layout_key(request, config, identity.load_dtype_name(request, config))
    layout_process.start(request, key)
    from_child, built_as = publish_view(path)
    assert built_as == "LayoutModel", "the load bound the child's layout"
    assert layout_process.take(key) is None, "the load took the child"
    assert len(layout_entries(store_dir)) == 1, "and remembered its layout once the checkpoint was bound to it"
    (entry,) = layout_entries(store_dir)
    (store_dir / entry).unlink()
    from_skeleton, built_as = publish_view(path)
    assert built_as != "LayoutModel"
    assert from_child == from_skeleton


def test_a_failed_child_leaves_the_load_to_build_the_skeleton(store_dir, model_dir, tmp_path, caplog):

    path = model_dir("llama")
    request = LoadRequest(model=str(path))
    config = identity.read_config(str(path))
    key = layout_key(request, config, identity.load_dtype_name(request, config))
    broken = LoadRequest(model=str(tmp_path / "no-such-model"))
    with layout_process._started_lock:
        layout_process._started[key] = layout_process.LayoutProcess(broken)  # a child that fails, under this key
    with caplog.at_level(logging.INFO, logger="weightcache.adapters.hf.layout_process"):
        view, built_as = publish_view(path)
    assert built_as != "LayoutModel", "the skeleton was built here"
    assert view is not None and "the layout process ended with status 1" in caplog.text


def test_a_child_past_its_time_is_stopped_and_reaped(model_dir):
    child = layout_process.LayoutProcess(LoadRequest(model=str(model_dir("llama"))))
    assert child.result(timeout=0.01) is None
    assert child.process.returncode is not None, "killed and reaped, no zombie left"


def test_children_nobody_took_end_with_the_process(model_dir):
    request = LoadRequest(model=str(model_dir("llama")))
    layout_process.start(request, "layout-nobody-takes-this")
    child = layout_process._started["layout-nobody-takes-this"]
    layout_process.stop_all()
    assert child.process.returncode is not None
    assert layout_process.take("layout-nobody-takes-this") is None


def test_the_variable_decides_and_else_the_cpus(monkeypatch):
    monkeypatch.setenv(layout_process.ENV, "1")
    assert layout_process.wanted()
    monkeypatch.setenv(layout_process.ENV, "0")
    assert not layout_process.wanted()
    monkeypatch.delenv(layout_process.ENV)
    assert layout_process.wanted() == (len(os.sched_getaffinity(0)) >= layout_process.MIN_CPUS)


def test_the_cli_on_first_sight_never_imports_transformers_and_attaches_like_from_pretrained(server, model_dir, tmp_path):
    path = model_dir("llama")
    first = cli_load(server.socket_dir, path, tmp_path / "store", layout_process="1")
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.startswith("published"), first.stdout
    assert "TRANSFORMERS False" in first.stdout, "the child built the skeleton; this process only its layout's tree"
    assert layout_entries(tmp_path / "store"), "the layout is remembered for the next load"
    assert len(_entries(server.socket_dir)) == 1
    assert_attaches_like_from_pretrained(path, server.socket_dir, "float32", None)


@pytest.mark.parametrize("kind", ["llama", "gemma", "bert"])
@pytest.mark.parametrize("dtype", [None, "bfloat16", "float32"])
def test_the_warm_up_names_the_entry_the_load_reads_without_importing_torch(model_dir, kind, dtype, tmp_path):
    """The warm-up's key (no torch) and the load's dtype agree, for the checkpoint's dtype and a requested one."""
    request = LoadRequest(model=str(model_dir(kind, "bfloat16")), dtype=dtype)
    config = identity.read_config(request.model)
    assert identity.load_dtype_name(request, config) == str(identity.load_dtype(request, config)).removeprefix("torch.")
    code = (
        "import sys\nfrom weightcache.adapters.hf import identity\nfrom weightcache.adapters.hf.layout_key import layout_key\n"
        "from weightcache.core.request import LoadRequest\n"
        f"request = LoadRequest(model={request.model!r}, dtype={dtype!r})\n"
        "config = identity.read_config(request.model)\n"
        "key = layout_key(request, config, identity.load_dtype_name(request, config))\n"
        "from weightcache.adapters.hf import hooks, layout_process\n"
        "hooks.weightcache_warm_up(request, for_publish=True)\n"
        "print(key, key in layout_process._started)\n"
        "print('TORCH', 'torch' in sys.modules)\n"
        "layout_process.stop_all()\n"
    )
    env = {**os.environ, layout_process.ENV: "1", "WEIGHTCACHE_CACHE_DIR": str(tmp_path / "store")}
    named = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, check=True)
    key = layout_key(request, config, identity.load_dtype_name(request, config))
    assert named.stdout.splitlines() == [f"{key} True", "TORCH False"], "the warm-up started the child before torch"
