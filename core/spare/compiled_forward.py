"""A compiled forward that travels with the weights: compiled once ahead of time, loaded by the next engine without tracing.

``torch.compiler.load_cache_artifacts`` (``compile_cache``) fills inductor's
caches, but a new process still runs Dynamo over the model and loads every
kernel on its first call. Here the forward is compiled with torch's
ahead-of-time compile (``torch.compile(fullgraph=True).aot_compile``): the
result, Dynamo's bytecode and guards plus inductor's compiled graph, is
serialised with ``save_compiled_function``, kept beside the entry as a sealed
memfd (the server's ``put_artifact`` op) and brought back with
``torch.compiler.load_compiled_function``: no tracing, no lowering.

What is compiled is ``model(**inputs)`` with the model passed as an argument:
its parameters and buffers are inputs of the graph, never constants baked into
the artifact, so the forward a restarted engine loads reads that engine's own
(attached) weights. Every call checks the guards torch kept (the inputs' and
parameters' dtypes, shapes, strides and devices, the model's flags); a call
they refuse is logged once and runs through a plain ``torch.compile`` of the
model instead. Calls run under ``torch.inference_mode()``.

The key adds to ``artifact_key`` Python's version, the compile mode, a digest
of the inputs' signature and one of the model's structure (its class, config
and every parameter's and buffer's name, dtype and shape). A torch without the
ahead-of-time compile falls back, with one warning, to ``compile_cache``'s
artifacts: the same calls then fill inductor's caches and compile as before.
"""

from __future__ import annotations

import builtins
import hashlib
import importlib
import inspect
import io
import json
import logging
import platform
import struct
import sys
import tempfile
import time
import types
import typing

import attrs

from weightcache.core.socket_dir import SocketDirLike
from weightcache.core.spare.compile_cache import (
    ArtifactInfo,
    artifact_key,
    fetch_beside,
    keep_beside,
    loaded_device,
    publish_artifacts,
    restore_artifacts,
    unavailable,
)

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.flow.modes import LoadedModel

log = logging.getLogger(__name__)

AHEAD_NAME = "torch.compile.aot"
_MAGIC = b"weightcache-aot\x00"
_HEADER = struct.Struct("<I")
_FRESH_GLOBALS = ("__name__", "__builtins__")
_BUILTINS = vars(builtins)
_NONE = object()
_warned_fallback: list[str] = []

Inputs = typing.Mapping[str, typing.Any]


def _call_model(model: typing.Any, inputs: Inputs) -> typing.Any:
    """What is compiled: the model is an argument, so its parameters and buffers are inputs of the graph."""
    return model(**inputs)


@attrs.define(eq=False)
class CompiledForward:
    """``model(**inputs)``, compiled: call it as the model, with keyword inputs.

    ``origin`` is ``"compiled"`` (compiled in this process) or ``"restored"``
    (loaded from the bytes kept beside the entry); ``ahead`` says whether it is
    torch's ahead-of-time compiled function (False: a plain ``torch.compile``,
    where this torch lacks it). Inputs its guards refuse run through a plain
    ``torch.compile`` of the model, logged once.
    """

    model: "torch.nn.Module"
    origin: str
    signature: str
    mode: str | None = None
    _ahead: typing.Any = attrs.field(default=None, alias="ahead_function")
    _namespace: dict[str, typing.Any] = attrs.field(factory=dict, alias="namespace")
    _plain: typing.Any = attrs.field(default=None, init=False)
    _missed: bool = attrs.field(default=False, init=False)

    @property
    def ahead(self) -> bool:
        """Whether this is torch's ahead-of-time compiled function (False: a plain ``torch.compile``)."""
        return self._ahead is not None

    def matches(self, inputs: Inputs) -> bool:
        """Whether the ahead-of-time function's guards accept ``inputs`` (always False for a plain compile)."""
        import torch

        if self._ahead is None:
            return False
        with torch.inference_mode():
            return bool(self._ahead.guard_check(self.model, dict(inputs)))

    def __call__(self, **inputs: typing.Any) -> typing.Any:
        import torch

        with torch.inference_mode():
            if self._ahead is not None:
                if self._ahead.guard_check(self.model, inputs):
                    return self._ahead.fn(self.model, inputs)
                if not self._missed:
                    self._missed = True
                    log.warning(
                        "weightcache: the compiled forward's guards refuse these inputs (%s, compiled for %s); "
                        "compiling them as usual",
                        signature_of(inputs),
                        self.signature,
                    )
            if self._plain is None:
                self._plain = torch.compile(self.model, mode=self.mode)
            return self._plain(**inputs)


