"""Block-wise FP8 (e4m3) weight quantization, DeepSeek-V3 / transformers FineGrainedFP8 layout.

A weight ``W`` of shape ``(out, in)`` is cut into ``block_size`` tiles (128x128 by
default; the last row and column of tiles may be partial).  Each tile stores its
values as ``float8_e4m3fn`` in ``weight`` (same shape as ``W``) and one float32
``weight_scale_inv`` entry in a ``(ceil(out/bm), ceil(in/bn))`` grid, so that::

    W ~= weight.float() * weight_scale_inv (each entry spread over its tile)

Why this method is safe to map raw: every bit of its effect lives in the two
tensors ``weight`` and ``weight_scale_inv``, plus the block size, which is a field
of :class:`Fp8BlockConfig` and therefore of the fingerprint.  Nothing is kept in
Python-side metadata, nothing is repacked, transposed or padded for a kernel, and
activations are quantized dynamically at run time (static activation scales are
refused).  An engine that maps the cached bytes and knows the block size computes
exactly what an engine that quantized from disk computes.

Only torch is used; every op is device-agnostic (CPU and CUDA), and quantization
is deterministic: the same input gives the same bytes every time.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import sys
import typing

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from weightcache.core.errors import RebindError, UnsupportedQuantization
from weightcache.core.quantization.method import QuantizationMethod

FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32
FP8_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value; each tile's amax maps onto it."""
_MIN_AMAX = 2.0**-100
"""Tiles with ``0 < amax < 2**-100`` are scaled as if amax were 2**-100, so the scale stays finite."""
METHOD = "fp8-block"
FORMAT_VERSION = 1
"""Bump when the quantized bytes for the same input would change."""

DEFAULT_EXCLUDE = ("lm_head", "*embed*", "*wte*", "*wpe*")
_REGEX_ONLY = frozenset("^$()|+{}\\")

BlockSize = tuple[int, int]


def _pair(value: typing.Iterable[int]) -> tuple[int, ...]:
    """A block size as a tuple (``_check_block_size`` then checks it is two positive ints)."""
    return tuple(value)


# ---------------------------------------------------------------- config


def _to_str_tuple(value) -> tuple[str, ...]:
    if isinstance(value, str):
        raise TypeError(f"exclude must be a sequence of patterns, not the string {value!r}; wrap it: ({value!r},)")
    return tuple(sorted(set(value)))


def _check_block_size(_inst, _attr, value) -> None:
    if len(value) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        raise ValueError(f"block_size must be two positive ints, got {value!r}; DeepSeek-V3 uses (128, 128)")


def _check_activation_scheme(_inst, _attr, value) -> None:
    if value != "dynamic":
        raise UnsupportedQuantization(
            "fp8", f"activation_scheme {value!r}: static activation scales are not validated, only 'dynamic' is"
        )


