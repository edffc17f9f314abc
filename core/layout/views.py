"""Tensors viewing mapped arenas, made from a tensor table in batches rather than one Python call per record.

Records of one layout (same arena, dtype, shape, stride and name pattern: the
gate projections of every expert of a layer) usually lie at a constant step
in their arena. Such a run becomes one ``as_strided`` of ``(count, *shape)``
and one ``unbind``, which makes its ``count`` tensors inside torch; the grouping
itself is a few vectorised torch operations over the table's columns, done once
per table and arena sizes (:func:`plan_of`) and shared by the plain tensors
(:func:`table_views`) and the Parameters rebind makes (:func:`table_parameters`).
A record that fits no run gets its own ``as_strided``. torch checks every view
against its arena's storage, so none reaches outside the memory mapped.

The tensors are made below torch's autograd view tracking (``unbind`` then
records no view of the run for each one): each is a plain alias of its arena's
memory, as ``detach()`` would give, not an autograd view, at about half the cost.
"""

from __future__ import annotations

import array
import collections
import contextlib
import itertools
import typing

from weightcache.core.dtypes import ITEM_SIZES, to_dtype
from weightcache.core.gc_pause import gc_paused
from weightcache.core.layout.tensor_table import KINDS, contiguous_stride, numel

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.layout.tensor_table import TensorTable

_PARAMETER = KINDS.index("parameter")


class MappedTensors(dict):
    """A table's tensors by name (a plain dict to every reader) that remembers the table and arenas it was made from.

    ``rebind_module`` uses ``source`` to make its Parameters straight from the
    table in batches; any change to the dict drops ``source`` (the tensors may
    then no longer be the table's), and rebind takes each tensor from the dict.
    """

    __slots__ = ("_unmade", "source")

    def __init__(self, items: "typing.Iterable[tuple[str, torch.Tensor]]", source: "tuple[TensorTable, list] | None"):
        super().__init__(items)
        self.source = source
        self._unmade: tuple[TensorTable, list, dict[str, str]] | None = None

    def __setitem__(self, key, value) -> None:
        self.source = None
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        self.source = None
        super().__delitem__(key)

    def __ior__(self, other):  # type: ignore[misc]  # dict.__or__ gives a dict, |= keeps this one (as dict does)
        self.source = None
        return super().__ior__(other)

    def update(self, *args: typing.Any, **kwargs: typing.Any) -> None:
        self.source = None
        super().update(*args, **kwargs)

    def pop(self, *args: typing.Any) -> typing.Any:
        self.source = None
        return super().pop(*args)

    def popitem(self) -> tuple[str, typing.Any]:
        self.source = None
        return super().popitem()

    def setdefault(self, key: str, default: typing.Any = None) -> typing.Any:
        if key not in self:
            self.source = None
        return super().setdefault(key, default)

    def clear(self) -> None:
        self.source = None
        super().clear()


