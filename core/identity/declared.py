"""The files of a checkpoint an adapter reads, as it declares them (``weightcache_checkpoint_files``).

The checkpoint identity covers every declared file's content: each weight file and
each config file, in the checkpoint's root or in a subfolder. Changing one byte of
any of them is another identity, so a stale entry is never attached; a file the
adapter reads without declaring it is what the conformance kit's fresh process
looks for (``weightcache.conformance.fresh_process``).
"""

from __future__ import annotations

import json
import os
import stat
import typing
from pathlib import Path, PurePosixPath

import attrs

from weightcache.core.errors import CheckpointNotFound, InvalidCheckpoint
from weightcache.core.fileio import check_regular

DEFAULT_WEIGHTS = ("*.safetensors",)
DEFAULT_CONFIGS = ("config.json", "generation_config.json")
INDEX_SUFFIX = ".safetensors.index.json"
"""A sharded file set's index (``model.safetensors.index.json``, ``diffusion_pytorch_model.safetensors.index.json``)."""


def _patterns(value: typing.Any) -> tuple[str, ...]:
    """Patterns as a tuple of strings, each relative to the checkpoint and inside it; ValueError naming the first that is not."""
    patterns = (value,) if isinstance(value, str) else tuple(value or ())
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"a checkpoint file pattern must be a non-empty string, got {pattern!r}")
        parts = PurePosixPath(pattern).parts
        if pattern.startswith(("/", "~")) or ".." in parts or "\\" in pattern:
            raise ValueError(
                f"checkpoint file pattern {pattern!r} leaves the checkpoint: write it relative to the checkpoint "
                "directory with '/' between folders (e.g. '2_Dense/*.safetensors')"
            )
    return patterns


@attrs.frozen
class CheckpointFiles:
    """Which files of a checkpoint an adapter reads (``weightcache_checkpoint_files``): glob patterns relative to it.

    :param weights: safetensors weight files (``*.safetensors``, ``2_Dense/*.safetensors``, ``unet/*.safetensors``,
        ``**/*.safetensors``). In a folder holding a ``*.safetensors.index.json``, the files its ``weight_map`` names
        are that folder's weights (each must exist) and the index is fingerprinted with them. At least one weight file
        must match.
    :param configs: every other file the adapter reads (``config.json``, ``1_Pooling/config.json``, ``modules.json``,
        ``*/config.json``); none need exist.

    The checkpoint identity covers the content of every file either matches, named by its path relative to the
    checkpoint; a file the adapter reads beyond them is a failure the conformance kit names. Default: the root's
    ``*.safetensors`` (an index's shards where it has one) and ``config.json``.
    """

    weights: tuple[str, ...] = attrs.field(default=DEFAULT_WEIGHTS, converter=_patterns)
    configs: tuple[str, ...] = attrs.field(default=DEFAULT_CONFIGS, converter=_patterns)

    def weight_files(self, path: str | os.PathLike) -> list[Path]:
        """The weight files of the checkpoint at ``path`` (a directory, or one ``*.safetensors`` file), sorted.

        Raises CheckpointNotFound when ``path`` does not exist, no weight file matches or an index names a missing
        shard; NotRegularFile when a weight file is a FIFO, a device, a socket or a directory.
        """
        path = Path(path)
        if not _is_directory(path):
            if path.suffix != ".safetensors":
                raise CheckpointNotFound(path, "a file, but not a *.safetensors file")
            check_regular(path, path.stat().st_mode)
            return [path]
        found: dict[Path, None] = {}
        for pattern in self.weights:
            found.update(dict.fromkeys(sorted(file for file in path.glob(pattern) if not file.name.endswith(".json"))))
        files = []
        for folder in sorted({file.parent for file in found}, key=lambda folder: _relative(folder, path)):
            shards = _indexed_shards(folder)
            mine = [file for file in found if file.parent == folder]
            files.extend(shards if shards is not None else mine)
        if not files:
            if not any(path.iterdir()):
                contents = "it is empty"
            elif self.weights == DEFAULT_WEIGHTS:
                contents = "it holds no *.safetensors file"
            else:
                contents = f"no file in it matches the adapter's weight patterns {', '.join(self.weights)}"
            raise CheckpointNotFound(path, f"{contents} (weightcache reads safetensors checkpoints only)")
        files = sorted(dict.fromkeys(files), key=lambda file: _relative(file, path))
        for file in files:
            check_regular(file, file.stat().st_mode)
        return files

    def config_files(self, path: str | os.PathLike, weights: "typing.Sequence[Path] | None" = None) -> list[Path]:
        """The other declared files of the checkpoint at ``path`` that exist, and the index of each sharded folder, sorted.

        :param weights: the weight files, when the caller has them already (their folders' indexes are added).
        """
        path = Path(path)
        if not _is_directory(path):
            return []
        weights = self.weight_files(path) if weights is None else weights
        found = {file for pattern in self.configs for file in path.glob(pattern) if file.is_file()}
        found |= {index for folder in {file.parent for file in weights} for index in folder.glob(f"*{INDEX_SUFFIX}")}
        return sorted(found - set(weights), key=lambda file: _relative(file, path))

    def files(self, path: str | os.PathLike) -> list[Path]:
        """Every declared file of the checkpoint: its weight files, then its config files."""
        weights = self.weight_files(path)
        return weights + self.config_files(path, weights)

    def tensor_prefix(self, path: str | os.PathLike, file: Path) -> str:
        """What the checkpoint calls a tensor of ``file`` beyond its own name: '' in the root, ``folder/`` in a subfolder
        (``2_Dense/linear.weight``), so that two folders' tensors of one name stay two (diffusers' unet/ and vae/)."""
        path = Path(path)
        if not _is_directory(path):
            return ""
        folder = _relative(file.parent, path)
        return "" if folder == "." else f"{folder}/"


def _is_directory(path: Path) -> bool:
    try:
        return stat.S_ISDIR(path.stat().st_mode)
    except FileNotFoundError:
        raise CheckpointNotFound(path, "no such file or directory") from None


def _relative(file: Path, root: Path) -> str:
    return str(file.relative_to(root)) if file != root else "."


def _indexed_shards(folder: Path) -> list[Path] | None:
    """The shards the ``*.safetensors.index.json`` files of ``folder`` name (None: it has none); CheckpointNotFound for a
    shard that is missing, InvalidCheckpoint for an index that is not one."""
    indexes = sorted(folder.glob(f"*{INDEX_SUFFIX}"))
    if not indexes:
        return None
    names: set[str] = set()
    for index in indexes:
        try:
            names |= set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            raise InvalidCheckpoint(index, "not a safetensors index (a JSON object with a weight_map)") from None
    files = [folder / name for name in sorted(names)]
    missing = [file.name for file in files if not file.exists()]
    if missing:
        raise CheckpointNotFound(folder, f"{len(missing)} shards its index names are missing ({', '.join(missing[:3])})")
    return files
