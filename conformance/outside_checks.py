"""The kit's checks of what one load in one process cannot show: fresh processes (other hash seeds, another thread
count, the files they open) and the files a user can change (every declared JSON scalar, every weight file)."""

from __future__ import annotations

import typing

import pytest

from weightcache.conformance.assertions import assert_same_model, assert_same_outputs, failures, flatten_outputs, model_tensors
from weightcache.conformance.fixtures import adapter_facade, refused_quantization_skips

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.flow.plugins import Plugins
    from weightcache.core.request import LoadRequest


class FreshProcessTests:
    """Loads in fresh processes (two hash seeds, two thread counts) give the published fingerprint, bytes and outputs, and
    read no file of the checkpoint the adapter did not declare."""

    def test_fresh_process_publishes_the_same_model(self, fresh_process, published, mapped_model, run_model, example_inputs):
        for process in fresh_process:
            self._same_model(process.finish(example_inputs), published, mapped_model, run_model, example_inputs)

    def test_load_reads_only_declared_files(self, fresh_process, example_inputs):
        for process in fresh_process:
            child = process.finish(example_inputs)
            from weightcache.conformance.file_reads import undeclared

            extra = undeclared(child.read, child.declared)
            assert not extra, failures(
                f"the adapter's load reads files of the checkpoint it does not declare ({', '.join(extra)}): they are "
                "outside the checkpoint identity, so a change to one is served from the stale entry; declare each in "
                "weightcache_checkpoint_files (CheckpointFiles(weights=..., configs=...), patterns relative to the "
                "checkpoint, subfolders included)",
                [f"{name} is read but not declared" for name in extra],
            )

    @staticmethod
    def _same_model(child, published, mapped_model, run_model, example_inputs) -> None:
        from weightcache.conformance.fresh_process import HASH_PROBE, first_differing_tensor
        from weightcache.core.request import ForwardUnavailable

        assert child.hash_probe != hash(HASH_PROBE), (
            f"the fresh process (PYTHONHASHSEED={child.seed}) hashes strings as this one does: set PYTHONHASHSEED to "
            "another value (or unset it) for the kit's own process"
        )
        where = f"a fresh process ({child.how})"
        mismatched = published.fingerprint.mismatched_fields(child.fingerprint)
        assert not mismatched, (
            f"{where} computes another fingerprint, differing in {list(mismatched)}: a client in another process "
            "never finds the entry; the fingerprint must not depend on the process (hash(), id(), set order, time)"
        )
        problems = first_differing_tensor(child, model_tensors(mapped_model.model))
        assert not problems, failures(
            f"{where} loads other tensors than this process published, first {problems[0].split(' ')[0]}: "
            "post-processing depends on the process (hash() of a string, id(), set order, unseeded randomness, the "
            "thread count); a client there attaches weights its own disk load would not give",
            problems,
        )
        extra = published.manifest.extra
        differing = sorted(key for key, value in child.manifest_extra.items() if extra.get(key) != value)
        assert not differing, (
            f"{where} computes another manifest extra ({differing[0]} is {child.manifest_extra[differing[0]]!r:.80} "
            f"instead of {extra.get(differing[0])!r:.80}): weightcache_manifest_extra depends on the process (hash(), "
            "set order, id(), the thread count); a client there rebinds with state its own disk load would not give"
        )
        if isinstance(example_inputs, ForwardUnavailable):
            return
        assert child.forward_error is None, f"{where} could not run the forward: {child.forward_error}"
        expected = flatten_outputs(run_model(mapped_model.model, example_inputs))
        assert_same_outputs(child.outputs, expected, f"{where}", label="fresh process")


class ConfigTests:
    """Every scalar of config.json and of every declared JSON file, and one byte of every safetensors file under the
    checkpoint, changed alone on a copy: another fingerprint, or the same tensors, outputs and manifest extra."""

    def test_config_fields_change_the_fingerprint_or_nothing(
        self,
        load_request,
        plugins,
        conventions,
        disk_model,
        run_model,
        example_inputs,
        long_inputs,
        tmp_path,
    ):
        from weightcache.conformance.config_fields import check_config_fields
        from weightcache.core.flow.loader import resolved
        from weightcache.core.request import ForwardUnavailable

        def same_as_disk(model: "torch.nn.Module") -> None:
            assert_same_model(model, disk_model.model, run_model, example_inputs, "config changed")
            assert_same_extra(plugins, load_request, model, disk_model.model, "config changed")
            if not isinstance(long_inputs, ForwardUnavailable):
                expected = flatten_outputs(run_model(disk_model.model, long_inputs))
                assert_same_outputs(flatten_outputs(run_model(model, long_inputs)), expected, "config changed, long input")

        with refused_quantization_skips(load_request):
            found = check_config_fields(
                resolved(load_request), plugins, conventions.unused_config, tmp_path / "copy", same_as_disk
            )
        if found is None:
            pytest.skip("the checkpoint has no config.json nor another JSON file the adapter declares")
        assert not found.problems, failures("JSON fields folded into the weights but not into the fingerprint", found.problems)

    def test_weight_files_change_the_fingerprint_or_nothing(
        self, load_request, plugins, disk_model, run_model, example_inputs, tmp_path
    ):
        from weightcache.conformance.weight_files import check_weight_files
        from weightcache.core.flow.loader import resolved

        def same_as_disk(model: "torch.nn.Module") -> None:
            assert_same_model(model, disk_model.model, run_model, example_inputs, "weight file changed")
            assert_same_extra(plugins, load_request, model, disk_model.model, "weight file changed")

        with refused_quantization_skips(load_request):
            problems, changed = check_weight_files(resolved(load_request), plugins, tmp_path / "copy", same_as_disk)
        if not changed:
            pytest.skip("the checkpoint is one file, not a directory")
        assert not problems, failures("weight files outside the fingerprint", problems)


def assert_same_extra(
    plugins: "Plugins", request: "LoadRequest", model: "torch.nn.Module", disk: "torch.nn.Module", context: str
) -> None:
    """The adapter's manifest extra (``weightcache_manifest_extra``) for ``model`` equals the one for the disk load: a
    client attaching the published entry rebinds with the published value, never with the one its own files give."""
    adapter = adapter_facade(plugins, request.adapter)
    expected, actual = adapter.manifest_extra(request, disk), adapter.manifest_extra(request, model)
    keys = sorted(str(key) for key in set(expected) | set(actual) if expected.get(key) != actual.get(key))
    assert not keys, (
        f"{context}: the adapter's manifest extra differs from the published entry's in {keys} ({keys[0]} is "
        f"{actual.get(keys[0])!r:.80} instead of {expected.get(keys[0])!r:.80}) while the fingerprint stays: a client "
        "attaches the entry and rebinds with the old value; put what decides it into ModelDescription.config (or "
        "extra) in weightcache_describe"
    )
