"""Batched views and batched Parameters (issue 21): the tensors ``Manifest.views`` makes in runs are the ones a record
at a time would give, the Parameters ``rebind_module`` makes from the table are ``nn.Parameter``s of the same memory,
new each time, and a changed tensors dict is honoured; the module walk still finds every tensor left on meta."""

from __future__ import annotations

import collections
import copy

import pytest
import torch

from weightcache.core.errors import RebindError
from weightcache.core.layout.manifest import Manifest
from weightcache.core.layout.tensor_table import TensorTable
from weightcache.core.layout.views import (
    MappedTensors,
    UnmadeTensors,
    plan_of,
    table_bindings,
    table_parameters,
    table_views,
    view_of,
)
from weightcache.core.load import rebind as rebind_mod
from weightcache.core.load.export import ArenaBuilder, NamedTensor, export_tensors
from weightcache.core.load.rebind import check_no_meta, rebind_module


def mixed_table() -> tuple[TensorTable, list[torch.Tensor]]:
    """Records of every shape of run: interleaved experts (gate, up, down and scales, names of 1 and 2 digits), a
    transposed view, one at a storage offset, an empty one, a second arena, and an arena no whole number of float32s."""
    names, kinds, dtypes, shapes, strides, offsets_, arenas, nbytes, storage = [], [], [], [], [], [], [], [], []

    def add(name, dtype, shape, stride, offset, size, arena=0, storage_offset=0, kind="parameter"):
        names.append(name), kinds.append(kind), dtypes.append(dtype), shapes.append(shape), strides.append(stride)
        offsets_.append(offset), arenas.append(arena), nbytes.append(size), storage.append(storage_offset)

    offset = 0
    for expert in range(12):  # gate/up (4, 8) bf16 share a layout and interleave; down (8, 4); a float32 scale each
        for proj, shape, stride in (("gate", (4, 8), (8, 1)), ("up", (4, 8), (8, 1)), ("down", (8, 4), (4, 1))):
            add(f"layers.{expert % 3}.experts.{expert}.{proj}_proj.weight", "bfloat16", shape, stride, offset, 64)
            add(f"layers.{expert % 3}.experts.{expert}.{proj}_proj.weight_scale_inv", "float32", (1, 1), (1, 1), offset + 64, 4)
            offset += 128
    add("transposed.weight", "float32", (4, 2), (1, 4), offset, 32)
    add("shifted.weight", "float32", (3,), (1,), offset + 32, 32, storage_offset=5)
    add("empty.weight", "float32", (0, 4), (4, 1), offset + 64, 0)
    add("norm.bias", "float32", (8,), (1,), offset + 64, 32, kind="buffer")
    add("other.weight", "float16", (2, 3), (3, 1), 6, 12, arena=1)
    add("odd.weight", "float32", (2,), (1,), 0, 8, arena=2)
    table = TensorTable.encode(
        names, kinds, dtypes, shapes, strides, storage, arenas, offsets_, nbytes, [True] * len(names), [{}] * len(names)
    )
    generator = torch.Generator().manual_seed(3)
    sizes = (offset + 128, 64, 10)  # bytes below 64: every float finite (no NaN to compare)
    arena_bytes = [torch.randint(0, 64, (size,), dtype=torch.uint8, generator=generator) for size in sizes]
    table.check([len(a) for a in arena_bytes])
    return table, arena_bytes


def test_batched_views_are_the_record_by_record_views_and_are_plain_aliases():
    table, arena_bytes = mixed_table()
    views = table_views(table, arena_bytes)
    assert set(views) == set(table.names)
    assert isinstance(views, MappedTensors) and views.source[0] is table
    plan = plan_of(table, arena_bytes)
    assert len(plan.runs) < table.count // 2  # the experts went in runs, not one as_strided each
    for index, name in enumerate(table.names):
        expected, got = view_of(arena_bytes[table.arena[index]], table, index), views[name]
        assert type(got) is torch.Tensor and got.dtype == expected.dtype and got.shape == expected.shape, name
        if expected.numel():
            assert got.stride() == expected.stride() and got.data_ptr() == expected.data_ptr(), name
            assert torch.equal(got, expected), name
        assert got._base is None and not got.requires_grad and got.grad_fn is None and not got.is_inference(), name


