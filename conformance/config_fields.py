"""The kit's JSON perturbations: every scalar of config.json and of every other JSON file the adapter declares
(``weightcache_checkpoint_files``) changed, one at a time, on a copy.

A field is sound in one of two ways, as a flip is (``weightcache.conformance.flips``):
the fingerprint changes (a client with the other value misses the entry), or the
same fingerprint comes with the same published tensors and outputs (the field
cannot change the weights). Anything else is a config field that post-processing
folds into the weights while ``weightcache_describe`` leaves it out: edit
config.json, and a client attaches the stale entry.

The copy links every file of the checkpoint but config.json, which it rewrites, so
the weights' content identity stays the same (their digests are remembered by
inode) and a perturbation costs one describe and one fingerprint; only the fields
whose fingerprint does not change are loaded, all of them at once first, one by
one only when that load differs.
"""

from __future__ import annotations

import fnmatch
import json
import os
import typing
from collections.abc import Callable
from pathlib import Path

import attrs

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.flow.plugins import Plugins
    from weightcache.core.request import LoadRequest

CONFIG = "config.json"

METADATA_FIELDS: tuple[tuple[str, str], ...] = (
    ("transformers_version", "the version of the library that wrote the file"),
    ("_name_or_path", "where the checkpoint was loaded from when it was saved"),
    ("_commit_hash", "the hub revision the checkpoint was downloaded at"),
)
"""Fields no adapter needs to declare: they record where the file came from, never what the weights are."""

Leaf = tuple[tuple[typing.Union[str, int], ...], typing.Any]  # noqa: UP007  (a path of keys and indices, the value)


def scalar_leaves(value: typing.Any, path: tuple = ()) -> list[Leaf]:
    """Every scalar (number, boolean, string, null) in ``value``, with the keys and list indices leading to it."""
    if isinstance(value, dict):
        return [leaf for key, item in value.items() for leaf in scalar_leaves(item, (*path, key))]
    if isinstance(value, list):
        return [leaf for index, item in enumerate(value) for leaf in scalar_leaves(item, (*path, index))]
    return [(path, value)]


def field_name(path: tuple) -> str:
    """A field's path as the kit names it and as ``unused_config`` patterns match it: ``rope_scaling.factor``, ``layer_types.0``."""
    return ".".join(str(part) for part in path)


def perturbed(value: typing.Any) -> typing.Any:
    """Another value of the same kind: a boolean negated, a number moved, a string extended, a null made 1."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 if value else 1.0
    if isinstance(value, str):
        return f"{value}-conformance"
    return 1


def with_changes(config: dict | list, paths: "typing.Iterable[tuple]") -> dict | list:
    """A deep copy of ``config`` with the scalar at each of ``paths`` perturbed."""
    changed = json.loads(json.dumps(config))
    for path in paths:
        holder = changed
        for part in path[:-1]:
            holder = holder[part]
        holder[path[-1]] = perturbed(holder[path[-1]])
    return changed


def skip_reason(name: str, declared: "typing.Iterable[tuple[str, str]]") -> str | None:
    """Why field ``name`` need not be perturbed: a metadata field, or one the adapter declares (``unused_config``)."""
    for pattern, reason in (*METADATA_FIELDS, *declared):
        if fnmatch.fnmatchcase(name, pattern):
            return reason
    return None


def linked_copy(checkpoint: str | os.PathLike, target: Path, copied: str = CONFIG) -> Path:
    """``target`` holding a symlink to every file of the directory ``checkpoint`` but ``copied`` (relative), which is copied."""
    source = Path(checkpoint).resolve()
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.rglob("*")):
        destination = target / path.relative_to(source)
        if path.is_dir():
            destination.mkdir(parents=True, exist_ok=True)
        elif path.relative_to(source) == Path(copied):
            destination.write_bytes(path.read_bytes())
        else:
            destination.parent.mkdir(parents=True, exist_ok=True)
            destination.symlink_to(path)
    return target


def read_config(checkpoint: str | os.PathLike, name: str = CONFIG) -> dict | list | None:
    """The checkpoint's JSON file ``name`` (config.json), or None when it has none or it is no JSON object or list."""
    path = Path(checkpoint) / name
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except ValueError:
        return None
    return config if isinstance(config, (dict, list)) else None


def write_config(checkpoint: Path, config: dict | list, name: str = CONFIG) -> None:
    (checkpoint / name).write_text(json.dumps(config, indent=2))


def declared_json(request: "LoadRequest", plugins: "Plugins | None") -> list[str]:
    """The JSON files the adapter declares (``weightcache_checkpoint_files``), relative to the checkpoint, config.json first."""
    from weightcache.core.flow.loader import check

    checkpoint = Path(request.model)
    if not checkpoint.is_dir():
        return []
    checked = check(request, plugins)
    files = checked.adapter.checkpoint_files(checked.request).config_files(checkpoint)
    names = [str(file.relative_to(checkpoint)) for file in files if file.suffix == ".json"]
    return sorted(names, key=lambda name: (name != CONFIG, name))


