"""0.1.0's module paths and where each lives now, and the import hook that keeps them working, warning, for one minor
version.

The package ``weightcache`` installs the hook (:func:`keep_old_paths`) when it is imported, which every
``import weightcache.…`` does first; each warning names the public import to use instead (the package's ``NAMES``).
Modules are named here as strings and imported only when an old path is asked for: this module sits in the foundation
and imports no layer.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
import typing
import warnings

if typing.TYPE_CHECKING:
    import importlib.abc

DEPRECATED_SINCE = "0.2.0"
REMOVED_IN = "0.3.0"

MOVED: dict[str, str] = {
    f"weightcache.core.{old}": f"weightcache.core.{new}"
    for old, new in {
        "admission": "server.admission",
        "api": "flow.api",
        "arena.driver": "cuda_driver",
        "attach": "client.attach",
        "bounds": "server.bounds",
        "cli_options": "cli.cli_options",
        "compile_cache": "spare.compile_cache",
        "connections": "server.connections",
        "defaults": "flow.defaults",
        "demo": "cli.demo",
        "digests": "identity.digests",
        "entry_record": "server.entry_record",
        "example_inputs": "flow.example_inputs",
        "export": "load.export",
        "exporter": "server.exporter",
        "fdstore": "server.fdstore",
        "fill": "node.fill",
        "handover": "server.handover",
        "hub": "identity.hub",
        "loader": "flow.loader",
        "logformat": "cli.logformat",
        "manifest": "layout.manifest",
        "metrics": "server.metrics",
        "modes": "flow.modes",
        "paths": "wire.paths",
        "plugins": "flow.plugins",
        "prefetch": "load.prefetch",
        "preflight": "load.preflight",
        "probe": "cli.probe",
        "protocol": "wire.protocol",
        "publish": "load.publish",
        "reader": "load.reader",
        "readiness": "server.readiness",
        "rebind": "load.rebind",
        "reexec": "server.reexec",
        "registry": "server.registry",
        "reporting": "cli.reporting",
        "rewarm": "server.rewarm",
        "safetensors_io": "identity.safetensors_io",
        "seed": "cli.seed",
        "seeding": "node.seeding",
        "serve_config": "server.serve_config",
        "server_process": "server.server_process",
        "standby": "spare.standby",
        "tensor_table": "layout.tensor_table",
        "verify": "cli.verify",
        "views": "layout.views",
        "warm": "spare.warm",
        "watch": "client.watch",
    }.items()
}
"""Each module of 0.1.0 that moved into a layer's folder, and its module now; imported through :class:`OldPaths`."""

FOLDED: dict[str, str] = {
    f"weightcache.core.{name}": f"weightcache.core.{name}.{name}" for name in ("cli", "client", "identity", "server")
}
"""Modules of 0.1.0 whose path is now a folder of the same name: the package serves the old module's names
(:func:`old_names`), from the module of that name inside it."""


def public_import(module: str, name: str | None = None) -> str:
    """How to import ``name`` of ``module`` (or what ``module`` offers) from now on: public names from the public module
    that lists them (``weightcache``, ``weightcache.adapter``, ...; the first that does), anything else from the private
    module that holds it now. A module whose public names one public module lists whole is named alone."""
    faces = getattr(sys.modules.get("weightcache"), "public_names", None)
    listed = {
        face: sorted(n for n, home in names.items() if home == module) for face, names in (faces() if faces else {}).items()
    }
    offered = sorted({n for names in listed.values() for n in names})
    if name is not None:
        offered = [name] if name in offered else []
    whole = next((face for face, names in listed.items() if offered and set(offered) <= set(names)), None)
    if whole is not None:
        return f"use from {whole} import {', '.join(offered)}"
    parts, placed = [], set()
    for face, names in listed.items():
        if here := [n for n in names if n in offered and n not in placed]:
            parts.append(f"from {face} import {', '.join(here)}")
            placed.update(here)
    if parts:
        return "use " + "; ".join(parts)
    private = f"from {module} import {name}" if name else f"import {module}"
    return f"use {private} (a private path that may move again: ask for a public name if you need one)"


def _warn(message: str) -> None:
    """A DeprecationWarning pointing at the code that asked for an old path, past this module and the import system."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 2
    while frame is not None and (frame.f_code.co_filename in (__file__, importlib.__file__) or _bootstrap(frame)):
        level += not _bootstrap(frame)  # warnings skips the import system's bootstrap frames itself
        frame = frame.f_back
    warnings.warn(message, DeprecationWarning, stacklevel=level)


def _bootstrap(frame: types.FrameType) -> bool:
    return "importlib" in frame.f_code.co_filename and "_bootstrap" in frame.f_code.co_filename


def _deprecated(old: str, new: str, name: str | None = None) -> str:
    return f"{old} is deprecated since weightcache {DEPRECATED_SINCE} and goes in {REMOVED_IN}: {public_import(new, name)}"


class OldPaths:
    """Imports each module path of :data:`MOVED` as a thin module that warns once and serves its new module's names.

    A meta path finder and its loader in one: the import protocol's three methods, without ``importlib.abc``, whose own
    imports every ``import weightcache`` would pay for."""

    def find_spec(
        self, fullname: str, path: typing.Any = None, target: typing.Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(fullname, typing.cast("importlib.abc.Loader", self)) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module object

    def exec_module(self, module: types.ModuleType) -> None:
        new = MOVED[module.__name__]
        target = importlib.import_module(new)
        module.__doc__ = f"Deprecated: {module.__name__} is {new} now; {public_import(new)}."
        module.__getattr__ = lambda name: getattr(target, name)  # type: ignore[method-assign]
        module.__dir__ = lambda: dir(target)  # type: ignore[method-assign]
        _warn(_deprecated(module.__name__, new))


def keep_old_paths() -> None:
    """Make 0.1.0's module paths importable in this process (once; a second call does nothing)."""
    if not any(isinstance(finder, OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(OldPaths())


def old_names(package: str) -> typing.Callable[[str], typing.Any]:
    """The ``__getattr__`` of a package in :data:`FOLDED`: a name its 0.1.0 module had comes from the module inside it,
    with a DeprecationWarning; the package's own submodules and private names are left to the import system."""
    module = FOLDED[package]

    def __getattr__(name: str) -> typing.Any:
        import importlib.util  # only once an attribute is missing: ``import weightcache`` stays without it

        if name.startswith("_") or importlib.util.find_spec(f"{package}.{name}") is not None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        _warn(_deprecated(f"{package}.{name}", module, name))
        setattr(sys.modules[package], name, value)  # warned once: later reads find the name itself
        return value

    return __getattr__