def one_layout_table(order: list[int], odd: "int | None" = None) -> tuple[TensorTable, list[torch.Tensor]]:
    """Records of one layout (bf16, (4,), one arena) at offsets ``order`` * 8 bytes; ``odd``: that record's shape is
    (3,) instead (another layout among them, of the same rank and stride)."""
    count = len(order)
    shapes = [(3,) if index == odd else (4,) for index in range(count)]
    strides = [(1,)] * count
    table = TensorTable.encode(
        [f"w{index}" for index in range(count)], ["parameter"] * count, ["bfloat16"] * count, shapes, strides,
        [0] * count, [0] * count, [8 * slot for slot in order], [6 if index == odd else 8 for index in range(count)], [True] * count, [{}] * count,
    )  # fmt: skip
    size = 8 * (max(order) + 1)
    arena_bytes = [torch.randint(0, 64, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))]
    table.check([len(arena_bytes[0])])
    return table, arena_bytes


@pytest.mark.parametrize(
    ("order", "odd", "runs"),
    [(list(range(12)), None, 1), (list(range(11, -1, -1)), None, 1), ([0, 1, 2, 3, 9, 10, 11], None, 3), (list(range(12)), 5, 4)],
    ids=["in order", "reversed", "two steps", "another layout among them"],
)
def test_views_of_one_layout_are_the_record_by_record_views(order, odd, runs):
    table, arena_bytes = one_layout_table(order, odd)
    assert len(plan_of(table, arena_bytes).runs) == runs
    views, bound = table_views(table, arena_bytes), table_bindings(table, arena_bytes)
    for index, name in enumerate(table.names):
        expected = view_of(arena_bytes[0], table, index)
        for got in (views[name], bound.tensors[index]):
            assert got.shape == expected.shape == bound.shapes[index] and got.stride() == expected.stride(), name
            assert got.data_ptr() == expected.data_ptr() and torch.equal(got, expected), name


def test_table_parameters_are_new_parameters_of_the_same_memory_each_time():
    table, arena_bytes = mixed_table()
    views = table_views(table, arena_bytes)
    first, second = table_parameters(table, arena_bytes), table_parameters(table, arena_bytes)
    assert set(first) == {n for n, k in zip(table.names, table.kind, strict=True) if k == 0}  # parameters only
    for name, parameter in first.items():
        reference = torch.nn.Parameter(views[name], requires_grad=False)
        assert type(parameter) is torch.nn.Parameter and parameter is not second[name] and parameter is not views[name]
        assert not parameter.requires_grad and parameter.is_leaf and parameter.grad_fn is None and parameter._base is None
        assert parameter.shape == reference.shape and parameter.dtype == reference.dtype, name
        if reference.numel():
            assert parameter.stride() == reference.stride() and parameter.data_ptr() == reference.data_ptr(), name
    # They behave as any Parameter: data replaced, requires_grad turned on, copied, a module's state.
    parameter = first["layers.0.experts.0.gate_proj.weight"]
    module = torch.nn.Module()
    module.weight = parameter
    assert list(module.state_dict()) == ["weight"] and module.weight is parameter
    clone = copy.deepcopy(parameter)
    assert type(clone) is torch.nn.Parameter and torch.equal(clone, parameter) and clone.data_ptr() != parameter.data_ptr()
    parameter.data = torch.zeros(2)
    assert parameter.shape == (2,) and views["layers.0.experts.0.gate_proj.weight"].shape == (4, 8)
    assert parameter.requires_grad_(True).requires_grad


