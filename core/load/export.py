"""Placing a model's final tensors into arenas: layout, copy, manifest."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import typing

import attrs

from weightcache.core.arena import ArenaSpec, backend_for_device, round_up
from weightcache.core.arena.checksum import check_copy, checksum
from weightcache.core.device import Device
from weightcache.core.errors import ArenaError
from weightcache.core.identity.digests import FileDigest
from weightcache.core.layout.manifest import Manifest, TensorRecord

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.arena.base import Arena, ArenaBackend

log = logging.getLogger(__name__)

ALIGNMENT = 256
DEFAULT_CHUNK_BYTES = 1 << 30


@attrs.frozen
class Slot:
    """Where one tensor's storage region lies: arena index, byte offset, bytes."""

    arena: int
    offset: int
    nbytes: int


class ArenaBuilder:
    """Lays tensors out in arenas of at most ``chunk_bytes`` and fills them.

    Arenas are created one at a time as they are first touched, so copying a
    loaded model into them peaks at the weights plus one arena.
    """

    def __init__(
        self,
        device: "Device | str" = "cpu",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        backend: "ArenaBackend | None" = None,
        progress=None,
    ):
        from weightcache.core.progress import NoProgress

        self.device = Device.parse(device)
        self.backend = backend or backend_for_device(self.device)
        self.chunk_bytes = chunk_bytes
        self.progress = progress or NoProgress()
        self._sizes: list[int] = []  # planned bytes per arena
        self._arenas: list[Arena | None] = []
        self._fill = 0  # bytes used in the last planned arena
        self._last_is_whole = False  # the last arena came from add_arena: plan() never adds to it
        self._sealed = False
        self.read_digests: dict[str, FileDigest] = {}
        """Digests of the checkpoint files whose bytes ``weightcache.core.load.reader`` placed here, by path: computed
        from those very bytes, they name what the arenas hold."""
        self.read_mode: typing.Any = None
        """How the reader read them (its ``ReadMode``), for diagnostics."""

    def __enter__(self) -> "ArenaBuilder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def plan(self, nbytes: int) -> Slot:
        """Reserve ``nbytes`` (aligned) in the current arena, or start a new one.

        An arena that exists already never grows: a slot goes into its spare
        bytes (its size rounded up to the backend's granularity) or into a new arena.
        """
        size = round_up(max(nbytes, 1), ALIGNMENT)
        if self._sealed:
            raise ArenaError(f"cannot plan {nbytes} bytes: the arenas are sealed; plan every tensor before publishing")
        if not self._sizes or self._last_is_whole or self._fill + size > self._capacity():
            self._last_is_whole = False
            self._sizes.append(0)
            self._arenas.append(None)
            self._fill = 0
        slot = Slot(arena=len(self._sizes) - 1, offset=self._fill, nbytes=nbytes)
        self._fill += size
        self._sizes[-1] = self._fill
        return slot

    def add_arena(self, nbytes: int) -> Slot:
        """Plan a new arena of its own for ``nbytes`` and return the slot covering all of it (copying an entry
        arena by arena keeps every manifest offset)."""
        if self._sealed:
            raise ArenaError(f"cannot plan an arena of {nbytes} bytes: the arenas are sealed")
        if nbytes <= 0:
            raise ValueError(f"an arena holds at least one byte, not {nbytes}")
        self._sizes.append(nbytes)
        self._arenas.append(None)
        self._fill = nbytes
        self._last_is_whole = True
        return Slot(arena=len(self._sizes) - 1, offset=0, nbytes=nbytes)

    def _capacity(self) -> int:
        """Bytes the last arena may hold: ``chunk_bytes`` while only planned, its real size once created."""
        arena = self._arenas[-1]
        return self.chunk_bytes if arena is None else arena.spec.size

    def view(self, slot: Slot) -> "torch.Tensor":
        """The writable uint8 bytes of ``slot`` (creates its arena on first use).

        Raises ArenaError for a slot that does not lie inside its arena.
        """
        arena = self.arena(slot)
        if slot.offset < 0 or slot.offset + slot.nbytes > arena.spec.size:
            raise ArenaError(
                f"{slot} lies outside arena {slot.arena} ({arena.spec.size} bytes); write only slots this builder's plan() returned"
            )
        return arena.bytes_view()[slot.offset : slot.offset + slot.nbytes]

    def arena(self, slot: Slot) -> "Arena":
        """The arena ``slot`` lies in, created on first use (a host arena's memfd is mapped only when viewed)."""
        if self._sealed:
            raise ArenaError(f"cannot write {slot}: the arenas are sealed")
        if not 0 <= slot.arena < len(self._arenas):
            raise ArenaError(
                f"{slot} names arena {slot.arena}, but {len(self._arenas)} were planned; plan the slot with this builder"
            )
        arena = self._arenas[slot.arena]
        if arena is None:
            arena = self._arenas[slot.arena] = self.backend.create(self._sizes[slot.arena], str(self.device))
        return arena

    @property
    def arenas(self) -> list["Arena"]:
        missing = [i for i, a in enumerate(self._arenas) if a is None]
        if missing:
            raise RuntimeError(f"arenas {missing} were planned but never filled")
        return [arena for arena in self._arenas if arena is not None]

    def specs(self) -> list[ArenaSpec]:
        return [arena.spec for arena in self.arenas]

    def seal(self) -> None:
        """Make every arena final and checksum its bytes (into ``arena.spec``); views handed out before must be dropped by now.

        Idempotent: an arena sealed and checksummed once is left as it is. The checksum
        runs where the arena lives (on its GPU for a CUDA arena).
        """
        for index in range(len(self.arenas)):
            self.seal_arena(index)
        self._sealed = True

    def seal_arena(self, index: int) -> ArenaSpec:
        """Make arena ``index`` final and checksum its bytes, alone (a copy checked arena by arena); its spec.

        Idempotent like ``seal``; the other arenas stay writable. Views of this arena must be dropped by now.
        """
        arena = self._arenas[index]
        if arena is None:
            raise RuntimeError(f"arena {index} was planned but never filled")
        if arena.spec.checksum is None:
            self.backend.seal(arena)
            arena.spec = attrs.evolve(arena.spec, checksum=checksum(arena.bytes_view()))
        return arena.spec

    def replace_arena(self, index: int) -> "Arena | None":
        """Plan arena ``index`` afresh, empty and of the same size (a copy into it failed or did not match); returns
        the arena it held, which the caller closes once nothing can write into it any more."""
        if self._sealed:
            raise ArenaError(f"cannot replace arena {index}: the arenas are sealed")
        old, self._arenas[index] = self._arenas[index], None
        return old

    def check_copy(self, declared: "typing.Sequence[ArenaSpec]", source: str) -> list[ArenaSpec]:
        """Seal, then the arenas' specs if their bytes are what ``source`` ``declared`` (ChecksumMismatch otherwise)."""
        self.seal()
        specs = self.specs()
        check_copy(declared, specs, source)
        return specs

    def close(self) -> None:
        """Release this process's handles (the server keeps its own fds)."""
        for arena in self._arenas:
            if arena is not None:
                arena.close()
        self._arenas = [None] * len(self._arenas)

    def truncate(self, count: int) -> None:
        """Close and forget every arena after the first ``count`` (their tensors were copied elsewhere: a refit's
        version placed as its previous version)."""
        if self._sealed:
            raise ArenaError("cannot drop arenas: they are sealed")
        for arena in self._arenas[count:]:
            if arena is not None:
                arena.close()
        self._sizes, self._arenas = self._sizes[:count], self._arenas[:count]
        self._fill, self._last_is_whole = (self._sizes[-1] if self._sizes else 0), True

    def reset(self) -> None:
        """Close every arena and forget every plan: the builder is empty again (a failed copy starts over)."""
        self.close()
        self._sizes, self._arenas, self._fill, self._last_is_whole, self._sealed = [], [], 0, False, False
        self.read_digests = {}
        self.read_mode = None

    def locate(self, tensor: "torch.Tensor") -> Slot | None:
        """The slot of a tensor that already lives in one of these arenas, else None."""
        start = tensor.data_ptr()
        for index, arena in enumerate(self._arenas):
            if arena is None:
                continue
            base = arena.bytes_view().data_ptr()
            if base <= start < base + arena.spec.size:
                return Slot(arena=index, offset=start - base, nbytes=storage_region_bytes(tensor))
        return None


