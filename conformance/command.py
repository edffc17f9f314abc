"""``weightcache conformance``: run the kit on one model and print a pass/fail table.

It runs pytest in this process on ``weightcache/conformance/suite.py`` with the
kit's plugin and a collector plugin that records each check's outcome; the
exit status is pytest's (0 only when every check passed or was skipped), and
the verdict says ``PASSED without forward checks`` when the outputs were never
compared (``weightcache.conformance.verdict``). The pre-check runs first and
stops the command with one line when no check could pass.
Importing this module stays light: the weightcache CLI imports it to build its parser.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
import typing
from pathlib import Path

from weightcache.conformance.verdict import (
    FAILED,
    NO_CHECK_EXIT,
    NO_CHECK_RAN,
    PASSED_WITHOUT_FORWARD,
    forward_skip,
    skip_reason,
    verdict,
)

if typing.TYPE_CHECKING:
    import argparse


def add_parser(commands: "argparse._SubParsersAction") -> None:
    parser = commands.add_parser(
        "conformance",
        help="check that mapped weights give exactly a disk load's outputs",
        description="Run the conformance kit on one model: publish it to a private server, attach it, and compare "
        "tensors and outputs with a disk load; also fingerprint mismatches, refused quantization methods and a "
        "server crash. Exit status 0 only if every check passes.",
    )
    parser.add_argument("--adapter", default="hf", help="adapter name (default: hf)")
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--quant", help="quantization method to check: fp8-block (default: none)")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument("--dtype", help="dtype of unquantized weights (default: the checkpoint's)")
    parser.add_argument(
        "--inputs",
        help="MODULE:FUNCTION giving example inputs: FUNCTION(model) -> dict, tuple or tensor "
        "(default: the adapter's weightcache_example_inputs hook)",
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an adapter option (repeatable; a JSON value is decoded)",
    )
    parser.add_argument(
        "--no-fp8", action="store_true", help="the adapter does not implement fp8-block: check that it refuses it"
    )
    parser.add_argument(
        "--tied",
        action="append",
        default=[],
        metavar="NAME,NAME",
        help="names that must stay tied in both models (repeatable: one group each)",
    )
    parser.add_argument(
        "--declare-quantization",
        metavar="HOW",
        help="how a checkpoint declares a method: hf-config (default), none, or MODULE:FUNCTION(checkpoint, method)",
    )
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--pytest-args", default="", help='extra pytest arguments, as one string (e.g. "-k parity -x")')


class ResultCollector:
    """A pytest plugin that records one result per check (test item)."""

    def __init__(self):
        self.results: dict[str, dict] = {}
        self.collection_errors: list[str] = []

    def pytest_runtest_logreport(self, report) -> None:
        name = report.nodeid.rsplit("::", 1)[-1]
        entry = self.results.setdefault(
            report.nodeid, {"check": name, "group": name.split("[", 1)[0], "outcome": "passed", "duration_s": 0.0, "message": ""}
        )
        entry["duration_s"] += report.duration
        if report.failed:
            entry["outcome"] = "failed" if report.when == "call" else "error"
            entry["message"] = _message(report)
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
            entry["message"] = skip_reason(report)

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self.collection_errors.append(f"{report.nodeid or '<session>'}: {_message(report)}")


def _message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and crash.message:
        return crash.message
    return str(report.longrepr).strip().splitlines()[-1] if report.longrepr else ""


def pytest_arguments(args: "argparse.Namespace", workdir: Path) -> list[str]:
    """The pytest command line that runs the built-in suite with the options of ``args``."""
    import shlex

    from weightcache.conformance import SUITE

    config = workdir / "pytest.ini"
    config.write_text("[pytest]\n")  # ignore the caller's pytest configuration
    argv = [
        str(SUITE),
        "-c",
        str(config),
        "--rootdir",
        str(workdir),
        "-p",
        "no:cacheprovider",
        "-q",
        "--tb=short",
        "--weightcache-adapter",
        args.adapter,
        "--weightcache-model",
        str(Path(args.model).resolve()),
    ]
    for flag, value in (
        ("--weightcache-quant", args.quant),
        ("--weightcache-device", args.device),
        ("--weightcache-dtype", args.dtype),
        ("--weightcache-inputs", args.inputs),
        ("--weightcache-declare-quantization", args.declare_quantization),
    ):
        if value:
            argv += [flag, value]
    for flag, values in (("--weightcache-option", args.option), ("--weightcache-tied", args.tied)):
        for value in values:
            argv += [flag, value]
    if args.no_fp8:
        argv.append("--weightcache-no-fp8")
    return argv + shlex.split(args.pytest_args or "")


def check_arguments(args: "argparse.Namespace") -> None:
    """The pre-check: stop before any check runs when the adapter, the model or an option cannot work (one line, not 86 errors)."""
    from weightcache.conformance.precheck import precheck, request_from_options

    precheck(request_from_options(args.adapter, args.model, args.quant, args.device, args.dtype, args.option))


def run(args: "argparse.Namespace") -> int:
    try:
        import pytest
    except ImportError as exc:
        print(
            f"weightcache: error: weightcache conformance runs its checks with pytest, which does not import ({exc}): "
            "pip install 'weightcache[conformance]' (or pip install pytest)",
            file=sys.stderr,
        )
        return 2

    import weightcache.conformance as kit

    check_arguments(args)
    collector = ResultCollector()
    start = time.perf_counter()
    root = logging.getLogger()
    handlers = root.handlers[:]
    for handler in handlers:  # the kit logs a warning per deliberate fallback; pytest shows what matters
        root.removeHandler(handler)
    try:
        with tempfile.TemporaryDirectory(prefix="weightcache-conformance-") as workdir:
            exit_code = int(pytest.main(pytest_arguments(args, Path(workdir)), plugins=[kit, collector]))
    finally:
        for handler in handlers:
            root.addHandler(handler)
    results = list(collector.results.values())
    if not results and exit_code == 0:
        exit_code = NO_CHECK_EXIT  # collected, none run (--collect-only): not a pass
    summary = _summary(args, results, collector.collection_errors, exit_code, time.perf_counter() - start)
    print_table(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"results written to {args.json}")
    return exit_code


def _summary(args, results: list[dict], collection_errors: list[str], exit_code: int, seconds: float) -> dict:
    counts = {outcome: sum(r["outcome"] == outcome for r in results) for outcome in ("passed", "failed", "error", "skipped")}
    no_forward = forward_skip(r["message"] for r in results if r["outcome"] == "skipped")
    return {
        "adapter": args.adapter,
        "model": str(args.model),
        "quantization": args.quant or "none",
        "device": args.device or "cpu",
        "passed": exit_code == 0,
        "verdict": verdict(exit_code, no_forward) if results else NO_CHECK_RAN,
        "forward_checks": no_forward is None,
        "exit_code": exit_code,
        "counts": counts,
        "seconds": round(seconds, 3),
        "collection_errors": collection_errors,
        "checks": [{**r, "duration_s": round(r["duration_s"], 4)} for r in results],
    }


def print_table(summary: dict, stream: typing.TextIO | None = None) -> None:
    """One row per check (parametrized variants counted together), then each failure's message."""
    stream = stream or sys.stdout
    groups: dict[str, dict[str, int]] = {}
    for result in summary["checks"]:
        counts = groups.setdefault(result["group"], {"passed": 0, "failed": 0, "error": 0, "skipped": 0})
        counts[result["outcome"]] += 1
    rows = [("CHECK", "RESULT", "PASSED", "FAILED", "SKIPPED")]
    for group, counts in groups.items():
        bad = counts["failed"] + counts["error"]
        total = sum(counts.values())
        result = "FAIL" if bad else ("SKIP" if counts["skipped"] == total else "PASS")
        rows.append((group.removeprefix("test_"), result, str(counts["passed"]), str(bad), str(counts["skipped"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    quant = summary["quantization"]
    print(
        f"\nweightcache conformance: adapter {summary['adapter']}, model {summary['model']}, "
        f"quantization {quant}, device {summary['device']}",
        file=stream,
    )
    for index, row in enumerate(rows):
        print("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip(), file=stream)
        if index == 0:
            print("  " + "  ".join("-" * width for width in widths), file=stream)
    skips: dict[str, list[str]] = {}
    for result in summary["checks"]:
        if result["outcome"] == "skipped":
            skips.setdefault(result["message"], []).append(result["check"])
    if skips:
        print("\nskipped:", file=stream)
        for reason, names in skips.items():
            print(f"  {len(names)} ({', '.join(names[:3])}{' ...' if len(names) > 3 else ''}): {reason}", file=stream)
    failures = [r for r in summary["checks"] if r["outcome"] in ("failed", "error")]
    for error in summary["collection_errors"]:
        print(f"  collection error: {error}", file=stream)
    if failures:
        print("\nfailures:", file=stream)
        by_message: dict[str, list[dict]] = {}
        for result in failures:
            by_message.setdefault(f"{result['outcome']}: {result['message']}", []).append(result)
        for message, results in by_message.items():
            shown = ", ".join(r["check"] for r in results[:3]) + (f" and {len(results) - 3} more" if len(results) > 3 else "")
            count = f"{len(results)} checks" if len(results) > 1 else "1 check"
            print(f"  {count} ({shown}) {message}", file=stream)
    counts = summary["counts"]
    said = summary.get("verdict") or verdict(summary["exit_code"], None)
    if said == NO_CHECK_RAN:
        said = f"{NO_CHECK_RAN} (pytest exit status {summary['exit_code']}; --collect-only or a -k that selects nothing?)"
    elif said == FAILED:
        said = f"{FAILED} (pytest exit status {summary['exit_code']})"
    elif said == PASSED_WITHOUT_FORWARD:
        said += " (tensors compared, outputs not: see 'skipped' above)"
    print(
        f"\n{said}: {counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
        f"{counts['skipped']} skipped in {summary['seconds']:.1f} s",
        file=stream,
    )
    stream.flush()