def test_where_a_tensor_refuses_the_class_change_its_parameter_is_made_as_nn_parameter_makes_it():
    from weightcache.core.layout.views import _as_parameters

    class Slotted(torch.Tensor):  # another object layout: ``__class__ = Parameter`` raises TypeError
        __slots__ = ("extra",)

    made = [torch.arange(3.0).as_subclass(Slotted), torch.zeros(2).as_subclass(Slotted)]
    pointers = [t.data_ptr() for t in made]
    _as_parameters(made, torch.nn.Parameter)
    assert [type(t) for t in made] == [torch.nn.Parameter] * 2 and not any(t.requires_grad for t in made)
    assert [t.data_ptr() for t in made] == pointers and torch.equal(made[0], torch.arange(3.0))


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.__setitem__("x", torch.zeros(1)),
        lambda d: d.__delitem__(next(iter(d))),
        lambda d: d.update(x=torch.zeros(1)),
        lambda d: d.pop(next(iter(d))),
        lambda d: d.popitem(),
        lambda d: d.setdefault("x", torch.zeros(1)),
        lambda d: d.clear(),
        lambda d: d.__ior__({"x": torch.zeros(1)}),
    ],
)
def test_a_changed_tensors_dict_forgets_its_source(change):
    table, arena_bytes = mixed_table()
    views = table_views(table, arena_bytes)
    views.setdefault(table.names[0], None)  # an existing key: nothing changes
    assert views.source is not None
    change(views)
    assert views.source is None


READS = {
    "getitem": lambda d, name: d[name],
    "get": lambda d, name: d.get(name),
    "in": lambda d, name: name in d,
    "len": lambda d, name: len(d),
    "iter": lambda d, name: list(d),
    "reversed": lambda d, name: list(reversed(d)),
    "keys": lambda d, name: list(d.keys()),
    "values": lambda d, name: list(d.values()),
    "items": lambda d, name: list(d.items()),
    "bool": lambda d, name: bool(d),
    "dict()": lambda d, name: dict(d),
    "{**d}": lambda d, name: {**d},
    "plain.update": lambda d, name: {}.update(d),
    "OrderedDict": lambda d, name: collections.OrderedDict(d),
    "copy": lambda d, name: d.copy(),
    "copy.copy": lambda d, name: copy.copy(d),
    "==": lambda d, name: d == {},
    "plain ==": lambda d, name: {} == d,
    "|": lambda d, name: d | {},
    "ror": lambda d, name: {} | d,
    "repr": lambda d, name: repr(d),
    "load_state_dict": lambda d, name: torch.nn.Module().load_state_dict(d, strict=False),
    "setitem": lambda d, name: d.__setitem__("x", torch.zeros(1)),
    "pop": lambda d, name: d.pop(name),
    "setdefault": lambda d, name: d.setdefault(name),
    "update": lambda d, name: d.update(x=torch.zeros(1)),
    "clear": lambda d, name: d.clear(),
}


@pytest.mark.parametrize("read", list(READS))
def test_unmade_tensors_are_made_by_any_read_and_are_the_views(read):
    table, arena_bytes = mixed_table()
    unmade = UnmadeTensors.of(table, arena_bytes, {"alias.weight": table.names[0]})
    assert dict.__len__(unmade) == 0  # nothing made yet
    result = READS[read](unmade, table.names[0])
    assert type(unmade) is MappedTensors  # made: a plain MappedTensors from now on
    if read in ("len", "bool", "in"):
        assert result == (len(table.names) + 1 if read == "len" else True)
    if read == "plain ==":
        assert result is False
    if read not in ("setitem", "pop", "update", "clear"):
        expected = table_views(table, arena_bytes)
        assert set(unmade) == {*table.names, "alias.weight"} and unmade.source is not None
        assert unmade["alias.weight"] is unmade[table.names[0]]
        for name in table.names:
            assert unmade[name].data_ptr() == expected[name].data_ptr() and unmade[name].shape == expected[name].shape
    else:
        assert unmade.source is None  # a change: rebind takes each tensor from the dict


