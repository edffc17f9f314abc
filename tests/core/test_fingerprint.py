"""Fingerprints and checkpoint identity."""

from __future__ import annotations

import shutil

import attrs
import pytest

from weightcache.core.fingerprint import FIELDS, Fingerprint
from weightcache.core.safetensors_io import checkpoint_identity


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


def test_same_files_in_two_directories_match_and_a_changed_header_byte_does_not(model_dir, tmp_path):
    original = model_dir("llama", "float32", True)
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    assert checkpoint_identity(original) == checkpoint_identity(copy)
    shard = sorted(copy.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    position = data.index(b'"shape":[') + len(b'"shape":[')
    data[position] = ord("9") if data[position] != ord("9") else ord("8")
    shard.write_bytes(bytes(data))
    assert checkpoint_identity(original) != checkpoint_identity(copy)


def test_a_directory_without_safetensors_gets_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="safetensors"):
        checkpoint_identity(tmp_path)
