"""The installed adapters (``Plugins``) and the typed facade the rest of the core calls (``Adapter``).

Adapters register through the entry-point group ``weightcache.adapters`` (the
built-in ``hf``, ``vllm`` and ``sglang`` too) or in-process with
``Plugins.from_modules``. Either way each adapter is checked when it is
registered: every ``weightcache_*`` function must be a known hook carrying the
``hookimpl`` marker, with arguments its spec has, and the required hooks must be
there. An installed adapter that fails to import or to pass these checks is
reported by name and skipped; the others keep working.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import importlib.util
import logging
import os
import sys
import typing

import attrs
import pluggy

from weightcache.core import hookspecs
from weightcache.core.errors import AdapterNotFound, InvalidAdapter, InvalidOption, UnknownOption
from weightcache.core.layout.manifest import Manifest
from weightcache.core.options import AdapterOption, declared_options
from weightcache.core.request import CheckpointConventions, ModelDescription

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.identity.declared import CheckpointFiles
    from weightcache.core.load.export import ArenaBuilder
    from weightcache.core.request import ExampleInputs, LoadRequest

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "weightcache.adapters"
ENV_BLOCK = "WEIGHTCACHE_BLOCK_ADAPTERS"
CORE_PLUGIN = "weightcache.core.flow.defaults"
HOOK_PREFIX = "weightcache_"
SPEC_NAMES = frozenset(name for name in vars(hookspecs) if name.startswith(HOOK_PREFIX))


def blocked_adapters() -> list[str]:
    """Adapter names listed in ``$WEIGHTCACHE_BLOCK_ADAPTERS`` (comma-separated): never loaded."""
    return [name.strip() for name in os.environ.get(ENV_BLOCK, "").split(",") if name.strip()]


def check_adapter_module(module: object, name: str) -> None:
    """Raise InvalidAdapter unless ``module`` is a well-formed adapter.

    Every ``weightcache_*`` attribute must be a hook spec's name and carry the
    ``hookimpl`` marker; the required hooks (``hookspecs.REQUIRED_HOOKS``) must be there;
    a retired name (``hookspecs.RETIRED_HOOKS``) is refused with its successor's.
    """
    marker = f"{hookspecs.PROJECT}_impl"
    problems = []
    for attr in sorted(dir(module)):
        value = getattr(module, attr, None)
        if not attr.startswith(HOOK_PREFIX) or not callable(value):
            continue
        if attr in hookspecs.RETIRED_HOOKS:
            problems.append(f"{attr} was retired: rename it to {hookspecs.RETIRED_HOOKS[attr]}")
        elif attr not in SPEC_NAMES:
            close = difflib.get_close_matches(attr, SPEC_NAMES, n=1)
            problems.append(f"{attr} is not a weightcache hook" + (f" (did you mean {close[0]}?)" if close else ""))
        elif not hasattr(value, marker):
            problems.append(f"{attr} lacks the @hookimpl marker (from weightcache.core.hookspecs import hookimpl)")
    for hook in hookspecs.REQUIRED_HOOKS:
        if not callable(getattr(module, hook, None)):
            problems.append(f"the required hook {hook} is missing")
    if problems:
        raise InvalidAdapter(name, problems)


@attrs.define
class Plugins:
    """The adapters of this process: a pluggy manager holding them and the core defaults, and the broken ones.

    ``Plugins.installed()`` loads the entry-point group; ``Plugins.from_modules``
    registers modules in-process (tests, notebooks). ``adapter(name)`` gives one
    adapter's facade.
    """

    pm: pluggy.PluginManager
    broken: dict[str, str] = attrs.field(factory=dict)

    @classmethod
    def empty(cls) -> "Plugins":
        """The specs and the core defaults, no adapter."""
        from weightcache.core.flow import defaults

        pm = pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        pm.register(defaults, name=CORE_PLUGIN)
        return cls(pm)

    @classmethod
    def installed(cls) -> "Plugins":
        """Every adapter of the ``weightcache.adapters`` entry points, except blocked and broken ones."""
        plugins = cls.empty()
        blocked = set(blocked_adapters())
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if entry_point.name in blocked or plugins.pm.has_plugin(entry_point.name):
                continue
            try:
                plugins.register(entry_point.load(), entry_point.name)
            except Exception as exc:
                reason = str(exc) if isinstance(exc, InvalidAdapter) else f"{type(exc).__name__}: {exc}"
                plugins.broken[entry_point.name] = f"entry point {entry_point.value!r}: {reason}"
                log.warning(
                    "weightcache: adapter %r is broken and was skipped (%s); fix or uninstall its package, or set %s=%s",
                    entry_point.name,
                    plugins.broken[entry_point.name],
                    ENV_BLOCK,
                    entry_point.name,
                )
        return plugins

    @classmethod
    def from_modules(cls, adapters: "typing.Mapping[str, object]", installed: bool = False) -> "Plugins":
        """The adapters ``{name: module}`` registered in-process (checked), plus the installed ones if asked."""
        plugins = cls.installed() if installed else cls.empty()
        for name, module in adapters.items():
            plugins.register(module, name)
        return plugins

    def register(self, module: object, name: str) -> None:
        """Check ``module`` as an adapter and register it under ``name``; InvalidAdapter names what is wrong."""
        check_adapter_module(module, name)
        try:
            self.pm.register(module, name=name)
            self.pm.check_pending()
        except (pluggy.PluginValidationError, ValueError) as exc:
            if self.pm.has_plugin(name):
                self.pm.unregister(name=name)
            raise InvalidAdapter(name, [str(exc)]) from None

    def names(self) -> list[str]:
        """The usable adapters' names: registered, and the engine each needs is installed."""
        return sorted(
            name
            for name, plugin in self.pm.list_name_plugin()
            if plugin is not None and name != CORE_PLUGIN and not missing_engines(plugin)
        )

    def adapter(self, name: str) -> "Adapter":
        """The facade of adapter ``name``; AdapterNotFound says what is installed, broken, blocked or lacks its engine."""
        plugin = self.pm.get_plugin(name) if name != CORE_PLUGIN else None
        missing = missing_engines(plugin) if plugin is not None else []
        if plugin is None or missing:
            raise AdapterNotFound(name, self.names(), self.broken, name in blocked_adapters(), missing)
        return Adapter(self.pm, name)


