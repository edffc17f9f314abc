"""What a kit run concludes, in one word for the CLI and the pytest form alike: PASSED, PASSED without forward checks, FAILED.

A run whose forward checks were skipped (the adapter's ``weightcache_example_inputs``
said ``ForwardUnavailable``, or its default could build no inputs) compared
tensors only: it never ends in a plain PASSED.
"""

from __future__ import annotations

import typing

NO_FORWARD = "no forward pass for this model here"
"""How every skip of a forward check begins (``disk_outputs``); the reason follows after a colon."""

PASSED = "PASSED"
PASSED_WITHOUT_FORWARD = "PASSED without forward checks"
FAILED = "FAILED"
NO_CHECK_RAN = "no check ran"
"""The verdict of a run that collected checks but ran none (``--collect-only``, a ``-k`` that selects nothing)."""
NO_CHECK_EXIT = 5
"""The exit status of such a run from ``weightcache conformance`` (pytest's own for "no tests ran"): never a pass."""


def forward_skip(messages: "typing.Iterable[str]") -> str | None:
    """The first skip message that says the forward checks did not run, or None."""
    return next((message for message in messages if message.startswith(NO_FORWARD)), None)


def verdict(exit_code: int, forward_skipped: str | None) -> str:
    """The run's verdict: FAILED unless pytest exited 0; PASSED only if the forward checks ran."""
    if exit_code != 0:
        return FAILED
    return PASSED_WITHOUT_FORWARD if forward_skipped else PASSED


def skip_reason(report: typing.Any) -> str:
    """Why pytest skipped the check of ``report`` (its message without pytest's ``Skipped:`` prefix)."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr or "")