@attrs.frozen
class FieldCheck:
    """What the config check found: problems (one line each), fields skipped with their reasons, and fields loaded."""

    problems: list[str]
    skipped: list[str]
    loaded: list[str]


def check_config_fields(
    request: "LoadRequest",
    plugins: "Plugins | None",
    declared: "typing.Iterable[tuple[str, str]]",
    copy_dir: Path,
    reference: "Callable[[torch.nn.Module], None]",
) -> FieldCheck | None:
    """Perturb every scalar of config.json and of every other JSON file the adapter declares, one file at a time, each on a
    linked copy under ``copy_dir`` (see the module docstring).

    :param declared: the adapter's ``unused_config`` (pattern, reason) pairs; a field of a file other than config.json
        is named ``FILE:FIELD`` (``1_Pooling/config.json:pooling_mode_mean_tokens``).
    :param reference: raises AssertionError unless a model equals the disk load (tensors, outputs).
    :returns: None when the checkpoint has no such file.
    """
    declared = list(declared)
    names = list(dict.fromkeys([CONFIG, *declared_json(request, plugins)]))
    found = [check_file(request, plugins, declared, copy_dir / str(number), reference, name) for number, name in enumerate(names)]
    checked = [one for one in found if one is not None]
    if not checked:
        return None
    fields = ("problems", "skipped", "loaded")
    return FieldCheck(*([item for one in checked for item in getattr(one, field)] for field in fields))


def check_file(
    request: "LoadRequest",
    plugins: "Plugins | None",
    declared: "typing.Iterable[tuple[str, str]]",
    copy_dir: Path,
    reference: "Callable[[torch.nn.Module], None]",
    name: str = CONFIG,
) -> FieldCheck | None:
    """Perturb every scalar of the checkpoint's JSON file ``name`` on a linked copy in ``copy_dir``; None: no such file."""
    config = read_config(request.model, name)
    if config is None:
        return None
    copy = attrs.evolve(request, model=str(linked_copy(request.model, copy_dir, name)))
    baseline = _fingerprint(copy, plugins)
    if baseline is None:
        raise AssertionError(f"a linked copy of {request.model} with the same {name} cannot be described")
    same: dict[str, tuple] = {}
    skipped = []
    for path, _ in scalar_leaves(config):
        field = field_name(path) if name == CONFIG else f"{name}:{field_name(path)}"
        reason = skip_reason(field, declared)
        if reason is not None:
            skipped.append(f"{field}: {reason}")
            continue
        write_config(copy_dir, with_changes(config, [path]), name)
        if _fingerprint(copy, plugins) == baseline:
            same[field] = path
    problems: list[str] = []
    if same:
        write_config(copy_dir, with_changes(config, same.values()), name)
        together = _fingerprint(copy, plugins) == baseline and _load_problem(copy, plugins, reference) is None
        for field, path in ({} if together else same).items():
            write_config(copy_dir, with_changes(config, [path]), name)
            problem = _load_problem(copy, plugins, reference)
            if problem is not None:
                value = _value(config, path)
                problems.append(
                    f"{name} field {field!r} changed ({value!r} -> {perturbed(value)!r}) leaves the fingerprint "
                    f"unchanged, but {problem}; if it changes the weights, keep it in ModelDescription.config (or extra) "
                    "in weightcache_describe, or declare the file in weightcache_checkpoint_files; if it cannot, declare "
                    "it in CheckpointConventions.unused_config with the reason"
                )
    write_config(copy_dir, config, name)
    return FieldCheck(problems, skipped, sorted(same))


def _value(config: dict | list, path: tuple) -> typing.Any:
    value: typing.Any = config
    for part in path:
        value = value[part]
    return value


def _fingerprint(request: "LoadRequest", plugins: "Plugins | None") -> str | None:
    """The fingerprint's digest, or None when the adapter refuses the config before reading a weight (a clear error, safe)."""
    from weightcache.conformance.fixtures import fresh
    from weightcache.core.flow.loader import prepare

    try:
        return prepare(fresh(request), plugins).fingerprint.digest
    except Exception:
        return None


def _load_problem(
    request: "LoadRequest", plugins: "Plugins | None", reference: "Callable[[torch.nn.Module], None]"
) -> str | None:
    """None if a disk load of ``request`` equals the reference, else what differs (one line)."""
    from weightcache.conformance.fixtures import load

    try:
        loaded = load(request, "off", plugins)
    except Exception as exc:
        return f"its disk load fails ({type(exc).__name__}: {exc}) where the published entry would be attached"
    try:
        reference(loaded.model)
    except AssertionError as exc:
        lines = str(exc).strip().splitlines()
        return "its disk load differs from the published one (" + " ".join(line.strip() for line in lines[:2]) + ")"
    finally:
        loaded.close()
    return None
