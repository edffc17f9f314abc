"""Pointing a meta-device model's parameters, buffers and tensor attributes at mapped tensors."""

from __future__ import annotations

import contextlib
import itertools
import typing
from collections.abc import Iterator

from weightcache.core.errors import RebindError
from weightcache.core.gc_pause import gc_paused
from weightcache.core.layout.tensor_table import KINDS

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.layout.manifest import Manifest


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Create parameters on the meta device (no memory); buffers stay real.

    Modules built inside allocate nothing for their weights, but buffers that
    ``__init__`` computes (rotary frequencies, position ids) keep their values.
    """
    import torch

    original = torch.nn.Module.register_parameter

    def register_on_meta(self: "torch.nn.Module", name: str, param: "torch.nn.Parameter | None") -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


class _Owners:
    """The module that owns each dotted name of ``model``, looked up once per module (``get_submodule`` walks the
    whole path for every tensor)."""

    def __init__(self, model: "torch.nn.Module"):
        self._found: dict[str, torch.nn.Module] = {"": model}

    def split(self, name: str) -> "tuple[torch.nn.Module, str]":
        path, _, leaf = name.rpartition(".")
        owner = self._found.get(path)
        return (owner if owner is not None else self._module(path, name)), leaf

    def _module(self, path: str, name: str) -> "torch.nn.Module":
        import torch

        parent_path, _, child = path.rpartition(".")
        parent = self._found.get(parent_path)
        if parent is None:
            parent = self._module(parent_path, name)
        module = parent._modules.get(child)
        if module is None:
            module = getattr(parent, child, None)
        if not isinstance(module, torch.nn.Module):
            raise RebindError(f"the model has no module {path!r} for mapped tensor {name!r}; was it built from the same config?")
        self._found[path] = module
        return module


def _current(owner: "torch.nn.Module", leaf: str):
    """What ``owner`` holds under ``leaf`` now: a parameter, a buffer or a plain attribute (None if nothing)."""
    found: torch.Tensor | None = owner._parameters.get(leaf)
    if found is None:
        found = owner._buffers.get(leaf)
    if found is None:
        found = vars(owner).get(leaf)
    return found


def rebind_module(
    model: "torch.nn.Module",
    tensors: "dict[str, torch.Tensor]",
    manifest: "Manifest",
    device: "torch.device | str | None" = None,
    check: bool = True,
) -> "torch.nn.Module":
    """Point every parameter, buffer and tensor attribute of ``model`` at ``tensors`` (zero-copy) and check the result.

    Tensors the model lacks (made by post-processing) are registered; tied
    weights become one Parameter; plain tensor attributes (kind ``attribute``)
    are set as such; the Python attributes recorded on each tensor
    (``format_ue8m0``) are set again; buffers the manifest does not hold are
    moved to ``device``. Raises RebindError naming what does not fit.
    With ``check=False`` tensors may stay on meta: for an engine that runs its
    own post-processing on the rebound model first, then calls ``check_no_meta``.

    It reads the manifest's table column by column (no record objects), and
    finds each owner module once.
    """
    import torch

    table = manifest.table
    owners = _Owners(model)
    params: dict[str, torch.nn.Parameter] = {}
    attribute_sets = table.attribute_sets
    Parameter, Tensor = torch.nn.Parameter, torch.Tensor
    make_subclass = Tensor._make_subclass  # what Parameter() calls for a plain tensor, without its Python frame
    with gc_paused():  # tens of thousands of Parameters: no full collections in between
        for name, kind, persistent, attributes in zip(table.names, table.kind, table.persistent, table.attributes, strict=True):
            owner, leaf = owners.split(name)
            tensor = tensors[name]
            bound: torch.Tensor
            current = _current(owner, leaf)
            if isinstance(current, Tensor) and current.shape != tensor.shape:
                raise RebindError(
                    f"mapped tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(current.shape)}; "
                    "the cached entry was made from a different model configuration"
                )
            if kind == _PARAMETER:
                if type(tensor) is Tensor:
                    bound = params[name] = make_subclass(Parameter, tensor, False)
                else:
                    bound = params[name] = Parameter(tensor, requires_grad=False)
                if owner._buffers:
                    owner._buffers.pop(leaf, None)
                owner._parameters[leaf] = bound
            elif kind == _BUFFER:
                owner._parameters.pop(leaf, None)
                owner.register_buffer(leaf, tensor, persistent=bool(persistent))
                bound = tensor
            else:
                set_tensor_attribute(owner, leaf, tensor)
                bound = tensor
            if attributes:
                for attribute, value in attribute_sets[attributes - 1].items():
                    setattr(bound, attribute, value)
    kinds = dict(zip(table.names, table.kind, strict=True)) if manifest.aliases else {}
    for alias, target in manifest.aliases.items():
        owner, leaf = owners.split(alias)
        registered = leaf in owner._parameters or leaf in owner._buffers
        if not registered and (kinds[target] == _ATTRIBUTE or leaf in vars(owner)):
            set_tensor_attribute(owner, leaf, params.get(target, tensors[target]))
        elif target in params:
            owner._parameters[leaf] = params[target]
        else:
            owner._buffers[leaf] = tensors[target]
    if device is not None:
        _move_unmapped_buffers(model, manifest, device)
    modules = _modules(model)
    if check:
        check_no_meta(model, modules)
    evaluation_mode(model, modules)
    return model


def _modules(model: "torch.nn.Module") -> "list[torch.nn.Module]":
    """Every module of ``model`` once (what ``model.modules()`` yields, without building a name for each)."""
    found, seen, stack = [], set(), [model]
    while stack:
        module = stack.pop()
        if id(module) not in seen:
            seen.add(id(module))
            found.append(module)
            stack.extend(child for child in module._modules.values() if child is not None)
    return found


def evaluation_mode(model: "torch.nn.Module", modules: "list[torch.nn.Module] | None" = None) -> None:
    """``model.eval()`` in one pass: ``training`` is set straight in each module's ``__dict__`` (``Module.__setattr__``
    costs microseconds, and a MoE model has tens of thousands of modules); a module whose class overrides ``train``
    gets its own ``train(False)``."""
    import torch

    default = torch.nn.Module.train
    for module in _modules(model) if modules is None else modules:
        if type(module).train is default:
            module.__dict__["training"] = False
        else:
            module.train(False)


_PARAMETER, _BUFFER, _ATTRIBUTE = (KINDS.index(kind) for kind in ("parameter", "buffer", "attribute"))


def set_tensor_attribute(owner: "torch.nn.Module", leaf: str, tensor: "torch.Tensor") -> None:
    """Make ``tensor`` the plain attribute ``leaf`` of ``owner`` (neither parameter nor buffer)."""
    owner._parameters.pop(leaf, None)
    owner._buffers.pop(leaf, None)
    vars(owner)[leaf] = tensor


def _move_unmapped_buffers(model, manifest, device) -> None:
    mapped = {*manifest.names, *manifest.aliases}
    for owner_name, owner in model.named_modules():
        for leaf, buffer in list(owner._buffers.items()):
            name = f"{owner_name}.{leaf}" if owner_name else leaf
            if buffer is not None and name not in mapped and buffer.device.type != "meta":
                owner._buffers[leaf] = buffer.to(device)


def check_no_meta(model: "torch.nn.Module", modules: "list[torch.nn.Module] | None" = None) -> None:
    """Raise RebindError if any parameter, buffer or tensor attribute is still on the meta device.

    One pass over the modules (``modules``: all of them, when the caller has the list); names are made only for the message.
    """
    import torch

    Tensor = torch.Tensor
    internals = frozenset(vars(torch.nn.Module()))  # a module's own bookkeeping: never a tensor attribute
    for module in _modules(model) if modules is None else modules:
        for tensor in itertools.chain(
            module._parameters.values(), module._buffers.values(), map(vars(module).get, vars(module).keys() - internals)
        ):
            if isinstance(tensor, Tensor) and tensor.is_meta:
                _raise_left_on_meta(model)


def _raise_left_on_meta(model: "torch.nn.Module") -> typing.NoReturn:
    from weightcache.core.load.export import tensor_attributes

    named = [*model.named_parameters(), *model.named_buffers(), *((name, t) for name, _, _, t in tensor_attributes(model))]
    left = list(dict.fromkeys(name for name, t in named if t.device.type == "meta"))
    shown = ", ".join(left[:8]) + (f" and {len(left) - 8} more" if len(left) > 8 else "")
    raise RebindError(f"{len(left)} tensors stayed on the meta device after rebind: {shown}; the cached entry lacks them")