@attrs.frozen
class Fp8BlockConfig:
    """Settings of block-wise FP8 quantization; its :meth:`to_json` feeds the fingerprint.

    :param block_size: ``(rows, cols)`` of one tile of the weight.
    :param exclude: fnmatch patterns of module names to leave unquantized (kept
        sorted and deduplicated, so equal sets compare and hash equal).  A pattern
        excludes a module when it matches the module's qualified name, or that of
        an ancestor, either whole or from a dot boundary: ``lm_head`` excludes
        ``lm_head`` and ``model.lm_head``; ``model.visual`` excludes everything
        under it; ``*embed*`` excludes any name containing ``embed``.
    :param activation_scheme: only ``"dynamic"`` is supported.
    """

    block_size: BlockSize = attrs.field(default=(128, 128), converter=_pair, validator=_check_block_size)
    exclude: tuple[str, ...] = attrs.field(default=DEFAULT_EXCLUDE, converter=_to_str_tuple)
    activation_scheme: str = attrs.field(default="dynamic", validator=_check_activation_scheme)

    def to_json(self) -> dict:
        """A canonical JSON-able dict; any change of a field changes it."""
        return {
            "method": METHOD,
            "format_version": FORMAT_VERSION,
            "weight_dtype": str(FP8_DTYPE).removeprefix("torch."),
            "scale_dtype": str(SCALE_DTYPE).removeprefix("torch."),
            "block_size": list(self.block_size),
            "exclude": list(self.exclude),
            "activation_scheme": self.activation_scheme,
        }

    @classmethod
    def from_json(cls, data: dict) -> "Fp8BlockConfig":
        """The config that :meth:`to_json` described; refuses other methods or format versions."""
        if data.get("method") != METHOD or data.get("format_version") != FORMAT_VERSION:
            raise UnsupportedQuantization(
                str(data.get("method")),
                f"expected method {METHOD!r} format_version {FORMAT_VERSION}, got "
                f"{data.get('method')!r} format_version {data.get('format_version')!r}; re-publish the entry",
            )
        return cls(
            block_size=tuple(data["block_size"]),
            exclude=tuple(data["exclude"]),
            activation_scheme=str(data["activation_scheme"]),
        )

    @classmethod
    def from_hf_quantization_config(cls, qc: dict) -> "Fp8BlockConfig":
        """Read a transformers FineGrainedFP8 / DeepSeek-V3 ``quantization_config`` dict.

        ``modules_to_not_convert`` (or MiniMax's ``ignored_layers``) is added to
        :data:`DEFAULT_EXCLUDE`; its plain names and ``.*`` wildcards mean the
        same as fnmatch patterns, other regex syntax is refused.
        """
        method = str(qc.get("quant_method", "")).lower()
        if method != "fp8":
            raise UnsupportedQuantization(method or "unknown", "only quant_method 'fp8' maps to block-wise FP8")
        _refuse_hf_variants(qc)
        skip = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
        return cls(
            block_size=tuple(qc["weight_block_size"]),
            exclude=DEFAULT_EXCLUDE + tuple(_hf_pattern(p) for p in skip),
            activation_scheme=str(qc.get("activation_scheme", "dynamic")).lower(),
        )


def _refuse_hf_variants(qc: dict) -> None:
    """Raise for the FineGrainedFP8 options whose results are not validated."""
    if qc.get("weight_block_size") is None:
        raise UnsupportedQuantization("fp8", "per-tensor FP8 (no weight_block_size) keeps scales outside the 128x128 layout")
    refusals = {
        "scale_fmt": ("float", "only float32 weight_scale_inv is validated, not ue8m0 scales"),
        "expert_dtype": ("fp8", "FP4-packed experts are not validated"),
        "dequantize": (False, "dequantize=True loads unquantized weights; use quantization 'none' instead"),
    }
    for key, (expected, reason) in refusals.items():
        if qc.get(key, expected) != expected:
            raise UnsupportedQuantization("fp8", f"{key}={qc[key]!r}: {reason}")
    if qc.get("modules_to_convert"):
        raise UnsupportedQuantization("fp8", "modules_to_convert (FP8 embeddings) is not validated")


def _hf_pattern(pattern: str) -> str:
    if _REGEX_ONLY & set(pattern):
        raise UnsupportedQuantization(
            "fp8",
            f"modules_to_not_convert entry {pattern!r} is a regex; rewrite it as fnmatch patterns in Fp8BlockConfig.exclude",
        )
    return pattern


def is_excluded(name: str, patterns: typing.Iterable[str]) -> bool:
    """Whether ``patterns`` exclude the module ``name`` (rules in :class:`Fp8BlockConfig`)."""
    parts = name.split(".")
    prefixes = [".".join(parts[: i + 1]) for i in range(len(parts))]
    return any(
        fnmatch.fnmatchcase(prefix, pat) or fnmatch.fnmatchcase(prefix, "*." + pat) for pat in patterns for prefix in prefixes
    )


# ---------------------------------------------------------------- tensors


def scale_shape(shape: typing.Sequence[int], block_size: BlockSize) -> tuple[int, int]:
    """Shape of ``weight_scale_inv`` for a weight of ``shape``: ``(ceil(out/bm), ceil(in/bn))``."""
    _check_block_size(None, None, tuple(block_size))
    return math.ceil(shape[0] / block_size[0]), math.ceil(shape[1] / block_size[1])


def _padded_float32(tensor: torch.Tensor, block_size: BlockSize) -> torch.Tensor:
    """A new float32 tensor of whole tiles, ``tensor`` in its top-left corner, zeros elsewhere."""
    rows, cols = scale_shape(tensor.shape, block_size)
    buf = torch.zeros(rows * block_size[0], cols * block_size[1], dtype=torch.float32, device=tensor.device)
    buf[: tensor.shape[0], : tensor.shape[1]].copy_(tensor)
    return buf