class UnmadeTensors(MappedTensors):
    """A :class:`MappedTensors` whose tensors are made on its first read, all at once (then it is a MappedTensors).

    An engine whose adapter hands the dict to ``rebind_module`` and never reads it pays for one tensor per record
    (the Parameters rebind makes from ``source``), not two. Every Python-level way of reading a dict (items, values,
    iteration, ``len``, ``in``, ``get``, ``==``, ``dict(d)``, ``{**d}``, copy, pickle, changes) makes the tensors
    first; only C code that reads a dict's storage directly (``PyDict_Next``, ``PyDict_GetItem`` on a dict never read
    from Python) would see it empty.
    """

    __slots__ = ()

    @classmethod
    def of(cls, table: "TensorTable", arena_bytes: list, aliases: "dict[str, str]") -> "UnmadeTensors":
        tensors = cls((), (table, arena_bytes))
        tensors._unmade = (table, arena_bytes, aliases)
        return tensors

    def made(self) -> MappedTensors:
        """This dict with its tensors in it (made now, on the first call): a plain :class:`MappedTensors` from now on."""
        if self._unmade is not None:
            table, arena_bytes, aliases = self._unmade
            if table.count:
                with gc_paused():
                    plan = plan_of(table, arena_bytes)
                    dict.update(self, zip(plan.names, _make(plan, table, arena_bytes), strict=True))
            for alias, target in aliases.items():
                dict.__setitem__(self, alias, dict.__getitem__(self, target))
            self._unmade = None
        self.__class__ = MappedTensors  # type: ignore[assignment]  # the same layout: reads are dict's own from now on
        return self

    def __getitem__(self, key):
        return self.made()[key]

    def __iter__(self):
        return iter(self.made())

    def __reversed__(self):
        return reversed(self.made())

    def __len__(self) -> int:
        return len(self.made())

    def __contains__(self, key) -> bool:
        return key in self.made()

    def __repr__(self) -> str:
        return repr(self.made())

    def __eq__(self, other) -> bool:
        return self.made() == other

    def __ne__(self, other) -> bool:
        return self.made() != other

    __hash__ = None  # type: ignore[assignment]

    def __or__(self, other):
        return self.made() | other

    def __ror__(self, other):
        return other | dict(self.made())

    def __ior__(self, other):
        return self.made().__ior__(other)

    def __reduce_ex__(self, protocol):
        return self.made().__reduce_ex__(protocol)

    def __sizeof__(self) -> int:
        return self.made().__sizeof__()

    def get(self, key: str, default: typing.Any = None) -> typing.Any:
        return self.made().get(key, default)

    def keys(self) -> "typing.KeysView[str]":  # type: ignore[override]
        return self.made().keys()

    def values(self) -> "typing.ValuesView[typing.Any]":  # type: ignore[override]
        return self.made().values()

    def items(self) -> "typing.ItemsView[str, typing.Any]":  # type: ignore[override]
        return self.made().items()

    def copy(self) -> dict:
        return self.made().copy()

    def __setitem__(self, key, value) -> None:
        self.made()[key] = value

    def __delitem__(self, key) -> None:
        del self.made()[key]

    def update(self, *args: typing.Any, **kwargs: typing.Any) -> None:
        self.made().update(*args, **kwargs)

    def pop(self, *args: typing.Any) -> typing.Any:
        return self.made().pop(*args)

    def popitem(self) -> tuple[str, typing.Any]:
        return self.made().popitem()

    def setdefault(self, key: str, default: typing.Any = None) -> typing.Any:
        return self.made().setdefault(key, default)

    def clear(self) -> None:
        self.made().clear()


def table_views(table: "TensorTable", arena_bytes: "typing.Sequence[torch.Tensor]") -> MappedTensors:
    """Every record of ``table`` as a tensor viewing ``arena_bytes`` (one uint8 tensor per arena), by name."""
    arena_bytes = list(arena_bytes)
    if table.count == 0:
        return MappedTensors((), (table, arena_bytes))
    plan = plan_of(table, arena_bytes)
    return MappedTensors(zip(plan.names, _make(plan, table, arena_bytes), strict=True), (table, arena_bytes))


def table_parameters(table: "TensorTable", arena_bytes: "typing.Sequence[torch.Tensor]") -> "dict[str, torch.nn.Parameter]":
    """A new ``nn.Parameter`` (``requires_grad=False``) viewing its region for every record of kind ``parameter``, by name.

    Each call makes new objects (nothing is shared with :func:`table_views`' tensors or an earlier call's), each a
    Parameter as ``nn.Parameter(tensor, requires_grad=False)`` makes one: a plain alias of the memory, no autograd
    view, no grad. They are made as tensors in batches and their class set to Parameter, which skips the second
    tensor ``nn.Parameter()`` makes of each (``Tensor._make_subclass`` detaches a copy). What :func:`table_bindings`
    makes, by name.
    """
    return table_bindings(table, arena_bytes).parameters_by_name()


class Bindings:
    """What :func:`table_bindings` makes: per record of a table, in the table's order, its new tensor and its shape.

    ``tensors[i]``: record ``i``'s tensor, a new ``nn.Parameter`` where its kind is ``parameter`` (a plain tensor
    otherwise, which rebind does not use: it binds the tensors dict's own buffers and attributes). ``shapes[i]``: its
    shape as a ``torch.Size``, the very shape the tensor was made with (one object per run, shared by its records).
    ``mapped``: every tensor was made here as a view of mapped arenas (none is on the meta device); False for tensors
    taken from elsewhere (a dict).
    """

    __slots__ = ("all_parameters", "mapped", "names", "shapes", "table", "tensors")

    def __init__(self, table: "TensorTable", tensors: list, shapes: list, all_parameters: bool, mapped: bool):
        self.table, self.names, self.tensors, self.shapes = table, table.names, tensors, shapes
        self.all_parameters, self.mapped = all_parameters, mapped

    def other_records(self) -> list[int]:
        """The indices of the records not of kind ``parameter`` (buffers, attributes), in the table's order."""
        if self.all_parameters:
            return []
        return [index for index, kind in enumerate(self.table.kind) if kind != _PARAMETER]

    def parameters_by_name(self) -> "dict[str, torch.nn.Parameter]":
        """The Parameters by name (records of other kinds left out)."""
        if self.all_parameters:
            return dict(zip(self.names, self.tensors, strict=True))
        return {name: t for name, kind, t in zip(self.names, self.table.kind, self.tensors, strict=True) if kind == _PARAMETER}