def supported() -> bool:
    """Whether this torch has the ahead-of-time compile of a ``torch.compile``'d function and a loader that takes its globals."""
    import torch

    load = getattr(torch.compiler, "load_compiled_function", None)
    if load is None or not hasattr(torch._dynamo.config, "enable_aot_compile"):
        return False
    return "f_globals" in inspect.signature(load).parameters  # the first releases could not be given the globals


def compile_ahead(model: "torch.nn.Module", example_inputs: Inputs, *, mode: str | None = None) -> CompiledForward:
    """Compile ``model(**example_inputs)`` now, ahead of its first call (``mode`` as ``torch.compile`` takes it).

    Where this torch lacks the ahead-of-time compile (``supported``), or the
    model does not compile as one graph, one warning, and the model is compiled
    by a plain ``torch.compile`` run once on ``example_inputs`` (whose
    artifacts ``publish_compiled`` then keeps).
    """
    import torch

    inputs = dict(example_inputs)
    plain = CompiledForward(model, "compiled", signature_of(inputs), mode)
    if not supported():
        _warn_fallback()
        plain(**inputs)
        return plain
    namespace = _fresh_namespace()
    function = types.FunctionType(_call_model.__code__, namespace, _call_model.__name__)
    try:
        with torch._dynamo.config.patch(enable_aot_compile=True), torch.inference_mode():
            options: dict[str, typing.Any] = {"guard_filter_fn": _kept_guards}
            compiled: typing.Any = torch.compile(function, fullgraph=True, mode=mode, options=options)
            ahead = compiled.aot_compile(((model, inputs), {}))
    except Exception as exc:  # a graph break, an unserialisable guard: torch.compile as usual, its artifacts kept instead
        first_line = (str(exc).strip().splitlines() or [""])[0]
        log.warning(
            "weightcache: %s cannot be compiled ahead of time (%s: %s); compiling it as usual",
            type(model).__name__,
            type(exc).__name__,
            first_line,
        )
        plain(**inputs)
        return plain
    return attrs.evolve(plain, ahead_function=ahead, namespace=namespace)


def publish_compiled(
    loaded: "LoadedModel",
    forward: CompiledForward,
    *,
    socket_dir: SocketDirLike = None,
    timeout_s: float = 30.0,
    strict: bool = False,
) -> ArtifactInfo | None:
    """Keep ``forward`` (from ``compile_ahead`` on ``loaded.model``) beside ``loaded``'s entry.

    Returns what was kept, or None with a warning (CompileArtifactsUnavailable
    when ``strict``) when ``loaded`` has no entry, the server refused or is
    away, or the function holds state that cannot travel. A plain compile
    (this torch lacks the ahead-of-time one) publishes ``publish_artifacts``'s
    artifacts instead.
    """
    start = time.perf_counter()
    if forward._ahead is None:
        return publish_artifacts(loaded, socket_dir=socket_dir, timeout_s=timeout_s, strict=strict)
    try:
        blob = _pack(forward)
    except _Unportable as exc:
        unavailable(f"the compiled forward cannot be kept: {exc}", strict)
        return None
    key = compiled_key(loaded, forward.model, forward.signature, forward.mode)
    return keep_beside(loaded, key, blob, start, socket_dir, timeout_s, strict)


