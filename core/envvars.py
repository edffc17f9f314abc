"""Settings read from ``WEIGHTCACHE_*`` environment variables, parsed in one place.

An unset or empty variable means the caller's default. A value that does not parse is not silently ignored: the
default applies and one warning (once per process for each variable and value) names the variable, the value and
the values it accepts.
"""

from __future__ import annotations

import logging
import math
import os
import threading

log = logging.getLogger(__name__)

_warned: set[tuple[str, str]] = set()
_lock = threading.Lock()


def _refuse(name: str, value: str, accepted: str) -> None:
    """Warn, once per process for ``name`` and ``value``, that ``$name`` is ignored."""
    with _lock:
        if (name, value) in _warned:
            return
        _warned.add((name, value))
    log.warning("weightcache: ignoring %s=%r: it accepts %s; the default applies", name, value[:80], accepted)


def _raw(name: str) -> str:
    return os.environ.get(name, "").strip()


def switch(name: str) -> bool | None:
    """``$name`` as a switch: True for ``1``, False for ``0``, None where it is unset (the caller's default decides)."""
    value = _raw(name)
    if value in ("", "0", "1"):
        return None if not value else value == "1"
    _refuse(name, value, "1 (on) or 0 (off)")
    return None


def integer(name: str, low: int, high: int, step: int = 1, also: tuple[int, ...] = ()) -> int | None:
    """``$name`` as an integer from ``low`` to ``high`` in steps of ``step`` (or one of ``also``), None where unset."""
    value = _raw(name)
    if not value:
        return None
    number = int(value) if value.isdigit() else None
    if number is not None and (number in also or (low <= number <= high and number % step == 0)):
        return number
    steps = f" in steps of {step}" if step > 1 else ""
    extra = "".join(f" or {n}" for n in also)
    _refuse(name, value, f"an integer from {low} to {high}{steps}{extra}")
    return None


def seconds(name: str) -> float:
    """``$name`` as a number of seconds (0 or more), 0 where it is unset."""
    value = _raw(name)
    if not value:
        return 0.0
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if math.isfinite(number) and number >= 0:
        return number
    _refuse(name, value, "a number of seconds, 0 or more")
    return 0.0


env_switch = switch
"""``switch`` under its public name (``weightcache.env_switch``), for adapters with a 0/1 setting of their own."""