def _tiles(buf: torch.Tensor, block_size: BlockSize) -> torch.Tensor:
    """A ``(rows, bm, cols, bn)`` view of a padded buffer."""
    bm, bn = block_size
    return buf.view(buf.shape[0] // bm, bm, buf.shape[1] // bn, bn)


def _check_weight(weight: torch.Tensor) -> None:
    if weight.ndim != 2:
        raise ValueError(f"expected a 2-D (out, in) weight, got shape {tuple(weight.shape)}")
    if weight.is_meta:
        raise ValueError("cannot quantize a weight on the meta device; use convert_model_to_fp8_skeleton for skeletons")


def quantize_weight(weight: torch.Tensor, block_size: BlockSize = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight tile by tile; returns ``(qweight, weight_scale_inv)``.

    Per tile, in float32: ``amax = max|w|``, ``scale = 448 / amax``,
    ``qweight = clamp(w * scale, -448, 448)`` as ``float8_e4m3fn`` and
    ``weight_scale_inv = 1 / scale``.  An all-zero tile gets
    ``weight_scale_inv = 1.0`` (and zeros in ``qweight``), as in transformers.
    Partial edge tiles are padded with zeros only inside a temporary buffer,
    which does not change their amax.  Raises ``ValueError`` on inf or nan.
    """
    qweight, scale_inv, non_finite = _quantize(weight, block_size)
    _refuse_non_finite(tuple(weight.shape), int(non_finite))
    return qweight, scale_inv


def _quantize(weight: torch.Tensor, block_size: BlockSize) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_weight`` without its check: also the count of tiles holding inf or nan, as a tensor on the weight's
    device (reading it waits for the device, so ``quantize_model`` reads its layers' counts once all are queued).

    The same bytes as the float32 form the docstring of ``quantize_weight`` gives, with fewer passes over memory:
    a bfloat16 or float16 weight is never copied to float32 (its tile maxima are exact in its own dtype, and the
    multiplication by a float32 scale computes in float32, as on a copy), whole tiles are read in place, the product
    is cast to ``float8_e4m3fn`` as it is stored (``torch.mul(..., out=)``: on a GPU in the same pass, with no float32
    product in memory; on a CPU torch fills a float32 temporary and casts it, as ``.to`` does), and the clamp is left
    out: ``|w| <= amax`` and ``scale = fl(448 / amax)`` give ``|fl(w * scale)| <= 448 (1 + 2**-24)**2``,
    below 464, the least value that ``float8_e4m3fn``'s round-to-nearest-even takes past 448, so the cast gives what
    the clamp then the cast gave (tests/core/test_fp8_block.py compares them on edge values).
    """
    _check_weight(weight)
    out, into = tuple(weight.shape)
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        weight = weight.to(torch.float32)  # float64 and the rest: rounded to float32 first, as the float32 form does
    weight = weight.contiguous()
    rows, cols = scale_shape(weight.shape, block_size)
    whole = (rows * block_size[0], cols * block_size[1])
    if (out, into) != whole:  # partial edge tiles: zeros around them, in the weight's own dtype (exact)
        padded = torch.zeros(whole, dtype=weight.dtype, device=weight.device)
        padded[:out, :into].copy_(weight)
        weight = padded
    tiles = _tiles(weight, block_size)
    amax = torch.maximum(tiles.amax(dim=(1, 3)), tiles.amin(dim=(1, 3)).neg()).to(torch.float32)
    scale = torch.where(amax > 0, FP8_MAX / amax.clamp(min=_MIN_AMAX), torch.ones_like(amax))
    qweight = torch.empty(whole, dtype=FP8_DTYPE, device=weight.device)
    torch.mul(tiles, scale[:, None, :, None], out=_tiles(qweight, block_size))  # in float32, cast as it is stored
    if (out, into) != whole:
        qweight = qweight[:out, :into].contiguous()
    return qweight, (1.0 / scale).to(SCALE_DTYPE), (~torch.isfinite(amax)).sum()


def _refuse_non_finite(shape: tuple[int, ...], count: int) -> None:
    if count:
        raise ValueError(
            f"weight of shape {shape} holds inf or nan in {count} tiles; "
            "fix the checkpoint or exclude this module with Fp8BlockConfig.exclude"
        )


def dequantize_weight(
    qweight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: BlockSize = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``qweight.float() * scale_inv`` spread over each tile, as a new contiguous ``dtype`` tensor."""
    expected = scale_shape(qweight.shape, block_size)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv has shape {tuple(scale_inv.shape)}, but a {tuple(qweight.shape)} weight in "
            f"{tuple(block_size)} tiles needs {expected}; check the block size in the quantization config"
        )
    buf = _padded_float32(qweight, block_size)
    _tiles(buf, block_size).mul_(scale_inv.to(torch.float32)[:, None, :, None])
    return buf[: qweight.shape[0], : qweight.shape[1]].to(dtype).contiguous()


# ---------------------------------------------------------------- module


class Fp8BlockLinear(nn.Module):
    """A linear layer whose weight is block-wise FP8; ``forward`` dequantizes to the input's dtype.

    Parameters (none requires grad): ``weight`` (``float8_e4m3fn``, ``(out, in)``),
    ``weight_scale_inv`` (float32, see :func:`scale_shape`) and optional ``bias``
    (``dtype``).  Build it with ``device="meta"`` for a skeleton whose parameters
    are rebound later to mapped tensors.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        block_size: BlockSize = (128, 128),
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.block_size: BlockSize = (int(block_size[0]), int(block_size[1]))
        grid = scale_shape((out_features, in_features), self.block_size)
        self.weight = _frozen(torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device))
        self.weight_scale_inv = _frozen(torch.ones(grid, dtype=SCALE_DTYPE, device=device))
        if bias:
            self.bias = _frozen(torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def like(cls, linear: nn.Linear, block_size: BlockSize, device: torch.device | str = "meta") -> "Fp8BlockLinear":
        """An empty layer with ``linear``'s features, bias and bias dtype."""
        dtype = linear.bias.dtype if linear.bias is not None else linear.weight.dtype
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, block_size, dtype, device)
        return layer.train(linear.training)

    @classmethod
    def from_linear(cls, linear: nn.Linear, block_size: BlockSize) -> "Fp8BlockLinear":
        """``linear`` quantized; the bias is shared with ``linear`` (no copy)."""
        qweight, scale_inv = quantize_weight(linear.weight.detach(), block_size)
        layer = cls.like(linear, block_size)
        return layer.assign(qweight, scale_inv, linear.bias)

    def assign(self, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None) -> "Fp8BlockLinear":
        """Point the parameters at these tensors without copying them; returns ``self``."""
        _expect("weight", weight, FP8_DTYPE, self.weight.shape)
        _expect("weight_scale_inv", scale_inv, SCALE_DTYPE, self.weight_scale_inv.shape)
        self.weight = _frozen(weight.detach())
        self.weight_scale_inv = _frozen(scale_inv.detach())
        if bias is not None and self.bias is not None:
            _expect("bias", bias, self.bias.dtype, self.bias.shape)
            self.bias = _frozen(bias.detach())
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = dequantize_weight(self.weight, self.weight_scale_inv, self.block_size, x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, block_size={self.block_size}"
        )


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def _expect(name: str, tensor: torch.Tensor, dtype: torch.dtype, shape) -> None:
    if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
        raise RebindError(
            f"{name} is {tensor.dtype} {tuple(tensor.shape)}, the layer needs {dtype} {tuple(shape)}; "
            "check the block size and that the checkpoint matches the model"
        )


# ---------------------------------------------------------------- models


def _shared_ids(model: nn.Module) -> set[int]:
    """ids of the parameters and modules reachable under more than one name (tied weights)."""
    counts: dict[int, int] = {}
    for _, obj in [*model.named_parameters(remove_duplicate=False), *model.named_modules(remove_duplicate=False)]:
        counts[id(obj)] = counts.get(id(obj), 0) + 1
    return {key for key, n in counts.items() if n > 1}


def _is_tied(linear: nn.Module, shared: set[int]) -> bool:
    return id(linear) in shared or any(id(p) in shared for p in linear.parameters(recurse=False))


def _targets(model: nn.Module, config: Fp8BlockConfig) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` modules to convert: exactly ``nn.Linear``, not excluded, not tied.

    Subclasses of ``nn.Linear`` may change ``forward`` and are left alone, as is
    transformers' GPT-2 ``Conv1D`` (not an ``nn.Linear``; its weight is stored
    ``(in, out)``).
    """
    shared = _shared_ids(model)
    return [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and not is_excluded(name, config.exclude) and not _is_tied(module, shared)
    ]


def quantize_model(model: nn.Module, config: Fp8BlockConfig = Fp8BlockConfig()) -> list[str]:
    """Replace each eligible ``nn.Linear`` of ``model`` (see ``_targets``) by a quantized :class:`Fp8BlockLinear`.

    :returns: the qualified names of the converted modules, in module order.
    """
    names, checks = [], []
    for name, linear in _targets(model, config):
        with _naming(name):
            qweight, scale_inv, non_finite = _quantize(linear.weight.detach(), config.block_size)
        checks.append((name, tuple(linear.weight.shape), non_finite))
        model.set_submodule(name, Fp8BlockLinear.like(linear, config.block_size).assign(qweight, scale_inv, linear.bias))
        names.append(name)
    for name, shape, non_finite in checks:  # the first count read waits for every layer's work, queued by then
        with _naming(name):
            _refuse_non_finite(shape, int(non_finite))
    return names


@contextlib.contextmanager
def _naming(name: str) -> typing.Iterator[None]:
    """A ValueError raised inside names the layer ``name`` (a note; in the message on Python 3.10)."""
    try:
        yield
    except ValueError as exc:
        note = f"while quantizing {name}.weight"
        if sys.version_info >= (3, 11):
            exc.add_note(note)
            raise
        raise ValueError(f"{exc} ({note})") from exc  # Python 3.10 has no exception notes


def convert_model_to_fp8_skeleton(model: nn.Module, config: Fp8BlockConfig = Fp8BlockConfig()) -> list[str]:
    """The module replacement of :func:`quantize_model`, with every new parameter on the meta device.

    Gives the same module structure and parameter names, shapes and dtypes as
    :func:`quantize_model`, for a client that rebinds them to mapped tensors.
    """
    names = []
    for name, linear in _targets(model, config):
        model.set_submodule(name, Fp8BlockLinear.like(linear, config.block_size, device="meta"))
        names.append(name)
    return names


# ---------------------------------------------------------------- pre-quantized checkpoints

_SAFETENSORS_FP8 = "F8_E4M3"


def _is_fp8(value) -> bool:
    """Whether a tensor, a dtype or a dtype name (torch or safetensors spelling) is ``float8_e4m3fn``."""
    if isinstance(value, str):
        return value in (_SAFETENSORS_FP8, "float8_e4m3fn", "torch.float8_e4m3fn")
    return getattr(value, "dtype", value) == FP8_DTYPE


def prequantized_modules(tensors: typing.Mapping[str, typing.Any]) -> list[str]:
    """Module names whose ``.weight`` is ``float8_e4m3fn`` with a ``.weight_scale_inv`` beside it.

    :param tensors: checkpoint names mapped to tensors, dtypes, or dtype names
        (``"F8_E4M3"`` as in a safetensors header), so it works before any data is read.
    """
    return sorted(
        key.removesuffix(".weight")
        for key, value in tensors.items()
        if key.endswith(".weight") and _is_fp8(value) and key.removesuffix(".weight") + ".weight_scale_inv" in tensors
    )


def is_prequantized_state(tensors: typing.Mapping[str, typing.Any]) -> bool:
    """Whether a checkpoint already stores block-wise FP8 weights (see :func:`prequantized_modules`)."""
    return bool(prequantized_modules(tensors))


def load_prequantized(
    model: nn.Module,
    tensors: typing.Mapping[str, torch.Tensor],
    config: Fp8BlockConfig = Fp8BlockConfig(),
) -> list[str]:
    """Convert the modules stored pre-quantized in ``tensors`` and bind their bytes unchanged.

    Each module named by :func:`prequantized_modules` must be an ``nn.Linear``
    (or already an :class:`Fp8BlockLinear`) that is not tied; it becomes an
    :class:`Fp8BlockLinear` whose ``weight`` and ``weight_scale_inv`` are the
    given tensors themselves (no copy, no re-quantization).  Its bias, if any,
    is kept; load the remaining tensors with ``load_state_dict`` as usual.

    :returns: the converted module names.
    """
    shared = _shared_ids(model)
    names = prequantized_modules(tensors)
    for name in names:
        layer = _fp8_layer_for(model, name, config.block_size, shared)
        layer.assign(tensors[name + ".weight"], tensors[name + ".weight_scale_inv"])
        model.set_submodule(name, layer)
    return names


def _fp8_layer_for(model: nn.Module, name: str, block_size: BlockSize, shared: set[int]) -> Fp8BlockLinear:
    try:
        module = model.get_submodule(name)
    except AttributeError:
        raise RebindError(
            f"the checkpoint holds FP8 tensors for {name!r}, which the model lacks; check the architecture"
        ) from None
    if isinstance(module, Fp8BlockLinear):
        return module
    if type(module) is not nn.Linear or _is_tied(module, shared):
        raise RebindError(
            f"{name!r} is stored as FP8 but is a {'tied ' if _is_tied(module, shared) else ''}"
            f"{type(module).__name__} in the model; only untied nn.Linear layers can hold block-wise FP8 weights"
        )
    layer = Fp8BlockLinear.like(module, block_size)
    if module.bias is not None:
        layer.bias = _frozen(module.bias.detach())
    return layer


class Fp8Block(QuantizationMethod):
    """The method ``fp8-block``: this module's layers, as the registry serves them (``quantization/method.py``)."""

    name: typing.ClassVar[str] = METHOD
    convertible: typing.ClassVar[str] = (
        "only untied nn.Linear layers outside the excluded modules hold block-FP8 weights (GPT-2's Conv1D layers do not)"
    )

    def declared_by(self, quantization_config: typing.Mapping[str, typing.Any]) -> bool:
        """transformers' FineGrainedFP8: ``quant_method`` ``fp8`` with a ``weight_block_size`` (without one, per-tensor)."""
        return str(quantization_config.get("quant_method", "")).lower() == "fp8" and bool(
            quantization_config.get("weight_block_size")
        )

    def accept(self, declared: typing.Mapping[str, typing.Any] | None, options: typing.Mapping[str, typing.Any]) -> dict:
        if declared is not None:
            return Fp8BlockConfig.from_hf_quantization_config(dict(declared)).to_json()
        kwargs: dict[str, typing.Any] = {}
        if options.get("block_size"):
            kwargs["block_size"] = tuple(options["block_size"])
        if options.get("exclude") is not None:
            kwargs["exclude"] = tuple(options["exclude"])
        return Fp8BlockConfig(**kwargs).to_json()

    def quantize(self, model: nn.Module, config: typing.Mapping[str, typing.Any]) -> list[str]:
        return quantize_model(model, Fp8BlockConfig.from_json(dict(config)))

    def layout(self, model: nn.Module) -> dict:
        layer = next((m for m in model.modules() if isinstance(m, Fp8BlockLinear)), None)
        return {"fp8_block_size": list(layer.block_size)} if layer is not None else {}

    def rebind(self, model: nn.Module, names: typing.Iterable[str], layout: typing.Mapping[str, typing.Any]) -> list[str]:
        """Each module whose ``weight_scale_inv`` the entry holds becomes an :class:`Fp8BlockLinear` on meta."""
        block_size = tuple(layout.get("fp8_block_size") or (128, 128))
        converted = []
        for name in names:
            if not name.endswith(".weight_scale_inv"):
                continue
            name = name.removesuffix(".weight_scale_inv")
            module = model.get_submodule(name)
            if isinstance(module, Fp8BlockLinear):
                continue
            if not isinstance(module, nn.Linear):
                raise RebindError(f"{name} has a weight_scale_inv but is a {type(module).__name__}, not a Linear layer")
            model.set_submodule(name, Fp8BlockLinear.like(module, block_size, device="meta"))
            converted.append(name)
        return converted

    def load_stored(
        self, model: nn.Module, tensors: typing.Mapping[str, torch.Tensor], config: typing.Mapping[str, typing.Any]
    ) -> list[str]:
        return load_prequantized(model, tensors, Fp8BlockConfig.from_json(dict(config)))
