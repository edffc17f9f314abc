"""Fingerprints and checkpoint identity."""

from __future__ import annotations

import shutil
from pathlib import Path

import attrs
import pytest

from tests.models import save_random_model
from weightcache.core.fingerprint import FIELDS, HOST_TIER, Fingerprint
from weightcache.core.identity.safetensors_io import checkpoint_identity, read_header


def make(**changes) -> Fingerprint:
    values = {f: 0 if f.endswith(("_size", "_rank")) or f == "protocol_version" else "x" for f in FIELDS if f != "extra"}
    values.update(tp_size=1, pp_size=1, dp_size=1, ep_size=1, protocol_version=1, extra={})
    values.update(changes)
    return Fingerprint(**values)


def test_digest_is_canonical_and_json_round_trips():
    fp = make(extra={"b": 1, "a": 2})
    assert Fingerprint.from_json(fp.to_json()) == fp
    assert make(extra={"a": 2, "b": 1}).digest == fp.digest


def test_mismatched_fields_names_each_changed_field():
    base = make()
    assert base.mismatched_fields(base) == ()
    assert base.mismatched_fields(attrs.evolve(base, dtype="y", gpu_uuid="z")) == ("dtype", "gpu_uuid")
    assert base.mismatched_fields(attrs.evolve(base, extra={"k": 1})) == ("extra.k",)


def test_malformed_fingerprint_json_is_refused():
    data = make().to_json()
    del data["dtype"]
    with pytest.raises(ValueError, match="missing \\['dtype'\\]"):
        Fingerprint.from_json(data)


def _flip(file, position: int) -> None:
    """Change the byte at ``position`` of ``file`` in place (low bit: a float stays a finite float)."""
    with open(file, "r+b") as fh:
        fh.seek(position)
        byte = fh.read(1)[0]
        fh.seek(position)
        fh.write(bytes([byte ^ 1]))


def _data_start(file) -> int:
    with open(file, "rb") as fh:
        return 8 + int.from_bytes(fh.read(8), "little")


def test_same_bytes_in_two_directories_match_and_a_changed_data_byte_does_not(model_dir, tmp_path):
    original = model_dir("llama", "float32", True)
    copy = Path(shutil.copytree(original, tmp_path / "copy"))
    assert checkpoint_identity(original) == checkpoint_identity(copy)
    shard = max(copy.glob("*.safetensors"))
    _flip(shard, (_data_start(shard) + shard.stat().st_size) // 2 // 4 * 4)
    assert read_header(shard).raw == read_header(original / shard.name).raw, "only the data region changed"
    assert checkpoint_identity(original) != checkpoint_identity(copy)


def test_a_changed_header_byte_changes_the_identity_too(model_dir, tmp_path):
    original = model_dir("llama", "float32", True)
    copy = Path(shutil.copytree(original, tmp_path / "copy"))
    shard = min(copy.glob("*.safetensors"))
    _flip(shard, shard.read_bytes().index(b'"shape":[') + len(b'"shape":['))
    assert checkpoint_identity(original) != checkpoint_identity(copy)


def test_two_fine_tunes_with_identical_headers_get_different_identities(tmp_path):
    first = save_random_model("llama", tmp_path / "first", seed=1)
    second = save_random_model("llama", tmp_path / "second", seed=2)
    assert read_header(first / "model.safetensors").raw == read_header(second / "model.safetensors").raw
    assert checkpoint_identity(first) != checkpoint_identity(second)


def _another_value(value):
    if isinstance(value, dict):
        return {**value, "changed": 1}
    return value + 1 if isinstance(value, int) else value + "'"


@pytest.mark.parametrize("field", [f.name for f in attrs.fields(Fingerprint)])
def test_changing_any_one_field_changes_the_digest(field):
    base = make(extra={"kernel": "reference"})
    changed = attrs.evolve(base, **{field: _another_value(getattr(base, field))})
    assert changed.digest != base.digest
    assert base.mismatched_fields(changed) == (("extra.changed",) if field == "extra" else (field,))


def test_a_directory_without_safetensors_gets_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="safetensors"):
        checkpoint_identity(tmp_path)


@pytest.mark.parametrize("field", [f for f in FIELDS if f != "gpu_uuid"])
def test_the_content_digest_changes_with_every_field_but_the_gpu(field):
    base = make()
    assert base.on_device("GPU-other").content_digest == base.content_digest
    assert base.on_device(HOST_TIER).content_digest == base.content_digest
    assert base.on_device("GPU-other").digest != base.digest
    changed = attrs.evolve(base, **{field: _another_value(getattr(base, field))})
    assert changed.content_digest != base.content_digest
