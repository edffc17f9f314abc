"""The adapter guide's example adapter (examples/tinylm-adapter/, an outside package) through the conformance kit.

Three ways, as its author would use them:

- in-process: subclass the kit and register the adapter in a PluginManager (``plugins`` fixture);
- installed: ``pip install`` the package (into a private ``--target`` directory, so the
  shared environment stays untouched) and run ``weightcache conformance`` and
  ``pytest -p weightcache.conformance`` in fresh processes that find it through its entry point;
- broken: a copy whose rebind changes one weight by one ulp (``planted_adapters.RebindNudgesOneUlp``); the kit must
  fail and say where.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import zygote
from tests.helpers import EXAMPLE, PLANTED_DIR, kit_subclass_module
from tests.helpers import EXAMPLE_SRC as SRC
from weightcache.conformance import ConformanceFixtures, ConformanceTests


@pytest.fixture(scope="session")
def installed_example(tmp_path_factory):
    """The example adapter pip-installed into a private directory; put it on PYTHONPATH to use it."""
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        pytest.skip("pip is not available in this environment")
    target = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(EXAMPLE),
        ],
        cwd=build,
        timeout=300,
    )
    entry_points = list(target.glob("weightcache_example-*.dist-info/entry_points.txt"))
    assert entry_points and "weightcache.adapters" in entry_points[0].read_text(), "the install registered no entry point"
    return target


def _run(argv, env=None, cwd=None, timeout=600, check=True) -> subprocess.CompletedProcess:
    merged = {**os.environ, **(env or {})}
    proc = zygote.run(argv, preload=zygote.PYTEST_PRELOAD, capture_output=True, text=True, env=merged, cwd=cwd, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{argv[:4]}... exited {proc.returncode}:\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}")
    return proc


# ------------------------------------------------------------------ in-process, as a subclass


class ExampleFixtures(ConformanceFixtures):
    """The example adapter registered in-process (``plugins``), on a TinyLM checkpoint."""

    @pytest.fixture(scope="class")
    @classmethod
    def adapter_name(cls):
        return "example"

    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, example_checkpoint):
        return example_checkpoint

    @pytest.fixture(scope="class")
    @classmethod
    def plugins(cls, example_package):
        from weightcache.core.flow.plugins import Plugins

        return Plugins.from_modules({"example": example_package.plugin})

    @pytest.fixture(scope="class")
    @classmethod
    def example_inputs(cls, example_package, disk_model):
        return example_package.example_inputs(disk_model.model)

    @pytest.fixture(scope="class")
    @classmethod
    def expected_tied(cls):
        return (("head.weight", "embed.weight"),)


class TestExampleAdapter(ExampleFixtures, ConformanceTests):
    pass


class TestExampleAdapterFp8(TestExampleAdapter):
    @pytest.fixture(scope="class")
    @classmethod
    def quantization(cls):
        return "fp8-block"


# ------------------------------------------------------------------ installed, through its entry point


def test_cli_passes_on_installed_example(installed_example, example_checkpoint, tmp_path):
    """``weightcache conformance`` in a fresh process finds the adapter through its entry point and passes."""
    out = tmp_path / "results.json"
    proc = _run(
        [
            sys.executable,
            "-m",
            "weightcache.core.cli.cli",
            "conformance",
            "--adapter",
            "example",
            "--model",
            str(example_checkpoint),
            "--inputs",
            "weightcache_example:example_inputs",
            "--json",
            str(out),
        ],
        env={"PYTHONPATH": str(installed_example)},
        cwd=tmp_path,
    )
    results = json.loads(out.read_text())
    assert results["passed"] and results["exit_code"] == 0
    assert results["counts"]["failed"] == results["counts"]["error"] == 0
    groups = {check["group"] for check in results["checks"] if check["outcome"] == "passed"}
    assert {
        "test_tensor_parity",
        "test_forward_outputs_bit_identical",
        "test_outputs_survive_server_sigkill",
        "test_fingerprint_mismatch_is_explicit",
        "test_requested_method_refused_before_reading_weights",
    } <= groups
    assert "PASSED:" in proc.stdout and "tensor_parity" in proc.stdout


def test_pytest_plugin_runs_suite_on_installed_example_fp8(installed_example, example_checkpoint, tmp_path):
    """``pytest -p weightcache.conformance --weightcache-...`` alone runs the built-in suite."""
    proc = _run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "weightcache.conformance",
            "-p",
            "no:cacheprovider",
            "-q",
            "-W",
            "error",
            "--weightcache-adapter",
            "example",
            "--weightcache-model",
            str(example_checkpoint),
            "--weightcache-quant",
            "fp8-block",
            "--weightcache-inputs",
            "weightcache_example:example_inputs",
        ],
        env={"PYTHONPATH": str(installed_example)},
        cwd=tmp_path,
    )
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, proc.stdout


def test_cli_fails_with_nonzero_exit_and_json(installed_example, example_checkpoint, tmp_path):
    """Inputs that cannot be built make the forward checks error out: the exit status says so."""
    out = tmp_path / "results.json"
    proc = _run(
        [
            sys.executable,
            "-m",
            "weightcache.core.cli.cli",
            "conformance",
            "--adapter",
            "example",
            "--model",
            str(example_checkpoint),
            "--inputs",
            "weightcache_example:no_such_inputs",
            "--json",
            str(out),
            "--pytest-args",
            "-k bit_identical",
        ],
        env={"PYTHONPATH": str(installed_example)},
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode != 0, proc.stdout
    results = json.loads(out.read_text())
    assert not results["passed"]
    checks = {check["check"]: check for check in results["checks"]}
    assert sorted(checks) == ["test_forward_outputs_bit_identical", "test_long_forward_outputs_bit_identical"], checks
    assert all(check["outcome"] == "error" and "no_such_inputs" in check["message"] for check in checks.values()), checks
    assert "FAIL" in proc.stdout and "failures:" in proc.stdout


# ------------------------------------------------------------------ broken: the kit must catch it


def test_kit_catches_a_broken_rebind(example_checkpoint, tmp_path):
    """A one-ulp change in one mapped tensor fails parity, forward and crash checks, naming tensor, dtype, device, difference."""
    (tmp_path / "test_broken.py").write_text(kit_subclass_module("RebindNudgesOneUlp", example_checkpoint, "TestBroken"))
    proc = _run(
        [
            sys.executable,
            "-m",
            "pytest",
            "test_broken.py",
            "-p",
            "no:cacheprovider",
            "-q",
            "--tb=short",
            "-W",
            "error",
            "-k",
            "parity or bit_identical or sigkill or zero_copy or same_tensor_names",
        ],
        env={"PYTHONPATH": os.pathsep.join([str(SRC), str(PLANTED_DIR)])},
        cwd=tmp_path,
        check=False,
    )
    output = proc.stdout
    assert proc.returncode == 1, output
    for failed in ("test_tensor_parity", "test_forward_outputs_bit_identical", "test_outputs_survive_server_sigkill"):
        assert f"FAILED test_broken.py::TestBroken::{failed}" in output, output
    assert "FAILED test_broken.py::TestBroken::test_same_tensor_names" not in output
    assert "fc1.bias (float32 on cpu)" in output and "1 of 160 elements differ, largest difference" in output, output
    assert "mapped model: output: torch.float32 on cpu (mapped) differs from the disk load" in output, output
    assert "(a copy?)" in output, "the replaced bias is not a view of an arena: the zero-copy check must say so"
