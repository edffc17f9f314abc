"""Each planted bug of issue 22 (``planted_adapters.py``) fails the kit, by the check meant to catch it, as its author runs it.

The adapters are found through ``weightcache.adapters`` entry points (a dist-info
written into a private directory on PYTHONPATH), so ``weightcache conformance`` and
``pytest -p weightcache.conformance`` run in fresh processes exactly as for an
installed package. Contract mistakes stop the run in one line before any check;
the others run only the checks that concern them (``-k``) to stay quick.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import zygote
from tests.helpers import EXAMPLE_SRC, PLANTED_DIR, kit_subclass_module

ENTRY_POINTS = {
    "planted-scale-left-out": "ScaleLeftOutOfExtra",
    "planted-scale-in-extra": "ScaleInExtra",
    "planted-describe-reads-weights": "DescribeReadsWeights",
    "planted-describe-fails": "DescribeFails",
    "planted-options-list": "OptionsAsList",
    "planted-no-dtype": "DescriptionWithoutDtype",
    "planted-retired-hook": "RetiredHookName",
    "planted-device": "TorchGetsWeightcacheDevice",
    "planted-forward-less": "ForwardLess",
    "planted-dither-fp8": "DithersBeforeFp8ByHash",
    "planted-config-scale": "ConfigScaleLeftOutOfDescribe",
    "planted-long-only": "LongOnlyTensorInDict",
}
"""Adapter name -> class of planted_adapters.py, registered through ``weightcache.adapters`` entry points."""


@pytest.fixture(scope="module")
def planted_env(tmp_path_factory) -> dict:
    """PYTHONPATH holding the example package, ``planted_adapters`` and a dist-info registering each as an adapter."""
    site = tmp_path_factory.mktemp("planted-site")
    return adapters_env(site, "weightcache-planted", "planted_adapters", ENTRY_POINTS, PLANTED_DIR, EXAMPLE_SRC)


def adapters_env(site: Path, distribution: str, module: str, adapters: dict[str, str], *path: Path) -> dict:
    """PYTHONPATH holding ``site``, where a dist-info of ``distribution`` registers each adapter name of ``adapters`` as
    the ``weightcache.adapters`` entry point ``module:class``, then ``path``."""
    info = site / f"{distribution.replace('-', '_')}-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0\n")
    lines = [f"{name} = {module}:{attr}" for name, attr in adapters.items()]
    (info / "entry_points.txt").write_text("[weightcache.adapters]\n" + "\n".join(lines) + "\n")
    return {"PYTHONPATH": os.pathsep.join(str(folder) for folder in (site, *path))}


@pytest.fixture(scope="module")
def checkpoint(example_checkpoint) -> str:
    return str(example_checkpoint)


def _run(argv: list[str], env: dict, cwd: Path, adapter: str | None = None) -> subprocess.CompletedProcess:
    """``argv`` with the planted adapters on the path, all but ``adapter`` blocked (a broken one would warn in every run)."""
    blocked = ",".join(name for name in ENTRY_POINTS if name != adapter)
    env = {**os.environ, **env, "WEIGHTCACHE_BLOCK_ADAPTERS": blocked}
    return zygote.run(argv, preload=zygote.PYTEST_PRELOAD, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


def kit_cli(env: dict, cwd: Path, adapter: str, checkpoint: str, *args: str, select: str | None = None):
    """``weightcache conformance`` in a fresh process: the process and its JSON results (None if it stopped before)."""
    out = cwd / "results.json"
    out.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "weightcache.core.cli.cli", "conformance", "--adapter", adapter, "--model", checkpoint]
    argv += [*args, "--json", str(out)] + (["--pytest-args", f"-k '{select}'"] if select else [])
    proc = _run(argv, env, cwd, adapter)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def kit_pytest(env: dict, cwd: Path, adapter: str, checkpoint: str, *args: str) -> subprocess.CompletedProcess:
    """``pytest -p weightcache.conformance --weightcache-...`` in a fresh process."""
    argv = [sys.executable, "-m", "pytest", "-p", "weightcache.conformance", "-p", "no:cacheprovider", "-q", "-W", "error"]
    argv += ["--weightcache-adapter", adapter, "--weightcache-model", checkpoint, *args]
    return _run(argv, env, cwd, adapter)


def outcomes(results: dict) -> dict[str, tuple[str, str]]:
    return {check["check"]: (check["outcome"], check["message"]) for check in results["checks"]}


BROKEN_WARNING = "weightcache: adapter 'planted-retired-hook' is broken and was skipped"
"""What loading the entry points logs of the retired-hook adapter, before the pre-check says the same as its error."""


def assert_stopped_in_one_line(proc: subprocess.CompletedProcess, *expected: str) -> None:
    """The CLI stopped before any check: a non-zero exit, one error line saying ``expected``, no table."""
    assert proc.returncode != 0, proc.stdout
    lines = [line for line in proc.stderr.strip().splitlines() if BROKEN_WARNING not in line]
    assert len(lines) == 1 and lines[0].startswith("weightcache: error: weightcache conformance pre-check failed: "), proc.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    assert "CHECK" not in proc.stdout, proc.stdout


# ------------------------------------------------------------------ checks that run the model


def test_an_option_left_out_of_the_fingerprint_fails_the_flip_check_naming_it(planted_env, checkpoint, tmp_path):
    """The bug the kit missed: every other check passes; the option flip fails, naming the option and the fix."""
    select = "option_flips or tensor_parity or bit_identical or fingerprint_mismatch_is_explicit"
    proc, results = kit_cli(planted_env, tmp_path, "planted-scale-left-out", checkpoint, select=select)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failed = {name: message for name, (outcome, message) in outcomes(results).items() if outcome != "passed"}
    assert list(failed) == ["test_option_flips_are_a_miss_or_the_same_model"], failed
    message = failed["test_option_flips_are_a_miss_or_the_same_model"]
    assert "option 'scale' = 2.0 leaves the fingerprint unchanged" in message, message
    assert "fc1.weight" in proc.stdout and "put it into ModelDescription.extra" in proc.stdout, proc.stdout


def test_the_same_option_in_extra_passes(planted_env, checkpoint, tmp_path):
    proc, results = kit_cli(planted_env, tmp_path, "planted-scale-in-extra", checkpoint, select="option_flips or request_field")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert outcomes(results)["test_option_flips_are_a_miss_or_the_same_model"][0] == "passed"


def test_describe_reading_weights_fails_the_weightless_control_by_name(planted_env, checkpoint, tmp_path):
    proc, results = kit_cli(planted_env, tmp_path, "planted-describe-reads-weights", checkpoint, select="weightless")
    outcome, message = outcomes(results)["test_weightless_copy_cannot_load"]
    assert proc.returncode == 1 and outcome == "failed", proc.stdout
    assert message.startswith("Failed: weightcache_describe failed on the weightless copy"), message


def test_torch_given_a_weightcache_device_fails_the_mode_check_with_the_fix(planted_env, checkpoint, tmp_path):
    proc, results = kit_cli(planted_env, tmp_path, "planted-device", checkpoint, select="mode_loads")
    found = outcomes(results)
    assert proc.returncode == 1, proc.stdout
    outcome, message = found["test_mode_loads_on_the_requested_device[off]"]
    assert outcome == "failed" and "mode 'off' failed in the adapter's hooks: TypeError" in message, message
    assert "pass request.device.torch()" in message, message
    assert found["test_mode_loads_on_the_requested_device[daemon]"][0] == "failed"


def test_a_forward_less_run_never_says_plain_passed(planted_env, checkpoint, tmp_path):
    select = "tensor_parity or bit_identical or deterministic"
    proc, results = kit_cli(planted_env, tmp_path, "planted-forward-less", checkpoint, select=select)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert results["verdict"] == "PASSED without forward checks" and results["forward_checks"] is False
    assert "\nPASSED without forward checks" in proc.stdout and "\nPASSED:" not in proc.stdout, proc.stdout
    proc = kit_pytest(planted_env, tmp_path, "planted-forward-less", checkpoint, "-k", select)
    assert proc.returncode == 0, proc.stdout
    assert "weightcache conformance: PASSED without forward checks (no forward pass for this model here" in proc.stdout


def test_a_suite_subclassing_the_kit_ends_with_the_verdict_without_naming_the_plugin(planted_env, checkpoint, tmp_path):
    """The kit's pytest11 entry point loads it in every run: no ``-p weightcache.conformance``, still the verdict line."""
    import importlib.metadata

    assert "weightcache.conformance" in {entry.name for entry in importlib.metadata.entry_points(group="pytest11")}
    (tmp_path / "test_planted.py").write_text(kit_subclass_module("ForwardLess", checkpoint))
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "test_planted.py",
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        "tensor_parity or bit_identical",
    ]
    proc = _run(argv, planted_env, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "weightcache conformance: PASSED without forward checks (no forward pass for this model here" in proc.stdout, (
        proc.stdout
    )


def test_the_adapter_supplies_its_conventions_so_the_cli_needs_no_flags(planted_env, checkpoint, tmp_path):
    """Tied groups and how a checkpoint declares a method come from weightcache_checkpoint_conventions."""
    proc, results = kit_cli(planted_env, tmp_path, "planted-scale-in-extra", checkpoint, select="tied or declared_method")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = outcomes(results)
    assert found["test_tied_weights_stay_tied"][0] == "passed"
    assert all(outcome == "passed" for name, (outcome, _) in found.items() if name.startswith("test_declared_method")), found


# ------------------------------------------------------------------ what one process cannot see


def failed_checks(results: dict) -> dict[str, str]:
    return {name: message for name, (outcome, message) in outcomes(results).items() if outcome not in ("passed", "skipped")}


def test_a_post_process_seeded_by_the_hash_seed_fails_the_fresh_process_check_naming_the_tensor(
    planted_env, checkpoint, tmp_path
):
    """Every load in one process dithers alike; a fresh process with another PYTHONHASHSEED publishes other FP8 bytes."""
    select = "fresh_process or tensor_parity or bit_identical or sigkill"
    proc, results = kit_cli(planted_env, tmp_path, "planted-dither-fp8", checkpoint, "--quant", "fp8-block", select=select)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failed = failed_checks(results)
    assert list(failed) == ["test_fresh_process_publishes_the_same_model"], failed
    message = failed["test_fresh_process_publishes_the_same_model"]
    assert "loads other tensors than this process published, first fc1.weight" in message, message
    assert "fc1.weight (float8_e4m3fn on cpu): bytes differ" in proc.stdout + message, proc.stdout


@pytest.fixture(scope="module")
def scaled_checkpoint(example_package, tmp_path_factory) -> str:
    """A TinyLM checkpoint whose config.json says ``residual_scale: 2.0``."""
    path = example_package.save_checkpoint(tmp_path_factory.mktemp("scaled"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "residual_scale": 2.0}))
    return str(path)


