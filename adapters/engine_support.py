"""What the engine adapters (vLLM, SGLang) need around an engine's own code, beyond the core's one contract.

- ``Registrations`` and ``isolated``: an engine's process-wide tables (layer
  names, cached rotary embeddings) when one process builds a model more than once.
- ``check_publishable``: refuse a model whose weights moved into Python-side kernel state.
- ``no_writes_into``: turn an engine's write into mapped (read-only) weights into
  an error naming the tensor, instead of a SIGSEGV or a device fault.
- ``refuse_reload``, ``lazy_class``, ``entry_bytes``: the engines' loader classes.
- ``PrivateName``: an engine's private name an adapter relies on, looked up with
  an error that names it when a newer engine dropped it.
- ``ENGINE_LOADED_TENSORS``: what the engine adapters tell the conformance kit of their checkpoints' tensors.

The modes themselves (off, daemon, client, fallback, publish) are the core's
(``weightcache.core.flow.modes``). No engine is imported here.
"""

from __future__ import annotations

import bisect
import contextlib
import importlib
import json
import logging
import os
import typing
from collections.abc import Callable, Iterator

import attrs

from weightcache import AccessDenied, ServerUnavailable, SocketDirLike
from weightcache.adapter import RebindError
from weightcache.engine import ATTACHMENT_ATTR

if typing.TYPE_CHECKING:
    import torch

    from weightcache.adapter import Fingerprint, Manifest, ModelDescription

log = logging.getLogger(__name__)

ENGINE_LOADED_TENSORS = (
    (
        ".*",
        "the engine's own load_weights maps each checkpoint tensor into its parameters (fusing projections and experts "
        "under its own names) and refuses one it does not know",
    ),
)
"""``CheckpointConventions.unused_tensors`` of the engine adapters: the kit cannot match checkpoint names to the
engine's fused parameters one by one, so it leaves that to the engine's loader (the parity checks still compare every
published tensor with the engine's own disk load)."""

EngineModelConfig = typing.Any
"""vLLM's ``vllm.config.ModelConfig`` or SGLang's ``ModelConfig``: neither engine is imported here."""


class Registrations:
    """Keys a model build adds to an engine's process-wide tables (layer names, cached rotary embeddings).

    Daemon mode builds the model twice in one process: once to load and
    publish, once on meta to rebind. The published model's entries must go
    before the second build (the engines clear these tables themselves when
    they drop a model), or it would reuse a rotary cache whose buffers were
    freed once copied into the arenas, or refuse a duplicate layer name.
    """

    def __init__(self, tables: "typing.Iterable[dict]"):
        self.tables = tuple(tables)
        self.added: list[tuple[dict, object]] = []

    @contextlib.contextmanager
    def recorded(self) -> Iterator[None]:
        """Record the keys added while the block runs."""
        before = [set(table) for table in self.tables]
        try:
            yield
        finally:
            for table, keys in zip(self.tables, before, strict=True):
                self.added += [(table, key) for key in table if key not in keys]

    def forget(self) -> None:
        """Remove the recorded keys."""
        for table, key in self.added:
            table.pop(key, None)
        self.added = []


def engine_description(
    model_config: EngineModelConfig, *, engine: str, engine_version: str, method: str, quant_config: dict, extra: dict
) -> "ModelDescription":
    """The ModelDescription of an engine's model from its ModelConfig (vLLM's and SGLang's alike).

    The full Hugging Face config (JSON), the architectures, the dtype the engine
    resolved, the checked quantization method and the engine's own key fields (``extra``).
    """
    from weightcache import __version__
    from weightcache.adapter import ModelDescription

    return ModelDescription(
        architecture=",".join(getattr(model_config.hf_config, "architectures", None) or []),
        config=json.loads(model_config.hf_config.to_json_string(use_diff=False)),
        dtype=str(model_config.dtype).removeprefix("torch."),
        quantization=method,
        quantization_config=quant_config,
        adapter_version=__version__,
        engine=engine,
        engine_version=engine_version,
        extra=extra,
    )


def checkpoint_dir(model: str, revision: str | None, load_config: typing.Any, download: Callable[..., str]) -> str:
    """The local directory of the checkpoint's safetensors files: ``model`` itself, else what ``download`` fetched.

    ``download`` is the engine's own ``download_weights_from_hf`` (vLLM's and SGLang's take the same arguments);
    ``load_config`` is the engine's LoadConfig (its download directory and ignore patterns).
    """
    if os.path.isdir(model):
        return model
    return download(model, load_config.download_dir, ["*.safetensors"], revision, ignore_patterns=load_config.ignore_patterns)


