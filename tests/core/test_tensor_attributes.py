"""Every tensor a forward reads is cached: plain tensor attributes of modules and the Python flags hung on tensors.

Engines' post-processing leaves weights outside parameters and buffers (vLLM's
MLA ``W_UV``, SGLang's ``w_kc``/``w_vc``) and flags on parameters
(``format_ue8m0``). Each is published, mapped and restored on rebind, through
a real server, and the kit's comparison sees a missing or differing one.
"""

from __future__ import annotations

import pytest
import torch

from weightcache.conformance.assertions import model_tensors
from weightcache.core.errors import InvalidManifest, RebindError
from weightcache.core.flow import api
from weightcache.core.layout.manifest import Manifest, TensorRecord
from weightcache.core.load.export import ArenaBuilder, collect_tensors, export_module
from weightcache.core.load.rebind import check_no_meta, rebind_module


class Attention(torch.nn.Module):
    """A layer whose post-processing derives a plain tensor attribute from its weight (as MLA derives W_UV)."""

    def __init__(self, rotary: torch.nn.Module):
        super().__init__()
        self.kv_b_proj = torch.nn.Linear(4, 6, bias=False)
        self.rotary = rotary
        self.W_UV = None

    def process_weights_after_loading(self) -> None:
        self.W_UV = self.kv_b_proj.weight.detach().reshape(2, 3, 4).transpose(0, 1).contiguous()
        self.kv_b_proj.weight.format_ue8m0 = True
        self.kv_b_proj.weight.block = (128, 128)
        self.kv_b_proj.weight.weight_loader = print  # not JSON-able: left to the engine's skeleton
        self.kv_b_proj.weight._is_hf_initialized = True  # a framework's own bookkeeping: left out
        self.weight_view = self.kv_b_proj.weight[:2]  # a plain attribute viewing a parameter

    def forward(self, x):
        return torch.einsum("bi,lni->bn", x, self.W_UV) + self.kv_b_proj(x).sum() + self.rotary.cache.sum()


class Layers(torch.nn.ModuleList):
    def forward(self, x):
        return sum(layer(x) for layer in self)