def restore_compiled(
    loaded: "LoadedModel",
    example_inputs: Inputs,
    *,
    mode: str | None = None,
    socket_dir: SocketDirLike = None,
    timeout_s: float = 30.0,
    strict: bool = False,
) -> CompiledForward | None:
    """The compiled forward kept beside ``loaded``'s entry for inputs like ``example_inputs``, on ``loaded.model``.

    None when none is kept for this key (another stack, model, compile mode or
    input signature: logged), when it cannot be loaded here or its guards
    refuse ``example_inputs`` (one warning each), or when ``loaded`` has no
    entry or the server is away (a warning; CompileArtifactsUnavailable when
    ``strict``). Where this torch lacks the ahead-of-time compile, the
    ``restore_artifacts`` artifacts are loaded and the model compiled on
    ``example_inputs`` (None when there were none).
    """
    inputs = dict(example_inputs)
    if not supported():
        _warn_fallback()
        if restore_artifacts(loaded, socket_dir=socket_dir, timeout_s=timeout_s, strict=strict) is None:
            return None
        forward = compile_ahead(loaded.model, inputs, mode=mode)
        forward.origin = "restored"
        return forward
    signature = signature_of(inputs)
    key = compiled_key(loaded, loaded.model, signature, mode)
    found = fetch_beside(loaded, key, socket_dir, timeout_s, strict)
    if found is None:
        return None
    blob, digest = found
    try:
        forward = _unpack(blob, loaded.model, signature, mode)
    except Exception as exc:  # whatever torch raises on an artifact it cannot load: a miss, never a wrong answer
        unavailable(f"the compiled forward kept beside {digest[:12]} does not load here ({type(exc).__name__}: {exc})", False)
        return None
    if not forward.matches(inputs):
        unavailable(
            f"the compiled forward kept beside {digest[:12]} refuses these inputs ({signature}); compiling as usual", False
        )
        return None
    log.info("restored a compiled forward of %d bytes from %s", len(blob), digest[:12])
    return forward


def compiled_forward(
    loaded: "LoadedModel",
    example_inputs: Inputs,
    *,
    mode: str | None = None,
    publish: bool = True,
    socket_dir: SocketDirLike = None,
    timeout_s: float = 30.0,
) -> CompiledForward:
    """``loaded.model``'s compiled forward: restored from beside its entry, else compiled now (and kept, with ``publish``)."""
    forward = restore_compiled(loaded, example_inputs, mode=mode, socket_dir=socket_dir, timeout_s=timeout_s)
    if forward is not None:
        return forward
    forward = compile_ahead(loaded.model, example_inputs, mode=mode)
    if publish and loaded.attachment is not None:
        publish_compiled(loaded, forward, socket_dir=socket_dir, timeout_s=timeout_s)
    return forward


def compiled_key(loaded: "LoadedModel", model: "torch.nn.Module", signature: str, mode: str | None) -> str:
    """The key a compiled forward is kept under: ``artifact_key``'s fields, Python, the mode, the inputs and the model."""
    parts = [
        artifact_key(loaded_device(loaded), AHEAD_NAME),
        f"python={platform.python_version()}",
        f"mode={mode or 'default'}",
        f"inputs={_short(signature)}",
        f"model={model_digest(model)}",
    ]
    return ";".join(parts)


def signature_of(inputs: Inputs) -> str:
    """The inputs as the compiled graph depends on them: each tensor's dtype, shape, stride and device, each constant's value."""
    import torch

    described = []
    for name in sorted(inputs):
        value = inputs[name]
        if isinstance(value, torch.Tensor):
            shape = "x".join(str(size) for size in value.shape)
            stride = ",".join(str(step) for step in value.stride())
            described.append(f"{name}:{str(value.dtype).removeprefix('torch.')}[{shape}/{stride}]@{value.device.type}")
        else:
            described.append(f"{name}={value!r}")
    return " ".join(described)