@contextlib.contextmanager
def isolated(table: dict) -> Iterator[None]:
    """Run a model build with the process-wide cache ``table`` empty, then put its entries back.

    The build neither reuses a module another model holds (a rotary embedding
    built on meta, or one whose buffers now view an arena that may be unmapped)
    nor leaves its own modules for the next build to share.
    """
    saved = dict(table)
    table.clear()
    try:
        yield
    finally:
        table.clear()
        table.update(saved)


@attrs.frozen
class HeldReferences:
    """Parameters and buffers a module also keeps in a helper object, to point at the bound tensors after a rebind.

    Engines hand a parameter to a plain object beside the module: SGLang's MoE
    ``TopKConfig`` and vLLM's CPU MoE router keep the gate's
    ``e_score_correction_bias`` (DeepSeek-V3). A rebind replaces the
    Parameter in the module; the helper would go on reading the meta tensor
    the model was built with. Found one level deep: a dataclass's fields or a
    plain object's attributes, in any module's attributes.
    """

    held: tuple[tuple[object, str, str], ...]  # (helper, attribute, tensor name)

    @classmethod
    def of(cls, model: "torch.nn.Module") -> "HeldReferences":
        """The references in ``model`` as built (before the rebind)."""
        import torch

        named = {id(tensor): name for name, tensor in _named_tensors(model).items()}
        held = []
        for module in model.modules():
            for helper in vars(module).values():
                if isinstance(helper, (torch.nn.Module, torch.Tensor, type)) or not hasattr(helper, "__dict__"):
                    continue
                for attribute, value in list(vars(helper).items()):
                    name = named.get(id(value))
                    if name is not None:
                        held.append((helper, attribute, name))
        return cls(tuple(held))

    def point_at_bound(self, model: "torch.nn.Module") -> None:
        """Point each reference at the tensor ``model`` now holds under that name."""
        bound = _named_tensors(model)
        for helper, attribute, name in self.held:
            object.__setattr__(helper, attribute, bound[name])  # the helper may be a frozen dataclass


def _named_tensors(model: "torch.nn.Module") -> "dict[str, torch.Tensor]":
    return dict((*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)))


def check_publishable(model: "torch.nn.Module") -> None:
    """Refuse a model whose post-processing emptied parameters (their weight now lives in a kernel handle held in Python).

    vLLM's CPU backend, for one, repacks linear weights into oneDNN handles and
    leaves an empty parameter behind: mapped elsewhere, it would compute with nothing.
    """
    empty = [name for name, param in model.named_parameters() if param.numel() == 0]
    if empty:
        shown = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        raise RuntimeError(
            f"post-processing left {len(empty)} parameters empty ({shown}): the engine moved these weights into "
            "Python-side kernel state that weightcache cannot share; load this model with mode 'off'"
        )


INPLACE_DUNDERS = frozenset(
    f"__i{op}__"
    for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift", "matmul")
) | {"__setitem__"}
NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "set_", "retain_grad", "_fix_weakref"})
"""Methods whose names end in ``_`` but leave the tensor's bytes alone."""


class MappedRanges:
    """The byte ranges of mapped tensors, for asking which one (if any) a tensor's memory lies in."""

    def __init__(self, tensors: "typing.Mapping[str, torch.Tensor]", manifest: "Manifest"):
        spans = []
        for record in manifest.tensors:
            tensor = tensors.get(record.name)
            if tensor is not None and record.nbytes:
                spans.append((tensor.data_ptr(), tensor.data_ptr() + record.nbytes, record.name))
        spans.sort()
        self.starts = [start for start, _, _ in spans]
        self.spans = spans

    def name_of(self, tensor: "torch.Tensor") -> str | None:
        """The mapped tensor whose bytes ``tensor`` starts in, else None."""
        if tensor.device.type == "meta" or not tensor.numel():
            return None
        pointer = tensor.data_ptr()
        index = bisect.bisect_right(self.starts, pointer) - 1
        if index >= 0 and pointer < self.spans[index][1]:
            return self.spans[index][2]
        return None