def test_a_config_field_folded_into_the_weights_but_not_described_fails_the_config_check_naming_it(
    planted_env, scaled_checkpoint, tmp_path
):
    select = "config_fields or tensor_parity or bit_identical"
    proc, results = kit_cli(planted_env, tmp_path, "planted-config-scale", scaled_checkpoint, select=select)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failed = failed_checks(results)
    assert list(failed) == ["test_config_fields_change_the_fingerprint_or_nothing"], failed
    assert "config.json field 'residual_scale' changed (2.0 -> 4.0) leaves the fingerprint unchanged" in proc.stdout, proc.stdout
    assert "fc1.weight" in proc.stdout, proc.stdout
    for field in ("vocab_size", "dim", "hidden", "dtype"):  # in the description: another fingerprint each
        assert f"field '{field}'" not in proc.stdout, proc.stdout


@pytest.fixture(scope="module")
def long_context_checkpoint(example_package, tmp_path_factory) -> str:
    """A TinyLM checkpoint with a ``long_context.bias`` tensor beside its weights (``planted_adapters.LongContextTinyLM``)."""
    import safetensors.torch
    import torch

    path = example_package.save_checkpoint(tmp_path_factory.mktemp("long-context"))
    state = safetensors.torch.load_file(str(path / "model.safetensors"))
    state["long_context.bias"] = torch.randn(state["embed.weight"].shape[1], generator=torch.Generator().manual_seed(5))
    safetensors.torch.save_file(state, str(path / "model.safetensors"))
    return str(path)