def model_digest(model: "torch.nn.Module") -> str:
    """A digest of what the traced code depends on besides the weights' values: class, config, names, dtypes, shapes."""
    config = getattr(model, "config", None)
    described = [f"{type(model).__module__}.{type(model).__qualname__}"]
    if config is not None:
        to_json = getattr(config, "to_json_string", None)
        described.append(to_json(use_diff=False) if callable(to_json) else repr(config))
        described.append(str(getattr(config, "_attn_implementation", None)))
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        described.append(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}:{tensor.device.type}")
    modules = _modules_and_wrappers(model)
    described += _code_of(modules)
    described += _replaced_forwards(modules)
    return _short("\n".join(described))


def _code_of(modules: typing.Sequence[tuple[str, "torch.nn.Module"]]) -> list[str]:
    """The code the trace ran: each file defining one of the model's classes or their forwards, by content, with the
    version of the package it belongs to.

    An engine on another transformers or ``kernels`` release, or a patched
    checkout, runs other code under the same class names; its forward must be
    compiled anew.
    """
    files: dict[str, str] = {}
    for kind in {type(module) for _, module in modules}:
        source = sys.modules.get(kind.__module__)
        files.setdefault(getattr(source, "__file__", None) or kind.__module__, kind.__module__)
        code = getattr(getattr(kind, "forward", None), "__code__", None)
        if code is not None and code.co_filename not in files:  # (the look through sys.modules only where needed)
            files[code.co_filename] = _module_of_file(code.co_filename) or kind.__module__
    described = []
    for path, module_name in sorted(files.items()):
        package = sys.modules.get(module_name.partition(".")[0])
        try:
            with open(path, "rb") as file:
                content = hashlib.sha256(file.read()).hexdigest()
        except OSError:
            content = "unreadable"
        described.append(f"code:{module_name}:{getattr(package, '__version__', None)}:{content}")
    return described


def _module_of_file(path: str) -> str | None:
    """The name of the imported module loaded from ``path``, if one was."""
    for name, module in list(sys.modules.items()):
        if getattr(module, "__file__", None) == path:
            return name
    return None


def _replaced_forwards(modules: typing.Sequence[tuple[str, "torch.nn.Module"]]) -> list[str]:
    """Forwards set on instances rather than on their classes (``kernels.kernelize`` sets them)."""
    described = []
    for label, module in modules:
        forward = vars(module).get("forward")
        if forward is not None:
            described.append(
                f"forward:{label}:{getattr(forward, '__module__', None)}.{getattr(forward, '__qualname__', forward)}"
            )
    return described


def _modules_and_wrappers(model: "torch.nn.Module") -> list[tuple[str, "torch.nn.Module"]]:
    """The model's modules, and the modules they keep in a dict attribute of their own rather than as submodules
    (``kernels``' per-module function wrappers, ``_kernel_funcs``), each with its name."""
    import torch

    found = []
    for name, module in model.named_modules():
        found.append((name, module))
        for attribute, value in vars(module).items():
            if isinstance(value, dict) and attribute not in ("_modules", "_parameters", "_buffers"):
                found += [
                    (f"{name}.{attribute}[{key}]", item) for key, item in value.items() if isinstance(item, torch.nn.Module)
                ]
    return found


class _Unportable(Exception):
    """The compiled function refers to something another process cannot rebuild."""


def _pack(forward: CompiledForward) -> bytes:
    """The envelope kept beside the entry: a header naming the modules Dynamo bound as globals, then torch's bytes."""
    modules, namespaces = {}, {}
    for name, value in forward._namespace.items():
        if name in _FRESH_GLOBALS or value is _BUILTINS.get(name, _NONE) or name in _provided_by_torch(forward._ahead):
            continue
        if isinstance(value, types.ModuleType):
            modules[name] = value.__name__
        elif isinstance(value, dict) and value is vars(builtins):
            namespaces[name] = "builtins"
        else:
            raise _Unportable(f"Dynamo bound the global {name!r} to a {type(value).__name__}, not a module")
    header = json.dumps({"modules": modules, "namespaces": namespaces}).encode()
    with tempfile.TemporaryDirectory(prefix="weightcache-aot-") as directory:
        path = f"{directory}/forward"
        forward._ahead.save_compiled_function(path)
        with open(path, "rb") as saved:
            data = saved.read()
    return _MAGIC + _HEADER.pack(len(header)) + header + data