def test_rebind_from_unmade_tensors_makes_only_the_parameters():
    builder, manifest = published(Model())
    try:
        views = manifest.views(builder.arenas)
        assert type(views) is UnmadeTensors
        model = rebind_module(meta_model(), views, manifest)  # buffers and aliases read the dict: made then
        assert type(views) is MappedTensors and model.experts[1].scale is views["experts.1.scale"]
        del model, views
        # A model of parameters only, no aliases: rebind leaves the dict unmade.
        original = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        items = [NamedTensor(name, "parameter", t) for name, t in original.named_parameters()]
        built = ArenaBuilder("cpu")
        try:
            exported = export_tensors(items, {}, built, release=False)
            plain = Manifest.from_wire(*exported.to_wire(), trusted=True)
            views = plain.views(built.arenas)
            with torch.device("meta"):
                skeleton = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
            model = rebind_module(skeleton, views, plain)
            assert type(views) is UnmadeTensors
            x = torch.randn(3, 4)
            assert torch.equal(model(x), original(x))
            assert model[0].weight.data_ptr() == views["0.weight"].data_ptr()
            del model, views
        finally:
            built.close()
    finally:
        builder.close()


class Expert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 8))
        self.register_buffer("scale", torch.rand(4))

    def forward(self, x):
        return (x @ self.weight.T) * self.scale


class Model(torch.nn.Module):
    def __init__(self, experts: int = 6):
        super().__init__()
        self.experts = torch.nn.ModuleList(Expert() for _ in range(experts))
        self.shared = self.experts[0]  # one module reached at two paths
        self.norm = torch.nn.Parameter(torch.randn(4))
        self.trained_off = 0

    def train(self, mode: bool = True):  # an override: called once the weights are bound
        if not mode:
            assert not self.norm.is_meta
            self.trained_off += 1
        return super().train(mode)

    def forward(self, x):
        return sum(expert(x) for expert in self.experts) * self.norm


def published(model: Model) -> tuple[ArenaBuilder, Manifest]:
    items = [NamedTensor(name, "parameter", t) for name, t in model.named_parameters(remove_duplicate=False)]
    items += [NamedTensor(name, "buffer", t) for name, t in model.named_buffers(remove_duplicate=False)]
    seen: dict[int, str] = {}
    kept, aliases = [], {}
    for item in items:  # the shared module's tensors: aliases of the first path's
        if id(item.tensor) in seen:
            aliases[item.name] = seen[id(item.tensor)]
        else:
            seen[id(item.tensor)] = item.name
            kept.append(item)
    builder = ArenaBuilder("cpu")
    manifest = export_tensors(kept, aliases, builder, release=False)
    return builder, Manifest.from_wire(*manifest.to_wire(), trusted=True)


def meta_model() -> Model:
    with torch.device("meta"):
        return Model()


def test_rebind_from_the_views_makes_its_parameters_from_the_table_and_gives_the_same_model(monkeypatch):
    torch.manual_seed(0)
    original = Model().eval()
    builder, manifest = published(original)
    calls = []
    real = rebind_mod.table_bindings
    monkeypatch.setattr(rebind_mod, "table_bindings", lambda *a: calls.append(1) or real(*a))
    try:
        views = manifest.views(builder.arenas)
        fast = rebind_module(meta_model(), views, manifest)
        slow = rebind_module(meta_model(), dict(views), manifest)  # a plain dict: every Parameter from the dict
        assert calls == [1]
        x = torch.randn(3, 8)
        assert torch.equal(fast(x), original(x)) and torch.equal(slow(x), original(x))
        for model in (fast, slow):
            assert not model.training and model.trained_off == 1 and all(not m.training for m in model.modules())
            assert model.shared is model.experts[0] and model.shared.weight is model.experts[0].weight
            for name, parameter in model.named_parameters():
                assert type(parameter) is torch.nn.Parameter and not parameter.requires_grad, name
                assert parameter.data_ptr() == views[name].data_ptr() and parameter is not views[name], name
            for name, buffer in model.named_buffers():
                assert buffer is views[name], name
        assert fast.norm is not slow.norm
        del fast, slow, views
    finally:
        builder.close()


