"""The weightcache conformance kit: prove that an adapter's mapped weights give exactly a disk load's outputs.

A pytest plugin plus abstract test classes, in the manner of fsspec's
abstract tests. pytest loads the plugin in every run (a ``pytest11`` entry point):
it adds the ``--weightcache-*`` options and, after any run that collected a check
of the kit, prints the verdict line. Two ways to run it:

- On one model from the command line (the built-in suite)::

      pytest -p weightcache.conformance --weightcache-adapter NAME --weightcache-model PATH [--weightcache-quant fp8-block]
      weightcache conformance --adapter NAME --model PATH [--quant fp8-block] [--json FILE]

- In your own test suite (``pytest_plugins = ["weightcache.conformance"]`` in your
  top-level conftest is needed only where entry-point plugins are disabled), then
  subclass the kit::

      from weightcache.conformance import ConformanceFixtures, ConformanceTests

      class TestMyAdapter(ConformanceFixtures, ConformanceTests):
          @pytest.fixture(scope="class")
          def adapter_name(self):
              return "my-adapter"

          @pytest.fixture(scope="class")
          def model_path(self, tmp_path_factory):
              return make_checkpoint(tmp_path_factory.mktemp("ckpt"))

This module is public (``__all__``; docs/api.md): the test classes an adapter's suite subclasses and the kit's tensor
assertions. It stays light (no torch): each name loads its module on first access. See docs/adapter-guide.md.
"""

from __future__ import annotations

import functools
import typing
from pathlib import Path

__all__ = [
    "REFUSED_METHODS",
    "AdapterTests",
    "ArchitectureTests",
    "ConfigTests",
    "ConformanceFixtures",
    "ConformanceTests",
    "CrashTests",
    "DtypeTests",
    "FingerprintTests",
    "FlipTests",
    "FreshProcessTests",
    "ModeTests",
    "ParityTests",
    "QuantizationTests",
    "RefitTests",
    "assert_tensors_identical",
    "model_tensors",
    "tensor_digest",
    "tied_groups",
]

_LAZY = {
    "AdapterTests": "weightcache.conformance.checks",
    "ArchitectureTests": "weightcache.conformance.checks",
    "ConfigTests": "weightcache.conformance.outside_checks",
    "ConformanceFixtures": "weightcache.conformance.fixtures",
    "ConformanceTests": "weightcache.conformance.checks",
    "CrashTests": "weightcache.conformance.checks",
    "DtypeTests": "weightcache.conformance.dtype_checks",
    "FingerprintTests": "weightcache.conformance.checks",
    "FlipTests": "weightcache.conformance.checks",
    "FreshProcessTests": "weightcache.conformance.outside_checks",
    "ModeTests": "weightcache.conformance.checks",
    "ParityTests": "weightcache.conformance.checks",
    "QuantizationTests": "weightcache.conformance.checks",
    "REFUSED_METHODS": "weightcache.conformance.checks",
    "RefitTests": "weightcache.conformance.refit",
    "assert_tensors_identical": "weightcache.conformance.assertions",
    "model_tensors": "weightcache.conformance.assertions",
    "tensor_digest": "weightcache.conformance.assertions",
    "tied_groups": "weightcache.conformance.assertions",
}

if typing.TYPE_CHECKING:  # what type checkers read; at run time each name loads on first access (__getattr__)
    from weightcache.conformance.assertions import assert_tensors_identical, model_tensors, tensor_digest, tied_groups
    from weightcache.conformance.checks import (
        REFUSED_METHODS,
        AdapterTests,
        ArchitectureTests,
        ConformanceTests,
        CrashTests,
        FingerprintTests,
        FlipTests,
        ModeTests,
        ParityTests,
        QuantizationTests,
    )
    from weightcache.conformance.dtype_checks import DtypeTests
    from weightcache.conformance.fixtures import ConformanceFixtures
    from weightcache.conformance.outside_checks import ConfigTests, FreshProcessTests
    from weightcache.conformance.refit import RefitTests

SUITE = Path(__file__).with_name("suite.py")
"""The module that runs the kit on the model named by the command-line options."""

