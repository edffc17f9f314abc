"""The kit's weight-file perturbations: one data byte of each safetensors file anywhere under the checkpoint changed.

Each file changed alone, on a linked copy (``config_fields.linked_copy``): the fingerprint
changes (the file is declared: ``weightcache_checkpoint_files``), or a disk load of the copy
gives the same tensors and outputs (the adapter never reads it). A file the load reads but
the declaration leaves out fails, named: edit it, and a client attaches the stale entry.
"""

from __future__ import annotations

import typing
from pathlib import Path

import attrs

from weightcache.conformance.config_fields import _fingerprint, _load_problem, linked_copy

if typing.TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from weightcache.core.flow.plugins import Plugins
    from weightcache.core.request import LoadRequest


def flip_data_byte(file: Path) -> None:
    """Flip the lowest bit of one byte in the middle of ``file``'s data (after its header; the header when it has none)."""
    data = bytearray(file.read_bytes())
    start = min(8 + int.from_bytes(data[:8], "little"), len(data) - 1) if len(data) > 8 else 0
    position = (start + len(data)) // 2
    data[position] ^= 1
    file.write_bytes(bytes(data))


def check_weight_files(
    request: "LoadRequest",
    plugins: "Plugins | None",
    copy_dir: Path,
    reference: "Callable[[torch.nn.Module], None]",
) -> tuple[list[str], int]:
    """One problem per safetensors file under ``request.model`` whose change keeps the fingerprint but not the model;
    and how many files were changed."""
    checkpoint = Path(request.model)
    if not checkpoint.is_dir():
        return [], 0
    files = sorted(str(file.relative_to(checkpoint)) for file in checkpoint.rglob("*.safetensors") if file.is_file())
    problems = []
    for number, name in enumerate(files):
        copy = attrs.evolve(request, model=str(linked_copy(checkpoint, copy_dir / str(number), name)))
        baseline = _fingerprint(copy, plugins)
        flip_data_byte(copy_dir / str(number) / name)
        if baseline is None or _fingerprint(copy, plugins) != baseline:
            continue
        problem = _load_problem(copy, plugins, reference)
        if problem is not None:
            problems.append(
                f"{name} changed (one data byte) leaves the fingerprint unchanged, but {problem}; declare it in "
                "weightcache_checkpoint_files (CheckpointFiles(weights=...), patterns relative to the checkpoint)"
            )
    return problems, len(files)