def storage_region_bytes(tensor: "torch.Tensor") -> int:
    """Bytes of the storage a tensor reaches from its own offset (all of it for a strided view)."""
    if tensor.numel() == 0:
        return 0
    elements = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return elements * tensor.element_size()


def region_bytes(tensor: "torch.Tensor") -> "torch.Tensor":
    """The tensor's storage region, from its offset, as a flat uint8 tensor (no copy)."""
    import torch

    elements = storage_region_bytes(tensor) // tensor.element_size()
    flat = tensor.as_strided((elements,), (1,), tensor.storage_offset())
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=tensor.device)


@attrs.frozen
class NamedTensor:
    """One tensor to export: ``kind`` is ``parameter``, ``buffer`` or ``attribute`` (a plain tensor attribute of a module)."""

    name: str
    kind: str
    tensor: typing.Any = attrs.field(eq=False, repr=False)
    persistent: bool = True


def json_attributes(tensor: "torch.Tensor") -> dict:
    """The public JSON-able Python attributes an engine hung on ``tensor`` (``param.format_ue8m0 = True``), by name.

    Values are kept as JSON gives them back (tuples become lists); functions,
    tensors and other objects are left out (an engine's skeleton recreates those),
    and so are names with a leading underscore: a framework's own bookkeeping
    (transformers' ``_is_hf_initialized``), which depends on how a model was
    loaded, not on what it computes; and ``nn.Buffer``'s own ``persistent``
    (a record's ``persistent`` field holds it).
    """
    import torch

    own = ("persistent",) if isinstance(tensor, torch.nn.Buffer) else ()
    found = {}
    for name, value in sorted(getattr(tensor, "__dict__", {}).items()):
        if not name.startswith("_") and name not in own and _is_json_value(value):
            found[name] = json.loads(json.dumps(value, allow_nan=False))
    return found


