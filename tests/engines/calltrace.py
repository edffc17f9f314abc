"""The calls an engine's own code makes, in order, to compare an engine's load with the steps an adapter replays.

A drift test runs the engine's ``load_model`` and the adapter's replay of it
on one checkpoint under ``calls`` and compares the two sequences with
``difference``: a step the engine gains or loses (anywhere below
``load_model``) shows as a name in one sequence and not the other.
"""

from __future__ import annotations

import collections
import difflib
import sys
import typing


def calls(package: str, action: typing.Callable[[], object], skip: typing.Collection[str] = ()) -> list[str]:
    """``module:qualname`` of every Python call into ``package``'s functions while ``action()`` runs, in order.

    Left out as well: the import system's probes of a module's ``__getattr__`` (``from m import x`` inside a
    function asks ``m`` for ``__path__``, and a module-level ``__getattr__`` answers it): they say where an
    import statement stands, not what a load does.

    :param skip: qualnames whose calls, and everything below them, are left out (an adapter's own set-up).
    """
    seen: list[str] = []
    skipped: list[object] = []  # the frame being skipped, if any

    def profile(frame, event, _arg):
        if skipped:
            if event == "return" and frame is skipped[0]:
                skipped.clear()
            return
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if module.partition(".")[0] != package:
            return
        qualname = frame.f_code.co_qualname
        if qualname in skip or import_probe(frame):
            skipped.append(frame)
            return
        seen.append(f"{module}:{qualname}")

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(previous)
    return seen


def import_probe(frame) -> bool:
    """Whether ``frame`` is a module-level ``__getattr__`` asked for a dunder name (``__path__``, ``__spec__``)."""
    code = frame.f_code
    if code.co_qualname != "__getattr__" or not code.co_argcount:
        return False
    name = frame.f_locals.get(code.co_varnames[0])
    return isinstance(name, str) and name.startswith("__") and name.endswith("__")


def difference(engine: list[str], replay: list[str]) -> dict[str, dict[str, int]]:
    """What the engine's sequence has that the replay lacks (``engine_only``), and the reverse (``replay_only``), counted."""
    engine_only: collections.Counter[str] = collections.Counter()
    replay_only: collections.Counter[str] = collections.Counter()
    matcher = difflib.SequenceMatcher(None, engine, replay, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            engine_only.update(engine[i1:i2])
            replay_only.update(replay[j1:j2])
    return {"engine_only": dict(sorted(engine_only.items())), "replay_only": dict(sorted(replay_only.items()))}
