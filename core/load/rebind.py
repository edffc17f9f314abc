"""Pointing a meta-device model's parameters, buffers and tensor attributes at mapped tensors."""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import operator
import typing
from collections.abc import Iterator

from weightcache.core.errors import RebindError
from weightcache.core.gc_pause import gc_paused
from weightcache.core.layout.tensor_table import KINDS
from weightcache.core.layout.views import Bindings, table_bindings

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
    finds each owner module once. When ``tensors`` is what ``Manifest.views`` made
    from this manifest's table, unchanged since, the Parameters are made from the
    table in batches (``table_bindings``: one new Parameter of the same memory per
    record, as ``nn.Parameter(tensors[name], requires_grad=False)`` would make, in a
    list in the table's order with the shape each was made with: the shape check reads
    only the model's own tensor's shape).
    """
    import torch

    table = manifest.table
    owners = _Owners(model)
    Parameter, Tensor = torch.nn.Parameter, torch.Tensor
    with gc_paused():  # tens of thousands of Parameters: no full collections in between
        source = getattr(tensors, "source", None)
        if source is not None and source[0] is table:
            bindings = table_bindings(*source)
        else:
            bindings = _bindings_of(table, tensors, Parameter, Tensor)
        tree = _Tree(model)  # every module once: by path, with its dicts (no Module attribute lookups per record)
        names, made, shapes, others = table.names, bindings.tensors, bindings.shapes, bindings.other_records()
        if others:  # buffers and attributes: the parameters are bound first, each record touches its own slot only
            pick = _picker([index for index, kind in enumerate(table.kind) if kind == _PARAMETER])
            names, made, shapes = pick(names), pick(made), pick(shapes)
        entered = _bind_parameters(tree.owned, owners, names, made, shapes, Parameter, Tensor)
        spoiled: list = []  # _parameters that lost or gained an entry other than a Parameter bound here
        for index in others:
            name, kind = table.names[index], table.kind[index]
            owner, slots, _ = _held(tree.owned, owners, name)
            spoiled.append(slots)
            tensor = tensors[name]
            current = _current(owner, leaf := name.rpartition(".")[2])
            if isinstance(current, Tensor) and current.shape != tensor.shape:
                _raise_shape(name, tensor.shape, current)
            if kind == _BUFFER:
                slots.pop(leaf, None)
                owner.register_buffer(leaf, tensor, persistent=bool(table.persistent[index]))
            else:
                set_tensor_attribute(owner, leaf, tensor)
        bound_here = _bound_here(entered, len(names), spoiled) if bindings.mapped else {}
        params = bindings.parameters_by_name() if manifest.aliases or _has_attributes(table) else {}
        _set_attributes(table, params, tensors)
        kinds = dict(zip(table.names, table.kind, strict=True)) if manifest.aliases else {}
        for alias, target in manifest.aliases.items():
            owner, leaf = owners.split(alias)
            bound_here.pop(id(owner._parameters), None)
            registered = leaf in owner._parameters or leaf in owner._buffers
            if not registered and (kinds[target] == _ATTRIBUTE or leaf in vars(owner)):
                set_tensor_attribute(owner, leaf, params[target] if target in params else tensors[target])
            elif target in params:
                owner._parameters[leaf] = params[target]
            else:
                owner._buffers[leaf] = tensors[target]
        if device is not None:
            _move_unmapped_buffers(model, manifest, device, tree.modules)
        if check:
            if not bindings.mapped and any(t.is_meta for t in bindings.tensors if isinstance(t, Tensor)):
                _raise_left_on_meta(model)  # a dict's tensor on meta, bound where the model held nothing before
            tree.check_no_meta(bound_here)
        tree.finish_evaluation_mode()
    return model


def _bound_here(entered: list, records: int, spoiled: list) -> "dict[int, int]":
    """Per module ``_parameters`` dict (by id) whose every entry may be a Parameter this rebind bound from the arenas:
    how many it bound there. The loop entered each such dict once, for records of kind ``parameter`` only, so when the
    dict holds that many entries at the check, they are all those Parameters (none can be on meta) and its values need
    no look. A dict entered twice, or that a buffer, an attribute or an alias changed, is not in it: it is checked."""
    counts: dict[int, int] = {}
    if not entered:
        return counts
    twice: list[int] = []
    ends = [index for _, index in entered[1:]]
    ends.append(records)
    for (slots, start), end in zip(entered, ends, strict=True):
        key = id(slots)
        if key in counts:
            twice.append(key)
        counts[key] = end - start
    for key in twice:
        counts.pop(key, None)
    for slots in spoiled:
        counts.pop(id(slots), None)
    return counts


def _bind_parameters(
    owned: dict,
    owners: _Owners,
    names: list,
    made: list,
    shapes: list,
    Parameter: "type[torch.nn.Parameter]",
    Tensor: "type[torch.Tensor]",
) -> list:
    """Set each of ``made`` (Parameters) in its module's ``_parameters`` under its name's leaf, after checking the
    model's tensor there, if any, has ``shapes``' shape. Returns ``(_parameters, index of its first record)`` for each
    module entered, in order (a module's records usually follow each other: weight, weight_scale_inv)."""
    last_path = None
    entered: list = []
    records = enumerate(zip(names, made, shapes, strict=True))
    for index, (name, bound, shape) in records:
        path, _, leaf = name.rpartition(".")
        if path != last_path:
            last_path = path
            held = owned.get(path)
            if held is None:
                held = _held(owned, owners, name, path)
            owner, slots, buffers = held
            entered.append((slots, index))
            if len(slots) >= _BULK_MIN and _bind_in_bulk(slots, buffers, path, names, made, shapes, index, Parameter):
                if index + len(slots) == len(names):
                    break
                collections.deque(itertools.islice(records, len(slots) - 1), maxlen=0)  # the module's other records: bound
                continue
        current = slots.get(leaf)
        if current.__class__ is not Parameter:  # not the usual skeleton's Parameter: nothing, or anything else
            if current is None:
                current = _current(owner, leaf)
            if isinstance(current, Tensor) and current.shape != shape:
                _raise_shape(name, shape, current)
        elif current.shape != shape:  # ``shape`` is ``bound``'s own (Bindings): one read, not two
            _raise_shape(name, shape, current)
        if buffers:
            buffers.pop(leaf, None)
        slots[leaf] = bound
    return entered


_BULK_MIN = 32  # a module with fewer entries is bound record by record: below ~24-32 the lists cost more than they save
_SHAPE = operator.attrgetter("shape")


def _bind_in_bulk(
    slots: dict, buffers: dict, path: str, names: list, made: list, shapes: list, start: int, Parameter: type
) -> bool:
    """Bind records ``start``.. as the whole of one module's ``_parameters`` (``slots``), at C speed, when they are
    exactly its entries in its order, each a plain ``Parameter`` of the record's shape; else bind nothing and return
    False, and the caller binds record by record (which names what does not fit).

    What the record loop does per record, done per list: the names are the module's keys under its path (no key holds
    a dot, so each name's leaf is its key), every entry's type is exactly ``Parameter`` (nothing missing, no subclass
    or plain tensor), the shapes compare equal as ``torch.Size`` tuples, same-named buffers are dropped, and the dict's
    own keys get the new values (no fresh name hashed or looked up). The skeleton's Parameters are freed on return.
    """
    keys = list(slots)
    expected = list(map(f"{path}.".__add__, keys)) if path else keys
    if names[start : start + len(keys)] != expected or "." in "".join(keys):
        return False
    olds = list(slots.values())
    end = start + len(keys)
    if set(map(type, olds)) != {Parameter} or list(map(_SHAPE, olds)) != shapes[start:end]:
        return False
    if buffers:
        collections.deque(map(buffers.pop, keys, itertools.repeat(None)), maxlen=0)
    slots.update(zip(keys, made[start:end], strict=True))
    return True


def _held(owned: dict, owners: _Owners, name: str, path: "str | None" = None) -> tuple:
    """``(module, its _parameters, its _buffers)`` for the module that owns ``name`` (``path``: its module's path)."""
    if path is None:
        path = name.rpartition(".")[0]
    held = owned.get(path)
    if held is None:  # below a module reached twice, or not among ``_modules``: found by name
        owner = owners.split(name)[0]
        held = owned[path] = (owner, owner._parameters, owner._buffers)
    return held


def _picker(positions: list) -> "typing.Callable[[typing.Sequence], list]":
    """A function that takes ``positions``' items of a sequence, in that order, as a list (at C speed)."""
    if len(positions) < 2:  # itemgetter of one position gives the item, of none it is refused
        return lambda items: [items[position] for position in positions]
    getter = operator.itemgetter(*positions)
    return lambda items: list(getter(items))


class _Tree:
    """Every module of a model once (parents first), walked in one pass: each module's path, its ``_parameters`` and
    ``_buffers`` dicts, and ``training`` set to False where the class keeps ``nn.Module.train`` (the others get their
    own ``train(False)`` from :meth:`finish_evaluation_mode`, after the weights are bound)."""

    def __init__(self, model: "torch.nn.Module"):
        import torch

        default_train = torch.nn.Module.train
        bare = len(_module_internals())
        self.modules: list[torch.nn.Module] = [model]
        self.owned: dict[str, tuple] = {}
        self.containers: list[dict] = []  # every module's _parameters and _buffers that hold something
        self.extra: list[dict] = []  # instance dicts holding more than nn.Module's own entries (tensor attributes?)
        self.overriding: list[torch.nn.Module] = []
        paths = [""]
        seen = {id(model)}
        add, append, owned, containers = seen.add, self.modules.append, self.owned, self.containers
        for module, path in zip(self.modules, paths, strict=True):  # both grow as children are found
            own = module.__dict__
            if "_parameters" in own and "_buffers" in own:
                parameters, buffers = own["_parameters"], own["_buffers"]
            else:  # a module keeping them elsewhere (properties)
                parameters, buffers = module._parameters, module._buffers
            owned[path] = (module, parameters, buffers)
            # Only a dict holding tensors now can hold one left on meta later: what rebind adds is mapped.
            if parameters:
                containers.append(parameters)
            if buffers:
                containers.append(buffers)
            if len(own) != bare:
                self.extra.append(own)
            if type(module).train is default_train:
                own["training"] = False
            else:
                self.overriding.append(module)
            children = own.get("_modules")
            if children is None:
                children = module._modules
            if children:
                prefix = f"{path}." if path else ""
                for name, child in children.items():
                    if child is not None and id(child) not in seen:
                        add(id(child))
                        append(child)
                        paths.append(prefix + name)

    def check_no_meta(self, bound_here: "dict[int, int] | None" = None) -> None:
        """``check_no_meta`` over the walked modules; a ``_parameters`` dict that holds just the entries ``bound_here``
        counts for it (see :func:`_bound_here`) is passed over."""
        containers = self.containers
        if bound_here:
            get = bound_here.get
            containers = [values for values in containers if get(id(values)) != len(values)]
        _check_values(self.modules[0], containers, self.extra)

    def finish_evaluation_mode(self) -> None:
        for module in self.overriding:
            module.train(False)


def _bindings_of(
    table, tensors: "dict[str, torch.Tensor]", Parameter: "type[torch.nn.Parameter]", Tensor: "type[torch.Tensor]"
) -> Bindings:
    """The :class:`Bindings` of a tensors dict not made from ``table`` (or changed since): a new Parameter of each
    parameter's tensor, as ``nn.Parameter(tensor, requires_grad=False)`` makes it; the dict's own tensor for the rest."""
    make_subclass = Tensor._make_subclass  # what Parameter() calls for a plain tensor, without its Python frame
    made = []
    for name, kind in zip(table.names, table.kind, strict=True):
        tensor = tensors[name]
        if kind == _PARAMETER:
            tensor = make_subclass(Parameter, tensor, False) if type(tensor) is Tensor else Parameter(tensor, requires_grad=False)
        made.append(tensor)
    every_parameter = table.kind.tobytes().count(_PARAMETER) == table.count  # no kind code is assumed to be 0
    return Bindings(table, made, [t.shape for t in made], every_parameter, False)


def _has_attributes(table) -> bool:
    """Whether any record has Python attributes to set. A checked table's codes index its attribute sets, so a table
    without sets has none (no scan); otherwise the column's zero bytes are counted at C speed."""
    if not table.attribute_sets:
        return False
    codes = table.attributes
    return codes.tobytes().count(b"\0") != codes.nbytes


def _set_attributes(table, params: "dict[str, torch.nn.Parameter]", tensors) -> None:
    """The Python attributes recorded on each tensor (``format_ue8m0``), set on what was bound (the Parameter or tensor)."""
    if not _has_attributes(table):
        return
    codes = table.attributes
    names, sets = table.names, table.attribute_sets
    for index, code in enumerate(codes):
        if code:
            name = names[index]
            bound = params.get(name)
            if bound is None:
                bound = tensors[name]
            for attribute, value in sets[code - 1].items():
                setattr(bound, attribute, value)


def _raise_shape(name: str, shape: "torch.Size", current: "torch.Tensor") -> typing.NoReturn:
    raise RebindError(
        f"mapped tensor {name!r} has shape {tuple(shape)}, the model expects {tuple(current.shape)}; "
        "the cached entry was made from a different model configuration"
    )


def _modules(model: "torch.nn.Module") -> "list[torch.nn.Module]":
    """Every module of ``model`` once, parents before children (what ``model.modules()`` yields, without a name for each)."""
    found, seen = [model], {id(model)}
    add, append = seen.add, found.append
    for module in found:  # grows as children are found
        children = module.__dict__.get("_modules")
        if children is None:  # a module keeping them elsewhere (a property)
            children = module._modules
        if children:
            for child in children.values():
                if child is not None and id(child) not in seen:
                    add(id(child))
                    append(child)
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


def _move_unmapped_buffers(model, manifest, device, modules: "list[torch.nn.Module]") -> None:
    import torch

    device = torch.device(device)
    if not any(
        buffer is not None and not buffer.is_meta and buffer.device != device
        for module in modules
        if module._buffers
        for buffer in module._buffers.values()
    ):
        return  # every buffer is on the device already (or on meta): ``to(device)`` would give each back unchanged
    mapped = {*manifest.names, *manifest.aliases}
    for owner_name, owner in model.named_modules():
        for leaf, buffer in list(owner._buffers.items()):
            name = f"{owner_name}.{leaf}" if owner_name else leaf
            if buffer is not None and name not in mapped and buffer.device.type != "meta":
                owner._buffers[leaf] = buffer.to(device)


def check_no_meta(model: "torch.nn.Module", modules: "list[torch.nn.Module] | None" = None) -> None:
    """Raise RebindError if any parameter, buffer or tensor attribute is still on the meta device.

    One pass over the modules (``modules``: all of them, when the caller has the list); names are made only for the
    message. A module's instance dict is searched for tensor attributes only when it holds more entries than a bare
    ``nn.Module``'s (nn.Module never deletes its own), and the values are screened at C speed.
    """
    if modules is None:
        modules = _modules(model)
    bare = len(_module_internals())
    containers: list = []
    extra: list = []
    for module in modules:
        own = module.__dict__
        if "_parameters" in own and "_buffers" in own:
            containers += (own["_parameters"], own["_buffers"])
        else:  # a module keeping them elsewhere (properties)
            containers += (module._parameters, module._buffers)
        if len(own) != bare:  # more than nn.Module's own entries (which are never tensors): attributes to look at
            extra.append(own)
    _check_values(model, containers, extra)


def _check_values(model: "torch.nn.Module", containers: "list[dict]", extra: "list[dict]") -> None:
    """Raise RebindError if a tensor on meta is among ``containers``' values or ``extra``'s non-Module entries."""
    import torch

    internals = _module_internals()
    values = itertools.chain(
        itertools.chain.from_iterable(map(operator.methodcaller("values"), containers)),
        itertools.chain.from_iterable(map(own.get, own.keys() - internals) for own in extra),
    )
    is_tensor = functools.partial(type.__instancecheck__, torch.Tensor)
    if any(map(operator.attrgetter("is_meta"), filter(is_tensor, values))):
        _raise_left_on_meta(model)


@functools.cache
def _module_internals() -> frozenset[str]:
    """The entries of a bare ``nn.Module``'s instance dict (its bookkeeping: hooks, ``training``): never tensors."""
    import torch

    return frozenset(vars(torch.nn.Module()))


def _raise_left_on_meta(model: "torch.nn.Module") -> typing.NoReturn:
    from weightcache.core.load.export import tensor_attributes

    named = [*model.named_parameters(), *model.named_buffers(), *((name, t) for name, _, _, t in tensor_attributes(model))]
    left = list(dict.fromkeys(name for name, t in named if t.device.type == "meta"))
    shown = ", ".join(left[:8]) + (f" and {len(left) - 8} more" if len(left) > 8 else "")
    raise RebindError(f"{len(left)} tensors stayed on the meta device after rebind: {shown}; the cached entry lacks them")
