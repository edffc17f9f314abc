"""0.1.0's contract keeps working for one minor version, warning: its module paths import (each warning names the new
import), its command spelling runs, an option declared by help text alone makes the kit warn, not fail; and an adapter
written against 0.1.0's documented API (tests/adapter_010: the adapter guide's example as 0.1.0 documented it), or
against 0.2.0's (tests/adapter_020: every name from ``weightcache``), installed unchanged, passes the kit with
DeprecationWarnings.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests import zygote
from weightcache.core import old_paths

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = {"010": Path(__file__).with_name("adapter_010"), "020": Path(__file__).with_name("adapter_020")}


def _fresh_import(name: str) -> tuple[object, list[warnings.WarningMessage]]:
    """``name`` imported anew (dropped from ``sys.modules`` first), and the warnings that the import raised."""
    sys.modules.pop(name, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    return module, caught


@pytest.mark.parametrize("old", sorted(old_paths.MOVED))
def test_each_old_module_path_imports_warning_and_serves_the_new_module(old):
    module, caught = _fresh_import(old)
    new = importlib.import_module(old_paths.MOVED[old])
    assert [w.category for w in caught] == [DeprecationWarning], [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert message.startswith(f"{old} is deprecated since weightcache 0.2.0 and goes in 0.3.0: use "), message
    assert caught[0].filename == __file__, "the warning points at the import that asked for the old path"
    faces = importlib.import_module("weightcache").public_names().values()
    public = [name for names in faces for name, home in names.items() if home == old_paths.MOVED[old]]
    assert ("use from weightcache" in message) == bool(public), message
    for name in [n for n in vars(new) if not n.startswith("_")][:20]:
        assert getattr(module, name) is getattr(new, name), name
    with pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018


def test_the_documented_0_1_0_imports_work_and_name_the_public_import():
    """What 0.1.0's adapter guide and docs/api.md told authors to write."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in ("modes", "rebind", "api", "plugins", "export", "reader", "manifest", "server_process"):
            sys.modules.pop(f"weightcache.core.{name}", None)
        from weightcache.core.api import attach
        from weightcache.core.export import ArenaBuilder
        from weightcache.core.manifest import Manifest
        from weightcache.core.modes import CacheOptions, load_model, run
        from weightcache.core.plugins import Plugins
        from weightcache.core.reader import read_checkpoint
        from weightcache.core.rebind import rebind_module
        from weightcache.core.server_process import ServerProcess
    import weightcache
    import weightcache.adapter
    import weightcache.engine

    assert (load_model, run, CacheOptions, attach, Plugins, ArenaBuilder, read_checkpoint, rebind_module, Manifest) == (
        weightcache.load_model,
        weightcache.engine.run,
        weightcache.engine.CacheOptions,
        weightcache.engine.attach,
        weightcache.engine.Plugins,
        weightcache.adapter.ArenaBuilder,
        weightcache.adapter.read_checkpoint,
        weightcache.adapter.rebind_module,
        weightcache.adapter.Manifest,
    )
    assert ServerProcess is weightcache.ServerProcess
    messages = [str(w.message) for w in caught]
    assert any("weightcache.core.modes is deprecated" in m and "load_model" in m for m in messages), messages
    assert any("weightcache.core.rebind is deprecated" in m and "from weightcache.adapter import" in m for m in messages), (
        messages
    )


@pytest.mark.parametrize(
    ("package", "name", "advice"),
    [
        ("weightcache.core.identity", "fingerprint_for", "from weightcache.core.identity.identity import fingerprint_for"),
        ("weightcache.core.client", "Connection", "from weightcache.engine import Connection"),
        ("weightcache.core.server", "ServerConfig", "from weightcache.core.server.server import ServerConfig"),
        ("weightcache.core.cli", "main", "from weightcache.core.cli.cli import main"),
    ],
)
def test_a_module_that_became_a_folder_still_serves_its_names(package, name, advice):
    """0.1.0's ``weightcache.core.identity`` (a module) is a folder now: its names come from the module inside, warning;
    the folder's own submodules import as before, without a warning."""
    module = importlib.import_module(package)
    module.__dict__.pop(name, None)
    inner = importlib.import_module(old_paths.FOLDED[package])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(module, name)
        again = getattr(module, name)
    assert value is again is getattr(inner, name)
    assert len(caught) == 1 and advice in str(caught[0].message), [str(w.message) for w in caught]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        submodule = importlib.import_module(old_paths.FOLDED[package])
        assert getattr(module, old_paths.FOLDED[package].rpartition(".")[2]) is submodule
    with pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018