def test_a_long_input_only_tensor_kept_in_a_dict_fails_accounting_and_the_long_forward_naming_it(
    planted_env, long_context_checkpoint, tmp_path
):
    """The short example's outputs agree (12 tokens never reach the dict's tensor); the long input's do not."""
    select = "accounted or long_forward or bit_identical or tensor_parity"
    proc, results = kit_cli(planted_env, tmp_path, "planted-long-only", long_context_checkpoint, select=select)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failed = failed_checks(results)
    assert sorted(failed) == ["test_every_checkpoint_tensor_is_accounted_for", "test_long_forward_outputs_bit_identical"], failed
    assert "long_context.bias (float32 [32] in model.safetensors) is neither published" in proc.stdout, proc.stdout
    assert outcomes(results)["test_forward_outputs_bit_identical"][0] == "passed"


# ------------------------------------------------------------------ contract mistakes: the pre-check stops the run in one line


@pytest.mark.parametrize(
    ("adapter", "args", "expected"),
    [
        ("planted-describe-fails", (), ("weightcache_describe of adapter 'planted-describe-fails' failed", "KeyError")),
        ("planted-options-list", (), ("weightcache_options of adapter 'planted-options-list'", "returned a list")),
        ("planted-no-dtype", (), ("weightcache_describe of adapter 'planted-no-dtype'", "has no dtype; set dtype=")),
        ("planted-retired-hook", (), ("weightcache_quantize was retired: rename it to weightcache_post_process",)),
        ("planted-scale-in-extra", ("--option", 'scale="big"'), ("option 'scale' = 'big': expected a float",)),
        ("planted-scale-in-extra", ("--option", "nosuch=1"), ("takes no option 'nosuch'",)),
        ("nosuch", (), ("no weightcache adapter named 'nosuch'",)),
    ],
    ids=["describe-fails", "options-list", "no-dtype", "retired-hook", "bad-option-value", "unknown-option", "unknown-adapter"],
)
def test_a_contract_mistake_stops_the_cli_and_the_pytest_form_in_one_line(
    planted_env, checkpoint, tmp_path, adapter, args, expected
):
    proc, results = kit_cli(planted_env, tmp_path, adapter, checkpoint, *args)
    assert results is None
    assert_stopped_in_one_line(proc, *expected)
    pytest_args = [arg.replace("--option", "--weightcache-option") for arg in args]
    proc = kit_pytest(planted_env, tmp_path, adapter, checkpoint, *pytest_args)
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.strip() and BROKEN_WARNING not in line]
    assert len(errors) == 1 and errors[0].startswith("ERROR: weightcache conformance pre-check failed: "), proc.stderr
    assert all(text in errors[0] for text in expected), errors[0]
    assert " passed" not in proc.stdout and " error" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("adapter", ["OptionsAsList", "RetiredHookName"])
def test_a_subclass_of_the_kit_stops_at_its_first_check_in_one_line(planted_env, checkpoint, tmp_path, adapter):
    """In a suite of one's own, the pre-check errors once and stops the session (not one error per check and class)."""
    (tmp_path / "test_planted.py").write_text(kit_subclass_module(adapter, checkpoint, classes=2))
    proc = _run(
        [sys.executable, "-m", "pytest", "test_planted.py", "-q", "-p", "no:cacheprovider", "--tb=line"], planted_env, tmp_path
    )
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, proc.stdout
    assert "During handling" not in proc.stdout, proc.stdout
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("1 error") and "passed" not in summary, proc.stdout
    assert "Interrupted: weightcache conformance pre-check failed: " in proc.stdout, proc.stdout
