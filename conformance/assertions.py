"""Bit-exact tensor comparisons whose failures name the tensor, its dtype, its device and the largest difference."""

from __future__ import annotations

import hashlib
import typing

import attrs

if typing.TYPE_CHECKING:
    import torch


@attrs.frozen
class TensorFacts:
    """What the kit compares of one named tensor of a model (``digest`` is the sha256 of its bytes)."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    device: str
    digest: str
    tensor: typing.Any = attrs.field(eq=False, repr=False)
    attributes: dict = attrs.field(factory=dict, hash=False)

    def differences(self, other: "TensorFacts") -> list[str]:
        """What differs from ``other`` (empty when identical), each item readable on its own."""
        notes = [
            f"{label} {mine} != {theirs}"
            for label, mine, theirs in (
                ("kind", self.kind, other.kind),
                ("dtype", self.dtype, other.dtype),
                ("shape", self.shape, other.shape),
                ("stride", self.stride, other.stride),
                ("Python attributes", self.attributes, other.attributes),
            )
            if mine != theirs
        ]
        if self.digest != other.digest:
            notes.append(difference_message(self.tensor, other.tensor) or "sha256 of the bytes differs")
        return notes


def tensor_bytes(tensor: "torch.Tensor") -> "torch.Tensor":
    """The tensor's values in row-major order as a flat uint8 tensor on the CPU."""
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def tensor_digest(tensor: "torch.Tensor") -> str:
    """sha256 of the tensor's bytes in row-major order (independent of its strides and device)."""
    return hashlib.sha256(tensor_bytes(tensor).numpy().tobytes()).hexdigest()


def bit_identical(actual: "torch.Tensor", expected: "torch.Tensor") -> bool:
    """Same dtype, shape and bytes (NaNs compare by their bits)."""
    import torch

    return (
        actual.dtype == expected.dtype
        and tuple(actual.shape) == tuple(expected.shape)
        and torch.equal(tensor_bytes(actual), tensor_bytes(expected))
    )


def difference_message(actual: "torch.Tensor", expected: "torch.Tensor") -> str | None:
    """None if the tensors are bit-identical, else how they differ: count, largest difference and where."""
    import torch

    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype} != {expected.dtype}"
    if tuple(actual.shape) != tuple(expected.shape):
        return f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if bit_identical(actual, expected):
        return None
    a = actual.detach().to("cpu")
    b = expected.detach().to("cpu")
    if a.dtype.is_floating_point or a.dtype.is_complex:
        a, b = a.to(torch.float64), b.to(torch.float64)
        differs = ~((a == b) | (torch.isnan(a) & torch.isnan(b)))
        diff = torch.where(differs, (a - b).abs().nan_to_num(nan=float("inf")), torch.zeros_like(a))
    else:
        a, b = a.to(torch.int64), b.to(torch.int64)
        differs = a != b
        diff = (a - b).abs().to(torch.float64)
    count = int(differs.sum())
    if count == 0:  # equal values, other bits (e.g. -0.0 and 0.0, NaN payloads)
        return "values compare equal but their bytes differ (signed zeros or NaN payloads)"
    flat = int(diff.reshape(-1).argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(a.shape))) if a.dim() else ()
    return (
        f"{count} of {a.numel()} elements differ, largest difference {float(diff.reshape(-1)[flat]):.6g} "
        f"at index {list(index)} ({float(a.reshape(-1)[flat]):.9g} vs {float(b.reshape(-1)[flat]):.9g})"
    )


def assert_tensors_identical(
    name: str, actual: "torch.Tensor", expected: "torch.Tensor", context: str = "", label: str = "mapped"
) -> None:
    """Raise AssertionError naming ``name``, the dtype, both devices and the largest difference unless bit-identical.

    :param context: what is being compared (prefixes the message).
    :param label: what ``actual`` is (``expected`` is always the disk load).
    """
    message = difference_message(actual, expected)
    if message is not None:
        prefix = f"{context}: " if context else ""
        raise AssertionError(
            f"{prefix}{name}: {actual.dtype} on {actual.device} ({label}) differs from the disk load "
            f"({expected.dtype} on {expected.device}): {message}"
        )