def test_python_m_the_old_cli_module_runs_the_command_and_warns():
    proc = subprocess.run(
        [sys.executable, "-m", "weightcache.core.cli", "--version"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "weightcache 0.2.0", proc.stdout + proc.stderr
    assert "DeprecationWarning: python -m weightcache.core.cli is deprecated" in proc.stderr, proc.stderr
    assert "use python -m weightcache" in proc.stderr


def test_the_kit_warns_on_an_option_declared_by_help_text_alone():
    from weightcache.adapter import AdapterOption, LoadRequest
    from weightcache.conformance.flips import option_flips

    request = LoadRequest(model="/nowhere", adapter="x", options={"flag": True})
    flips, unflippable = option_flips(
        request, {"note": AdapterOption.of("free text"), "flag": AdapterOption("a flag", type=bool)}
    )
    assert [flip.label for flip in flips] == ["option 'flag' = False"]
    assert len(unflippable) == 1 and "option 'note' is declared by its help text alone" in unflippable[0]
    assert "from weightcache 0.3.0" in unflippable[0] and "AdapterOption(help, type=" in unflippable[0]


@pytest.fixture(scope="module", params=sorted(ADAPTERS))
def installed(request, tmp_path_factory):
    """tests/adapter_010 or adapter_020 pip-installed, unchanged, into a private directory (put it on PYTHONPATH); built
    from a copy, so the build leaves nothing in the tree. Its version, and the directory."""
    target = tmp_path_factory.mktemp("site")
    source = tmp_path_factory.mktemp("adapter") / ADAPTERS[request.param].name
    shutil.copytree(ADAPTERS[request.param], source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path_factory.mktemp("build"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return request.param, target


def test_an_adapter_written_for_0_1_0_or_0_2_0_passes_the_kit_with_deprecation_warnings(installed, tmp_path):
    """``python -m weightcache conformance`` on the 0.1.0 or the 0.2.0 adapter, found through its entry point: every
    check passes; the 0.1.0 adapter's module paths and untyped option warn, the 0.2.0 adapter's names do."""
    version, site = installed
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONWARNINGS": "default::DeprecationWarning"}
    checkpoint = tmp_path / "tinylm"
    made = subprocess.run(
        [sys.executable, "-c", f"import tinylm_{version}; tinylm_{version}.save_checkpoint({str(checkpoint)!r})"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr[-3000:]
    results = tmp_path / "results.json"
    proc = zygote.run(
        [
            sys.executable,
            "-m",
            "weightcache",
            "conformance",
            "--adapter",
            f"tinylm-{version}",
            "--model",
            str(checkpoint),
            "--inputs",
            f"tinylm_{version}:example_inputs",
            "--json",
            str(results),
        ],
        preload=zygote.PYTEST_PRELOAD,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    summary = json.loads(results.read_text())
    assert summary["passed"] and summary["counts"]["failed"] == summary["counts"]["error"] == 0, summary["counts"]
    assert summary["counts"]["passed"] > 50, summary["counts"]
    output = proc.stdout + proc.stderr
    if version == "010":
        assert "weightcache.core.rebind is deprecated since weightcache 0.2.0" in output, output[-6000:]
        assert "from weightcache.adapter import check_no_meta, meta_parameters, rebind_module" in output
        assert "option 'note' is declared by its help text alone" in output, output[-6000:]
    else:
        assert (
            "weightcache.hookimpl is deprecated since weightcache 0.3.0 and goes in 0.4.0: "
            "use from weightcache.adapter import hookimpl" in output
        ), output[-6000:]
