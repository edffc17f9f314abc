"""How each public module serves its names: listed once, in the stub (``.pyi``) beside it, loaded on first use.

A public module (``weightcache``, ``weightcache.adapter``, ...) holds no code of its own: each of its names lives in a
private module, and the stub's ``from MODULE import NAME as NAME`` lines say which. Type checkers read the stub; at run
time :func:`serve` reads it and gives the module its ``__getattr__``, so importing a public module loads nothing heavy.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
import typing


def stub_names(module_file: str) -> dict[str, str]:
    """Each name the stub beside ``module_file`` lists, and the private module that holds it."""
    with open(os.path.splitext(module_file)[0] + ".pyi", encoding="utf-8") as stub:
        tree = ast.parse(stub.read())
    return {
        alias.asname or alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }


def serve(
    module_name: str, module_file: str
) -> tuple[dict[str, str], typing.Callable[[str], typing.Any], typing.Callable[[], list[str]]]:
    """The public module's names (``NAMES``), its ``__getattr__`` and its ``__dir__``."""
    names = stub_names(module_file)

    def __getattr__(name: str) -> typing.Any:
        if name in names:
            value = getattr(importlib.import_module(names[name]), name)
            setattr(sys.modules[module_name], name, value)
            return value
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[module_name]), *names})

    return names, __getattr__, __dir__