def model_tensors(model: "torch.nn.Module") -> dict[str, TensorFacts]:
    """Every tensor the forward may read, by name, tied aliases included: parameters, buffers and the
    tensor-valued plain attributes of modules (kind ``attribute``, e.g. vLLM's MLA ``W_UV``), each with the
    JSON-able Python attributes hung on it (``format_ue8m0``)."""
    from weightcache.core.load.export import json_attributes, tensor_attributes

    facts: dict[str, TensorFacts] = {}
    named = [
        *(("parameter", n, t) for n, t in model.named_parameters(remove_duplicate=False)),
        *(("buffer", n, t) for n, t in model.named_buffers(remove_duplicate=False)),
        *(("attribute", n, t) for n, _, _, t in tensor_attributes(model)),
    ]
    for kind, name, tensor in named:
        facts[name] = TensorFacts(
            name=name,
            kind=kind,
            dtype=str(tensor.dtype).removeprefix("torch."),
            shape=tuple(tensor.shape),
            stride=tuple(tensor.stride()),
            device=str(tensor.device),
            digest=tensor_digest(tensor) if tensor.device.type != "meta" else "meta",
            tensor=tensor,
            attributes=json_attributes(tensor),
        )
    return facts


def tied_groups(model: "torch.nn.Module") -> set[frozenset[str]]:
    """Names of parameters and buffers that share memory, grouped (only groups of two or more)."""
    by_place: dict[tuple, set[str]] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if tensor.numel() == 0 or tensor.device.type == "meta":
            continue
        key = (str(tensor.device), tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        by_place.setdefault(key, set()).add(name)
    return {frozenset(names) for names in by_place.values() if len(names) > 1}


def flatten_outputs(output: typing.Any, prefix: str = "output") -> dict[str, "torch.Tensor"]:
    """The tensors in a model's output (tensors, mappings such as ModelOutput, lists and tuples), by path.

    Other objects (e.g. a transformers cache) are skipped: they hold values the
    tensors around them already depend on.
    """
    import torch

    if isinstance(output, torch.Tensor):
        return {prefix: output}
    leaves: dict[str, torch.Tensor] = {}
    if isinstance(output, typing.Mapping):
        for key, value in output.items():
            leaves.update(flatten_outputs(value, f"{prefix}.{key}"))
    elif isinstance(output, (list, tuple)):
        for index, value in enumerate(output):
            leaves.update(flatten_outputs(value, f"{prefix}[{index}]"))
    return leaves


def failures(title: str, problems: list[str], limit: int = 40) -> str:
    """``title`` and its problems, one per line (the first ``limit``, then how many more)."""
    shown = problems[:limit] + ([f"... and {len(problems) - limit} more"] if len(problems) > limit else [])
    return f"{title} ({len(problems)}):\n  " + "\n  ".join(shown)


def assert_same_model(
    model: "torch.nn.Module",
    reference: "torch.nn.Module",
    run_model: "typing.Callable[[torch.nn.Module, typing.Any], typing.Any]",
    example_inputs: typing.Any,
    context: str,
    label: str = "mapped",
) -> None:
    """Every tensor of ``model`` equals ``reference``'s (a disk load); and its outputs too where a forward can run here."""
    from weightcache.core.request import ForwardUnavailable

    disk = model_tensors(reference)
    mine = model_tensors(model)
    problems = [
        f"{name} ({facts.dtype} on {facts.device}): " + "; ".join(facts.differences(disk[name]))
        for name, facts in mine.items()
        if name in disk and facts.differences(disk[name])
    ]
    problems += [f"{name} is missing" for name in sorted(set(disk) - set(mine))]
    assert not problems, failures(f"{context}: tensors differ from the disk load", problems)
    if not isinstance(example_inputs, ForwardUnavailable):
        expected = flatten_outputs(run_model(reference, example_inputs))
        assert_same_outputs(flatten_outputs(run_model(model, example_inputs)), expected, context, label)


def assert_same_outputs(
    actual: "dict[str, torch.Tensor]", expected: "dict[str, torch.Tensor]", context: str, label: str = "mapped"
) -> None:
    """The same output tensors by path, each bit-identical to the disk load's."""
    if set(actual) != set(expected):
        raise AssertionError(
            f"{context}: output tensors differ in names: missing {sorted(set(expected) - set(actual))}, "
            f"extra {sorted(set(actual) - set(expected))}"
        )
    for name in expected:
        assert_tensors_identical(name, actual[name], expected[name], context=context, label=label)
