"""What the vLLM and SGLang adapters share, without either engine: the extra-config options, the allowlist in the
engines' names, and ``adapters/engine_support.py`` (process-wide tables, the read-only guard, refusals).

The modes themselves are the core's one runner (tests/core); the engines' own
load and rebuild are exercised in test_vllm.py and test_sglang.py.
"""

from __future__ import annotations

import pytest

from weightcache.adapters import engine_quantization, engine_support
from weightcache.core.errors import RebindError, UnsupportedQuantization
from weightcache.core.flow.modes import ATTACHMENT_ATTR, CacheOptions

WHERE = "--model-loader-extra-config"

# Options (both engines read --model-loader-extra-config into the core's CacheOptions) ----------------------------------


def test_options_default_to_off():
    assert CacheOptions.from_mapping(None, WHERE) == CacheOptions()
    assert CacheOptions().mode == "off"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"mode": "zero_copy"}, "unknown weightcache mode 'zero_copy'"),
        ({"socket_path": "/x"}, "unknown keys \\['socket_path'\\] in --model-loader-extra-config"),
        ({"strict": "yes"}, "'strict' must be true or false"),
    ],
)
def test_bad_options_are_refused_with_what_to_write(config, message):
    with pytest.raises(ValueError, match=message):
        CacheOptions.from_mapping(config, WHERE)


# The allowlist in the engines' names ---------------------------------------------------------------------------------


@pytest.mark.parametrize("method", [None, "", "none"])
def test_unquantized_passes(method):
    assert engine_quantization.checked_method(method, None) == ("none", {})


def test_block_fp8_with_128_blocks_passes():
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert engine_quantization.checked_method("fp8", config) == ("fp8-block", config)


@pytest.mark.parametrize(
    ("method", "config", "family"),
    [
        ("fp8", {"activation_scheme": "static"}, "fp8"),
        ("fp8", {"weight_block_size": [64, 64]}, "fp8"),
        ("fp8", {"weight_block_size": [128, 128], "fmt": "e5m2"}, "fp8"),
        ("awq", {}, "awq"),
        ("awq_marlin", {}, "awq"),
        ("auto_gptq", {}, "gptq"),
        ("gptq_marlin", {}, "gptq"),
        ("fp8_per_tensor", {}, "fp8-tensor"),
        ("bitsandbytes", {}, "bitsandbytes"),
        ("compressed-tensors", {}, "compressed-tensors"),
        ("modelopt_fp4", {}, "modelopt_fp4"),
    ],
)
def test_every_other_method_is_refused_with_its_reason(method, config, family):
    with pytest.raises(UnsupportedQuantization) as caught:
        engine_quantization.checked_method(method, config)
    assert caught.value.method == family and caught.value.reason


# engine_support ------------------------------------------------------------------------------------------------------


def test_registrations_forget_what_a_build_added():
    table = {"kept": 1}
    registrations = engine_support.Registrations([table])
    with registrations.recorded():
        table["layer.0"] = 2
    registrations.forget()
    assert table == {"kept": 1}


def test_an_isolated_build_neither_reuses_nor_leaves_cached_modules():
    table = {"rope-key": "another model's rotary embedding"}
    with engine_support.isolated(table):
        assert "rope-key" not in table  # the build makes its own
        table["rope-key"] = "this build's"
    assert table == {"rope-key": "another model's rotary embedding"}


def test_a_model_whose_post_processing_emptied_weights_is_not_published():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # as vLLM's CPU oneDNN repacking leaves it
    with pytest.raises(RuntimeError, match=r"left 1 parameters empty \(1\.weight\)"):
        engine_support.check_publishable(model)
    engine_support.check_publishable(torch.nn.Linear(2, 2))


def test_writes_into_mapped_weights_are_named_and_private_tensors_stay_writable(server, socket_dir, model_dir):
    """In-place methods, ``out=`` and item assignment on a mapped tensor raise RebindError (a read-only mapping would
    SIGSEGV); the same on private tensors, and reads of mapped ones, go through."""
    import torch

    from weightcache.core.flow import api

    fingerprint = api.fingerprint(model_dir("llama"), architecture="GuardTest", dtype="float32")
    api.publish_state({"scale": torch.ones(4), "weight": torch.arange(6.0)}, fingerprint, socket_dir=socket_dir)
    attachment = api.attach(fingerprint, socket_dir)
    try:
        tensors, manifest = attachment.tensors, attachment.manifest
        private = torch.zeros(4)
        with engine_support.no_writes_into(tensors, manifest, "the post-processing under test"):
            for write in (
                lambda: tensors["scale"].fill_(1.0),
                lambda: torch.add(private, 1, out=tensors["weight"][:4]),
                lambda: tensors["weight"].__setitem__(0, 2.0),
                lambda: tensors["weight"][2:].mul_(2),
            ):
                with pytest.raises(RebindError, match="the post-processing under test writes into the mapped weight"):
                    write()
            private.fill_(2.0)
            torch.add(tensors["scale"], 1, out=private)
            assert float(tensors["weight"].sum()) == 15.0 and float(private.sum()) == 8.0
            tensors["scale"].requires_grad_(False)  # not a write
        assert float(tensors["weight"].sum()) == 15.0
    finally:
        tensors = None
        attachment.close()


def test_reloading_a_mapped_model_in_place_is_refused():
    import torch

    model = torch.nn.Linear(2, 2)
    engine_support.refuse_reload(model)  # a private model reloads
    setattr(model, ATTACHMENT_ATTR, object())
    with pytest.raises(RuntimeError, match="shared read-only"):
        engine_support.refuse_reload(model)


def test_entry_bytes_is_zero_without_a_server_or_an_entry(server, socket_dir, tmp_path, model_dir):
    from weightcache.core.flow import api

    fingerprint = api.fingerprint(model_dir("llama"), architecture="Absent", dtype="float32")
    assert engine_support.entry_bytes(fingerprint, tmp_path / "none") == 0
    assert engine_support.entry_bytes(fingerprint, socket_dir) == 0


def test_lazy_class_builds_once():
    namespace: dict = {}
    built = []
    first = engine_support.lazy_class(namespace, "Loader", lambda: built.append(1) or type("Loader", (), {}))
    assert engine_support.lazy_class(namespace, "Loader", lambda: built.append(1)) is first and built == [1]