def _written(func, args, kwargs) -> list:
    name = getattr(func, "__name__", "")
    targets = []
    if args and ((name.endswith("_") and not name.endswith("__") and name not in NOT_WRITES) or name in INPLACE_DUNDERS):
        targets.append(args[0])
    out = (kwargs or {}).get("out")
    targets += list(out) if isinstance(out, (list, tuple)) else [out]
    return targets


@contextlib.contextmanager
def no_writes_into(tensors: "typing.Mapping[str, torch.Tensor]", manifest: "Manifest", what: str) -> Iterator[None]:
    """Raise RebindError, naming the tensor and the operation, when code in the block writes into mapped weights.

    The arenas are mapped read-only and shared with other engines: a write
    would be a SIGSEGV on the host backend and a device fault on a GPU. Only
    writes through torch's Python API are seen (in-place methods, ``out=``).

    :param what: the code that runs in the block (for the message).
    """
    import torch

    ranges = MappedRanges(tensors, manifest)

    class Guard(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            for target in _written(func, args, kwargs):
                name = ranges.name_of(target) if isinstance(target, torch.Tensor) else None
                if name is not None:
                    raise RebindError(
                        f"{what} writes into the mapped weight {name} ({getattr(func, '__qualname__', func)}); "
                        "the arenas are shared read-only: give this engine a private copy of that tensor "
                        "before it runs, or let it create the tensor anew and map the cached one afterwards"
                    )
            return func(*args, **(kwargs or {}))

    with Guard():
        yield


def refuse_reload(model: "torch.nn.Module") -> None:
    """Raise if ``model`` maps a cached entry: writing weights in place would change them for every engine attached."""
    if getattr(model, ATTACHMENT_ATTR, None) is not None:
        raise RuntimeError(
            "this model's weights are mapped from weightcache and shared read-only with other engines; "
            "reload weights in place only in a model loaded with mode 'off'"
        )


def lazy_class(namespace: dict, name: str, build: Callable[[], type]) -> type:
    """``namespace[name]``, built by ``build()`` on first use: the engine is imported only then."""
    cls = namespace.get(name)
    if cls is None:
        cls = namespace[name] = build()
    return cls


def entry_bytes(fingerprint: "Fingerprint", socket_dir: SocketDirLike = None, timeout_s: float = 5.0) -> int:
    """Bytes the server holds for ``fingerprint`` (0 when it holds no such entry or does not answer).

    An engine's memory profiler must not count these as its own allocation.
    """
    from weightcache.engine import Connection

    digest = fingerprint.digest
    try:
        with Connection(socket_dir, timeout=timeout_s) as connection:
            entries = connection.status().get("entries", [])
    except (ServerUnavailable, AccessDenied) as exc:
        log.info("weightcache: no entry size from the server: %s", exc)
        return 0
    return sum(int(entry.get("bytes", 0)) for entry in entries if entry.get("digest") == digest)


@attrs.frozen
class PrivateName:
    """A private attribute of an engine (``module``, then a dotted ``path`` inside it) that an adapter uses, and why.

    :param engine: the engine's distribution name (``vllm``).
    :param checked_with: the engine version the name was read from.
    """

    engine: str
    checked_with: str
    module: str
    path: str
    why: str

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.path}"

    def lookup(self) -> typing.Any:
        """The object; ImportError naming it, its use and the version it was checked with when this engine lacks it."""
        try:
            found: typing.Any = importlib.import_module(self.module)
            for part in self.path.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError) as exc:
            raise ImportError(
                f"{self.engine} {_installed_version(self.engine)} lacks {self.dotted}, a private name weightcache's "
                f"{self.engine} adapter uses ({self.why}); it was checked with {self.engine} {self.checked_with}: "
                f"install {self.engine}=={self.checked_with} or update the adapter ({type(exc).__name__}: {exc})"
            ) from None
        return found

    @contextlib.contextmanager
    def replaced(self, value: typing.Any) -> Iterator[None]:
        """The name bound to ``value`` inside the block, to what it was before afterwards (a module attribute)."""
        self.lookup()  # the engine has it: ImportError naming it otherwise
        owner: typing.Any = importlib.import_module(self.module)
        *parents, leaf = self.path.split(".")
        for part in parents:
            owner = getattr(owner, part)
        before = getattr(owner, leaf)
        setattr(owner, leaf, value)
        try:
            yield
        finally:
            setattr(owner, leaf, before)


def _installed_version(distribution: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"