OPTIONS: tuple[tuple[str, str, dict[str, typing.Any]], ...] = (
    ("--weightcache-adapter", "adapter name, as registered in the 'weightcache.adapters' entry points", {}),
    ("--weightcache-model", "checkpoint the kit loads", {}),
    ("--weightcache-quant", "quantization method to check (fp8-block); default: none", {}),
    ("--weightcache-device", "device to load on (default: cpu)", {}),
    ("--weightcache-dtype", "dtype of unquantized weights (default: the checkpoint's)", {}),
    (
        "--weightcache-inputs",
        "MODULE:FUNCTION giving example inputs for a model: FUNCTION(model) -> dict, tuple or tensor "
        "(default: the adapter's weightcache_example_inputs hook)",
        {},
    ),
    ("--weightcache-option", "an adapter option KEY=VALUE (repeatable; a JSON value is decoded)", {"action": "append"}),
    ("--weightcache-no-fp8", "the adapter does not implement fp8-block: check that it refuses it", {"action": "store_true"}),
    ("--weightcache-tied", "names that must stay tied, comma-separated (repeatable: one group each)", {"action": "append"}),
    (
        "--weightcache-declare-quantization",
        "how a checkpoint declares a quantization method: hf-config (default: "
        "config.json's quantization_config), none (the adapter has no such notion) or MODULE:FUNCTION(checkpoint, method)",
        {},
    ),
)
"""The kit's command-line options (pytest form); ``weightcache conformance`` takes each without the ``weightcache-`` prefix."""


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def pytest_addoption(parser) -> None:
    group = parser.getgroup("weightcache", "weightcache conformance kit")
    for flag, help_text, kwargs in OPTIONS:
        group.addoption(flag, help=help_text, **({"default": None} | kwargs))


def pytest_configure(config) -> None:
    """With ``--weightcache-model`` and no test paths given, run the built-in suite alone, after the pre-check.

    A failed pre-check (unknown adapter or option, a bad option value, describe failing on the
    checkpoint) is a usage error: one line, no check run.
    """
    if config.getoption("weightcache_model", None) and config.args_source != config.ArgsSource.ARGS:
        import pytest

        from weightcache.conformance.precheck import PrecheckFailed, precheck, request_from_options

        try:
            precheck(
                request_from_options(
                    config.getoption("weightcache_adapter"),
                    config.getoption("weightcache_model"),
                    config.getoption("weightcache_quant"),
                    config.getoption("weightcache_device"),
                    config.getoption("weightcache_dtype"),
                    config.getoption("weightcache_option") or [],
                )
            )
        except PrecheckFailed as exc:
            raise pytest.UsageError(str(exc)) from None
        config.args = [str(SUITE)]


KIT_MODULE = "weightcache.conformance.checks"
"""Where the kit's test classes live: a collected test whose class derives from one of them is a check of the kit."""


def pytest_collection_finish(session) -> None:
    """Remember which tests to run are the kit's checks (their class derives from one of the kit's classes)."""
    session.config.stash[_kit_checks()] = {
        item.nodeid
        for item in session.items
        if any(base.__module__ == KIT_MODULE for base in getattr(getattr(item, "cls", None), "__mro__", ()))
    }


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The kit's verdict after every run that collected a check of it: PASSED, PASSED without forward checks, FAILED."""
    from weightcache.conformance.verdict import (
        NO_CHECK_RAN,
        PASSED,
        PASSED_WITHOUT_FORWARD,
        forward_skip,
        skip_reason,
        verdict,
    )

    checks = config.stash.get(_kit_checks(), set())
    if not checks:
        return
    stats = terminalreporter.stats

    def reports(*outcomes: str) -> list:
        return [report for outcome in outcomes for report in stats.get(outcome, []) if getattr(report, "nodeid", None) in checks]

    if not reports("passed", "failed", "error", "skipped"):
        terminalreporter.write_line(
            f"weightcache conformance: {NO_CHECK_RAN} ({len(checks)} collected, none run)", bold=True, yellow=True
        )
        return
    failed = bool(reports("failed", "error")) or int(exitstatus) not in (0, 1, 5)  # interrupted, usage or internal error
    no_forward = forward_skip(skip_reason(report) for report in reports("skipped"))
    said = verdict(1 if failed else 0, no_forward)
    detail = f" ({no_forward})" if said == PASSED_WITHOUT_FORWARD else ""
    colour = {
        "green": said == PASSED,
        "yellow": said == PASSED_WITHOUT_FORWARD,
        "red": said not in (PASSED, PASSED_WITHOUT_FORWARD),
    }
    terminalreporter.write_line(f"weightcache conformance: {said}{detail}", bold=True, **colour)


@functools.cache
def _kit_checks() -> typing.Any:
    """The stash key of the kit's collected checks (made on first use: importing this module imports no pytest)."""
    import pytest

    return pytest.StashKey[set]()
