"""Tensors viewing mapped arenas, made from a tensor table in batches rather than one Python call per record.

Records of one layout (same arena, dtype, shape, stride and name pattern: the
gate projections of every expert of a layer) usually lie at a constant step
in their arena. Such a run becomes one ``as_strided`` of ``(count, *shape)``
and one ``unbind``, which makes its ``count`` views inside torch; the grouping
itself is a few vectorised torch operations over the table's columns. A record
that fits no run gets its own ``as_strided``. torch checks every view against
its arena's storage, so none reaches outside the memory mapped.
"""

from __future__ import annotations

import contextlib
import typing

from weightcache.core.dtypes import ITEM_SIZES, to_dtype
from weightcache.core.layout.tensor_table import contiguous_stride, numel

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.layout.tensor_table import TensorTable

_DIGITS = str.maketrans("0123456789", "##########")


def table_views(table: "TensorTable", arena_bytes: "typing.Sequence[torch.Tensor]") -> "dict[str, torch.Tensor]":
    """Every record of ``table`` as a tensor viewing ``arena_bytes`` (one uint8 tensor per arena), by name."""
    with one_thread():
        return _table_views(table, arena_bytes)


@contextlib.contextmanager
def one_thread() -> "typing.Iterator[None]":
    """torch's intra-op pool at one thread for the block, restored after.

    The grouping runs a few dozen torch operations on columns of up to a few hundred thousand
    elements: microseconds each on one thread, but each one a fork-join over the whole pool
    otherwise. On a loaded host (an engine's node at start-up, other processes busy) that costs
    more than the work: 1,000 records took 25 ms on two threads and 1.3 ms on one, 20,000 took
    122 ms and 79 ms (2 shared, busy cores; out of the views of ``benchmarks/attach.py``).
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


def _table_views(table: "TensorTable", arena_bytes: "typing.Sequence[torch.Tensor]") -> "dict[str, torch.Tensor]":
    import torch

    count = table.count
    if count == 0:
        return {}
    names = table.names

    def column(name: str, dtype: "torch.dtype") -> "torch.Tensor":
        raw = bytearray(getattr(table, name))
        return torch.frombuffer(raw, dtype=dtype).long() if raw else torch.zeros(0, dtype=torch.long)

    ndim = column("ndim", torch.uint8)
    code = column("dtype", torch.uint8)
    arena = column("arena", torch.int32)
    nbytes = column("nbytes", torch.int64)
    itemsizes = torch.tensor([ITEM_SIZES[name] for name in table.dtypes], dtype=torch.long)[code]
    element = column("offset", torch.int64) // itemsizes + column("storage_offset", torch.int64)
    arena_sizes = torch.tensor([view.numel() for view in arena_bytes], dtype=torch.long)
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
    patterns: dict[str, int] = {}
    pattern = torch.tensor(list(map(patterns.setdefault, _patterns(names), range(count))))
    alone = (~batched).long() * (torch.arange(count) + 1)  # a record that cannot join a run gets a group of its own
    keys = torch.cat([torch.stack([alone, pattern, arena, code, ndim], 1), shapes, strides], 1)
    rows, group = _groups(keys)
    order = _sort_within_groups(group, element)
    group, element = group[order], element[order]
    step = element[1:] - element[:-1]
    new_group = group[1:] != group[:-1]
    breaks = new_group.clone()
    breaks[1:] |= ~new_group[:-1] & (step[1:] != step[:-1])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.nonzero(breaks).flatten() + 1]).tolist()
    ends = [*starts[1:], count]

    first = element.tolist()
    steps = step.tolist()
    run_groups = group.tolist()
    typed: dict = {}
    made: list = []
    for start, end in zip(starts, ends, strict=True):
        alone, _, arena_index, dtype_code, dims = rows[run_groups[start]][:5]
        if alone:  # its own group (``alone`` holds the record's index + 1)
            made.append(view_of(arena_bytes[arena_index], table, int(order[start])))
            continue
        row = rows[run_groups[start]]
        shape, stride = row[5 : 5 + dims], row[5 + width : 5 + width + dims]
        base = typed.get((arena_index, dtype_code))
        if base is None:
            base = typed[(arena_index, dtype_code)] = arena_bytes[arena_index].view(to_dtype(table.dtypes[dtype_code]))
        if end - start == 1:
            made.append(base.as_strided(shape, stride, first[start]))
        else:
            run = base.as_strided([end - start, *shape], [steps[start], *stride], first[start])
            made.extend(run.unbind(0))
    return dict(zip(map(names.__getitem__, order.tolist()), made, strict=True))


def _patterns(names: list[str]) -> list[str]:
    """Each name with its numbers replaced by ``#``: ``layers.3.mlp.experts.17.up_proj.weight`` and
    ``layers.12.mlp.experts.5.up_proj.weight`` share the pattern ``layers.#.mlp.experts.#.up_proj.weight``."""
    text = "\0".join(names).translate(_DIGITS)
    while "##" in text:
        text = text.replace("##", "#")
    return text.split("\0")


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
        return torch.argsort(group * span + element)
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