ENGINE_PACKAGES_ATTR = "ENGINE_PACKAGES"
"""An adapter module's optional tuple of the import names of the engine it drives (``("vllm",)``): without them
installed the adapter is not usable, and asking for it says what to install."""


def missing_engines(module: object) -> list[str]:
    """The engine packages ``module`` declares (``ENGINE_PACKAGES``) that are not installed."""
    return [package for package in getattr(module, ENGINE_PACKAGES_ATTR, ()) if importlib.util.find_spec(package) is None]


_INSTALLED: list[Plugins] = []
_KEPT: list[tuple[Plugins, ScanInputs]] = []
"""A scan made before this process was forked from a launcher, and what it read."""


def installed_plugins() -> Plugins:
    """The installed adapters, loaded once per process (in a process forked from a launcher: the launcher's scan, where
    everything that scan read is unchanged here)."""
    if not _INSTALLED:
        kept = _KEPT.pop() if _KEPT else None
        _INSTALLED.append(kept[0] if kept is not None and kept[1].still_hold() else Plugins.installed())
    return _INSTALLED[0]


def keep_for_forks(path: typing.Sequence[str]) -> None:
    """Scan the adapters' entry points now as a process whose ``sys.path`` is ``path`` would, for the processes forked
    from this one: the first ``installed_plugins()`` of each takes the result where what the scan read still holds
    there, and scans itself otherwise. A scan this process made for itself (on its own ``sys.path``) is forgotten; a
    scan that found a broken adapter is not kept (each process reports it as its own scan would)."""
    _INSTALLED.clear()
    _KEPT.clear()
    if any(not os.path.isabs(entry) and _holds_distributions(entry) for entry in path):
        return  # a relative entry is read in each process's working directory
    saved = sys.path[:]
    sys.path[:] = path
    try:
        inputs = ScanInputs.now()  # before the scan: what changes during it shows as a difference afterwards
        plugins = Plugins.installed()
    finally:
        sys.path[:] = saved
    if not plugins.broken:
        _KEPT.append((plugins, inputs))


