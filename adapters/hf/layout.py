"""A model's tensor layout, remembered, so that ``weightcache load`` publishes a known architecture without transformers.

Building a transformers model, even on meta, imports its modeling stack: thousands of modules
(pandas, scipy.stats, torch._dynamo among them), which take longer than reading a 16 GB
checkpoint (docs/benchmarks.md). Yet a publish that reads the checkpoint straight into arenas
uses the model only as a layout: which tensors exist where (parameters, buffers, tensor
attributes, their shapes and dtypes, which are shared), the values of the buffers its
``__init__`` computes (rotary frequencies), and its class name. ``Layout`` records exactly that
from a meta skeleton, and ``Layout.build`` makes a plain ``torch.nn.Module`` tree (its exact
``torch.nn.Linear`` layers as ``torch.nn.Linear``, which block-FP8 quantisation converts) with the same
names in the same order, the same sharing and the same buffer values: what export and the
manifest see of it is what they see of the skeleton (tests/adapters/test_hf_layout.py checks
the manifests are equal for every architecture the tests build).

The layout is remembered in the digest store's directory under a key of everything it depends
on: the config.json content, the requested class, the dtype, transformers' and torch's versions
and this format's version. A different config or version is another key, so a stale layout is
never read; an entry that is not one of ours is a miss (``DigestStore.read_entry``), and a miss
builds the skeleton as before.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import typing

import attrs
import torch

from weightcache.adapter import to_dtype
from weightcache.adapters.hf.layout_key import FORMAT, MAX_ENTRY_BYTES

if typing.TYPE_CHECKING:
    from weightcache.adapter import DigestStore

log = logging.getLogger(__name__)

MAX_VALUE_BYTES = 16 << 20
"""Real (computed) tensor values a layout may carry; a model with more is not remembered (its skeleton is built)."""

KINDS = ("parameter", "buffer", "attribute")


@attrs.frozen
class Tensor:
    """One tensor object of the skeleton: its dtype and shape, and its bytes where it is real (None: on meta)."""

    dtype: str
    shape: tuple[int, ...]
    value: bytes | None = None


@attrs.frozen
class Slot:
    """Where a module holds a tensor: ``leaf`` of kind parameter, buffer or attribute, pointing at tensor ``ref``
    (an index into ``Layout.tensors``; -1: registered as None); ``persistent`` for buffers."""

    leaf: str
    kind: str
    ref: int
    persistent: bool = True


@attrs.frozen
class Module:
    """One name of ``named_modules(remove_duplicate=False)``: a module of its own, or ``same_as`` an earlier name;
    ``linear`` where it is exactly a ``torch.nn.Linear`` (block-FP8 quantisation converts those, and only those)."""

    name: str
    slots: tuple[Slot, ...] = ()
    same_as: str | None = None
    linear: bool = False


@attrs.frozen
class Layout:
    """What a publish needs of a model: its class name, modules, tensors and how they are shared."""

    class_name: str
    modules: tuple[Module, ...]
    tensors: tuple[Tensor, ...]
    ties: tuple[tuple[str, str], ...] = ()
    """The parameters ``tie_weights`` points at another one: (name, the name it then shares)."""

    @classmethod
    def of_model(cls, model: torch.nn.Module, ties: typing.Iterable[tuple[str, str]] = ()) -> "Layout | None":
        """The layout of ``model`` (a skeleton: parameters on meta, ``ties`` made by its ``tie_weights``), or None where
        a plain module would not rebuild it faithfully (a non-contiguous or too large real tensor, a tensor subclass,
        state_dict hooks)."""
        refs: dict[int, int] = {}
        tensors: list[Tensor] = []
        value_bytes = 0
        modules: list[Module] = []
        first_name: dict[int, str] = {}

        def ref(tensor: "torch.Tensor | None") -> int | None:
            nonlocal value_bytes
            if tensor is None:
                return -1
            if id(tensor) in refs:
                return refs[id(tensor)]
            if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided:
                return None
            value = None
            if tensor.device.type != "meta":
                if not tensor.is_contiguous() or tensor.storage_offset() != 0:
                    return None
                value = (
                    tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
                )
                value_bytes += len(value)
            refs[id(tensor)] = len(tensors)
            tensors.append(Tensor(str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), value))
            return refs[id(tensor)]

        for name, module in model.named_modules(remove_duplicate=False):
            if id(module) in first_name:
                modules.append(Module(name, same_as=first_name[id(module)]))
                continue
            first_name[id(module)] = name
            if module._state_dict_hooks or module._state_dict_pre_hooks:  # the fit check reads state_dict()
                return None
            slots = []
            for kind, items in (
                ("parameter", module._parameters.items()),
                ("buffer", module._buffers.items()),
                ("attribute", [(k, v) for k, v in vars(module).items() if isinstance(v, torch.Tensor)]),
            ):
                for leaf, tensor in items:
                    index = ref(tensor)
                    if index is None:
                        return None
                    persistent = kind != "buffer" or leaf not in module._non_persistent_buffers_set
                    slots.append(Slot(leaf, kind, index, persistent))
            modules.append(Module(name, tuple(slots), linear=type(module) is torch.nn.Linear))
        if value_bytes > MAX_VALUE_BYTES:
            return None
        return cls(type(model).__name__, tuple(modules), tuple(tensors), tuple(ties))

    def build(self) -> "LayoutModel":
        """A plain module tree with this layout: parameters on meta, real tensors with their values, sharing kept."""
        objects: list[torch.Tensor] = []
        for tensor in self.tensors:
            dtype = to_dtype(tensor.dtype)
            if tensor.value is None:
                objects.append(torch.empty(tensor.shape, dtype=dtype, device="meta"))
            else:
                flat = (
                    torch.frombuffer(bytearray(tensor.value), dtype=torch.uint8)
                    if tensor.value
                    else torch.empty(0, dtype=torch.uint8)
                )
                objects.append(flat.view(dtype).reshape(tensor.shape))
        as_parameter = {slot.ref for module in self.modules for slot in module.slots if slot.kind == "parameter"}
        for index in as_parameter - {-1}:  # one Parameter object, whatever else holds it too
            objects[index] = torch.nn.Parameter(objects[index], requires_grad=False)

        root = LayoutModel(self)
        built: dict[str, torch.nn.Module] = {}
        for module in self.modules:
            if module.same_as is not None:
                target = built[module.same_as]
            else:
                target = root if not module.name else _linear(module, self) if module.linear else torch.nn.Module()
                for slot in module.slots:
                    if slot.kind == "parameter":
                        target._parameters[slot.leaf] = (
                            None if slot.ref < 0 else typing.cast(torch.nn.Parameter, objects[slot.ref])
                        )
                    elif slot.kind == "buffer":
                        target._buffers[slot.leaf] = None if slot.ref < 0 else objects[slot.ref]
                        if not slot.persistent:
                            target._non_persistent_buffers_set.add(slot.leaf)
                    else:
                        target.__dict__[slot.leaf] = objects[slot.ref]
            if module.name:
                parent, _, leaf = module.name.rpartition(".")
                built[parent].add_module(leaf, target)
            built[module.name] = target
        return root.eval()

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "format": FORMAT,
                "class_name": self.class_name,
                "modules": [
                    [m.name, m.same_as, [[s.leaf, s.kind, s.ref, s.persistent] for s in m.slots], m.linear] for m in self.modules
                ],
                "tensors": [
                    [t.dtype, list(t.shape), None if t.value is None else base64.b64encode(t.value).decode()]
                    for t in self.tensors
                ],
                "ties": [list(pair) for pair in self.ties],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Layout":
        """The layout ``to_json`` wrote; ValueError for anything else (a wrong shape, a dangling reference, a value whose
        size is not its shape's)."""
        try:
            raw = json.loads(data)
            if raw["format"] != FORMAT:
                raise ValueError(f"format {raw['format']!r}, not {FORMAT}")
            tensors = []
            for dtype, shape, value in raw["tensors"]:
                if not all(isinstance(n, int) and n >= 0 for n in shape):
                    raise ValueError(f"shape {shape!r}")
                tensor = Tensor(str(dtype), tuple(shape), None if value is None else base64.b64decode(value, validate=True))
                _check_value(tensor)
                tensors.append(tensor)
            modules: list[Module] = []
            names = {""}
            for name, same_as, slots, linear in raw["modules"]:
                parent = name.rpartition(".")[0]
                if (name and parent not in names) or (same_as is not None and same_as not in names) or (not name and modules):
                    raise ValueError(f"module {name!r} comes before its parent or the module it is")
                checked = []
                for leaf, kind, ref, persistent in slots:
                    if kind not in KINDS or not isinstance(ref, int) or not -1 <= ref < len(tensors):
                        raise ValueError(f"slot {leaf!r} of {name!r}: kind {kind!r}, reference {ref!r}")
                    checked.append(Slot(str(leaf), kind, ref, bool(persistent)))
                if linear and _linear_weight(checked, tensors) is None:
                    raise ValueError(f"module {name!r} is marked Linear without a 2-D weight")
                modules.append(Module(str(name), tuple(checked), same_as, bool(linear)))
                names.add(name)
            ties = tuple((str(name), str(target)) for name, target in raw["ties"])
            return cls(str(raw["class_name"]), tuple(modules), tuple(tensors), ties)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a weightcache model layout: {exc}") from None


def _linear_weight(slots: typing.Sequence[Slot], tensors: typing.Sequence[Tensor]) -> Tensor | None:
    """The 2-D weight parameter ``slots`` hold where they hold what a ``torch.nn.Linear`` holds (and a bias, or None)."""
    slot = next((s for s in slots if s.leaf == "weight" and s.kind == "parameter" and s.ref >= 0), None)
    return tensors[slot.ref] if slot is not None and len(tensors[slot.ref].shape) == 2 else None


def _linear(module: Module, layout: Layout) -> torch.nn.Module:
    """An empty ``torch.nn.Linear`` (no parameter made) whose features are those of ``module``'s weight; ``build``
    puts the parameters in."""
    weight = typing.cast(Tensor, _linear_weight(module.slots, layout.tensors))  # a linear module has one (from_json)
    linear = torch.nn.Linear.__new__(torch.nn.Linear)
    torch.nn.Module.__init__(linear)
    linear.out_features, linear.in_features = weight.shape
    return linear


def _check_value(tensor: Tensor) -> None:
    itemsize = to_dtype(tensor.dtype).itemsize  # every dtype checked, no tensor made: a layout holds 10^5 of them
    if tensor.value is not None and len(tensor.value) != math.prod(tensor.shape) * itemsize:
        raise ValueError(f"a value of {len(tensor.value)} bytes for shape {list(tensor.shape)} of {tensor.dtype}")


class LayoutModel(torch.nn.Module):
    """The root of a module tree built from a ``Layout``: ``weightcache_class_name`` is the transformers class it
    stands for, and ``tie_weights`` does what that class's did."""

    def __init__(self, layout: Layout):
        super().__init__()
        self.__dict__["weightcache_layout"] = layout
        self.__dict__["weightcache_class_name"] = layout.class_name

    def tie_weights(self) -> None:
        """Point each tied parameter at the one it shares (the skeleton's ``tie_weights``, replayed)."""
        for name, target in self.__dict__["weightcache_layout"].ties:
            owner_name, _, leaf = name.rpartition(".")
            self.get_submodule(owner_name)._parameters[leaf] = self.get_parameter(target)


def class_name_of(model: torch.nn.Module) -> str:
    """The transformers class ``model`` is or stands for (a ``LayoutModel`` names the class whose layout it has)."""
    return getattr(model, "weightcache_class_name", None) or type(model).__name__


def remembered(store: "DigestStore", key: str) -> Layout | None:
    """The layout remembered under ``key``, or None (none, or an entry that is not a layout: logged, then a miss)."""
    data = store.read_entry(key, MAX_ENTRY_BYTES)
    if data is None:
        return None
    try:
        return Layout.from_json(data)
    except ValueError as exc:
        log.debug("ignoring layout %s in %s: %s", key, store.directory, exc)
        return None


def remember(store: "DigestStore", key: str, model: torch.nn.Module, ties: typing.Iterable[tuple[str, str]]) -> None:
    """Remember ``model``'s layout under ``key`` (a tied skeleton; nothing where ``Layout.of_model`` declines)."""
    layout = Layout.of_model(model, ties)
    if layout is None:
        log.debug("not remembering the layout of %s: it holds tensors a plain module would not", type(model).__name__)
        return
    store.write_entry(key, layout.to_json())