def _is_json_value(value) -> bool:
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_is_json_value(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _is_json_value(item) for key, item in value.items())
    return False


def tensor_attributes(module: "torch.nn.Module") -> "list[tuple[str, torch.nn.Module, str, torch.Tensor]]":
    """Every tensor-valued plain attribute of ``module`` and its submodules: ``(name, owner, leaf, tensor)``.

    These are tensors a module keeps outside its parameters and buffers
    (vLLM's MLA ``W_UV``, SGLang's ``w_kc``/``w_vc``), usually made by
    post-processing; the forward reads them like weights.
    """
    import torch

    found = []
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for leaf, value in vars(owner).items():
            if isinstance(value, torch.Tensor):
                found.append((f"{owner_name}.{leaf}" if owner_name else leaf, owner, leaf, value))
    return found


def collect_tensors(module: "torch.nn.Module") -> tuple[list[NamedTensor], dict[str, str]]:
    """Every parameter, buffer and tensor attribute of ``module`` once, plus aliases for shared ones (alias -> name)."""
    seen: dict[int, str] = {}
    items: list[NamedTensor] = []
    aliases: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases[name] = seen[id(param)]
            continue
        seen[id(param)] = name
        items.append(NamedTensor(name, "parameter", param))
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for leaf, buffer in owner._buffers.items():
            if buffer is None:
                continue
            name = f"{owner_name}.{leaf}" if owner_name else leaf
            if id(buffer) in seen:
                if seen[id(buffer)] != name:
                    aliases[name] = seen[id(buffer)]
                continue
            seen[id(buffer)] = name
            items.append(NamedTensor(name, "buffer", buffer, leaf not in owner._non_persistent_buffers_set))
    for name, _owner, _leaf, tensor in tensor_attributes(module):
        if id(tensor) in seen:
            if seen[id(tensor)] != name:
                aliases[name] = seen[id(tensor)]
            continue
        seen[id(tensor)] = name
        items.append(NamedTensor(name, "attribute", tensor))
    return items, aliases


def export_module(module: "torch.nn.Module", builder: ArenaBuilder, extra: dict | None = None, release: bool = True) -> Manifest:
    """Copy every parameter, buffer and tensor attribute of ``module`` into ``builder``'s arenas and describe them.

    Tensors already inside the builder's arenas are recorded without a copy.
    With ``release`` each original is freed as soon as it is copied, so the
    module is empty afterwards: use the manifest (rebind) to get it back.
    """
    items, aliases = collect_tensors(module)
    items, aliases = _on_device(items, aliases, builder.device)
    return export_tensors(items, aliases, builder, extra, release)