def test_rebind_binds_what_a_changed_dict_holds():
    builder, manifest = published(Model())
    try:
        views = manifest.views(builder.arenas)
        replacement = torch.ones(4)
        views["norm"] = replacement
        model = rebind_module(meta_model(), views, manifest)
        assert model.norm.data_ptr() == replacement.data_ptr() and type(model.norm) is torch.nn.Parameter
        del model, views
    finally:
        builder.close()


def test_rebind_refuses_a_shape_the_model_does_not_have():
    builder, manifest = published(Model())
    try:
        skeleton = meta_model()
        skeleton.norm = torch.nn.Parameter(torch.empty(5, device="meta"))
        with pytest.raises(RebindError, match="'norm' has shape \\(4,\\), the model expects \\(5,\\)"):
            rebind_module(skeleton, manifest.views(builder.arenas), manifest)
    finally:
        builder.close()


@pytest.mark.parametrize("left", ["parameter", "buffer", "attribute"])
def test_check_no_meta_finds_a_tensor_left_on_meta(left):
    builder, manifest = published(Model())
    try:
        skeleton = meta_model()
        target = skeleton.experts[3]
        if left == "parameter":
            target.extra = torch.nn.Parameter(torch.empty(2, device="meta"))
        elif left == "buffer":
            target.register_buffer("extra", torch.empty(2, device="meta"))
        else:
            target.__dict__["extra"] = torch.empty(2, device="meta")
        with pytest.raises(RebindError, match=r"1 tensors stayed on the meta device after rebind: experts\.3\.extra"):
            rebind_module(skeleton, manifest.views(builder.arenas), manifest)
        model = rebind_module(skeleton, manifest.views(builder.arenas), manifest, check=False)
        with pytest.raises(RebindError, match=r"experts\.3\.extra"):
            check_no_meta(model)
        del target.extra
        check_no_meta(model)
        del model
    finally:
        builder.close()


def test_table_bindings_are_in_the_tables_order_with_the_shape_each_was_made_with():
    table, arena_bytes = mixed_table()
    bound = table_bindings(table, arena_bytes)
    assert plan_of(table, arena_bytes).table_order is not None  # the runs made them in another order
    views = table_views(table, arena_bytes)
    for name, kind, tensor, shape in zip(table.names, table.kind, bound.tensors, bound.shapes, strict=True):
        assert type(tensor) is (torch.nn.Parameter if kind == 0 else torch.Tensor), name
        assert type(shape) is torch.Size and shape == tensor.shape == views[name].shape, name
        if tensor.numel():
            assert tensor.data_ptr() == views[name].data_ptr() and tensor.stride() == views[name].stride(), name
    assert bound.mapped and not bound.all_parameters
    assert set(bound.parameters_by_name()) == set(table_parameters(table, arena_bytes))


def _wrong_shape(skeleton: Model, where: str) -> str:
    """Give ``skeleton`` one tensor of another shape; the name rebind must refuse."""
    if where == "in a run":  # the experts' weights are made as one run
        skeleton.experts[4].weight = torch.nn.Parameter(torch.empty(8, 4, device="meta"))
        return "experts.4.weight"
    if where == "a Parameter subclass":
        skeleton.experts[2].weight = type("Sub", (torch.nn.Parameter,), {})(torch.empty(4, 9, device="meta"))
        return "experts.2.weight"
    if where == "a plain attribute":
        del skeleton.norm
        skeleton.__dict__["norm"] = torch.empty(3, device="meta")
        return "norm"
    skeleton.experts[5].weight = torch.nn.Parameter(torch.empty(4, 8, 1, device="meta"))
    return "experts.5.weight"


