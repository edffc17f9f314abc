"""The kit's own edges: pytest missing, a run that collects checks but runs none, a fresh process whose adapter module
does not import. Each says so in words, never with a traceback or a PASSED."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from tests.conformance.test_planted_bugs import kit_cli
from tests.helpers import EXAMPLE_SRC


def test_without_pytest_the_command_says_what_to_install_in_one_line(tmp_path, example_checkpoint):
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "pytest.py").write_text('raise ImportError("No module named pytest")\n')
    example = _example_env(tmp_path)
    env = {**os.environ, **example, "PYTHONPATH": os.pathsep.join([str(hidden), example["PYTHONPATH"]])}
    argv = [sys.executable, "-m", "weightcache", "conformance", "--adapter", "example", "--model", str(example_checkpoint)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'weightcache[conformance]'" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def _example_env(tmp_path) -> dict:
    """PYTHONPATH with the example package and a dist-info registering its adapter as ``example``."""
    info = tmp_path / "site" / "weightcache_example_edges-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: weightcache-example-edges\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[weightcache.adapters]\nexample = weightcache_example.plugin\n")
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(EXAMPLE_SRC)]), "WEIGHTCACHE_BLOCK_ADAPTERS": ""}


def test_collect_only_says_no_check_ran(tmp_path, example_checkpoint):
    env = _example_env(tmp_path)
    proc, _ = kit_cli(env, tmp_path, "example", str(example_checkpoint), select="tensor_parity")
    assert proc.returncode == 0, proc.stdout + proc.stderr  # the control: one check selected, it ran
    out = tmp_path / "collect.json"
    argv = [sys.executable, "-m", "weightcache", "conformance", "--adapter", "example", "--model", str(example_checkpoint)]
    argv += ["--json", str(out), "--pytest-args=--collect-only"]
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **env}, cwd=tmp_path, timeout=300)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "no check ran" in proc.stdout, proc.stdout
    assert not [line for line in proc.stdout.splitlines() if line.startswith("PASSED")], proc.stdout
    assert '"verdict": "no check ran"' in out.read_text()


def test_a_fresh_process_import_failure_names_the_module_and_the_reason(tmp_path, example_checkpoint):
    """A module registered in this process only (nothing on sys.path holds it): the fresh process cannot import it."""
    import weightcache_example.plugin as plugin

    from weightcache.conformance.fresh_process import FreshProcess
    from weightcache.core.flow.plugins import Plugins
    from weightcache.core.request import ForwardUnavailable, LoadRequest

    ghost = types.ModuleType("ghost_adapter_module")
    ghost.__dict__.update({name: getattr(plugin, name) for name in dir(plugin) if name.startswith("weightcache_")})
    sys.modules[ghost.__name__] = ghost
    try:
        plugins = Plugins.from_modules({"ghost": ghost})
        request = LoadRequest(model=str(example_checkpoint), adapter="ghost")
        process = FreshProcess.start(request, plugins, lambda model, inputs: model(**inputs), tmp_path / "fresh")
        with pytest.raises(AssertionError) as caught:
            process.finish(ForwardUnavailable("not needed"))
    finally:
        del sys.modules[ghost.__name__]
    message = str(caught.value)
    assert "the adapter module 'ghost_adapter_module' does not import in a fresh process" in message, message
    assert "No module named 'ghost_adapter_module'" in message, message