def table_bindings(table: "TensorTable", arena_bytes: "typing.Sequence[torch.Tensor]") -> Bindings:
    """The tensors ``rebind_module`` binds, made from the table in batches: a list in the table's order, no dict.

    Each record of kind ``parameter`` gets a new ``nn.Parameter`` of its region, as :func:`table_parameters`
    describes; with it comes the shape each tensor was made with, so a caller checking it against a model's own
    tensor reads one shape, not two.
    """
    import torch

    arena_bytes = list(arena_bytes)
    if table.count == 0:
        return Bindings(table, [], [], True, True)
    plan = plan_of(table, arena_bytes)
    shapes: list = []
    made = _make(plan, table, arena_bytes, shapes)
    if plan.all_parameters:
        _as_parameters(made, torch.nn.Parameter)
    else:
        positions = plan.parameter_positions
        chosen = [made[position] for position in positions]
        _as_parameters(chosen, torch.nn.Parameter)
        for position, tensor in zip(positions, chosen, strict=True):
            made[position] = tensor
    table_order = plan.table_order
    if table_order is not None:  # making order -> the table's order
        made, shapes = list(map(made.__getitem__, table_order)), list(map(shapes.__getitem__, table_order))
    return Bindings(table, made, shapes, plan.all_parameters, not any(view.is_meta for view in arena_bytes))


def _as_parameters(tensors: list, parameter: type) -> None:
    """Make each of ``tensors`` (plain tensors of no grad) an instance of ``parameter`` in place."""
    if not tensors:
        return
    try:  # at C speed (``setattr`` mapped over the list), not a bytecode loop
        collections.deque(map(setattr, tensors, itertools.repeat("__class__"), itertools.repeat(parameter)), maxlen=0)
    except TypeError:  # a torch whose tensors refuse a class change: the Parameter() way, one copy each
        make = tensors[0].__class__._make_subclass
        tensors[:] = [t if type(t) is parameter else make(parameter, t, False) for t in tensors]


class Plan:
    """How to make a table's tensors over arenas of given sizes: its runs in making order, computed once.

    ``runs``: per run ``(record, arena, dtype, shape, stride, count, step, first)``; ``record`` is the table index
    of a record made alone (-1 for a run of ``count`` records from element ``first`` at ``step`` elements).
    ``names``: the records' names in making order. ``parameter_positions``: the positions in that order of the
    records of kind ``parameter`` (``all_parameters``: every record is one). ``table_order``: per record of the
    table, its position in making order (None: the orders are one).
    """

    __slots__ = ("_names", "_order", "_table_names", "all_parameters", "parameter_positions", "runs", "table_order")

    def __init__(
        self,
        runs: list,
        table_names: list[str],
        order: "list[int] | None",
        parameter_positions: "typing.Sequence[int]",
        all_parameters: bool,
        table_order: "list[int] | None",
    ):
        self.runs = runs
        self._table_names, self._order, self._names = table_names, order, None if order is not None else table_names
        self.parameter_positions = parameter_positions
        self.all_parameters = all_parameters
        self.table_order = table_order

    @property
    def names(self) -> list[str]:
        """The records' names in making order (listed on first use: rebind, which binds in the table's order, never asks)."""
        if self._names is None:
            assert self._order is not None
            self._names = list(map(self._table_names.__getitem__, self._order))
        return self._names


def plan_of(table: "TensorTable", arena_bytes: "typing.Sequence[torch.Tensor]") -> Plan:
    """The :class:`Plan` of ``table`` over ``arena_bytes``, kept on the table for the next call with arenas of these sizes."""
    sizes = tuple(view.numel() for view in arena_bytes)
    plans = table.__dict__.setdefault("_view_plans", {})
    plan = plans.get(sizes)
    if plan is None:
        with one_thread():
            plan = plans[sizes] = _plan(table, sizes)
    return plan


@contextlib.contextmanager
def one_thread() -> "typing.Iterator[None]":
    """torch's intra-op pool at one thread for the block, restored after.

    The grouping runs a few dozen torch operations on columns of up to a few hundred thousand
    elements: microseconds each on one thread, but each one a fork-join over the whole pool
    otherwise. On a loaded host (an engine's node at start-up, other processes busy) that costs
    more than the work itself.
    """
    import torch

    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _below_view_tracking() -> "typing.ContextManager":
    """torch's dispatch below autograd and its view tracking: view ops make plain aliases (as ``detach()`` would)."""
    import torch

    guard = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", None)
    return guard() if guard is not None else contextlib.nullcontext()