@pytest.mark.parametrize("where", ["in a run", "a Parameter subclass", "a plain attribute", "another rank"])
@pytest.mark.parametrize("fresh", [True, False], ids=["from the table", "from a dict"])
def test_rebind_refuses_every_shape_the_model_does_not_have(where, fresh):
    builder, manifest = published(Model())
    try:
        skeleton = meta_model()
        name = _wrong_shape(skeleton, where)
        views = manifest.views(builder.arenas)
        with pytest.raises(RebindError, match=f"'{name}' has shape"):
            rebind_module(skeleton, views if fresh else dict(views), manifest)
    finally:
        builder.close()


def test_a_module_reached_at_two_paths_is_checked_for_meta_whatever_its_records_bind():
    """Records under both paths of one module (no alias) bind its one slot twice: its dict holds as many entries as
    records were bound there, yet one of them is still on meta; the check must look at it."""
    torch.manual_seed(0)
    source = Model()
    state = {"experts.0.weight": source.experts[0].weight, "shared.weight": source.experts[0].weight.clone()}
    state.update((f"experts.{i}.weight", source.experts[i].weight) for i in range(1, 6))
    items = [NamedTensor(name, "parameter", t) for name, t in state.items()]  # parameters only: no dict is spoiled
    items.append(NamedTensor("norm", "parameter", source.norm))
    builder = ArenaBuilder("cpu")
    try:
        manifest = Manifest.from_wire(*export_tensors(items, {}, builder, release=False).to_wire(), trusted=True)
        skeleton = meta_model()
        for expert in skeleton.experts:
            del expert.scale
        skeleton.experts[0].extra = torch.nn.Parameter(torch.empty(2, device="meta"))
        with pytest.raises(RebindError, match=r"^1 tensors .*: experts\.0\.extra"):
            rebind_module(skeleton, manifest.views(builder.arenas), manifest)
    finally:
        builder.close()


def test_bound_here_keeps_only_dicts_entered_once_by_parameters():
    once, twice, spoiled = {}, {}, {}
    entered = [(once, 0), (twice, 2), (spoiled, 3), (twice, 5)]
    assert rebind_mod._bound_here(entered, 7, [spoiled]) == {id(once): 2}
    assert rebind_mod._bound_here([], 0, []) == {}


@pytest.mark.parametrize("positions", [[], [2], [3, 0, 1]])
def test_picker_takes_the_positions_in_order(positions):
    assert rebind_mod._picker(positions)("abcd") == ["abcd"[p] for p in positions]


def test_a_table_of_buffers_and_attributes_only_binds_them():
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.rand(3))
            self.W_UV = torch.rand(2, 2)

    source = Holder()
    builder = ArenaBuilder("cpu")
    try:
        items = [NamedTensor("scale", "buffer", source.scale), NamedTensor("W_UV", "attribute", source.W_UV)]
        manifest = Manifest.from_wire(*export_tensors(items, {}, builder, release=False).to_wire(), trusted=True)
        with torch.device("meta"):
            skeleton = Holder()
        model = rebind_module(skeleton, manifest.views(builder.arenas), manifest)
        assert torch.equal(model.scale, source.scale) and torch.equal(model.W_UV, source.W_UV)
        assert "W_UV" not in model._buffers and "W_UV" not in model._parameters
    finally:
        builder.close()


def test_a_dict_tensor_on_meta_bound_where_the_model_held_nothing_is_refused():
    builder, manifest = published(Model())
    try:
        views = manifest.views(builder.arenas)
        views["experts.2.weight"] = torch.empty(4, 8, device="meta")  # a changed dict: rebind binds what it holds
        skeleton = meta_model()
        del skeleton.experts[2].weight  # nothing there: the module's _parameters held no tensor when walked
        with pytest.raises(RebindError, match=r"experts\.2\.weight"):
            rebind_module(skeleton, views, manifest)
    finally:
        builder.close()
