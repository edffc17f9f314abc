"""The kit's refit check: a version published from tensors in memory, switched to in place, is a disk load of it.

:class:`RefitTests` takes the published model's checkpoint, makes a new version of every floating tensor (negated:
exact in every dtype; a block-FP8 checkpoint's weights come to mean their negation through their negated scales),
publishes it from memory (``publish_version``'s steps), switches the attached model to it (``LoadedModel.refit``) and
compares every tensor and output with a disk load of a checkpoint holding the new version. An adapter whose
post-processing is not re-run on the tensors fails it. One that does not implement ``weightcache_load_tensors``
(written before refits existed) cannot serve refits at all: the check is skipped with that reason.
``ConformanceTests`` includes it; alone, combine it with ``ConformanceFixtures``.
"""

from __future__ import annotations

import shutil
import typing
from pathlib import Path

import attrs
import pytest

from weightcache.conformance.assertions import assert_same_model
from weightcache.conformance.fixtures import adapter_facade, fresh, load

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.identity.declared import CheckpointFiles


def next_version(checkpoint: Path, directory: Path, declared: "CheckpointFiles | None" = None) -> "dict[str, torch.Tensor]":
    """A copy of ``checkpoint`` in ``directory`` whose floating tensors are negated (``_negated``), and its tensors by the
    names the checkpoint gives them (``folder/name`` in a declared subfolder's file, ``CheckpointFiles.tensor_prefix``)."""
    from safetensors.torch import load_file, save_file

    from weightcache.core.identity.declared import CheckpointFiles

    declared = declared or CheckpointFiles()
    shutil.copytree(checkpoint, directory)
    state: dict[str, torch.Tensor] = {}
    for file in declared.weight_files(directory):
        tensors = {name: _negated(t) for name, t in load_file(str(file)).items()}
        save_file(tensors, str(file), metadata={"format": "pt"})
        prefix = declared.tensor_prefix(directory, file)
        state.update({prefix + name: tensor for name, tensor in tensors.items()})
    return state


def _negated(tensor: "torch.Tensor") -> "torch.Tensor":
    """A floating tensor negated; an FP8 one (no CPU arithmetic) as it is: its negated scales negate what it means."""
    if not tensor.dtype.is_floating_point or tensor.element_size() == 1:
        return tensor
    return tensor.neg()


class RefitTests:
    """A refit's version equals a disk load of that version, and no tensor of the switched model moved."""

    def test_refit_equals_a_disk_load_of_the_new_version(
        self, load_request, plugins, weightcache_server, published, run_model, example_inputs, tmp_path_factory
    ):
        from weightcache.core.client.client import Connection
        from weightcache.core.flow.loader import prepare
        from weightcache.core.refit import stage_version

        if not adapter_facade(plugins, load_request.adapter).implements("weightcache_load_tensors"):
            pytest.skip(
                f"adapter {load_request.adapter!r} does not implement weightcache_load_tensors, so it cannot serve "
                "refits; implement it to build the model from tensors as weightcache_load does from files"
            )
        socket_dir = weightcache_server.socket_dir
        directory = tmp_path_factory.mktemp("refit") / "next-version"
        adapter = adapter_facade(plugins, load_request.adapter)
        state = next_version(Path(load_request.model), directory, adapter.checkpoint_files(load_request))
        mapped = load(load_request, "client", plugins, socket_dir, strict=True)
        try:
            addresses = {name: t.data_ptr() for name, t in mapped.model.state_dict().items()}
            with Connection(socket_dir) as connection:
                version = connection.versions(published.fingerprint.lineage)[-1].version + 1
            with stage_version(prepare(fresh(load_request), plugins), state, version, socket_dir) as staged:
                staged.publish()
            assert mapped.refit(version), f"the model did not switch to version {version}"
            moved = [name for name, t in mapped.model.state_dict().items() if t.data_ptr() != addresses.get(name)]
            assert not moved, f"tensors moved in the switch: {moved[:5]}"
            disk = load(attrs.evolve(load_request, model=str(directory)), "off", plugins)
            try:
                assert_same_model(mapped.model, disk.model, run_model, example_inputs, "after a refit", label="refit")
            finally:
                disk.close()
        finally:
            mapped.close()