def _make(plan: Plan, table: "TensorTable", arena_bytes: "list[torch.Tensor]", shapes: "list | None" = None) -> list:
    """The tensors of ``plan``'s records, in its order (each a new object); ``shapes`` (when given) gets each one's
    shape, as a ``torch.Size`` shared by a run's records."""
    import torch

    typed: dict = {}
    made: list = []
    extend, append = made.extend, made.append
    dtypes = table.dtypes
    with _below_view_tracking():
        for record, arena_index, dtype_code, shape, stride, count, step, first in plan.runs:
            if record >= 0:
                append(view_of(arena_bytes[arena_index], table, record))
                if shapes is not None:
                    shapes.append(made[-1].shape)
                continue
            base = typed.get((arena_index, dtype_code))
            if base is None:
                base = typed[(arena_index, dtype_code)] = arena_bytes[arena_index].view(to_dtype(dtypes[dtype_code]))
            if count == 1:
                append(base.as_strided(shape, stride, first))
            else:
                extend(base.as_strided([count, *shape], [step, *stride], first).unbind(0))
            if shapes is not None:
                shapes.extend([torch.Size(shape)] * count)
    return made


def _plan(table: "TensorTable", arena_sizes_of: "tuple[int, ...]") -> Plan:
    import torch

    count = table.count
    names = table.names

    def column(name: str, dtype: "torch.dtype") -> "torch.Tensor":
        raw = bytearray(getattr(table, name))
        return torch.frombuffer(raw, dtype=dtype).long() if raw else torch.zeros(0, dtype=torch.long)

    ndim = column("ndim", torch.uint8)
    code = column("dtype", torch.uint8)
    arena = column("arena", torch.int32)
    nbytes = column("nbytes", torch.int64)
    kind = column("kind", torch.uint8)
    itemsizes = torch.tensor([ITEM_SIZES[name] for name in table.dtypes], dtype=torch.long)[code]
    element = column("offset", torch.int64) // itemsizes + column("storage_offset", torch.int64)
    arena_sizes = torch.tensor(arena_sizes_of, dtype=torch.long)
    # Runs need a typed view of the whole arena; empty tensors and arenas no whole number of items long go one by one.
    batched = (nbytes > 0) & (arena_sizes[arena] % itemsizes == 0)

    width = int(ndim.max())
    shapes = torch.zeros((count, width), dtype=torch.long)
    strides = torch.zeros((count, width), dtype=torch.long)
    if table.dims:
        owner = torch.repeat_interleave(torch.arange(count), ndim)
        first_dim = torch.cumsum(ndim, 0) - ndim
        position = torch.arange(table.dims) - first_dim[owner]
        shapes[owner, position] = column("shape", torch.int64)
        strides[owner, position] = column("stride", torch.int64)
    alone = (~batched).long() * (torch.arange(count) + 1)  # a record that cannot join a run gets a group of its own
    layout = [alone, arena, code, ndim]
    found = _runs(layout, shapes, strides, element)
    if found[-1]:  # a layout's records lie at more than one step: interleaved kinds (gate, up), which names tell apart
        found = _runs([*layout, _patterns(names)], shapes, strides, element)
    rows, order, starts, first, steps, run_groups, _ = found
    key_width = len(rows[0]) - 2 * width
    ends = [*starts[1:], count]
    identity = torch.equal(order, torch.arange(count))
    order_list = None if identity else order.tolist()
    table_order = None
    if not identity:
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(count)
        table_order = inverse.tolist()
    runs = []
    for start, end, run_group, run_first, run_step in zip(starts, ends, run_groups, first, steps, strict=True):
        row = rows[run_group]
        is_alone, arena_index, dtype_code, dims = row[:4]
        if is_alone:  # its own group (``alone`` holds the record's index + 1)
            runs.append((is_alone - 1, arena_index, dtype_code, None, None, 1, 0, 0))
            continue
        shape, stride = row[key_width : key_width + dims], row[key_width + width : key_width + width + dims]
        runs.append((-1, arena_index, dtype_code, shape, stride, end - start, run_step if end - start > 1 else 0, run_first))
    if table.kind.tobytes().count(_PARAMETER) == count:  # every record a parameter (the usual table): no positions
        parameters: typing.Sequence[int] = range(count)
    else:
        parameters = torch.nonzero(kind[order] == _PARAMETER).flatten().tolist()
    return Plan(runs, names, order_list, parameters, len(parameters) == count, table_order)