def _on_device(items: list[NamedTensor], aliases: dict, device: Device) -> tuple[list[NamedTensor], dict]:
    """Leave out tensor attributes that live elsewhere than the weights (a CPU-side index beside GPU weights):
    mapped from a GPU arena they would change device."""
    elsewhere = {item.name for item in items if item.kind == "attribute" and item.tensor.device.type != device.kind}
    if not elsewhere:
        return items, aliases
    log.info("not cached (not on %s): tensor attributes %s", device, ", ".join(sorted(elsewhere)[:8]))
    return [item for item in items if item.name not in elsewhere], {a: t for a, t in aliases.items() if t not in elsewhere}


def export_state(state: "typing.Mapping[str, torch.Tensor]", builder: ArenaBuilder, extra: dict | None = None) -> Manifest:
    """Copy a ``name -> tensor`` mapping into ``builder``'s arenas (the same tensor twice becomes an alias)."""
    seen: dict[int, str] = {}
    items, aliases = [], {}
    for name, tensor in state.items():
        if id(tensor) in seen:
            aliases[name] = seen[id(tensor)]
            continue
        seen[id(tensor)] = name
        items.append(NamedTensor(name, "parameter", tensor))
    return export_tensors(items, aliases, builder, extra, release=False)


def export_tensors(
    items: list[NamedTensor], aliases: dict, builder: ArenaBuilder, extra: dict | None = None, release: bool = True
) -> Manifest:
    """Place ``items`` into arenas (copying those not there yet) and return their manifest.

    Raises ValueError for tensors on the meta device and ArenaError naming
    the tensor that could not be placed.
    """
    import torch

    if any(item.tensor.device.type == "meta" for item in items):
        meta = [item.name for item in items if item.tensor.device.type == "meta"][:5]
        raise ValueError(f"cannot export tensors on the meta device ({', '.join(meta)}); load the weights first")
    placed = []
    for item in items:
        with _naming(item):
            existing = builder.locate(item.tensor)
            placed.append((item, existing, existing or builder.plan(storage_region_bytes(item.tensor))))
    records = []
    with torch.no_grad():
        for item, existing, slot in placed:
            with _naming(item, slot):
                records.append(_record(item, slot))
                if existing is None:
                    target = builder.view(slot)  # creates the arena, even for an empty tensor
                    if slot.nbytes:
                        target.copy_(region_bytes(item.tensor.detach()))
                        builder.progress.update(slot.nbytes)
                        if release:
                            _release(item.tensor)
    if builder.device.is_cuda:
        torch.cuda.synchronize(builder.device.torch())  # this GPU's: a bare synchronize() makes a context on cuda:0
    return Manifest(tensors=records, arenas=builder.specs(), aliases=aliases, extra=dict(extra or {}))


def _record(item: NamedTensor, slot: Slot) -> TensorRecord:
    tensor = item.tensor
    return TensorRecord(
        name=item.name,
        kind=item.kind,
        dtype=str(tensor.dtype),
        shape=tuple(tensor.shape),
        stride=tuple(tensor.stride()),
        storage_offset=0,
        arena=slot.arena,
        offset=slot.offset,
        nbytes=slot.nbytes,
        persistent=item.persistent,
        attributes=json_attributes(tensor),
    )


@contextlib.contextmanager
def _naming(item: NamedTensor, slot: Slot | None = None):
    """Re-raise any failure to place ``item`` as an ArenaError that names it."""
    import torch

    try:
        yield
    except Exception as exc:
        tensor = item.tensor
        shape = f" {tuple(tensor.shape)}" if tensor.layout == torch.strided else ""
        where = f" into {slot}" if slot is not None else ""
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        hint = (
            "only dense tensors fit in arenas: make it one (to_dense())"
            if tensor.layout != torch.strided
            else "make it an ordinary tensor"
        )
        raise ArenaError(
            f"cannot export {item.kind} {item.name!r} ({tensor.dtype}{shape}, {tensor.layout}, on {tensor.device}){where}: "
            f"{reason}; nothing was published: {hint} in the adapter's load or post-processing"
        ) from exc


def _release(tensor: "torch.Tensor") -> None:
    """Free a copied original's memory (its module keeps an empty placeholder)."""
    import torch

    tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