class Rotary(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.cache = torch.arange(4.0)  # a plain tensor attribute made in __init__, one module shared by both layers


def build(device="cpu", processed=True):
    torch.manual_seed(0)
    with torch.device(device):
        rotary = Rotary()
        model = Layers([Attention(rotary), Attention(rotary)])
    if processed:
        for layer in model:
            layer.process_weights_after_loading()
    return model


def publish_and_attach(model, socket_dir):
    fingerprint = api.fingerprint(_checkpoint(), architecture="AttrTest", dtype="float32")
    api.publish_model(model, fingerprint, socket_dir=socket_dir)
    return api.attach(fingerprint, socket_dir)


_CHECKPOINT: list = []


def _checkpoint():
    import tempfile
    from pathlib import Path

    import safetensors.torch

    if not _CHECKPOINT:
        directory = Path(tempfile.mkdtemp(prefix="attr-test-"))
        safetensors.torch.save_file({"x": torch.zeros(1)}, str(directory / "model.safetensors"))
        _CHECKPOINT.append(directory)
    return _CHECKPOINT[0]


def test_tensor_attributes_are_collected_once_with_aliases_for_shared_ones():
    items, aliases = collect_tensors(build())
    kinds = {item.name: item.kind for item in items}
    assert kinds["0.W_UV"] == kinds["1.W_UV"] == kinds["0.weight_view"] == "attribute"
    assert kinds["0.rotary.cache"] == "attribute" and aliases["1.rotary.cache"] == "0.rotary.cache"
    assert kinds["0.kv_b_proj.weight"] == "parameter"


def test_json_flags_on_tensors_go_into_the_manifest_and_survive_its_json():
    with ArenaBuilder("cpu") as builder:
        manifest = export_module(build(), builder, release=False)
    record = next(r for r in manifest.tensors if r.name == "0.kv_b_proj.weight")
    assert record.attributes == {"block": [128, 128], "format_ue8m0": True}  # no weight_loader (not JSON), no _private
    again = Manifest.from_json(manifest.to_json())
    assert again == manifest and next(r for r in again.tensors if r.name == "0.W_UV").kind == "attribute"
    plain = next(r for r in manifest.tensors if r.name == "0.W_UV").to_json()
    assert "attributes" not in plain  # tensors without flags carry no empty dict


def test_malformed_attributes_are_refused():
    record = next(r for r in _one_record_manifest().tensors).to_json()
    with pytest.raises(InvalidManifest, match="field 'attributes': must be an object whose keys are attribute names"):
        Manifest.from_json({**_one_record_manifest().to_json(), "tensors": [{**record, "attributes": ["x"]}]})
    with pytest.raises(InvalidManifest, match="field 'attributes': hold more than 4096 bytes of JSON"):
        Manifest.from_json({**_one_record_manifest().to_json(), "tensors": [{**record, "attributes": {"blob": "x" * 5000}}]})
    with pytest.raises(InvalidManifest, match="field 'kind': 'closure' is not one of parameter, buffer, attribute"):
        Manifest.from_json({**_one_record_manifest().to_json(), "tensors": [{**record, "kind": "closure"}]})


def _one_record_manifest() -> Manifest:
    with ArenaBuilder("cpu") as builder:
        return export_module(torch.nn.Linear(2, 2, bias=False), builder, release=False)


def test_attributes_and_flags_are_mapped_and_restored_on_a_meta_skeleton(server, socket_dir):
    reference = build()
    attachment = publish_and_attach(build(), socket_dir)
    try:
        model = rebind_module(build("meta", processed=False), attachment.tensors, attachment.manifest, device="cpu")
        expected, actual = model_tensors(reference), model_tensors(model)
        assert sorted(actual) == sorted(expected)
        problems = {
            name: facts.differences(expected[name]) for name, facts in actual.items() if facts.differences(expected[name])
        }
        assert not problems
        assert model[0].rotary is model[1].rotary and model[0].rotary.cache.device.type == "cpu"
        assert model[0].kv_b_proj.weight.format_ue8m0 is True
        arena = attachment.arenas[0].bytes_view()
        assert arena.data_ptr() <= model[1].W_UV.data_ptr() < arena.data_ptr() + arena.numel()  # zero-copy
        x = torch.ones(1, 4)
        assert torch.equal(model(x), reference(x))
    finally:
        del model  # views of the arenas must go before they are unmapped
        attachment.close()


def test_an_attribute_left_on_meta_is_named():
    model = build()
    model[0].W_UV = torch.empty(3, 2, 4, device="meta")
    with pytest.raises(RebindError, match=r"0\.W_UV"):
        check_no_meta(model)


def test_the_kit_sees_a_missing_or_differing_attribute_or_flag():
    reference = model_tensors(build())
    unprocessed = model_tensors(build(processed=False))
    assert "0.W_UV" in reference and "0.W_UV" not in unprocessed  # test_same_tensor_names fails on this
    changed = build()
    changed[1].W_UV = changed[1].W_UV.clone()
    changed[1].W_UV[0, 0, 0] += 1
    changed[0].kv_b_proj.weight.format_ue8m0 = False
    facts = model_tensors(changed)
    assert any("elements differ" in note for note in facts["1.W_UV"].differences(reference["1.W_UV"]))
    assert facts["0.kv_b_proj.weight"].differences(reference["0.kv_b_proj.weight"]) == [
        "Python attributes {'block': [128, 128], 'format_ue8m0': False} != {'block': [128, 128], 'format_ue8m0': True}"
    ]


def test_a_record_of_kind_attribute_needs_no_owner_slot():
    record = TensorRecord(
        name="x", kind="attribute", dtype="float32", shape=(1,), stride=(1,), storage_offset=0, arena=0, offset=0, nbytes=4
    )
    assert record.to_json()["kind"] == "attribute"