@attrs.frozen
class ScanInputs:
    """What a scan of the entry points reads: the path entries in order, each directory's modification time (installing
    or removing a distribution adds or removes a directory there; a relative entry, read in the working directory, has
    none and must hold no distribution), the finders that look for distributions, and the block-list. A scan with the
    same inputs finds the same adapters."""

    path: tuple[str, ...]
    mtimes: tuple[int | None, ...]
    finders: tuple[object, ...] = attrs.field(eq=False)
    blocked: str | None

    @classmethod
    def now(cls) -> ScanInputs:
        path = tuple(dict.fromkeys(sys.path))
        mtimes = tuple(_mtime(entry) if os.path.isabs(entry) else None for entry in path)
        return cls(path, mtimes, tuple(sys.meta_path), os.environ.get(ENV_BLOCK))

    def still_hold(self) -> bool:
        """Whether a scan now, on this process's ``sys.path``, finders and environment, reads what this one read: the
        same entries in the same order with unchanged directories, and no distribution in an entry it did not read."""
        if os.environ.get(ENV_BLOCK) != self.blocked or len(sys.meta_path) != len(self.finders):
            return False
        if any(mine is not theirs for mine, theirs in zip(sys.meta_path, self.finders, strict=True)):
            return False
        scanned = dict(zip(self.path, self.mtimes, strict=True))
        order = []
        for entry in dict.fromkeys(sys.path):
            if entry in scanned:
                order.append(entry)
            if entry in scanned and os.path.isabs(entry):
                if _mtime(entry) != scanned[entry]:
                    return False
            elif _holds_distributions(entry):
                return False
        return tuple(order) == self.path


def _mtime(entry: str) -> int | None:
    try:
        return os.stat(entry).st_mtime_ns
    except OSError:
        return None


def _holds_distributions(entry: str) -> bool:
    """Whether ``entry`` of ``sys.path`` may hold a distribution's metadata (a file, e.g. a zip, may)."""
    try:
        names = os.listdir(entry or ".")
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return entry.lower().endswith(".egg") or any(name.lower().endswith((".dist-info", ".egg-info")) for name in names)


def _kind(value: object) -> str:
    return type(value).__name__ if value is not None else "None"