def _runs(columns: list, shapes: "torch.Tensor", strides: "torch.Tensor", element: "torch.Tensor") -> tuple:
    """Records grouped by ``columns``, shape and stride, sorted by element offset in each group and cut where the step
    changes: ``(rows, order, starts, firsts, steps, groups, split)``, per run its start in ``order``, first element,
    step and group; ``split``: some group holds more than one run."""
    import torch

    if all(bool((column == column[0]).all()) for column in (*columns, shapes, strides)):  # one layout: no key matrix
        rows = [[*(int(column[0]) for column in columns), *shapes[0].tolist(), *strides[0].tolist()]]
        group = torch.zeros(len(element), dtype=torch.long)
    else:
        rows, group = _groups(torch.cat([torch.stack(columns, 1), shapes, strides], 1))
    order = _sort_within_groups(group, element)
    group, element = group[order], element[order]
    step = element[1:] - element[:-1]
    new_group = group[1:] != group[:-1]
    breaks = new_group.clone()
    breaks[1:] |= ~new_group[:-1] & (step[1:] != step[:-1])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.nonzero(breaks).flatten() + 1])
    steps = torch.cat([step, torch.zeros(1, dtype=torch.long)])[starts]  # the last record's step: none
    split = int(breaks.sum()) > int(new_group.sum())
    return rows, order, starts.tolist(), element[starts].tolist(), steps.tolist(), group[starts].tolist(), split


def _patterns(names: list[str]) -> "torch.Tensor":
    """Each name's pattern as an index: the names with their digits left out share one when they are equal
    (``layers.3.mlp.experts.17.up_proj.weight`` and ``layers.12.mlp.experts.5.up_proj.weight``: ``layers..mlp.experts..up_proj.weight``).

    The pattern only decides which records may form a run (a run still needs one layout at one step), so two names
    that share a pattern by chance cost nothing but a shorter run.
    """
    import torch

    text = "\0".join(names).encode("utf-8").translate(None, b"0123456789")
    patterns: dict[bytes, int] = {}
    indices = array.array("q", map(patterns.setdefault, text.split(b"\0"), range(len(names))))
    return torch.frombuffer(indices, dtype=torch.long) if indices else torch.zeros(0, dtype=torch.long)


_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # an odd 64-bit constant as int64: rows hash by wrapping multiplication


def _groups(keys: "torch.Tensor") -> "tuple[list[list[int]], torch.Tensor]":
    """The distinct rows of ``keys`` (as lists) and each row's group index: rows hashed to one int64, collisions checked."""
    import torch

    weights = torch.empty(keys.shape[1], dtype=torch.long)
    weights[0], factor = 1, 1
    for column in range(1, keys.shape[1]):
        factor = (factor * _MIX) % (1 << 64)
        weights[column] = factor - (1 << 64) if factor >= 1 << 63 else factor
    hashes = (keys * weights).sum(1)
    unique, group = torch.unique(hashes, return_inverse=True)
    first = torch.full((len(unique),), keys.shape[0], dtype=torch.long)
    first.scatter_reduce_(0, group, torch.arange(keys.shape[0]), "amin")
    representative = keys[first]
    if not torch.equal(representative[group], keys):  # two layouts hashed alike: group them exactly
        representative, group = torch.unique(keys, dim=0, return_inverse=True)
    return representative.tolist(), group


def _sort_within_groups(group: "torch.Tensor", element: "torch.Tensor") -> "torch.Tensor":
    """The order that sorts records by group, then by element offset."""
    import torch

    span = int(element.max()) + 1
    groups = int(group.max()) + 1
    if groups * span < 1 << 62:
        key = group * span + element
        if bool((key[1:] > key[:-1]).all()):  # in order already (records laid out as listed): no sort
            return torch.arange(len(key))
        return torch.argsort(key)
    order = torch.argsort(element, stable=True)
    return order[torch.argsort(group[order], stable=True)]


def view_of(arena_bytes: "torch.Tensor", table: "TensorTable", index: int) -> "torch.Tensor":
    """Record ``index`` of ``table`` viewing ``arena_bytes`` (its arena) without a copy, one record at a time."""
    dtype = to_dtype(table.dtypes[table.dtype[index]])
    shape, stride = table.dims_of(index)
    offset, nbytes, storage_offset = table.offset[index], table.nbytes[index], table.storage_offset[index]
    typed = arena_bytes[offset : offset + nbytes].view(dtype)
    if nbytes == 0:
        return typed.reshape(shape)
    if storage_offset == 0 and typed.numel() == numel(shape) and stride == contiguous_stride(shape):
        return typed.view(shape)
    return typed.as_strided(shape, stride, typed.storage_offset() + storage_offset)