def _provided_by_torch(ahead: typing.Any) -> set[str]:
    """The globals torch's artifact brings back itself: the compiled graph, the modules it imports, the values it keeps."""
    artifacts = getattr(ahead, "_artifacts", None)
    environment = getattr(artifacts, "runtime_env", None)
    return {
        str(getattr(artifacts, "backend_id", "")),
        *getattr(environment, "import_sources", {}),
        *getattr(environment, "used_globals", {}),
    }


def _unpack(blob: bytes, model: "torch.nn.Module", signature: str, mode: str | None) -> CompiledForward:
    import torch

    if not blob.startswith(_MAGIC) or len(blob) < len(_MAGIC) + _HEADER.size:
        raise ValueError("not a weightcache compiled forward")
    (size,) = _HEADER.unpack_from(blob, len(_MAGIC))
    start = len(_MAGIC) + _HEADER.size
    header = json.loads(blob[start : start + size])
    namespace = _fresh_namespace()
    namespace.update({name: importlib.import_module(module) for name, module in header["modules"].items()})
    namespace.update({name: vars(importlib.import_module(module)) for name, module in header["namespaces"].items()})
    with torch.inference_mode():
        ahead: typing.Any = torch.compiler.load_compiled_function(io.BytesIO(blob[start + size :]), f_globals=namespace)
    ahead.disable_guard_check()  # CompiledForward checks them itself, and falls back instead of raising
    return CompiledForward(model, "restored", signature, mode, ahead_function=ahead, namespace=namespace)


def _fresh_namespace() -> dict[str, typing.Any]:
    """The globals the compiled function runs in: the builtins alone, so whatever Dynamo binds there is known and can be
    carried (some torch releases look builtins such as ``type`` up in the globals themselves)."""
    return {**_builtin_names(), "__name__": __name__, "__builtins__": builtins}


def _builtin_names() -> dict[str, typing.Any]:
    return {name: value for name, value in vars(builtins).items() if not name.startswith("__")}


def _kept_guards(entries: typing.Sequence[typing.Any]) -> list[bool]:
    """Keep every guard that can be serialised: on the inputs, the model's tensors and flags, torch's global state.

    Dropped, as torch's own default for the ahead-of-time compile drops them:
    guards on globals and on object identities, which mean nothing in
    another process; the key covers what they stood for (versions, the model).
    Dropped too: guards on an object whose class was made inside a function,
    and on everything reached through it (transformers with the ``kernels``
    package wraps functions such as ``apply_rotary_pos_emb`` so), which torch
    cannot rebuild in another process; the key's digest of the model's code
    and of its replaced forwards stands for them (``model_digest``).
    """
    from torch._dynamo.guards import CheckFunctionManager

    unserializable = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    made_locally = [entry.name for entry in entries if entry.has_value and _made_in_a_function(entry.value)]
    return [
        not (
            entry.is_global
            or entry.guard_type in unserializable
            or unserializable.intersection(getattr(entry, "derived_guard_types", None) or ())
            or any(name in entry.name for name in made_locally)
        )
        for entry in entries
    ]


def _made_in_a_function(value: typing.Any) -> bool:
    """Whether ``value`` is, or is an instance of, a class defined in a function's local scope."""
    kind = value if inspect.isclass(value) else type(value)
    return "<locals>" in kind.__qualname__


def _warn_fallback() -> None:
    import torch

    if not _warned_fallback:
        _warned_fallback.append(torch.__version__)
        log.warning(
            "weightcache: torch %s has no ahead-of-time compile (torch.compiler.load_compiled_function); "
            "keeping and restoring torch.compile's cache artifacts instead",
            torch.__version__,
        )


def _short(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