class Adapter:
    """One adapter's hooks (with the core defaults behind them), called by keyword.

    Every result is checked where it comes back: a wrong type is an InvalidAdapter
    naming the adapter and the hook, never an error deep inside the core.
    """

    def __init__(self, pm: pluggy.PluginManager, name: str):
        self.name = name
        others = [plugin for other, plugin in pm.list_name_plugin() if plugin is not None and other not in (name, CORE_PLUGIN)]
        self._pm = pm
        self._others = others

    def _hook(self, hook: str):
        return self._pm.subset_hook_caller(hook, remove_plugins=self._others)

    def implements(self, hook: str) -> bool:
        """Whether this adapter (not the core's defaults) implements ``hook``."""
        core = self._pm.get_plugin(CORE_PLUGIN)
        return any(impl.plugin is not core for impl in self._hook(hook).get_hookimpls())

    def contract_error(self, hook: str, problem: str) -> InvalidAdapter:
        """The error for ``hook`` breaking its contract (``problem`` says how and what to return instead)."""
        return InvalidAdapter(self.name, [problem], hook=hook)

    def options(self) -> dict[str, AdapterOption]:
        """The options this adapter reads, typed (a help text alone becomes an untyped AdapterOption)."""
        try:
            return declared_options(self._hook("weightcache_options")() or {})
        except TypeError as exc:
            raise self.contract_error("weightcache_options", str(exc)) from None

    def check_options(self, request: "LoadRequest") -> None:
        """Raise UnknownOption for an option the adapter does not declare, InvalidOption for a value it does not allow."""
        known = self.options()
        unknown = sorted(name for name, _ in request.options if name not in known)
        if unknown:
            raise UnknownOption(self.name, unknown, {name: option.help for name, option in known.items()})
        for name, value in request.options:
            problem = known[name].problem(value)
            if problem:
                raise InvalidOption(self.name, name, value, problem, known[name].help)

    def describe(self, request: "LoadRequest") -> ModelDescription:
        description = self._required("weightcache_describe", request=request)
        if not isinstance(description, ModelDescription):
            raise self.contract_error(
                "weightcache_describe",
                f"it returned a {_kind(description)}; return a weightcache.core.request.ModelDescription",
            )
        if description.dtype is None:
            raise self.contract_error(
                "weightcache_describe",
                "its ModelDescription has no dtype; set dtype= to the dtype unquantized weights will have "
                "(the request's, else the checkpoint's own)",
            )
        return description

    def quantization_allowlist(self, request: "LoadRequest") -> tuple[str, ...]:
        methods = self._hook("weightcache_quantization_allowlist")(request=request) or ()
        if isinstance(methods, (str, bytes)) or not isinstance(methods, typing.Iterable):
            raise self.contract_error(
                "weightcache_quantization_allowlist", f"it returned a {_kind(methods)}; return a tuple of method names"
            )
        methods = tuple(methods)
        if not all(isinstance(method, str) for method in methods):
            raise self.contract_error(
                "weightcache_quantization_allowlist", f"it returned {methods!r:.200}; every method name is a str"
            )
        return methods

    def load(self, request: "LoadRequest", builder: "ArenaBuilder | None") -> "torch.nn.Module":
        return self._module("weightcache_load", request=request, builder=builder)

    def load_tensors(
        self, request: "LoadRequest", tensors: "typing.Mapping[str, torch.Tensor]", builder: "ArenaBuilder"
    ) -> "torch.nn.Module":
        result = self._hook("weightcache_load_tensors")(request=request, tensors=tensors, builder=builder)
        if result is None:
            raise self.contract_error(
                "weightcache_load_tensors",
                "it is not implemented, so this adapter cannot publish a version from tensors in memory; "
                "save the tensors as a checkpoint and load that with `weightcache load`",
            )
        import torch

        if not isinstance(result, torch.nn.Module):
            raise self.contract_error("weightcache_load_tensors", f"it returned a {_kind(result)}; return a torch.nn.Module")
        return result

    def post_process(self, request: "LoadRequest", model: "torch.nn.Module", description: ModelDescription) -> "torch.nn.Module":
        return self._module("weightcache_post_process", request=request, model=model, description=description)

    def export(self, request: "LoadRequest", model: "torch.nn.Module", builder: "ArenaBuilder") -> Manifest:
        return self._typed("weightcache_export", Manifest, request=request, model=model, builder=builder)

    def manifest_extra(self, request: "LoadRequest", model: "torch.nn.Module") -> dict:
        extra = self._hook("weightcache_manifest_extra")(request=request, model=model) or {}
        if not isinstance(extra, typing.Mapping):
            raise self.contract_error("weightcache_manifest_extra", f"it returned a {_kind(extra)}; return a JSON-able dict")
        return dict(extra)

    def rebind(
        self,
        request: "LoadRequest",
        tensors: "dict[str, torch.Tensor]",
        manifest: Manifest,
        description: ModelDescription,
    ) -> "torch.nn.Module":
        return self._module("weightcache_rebind", request=request, tensors=tensors, manifest=manifest, description=description)

    def example_inputs(self, request: "LoadRequest", model: "torch.nn.Module") -> "ExampleInputs":
        return self._required("weightcache_example_inputs", request=request, model=model)

    def checkpoint_conventions(self, request: "LoadRequest") -> CheckpointConventions:
        return self._typed("weightcache_checkpoint_conventions", CheckpointConventions, request=request)

    def checkpoint_files(self, request: "LoadRequest") -> "CheckpointFiles":
        from weightcache.core.identity.declared import CheckpointFiles

        return self._typed("weightcache_checkpoint_files", CheckpointFiles, request=request)

    def warm_up(self, request: "LoadRequest", for_publish: bool = False) -> None:
        self._hook("weightcache_warm_up")(request=request, for_publish=for_publish)

    def _required(self, hook: str, **kwargs) -> typing.Any:
        result = self._hook(hook)(**kwargs)
        if result is None:
            raise self.contract_error(hook, "it returned None; it must return a value for this request")
        return result

    def _typed(self, hook: str, kind: type, **kwargs) -> typing.Any:
        result = self._required(hook, **kwargs)
        if not isinstance(result, kind):
            raise self.contract_error(hook, f"it returned a {_kind(result)}; return a {kind.__module__}.{kind.__name__}")
        return result

    def _module(self, hook: str, **kwargs) -> "torch.nn.Module":
        import torch

        return self._typed(hook, torch.nn.Module, **kwargs)
