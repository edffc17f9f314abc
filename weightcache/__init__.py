"""weightcache: keep an inference engine's final weights resident outside the engine; attach them zero-copy.

This package is weightcache's public API, for adapter authors and engine forks: every name in ``__all__``,
imported from here (``from weightcache import hookimpl, load_model``). The modules under ``weightcache.core``,
``weightcache.adapters`` and ``weightcache.conformance`` are private and may move between minor versions; the module
paths 0.1.0 documented still import for one minor version, each with a ``DeprecationWarning`` that names the new import
(CHANGELOG.md, docs/api.md).

The names and the modules that hold them are listed once, in ``__init__.pyi`` beside this file (type checkers read it
as the package's stub). Importing this package loads nothing heavy (no torch): each name loads its module on first use.
"""

from __future__ import annotations

import ast
import importlib
import os
import typing

# In a checkout this folder holds only the public face, and the layers are its neighbours (core/, adapters/,
# conformance/, which an install maps under this package): a checkout on sys.path before an install, as pytest's
# rootdir or a script run from the checkout puts it, finds them there.
_checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_checkout, "core", "hookspecs.py")) and _checkout not in __path__:
    __path__.append(_checkout)

from weightcache.core import __version__ as __version__  # noqa: E402
from weightcache.core import old_paths  # noqa: E402


def _public_names() -> dict[str, str]:
    """Each public name and its module, read from the stub's ``from MODULE import NAME as NAME`` lines."""
    with open(os.path.join(os.path.dirname(__file__), "__init__.pyi"), encoding="utf-8") as stub:
        tree = ast.parse(stub.read())
    return {
        alias.asname or alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }


NAMES = _public_names()
"""Each public name and the private module that holds it."""

__all__ = list(NAMES)


def __getattr__(name: str) -> typing.Any:
    if name in NAMES:
        value = getattr(importlib.import_module(NAMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'weightcache' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


old_paths.keep_old_paths()
