"""The files under a checkpoint a process opens, recorded in the kit's fresh process: what the identity must cover.

The checkpoint identity covers the files an adapter declares (``weightcache_checkpoint_files``).
A file the adapter reads without declaring it (a Dense head in ``2_Dense/``, a pooling
config) is outside the identity: change it, and a client attaches the stale entry. The
fresh process therefore records every file under the checkpoint it opens while it
describes, loads and runs the model, through three views, as none sees every read alone:

- Python's ``open`` audit event (``open()``, ``os.open``, ``io``, ``pathlib``, ``torch.load``);
- safetensors' ``safe_open`` (it opens and maps the file in Rust, where no audit event fires),
  wrapped before anything imports it;
- the files mapped into the process when the load ends (``/proc/self/maps``).

A read by native code other than safetensors that maps nothing is not seen.
"""

from __future__ import annotations

import os
import sys
import threading
import typing
from pathlib import Path


class FileReads:
    """Records the files under ``roots`` (a checkpoint as given and as resolved) this process opens, once installed."""

    def __init__(self, root: str | os.PathLike):
        given = os.path.abspath(root)
        self.roots = tuple(dict.fromkeys((given, os.path.realpath(given))))
        self.opened: set[str] = set()
        self._lock = threading.Lock()

    def install(self) -> "FileReads":
        """Start recording: the audit hook (it cannot be removed: the process ends after the load) and safe_open."""
        sys.addaudithook(self._audit)
        _wrap_safe_open(self.record)
        return self

    def record(self, path: typing.Any) -> None:
        """Note ``path`` if it names a file under the checkpoint."""
        if isinstance(path, int) or path is None:
            return
        try:
            absolute = os.path.abspath(os.fsdecode(path))
        except (TypeError, ValueError):
            return
        if any(absolute == root or absolute.startswith(root + os.sep) for root in self.roots):
            with self._lock:
                self.opened.add(absolute)

    def _audit(self, event: str, args: tuple) -> None:
        if event == "open" and args:
            self.record(args[0])

    def mapped(self) -> None:
        """Note the files under the checkpoint mapped into this process now (Linux; elsewhere nothing)."""
        try:
            lines = Path("/proc/self/maps").read_text().splitlines()
        except OSError:
            return
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                self.record(fields[5].removesuffix(" (deleted)"))

    def read(self, root: str | os.PathLike) -> list[str]:
        """The files recorded, each relative to the checkpoint ``root`` (directories left out), sorted."""
        self.mapped()
        return sorted({relative for path in self.opened if not os.path.isdir(path) for relative in [self._relative(path)]})

    def _relative(self, path: str) -> str:
        for root in self.roots:
            if path.startswith(root + os.sep):
                return os.path.relpath(path, root)
        return os.path.basename(path)


def declared_names(root: str | os.PathLike, files: "typing.Iterable[Path]") -> set[str]:
    """The declared ``files`` relative to the checkpoint, as given and resolved (a hub snapshot's links name blobs)."""
    names = set()
    given, resolved = os.path.abspath(root), os.path.realpath(root)
    for file in files:
        names.add(os.path.relpath(os.path.abspath(file), given))
        names.add(os.path.relpath(os.path.realpath(file), resolved))
    return names


def undeclared(read: "typing.Iterable[str]", declared: "typing.Iterable[str]") -> list[str]:
    """The files read that no declaration covers, sorted."""
    covered = set(declared)
    return sorted(name for name in read if name not in covered)


def _wrap_safe_open(record: typing.Callable[[typing.Any], None]) -> None:
    """Replace ``safetensors.safe_open`` (and the name ``safetensors.torch`` imported) by one that records its file."""
    try:
        import safetensors
        import safetensors.torch
    except ImportError:
        return
    original = safetensors.safe_open
    if getattr(original, "_weightcache_recording", False):
        return

    def safe_open(filename: typing.Any, *args: typing.Any, **kwargs: typing.Any) -> typing.Any:
        record(filename)
        return original(filename, *args, **kwargs)

    safe_open._weightcache_recording = True  # type: ignore[attr-defined]
    safetensors.safe_open = safe_open  # type: ignore[misc,assignment]
    safetensors.torch.safe_open = safe_open  # type: ignore[misc,assignment]
