"""What the vLLM and SGLang adapters share, without either engine: options, the allowlist mapping, the modes.

The modes run against a real ``weightcache serve`` process with a small
torch module standing in for the engine's model; the engines' own load and
rebuild are exercised in test_vllm.py and test_sglang.py.
"""

from __future__ import annotations

import pytest

from weightcache.adapters import engine_modes, engine_quantization
from weightcache.core.errors import ServerUnavailable, UnsupportedQuantization

# Options -------------------------------------------------------------------------------------------------------------


def test_options_default_to_off():
    assert engine_modes.LoaderOptions.from_extra_config(None, "weightcache") == engine_modes.LoaderOptions()
    assert engine_modes.LoaderOptions().mode == "off"


def test_options_read_every_key():
    options = engine_modes.LoaderOptions.from_extra_config(
        {"mode": "client", "socket_dir": "/run/wc", "strict": True, "republish": False, "timeout_s": 5}, "weightcache")
    assert (options.mode, options.socket_dir, options.strict, options.republish, options.timeout_s) == ("client", "/run/wc", True, False, 5.0)


@pytest.mark.parametrize(
    ("config", "message"),
    [({"mode": "zero_copy"}, "unknown weightcache mode 'zero_copy'"), ({"socket_path": "/x"}, "unknown keys \\['socket_path'\\]"),
     ({"strict": "yes"}, "'strict' must be true or false")],
)
def test_bad_options_are_refused_with_what_to_write(config, message):
    with pytest.raises(ValueError, match=message):
        engine_modes.LoaderOptions.from_extra_config(config, "weightcache")


# The allowlist in the engines' names ---------------------------------------------------------------------------------


@pytest.mark.parametrize("method", [None, "", "none"])
def test_unquantized_passes(method):
    assert engine_quantization.checked_method(method, None) == ("none", {})


def test_block_fp8_with_128_blocks_passes():
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert engine_quantization.checked_method("fp8", config) == ("fp8-block", config)


@pytest.mark.parametrize(
    ("method", "config", "family"),
    [("fp8", {"activation_scheme": "static"}, "fp8"), ("fp8", {"weight_block_size": [64, 64]}, "fp8"),
     ("fp8", {"weight_block_size": [128, 128], "fmt": "e5m2"}, "fp8"), ("awq", {}, "awq"), ("awq_marlin", {}, "awq"),
     ("auto_gptq", {}, "gptq"), ("gptq_marlin", {}, "gptq"), ("fp8_per_tensor", {}, "fp8-tensor"),
     ("bitsandbytes", {}, "bitsandbytes"), ("compressed-tensors", {}, "compressed-tensors"), ("modelopt_fp4", {}, "modelopt_fp4")],
)
def test_every_other_method_is_refused_with_its_reason(method, config, family):
    with pytest.raises(UnsupportedQuantization) as caught:
        engine_quantization.checked_method(method, config)
    assert caught.value.method == family and caught.value.reason


# The modes, around a stand-in engine ---------------------------------------------------------------------------------


class StandIn:
    """An engine's load and rebuild for a small torch module (tied weights, a non-persistent buffer)."""

    def __init__(self):
        self.disk_loads = 0
        self.rebuilds = 0

    @staticmethod
    def build(device=None):
        import torch

        torch.manual_seed(0)
        with torch.device(device or "cpu"):
            model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
            model[1].weight = model[0].weight  # tied
            model.register_buffer("table", torch.arange(4.0), persistent=False)
        return model

    def disk_load(self):
        self.disk_loads += 1
        return self.build()

    def rebuild(self, attachment):
        from weightcache.core.rebind import rebind_module

        self.rebuilds += 1
        return rebind_module(self.build("meta"), attachment.tensors, attachment.manifest, device="cpu")


def fingerprint():
    from weightcache.core.identity import make_fingerprint

    return make_fingerprint(_checkpoint(), architecture="StandIn", adapter="test", engine="standin", engine_version="0")


_CHECKPOINT: list = []


def _checkpoint():
    """A one-tensor safetensors file: the fingerprint's checkpoint identity needs real headers."""
    import tempfile
    from pathlib import Path

    if not _CHECKPOINT:
        import safetensors.torch
        import torch

        directory = Path(tempfile.mkdtemp(prefix="standin-"))
        safetensors.torch.save_file({"x": torch.zeros(1)}, str(directory / "model.safetensors"))
        _CHECKPOINT.append(directory)
    return _CHECKPOINT[0]


def run(options, engine: StandIn):
    return engine_modes.load(options, fingerprint(), device="cpu", disk_load=engine.disk_load, rebuild=engine.rebuild, label="stand-in")


def test_off_is_the_engines_own_load():
    engine = StandIn()
    loaded = run(engine_modes.LoaderOptions(mode="off"), engine)
    assert (loaded.source, engine.disk_loads, engine.rebuilds, loaded.external_bytes) == ("disk", 1, 0, 0)


def test_client_without_a_server_falls_back_or_raises_when_strict(tmp_path):
    engine = StandIn()
    loaded = run(engine_modes.LoaderOptions(mode="client", socket_dir=str(tmp_path / "none")), engine)
    assert loaded.source == "disk" and "no weightcache server" in loaded.fallback_reason
    with pytest.raises(ServerUnavailable):
        run(engine_modes.LoaderOptions(mode="client", socket_dir=str(tmp_path / "none"), strict=True), engine)


def test_daemon_publishes_once_then_clients_map_it(server, socket_dir):
    import torch

    first, second = StandIn(), StandIn()
    daemon = run(engine_modes.LoaderOptions(mode="daemon", socket_dir=str(socket_dir), republish=False), first)
    client = run(engine_modes.LoaderOptions(mode="client", socket_dir=str(socket_dir), strict=True, republish=False), second)
    try:
        assert (daemon.source, daemon.created, first.disk_loads, first.rebuilds) == ("cache", True, 1, 1)
        assert (client.source, client.created, second.disk_loads, second.rebuilds) == ("cache", False, 0, 1)
        assert daemon.external_bytes == 0 and client.external_bytes == client.attachment.manifest.nbytes > 0
        assert engine_modes.entry_bytes(fingerprint(), socket_dir) == client.external_bytes
        reference = StandIn.build()
        for model in (daemon.model, client.model):
            assert model[1].weight is model[0].weight  # the tie survives the round trip
            assert torch.equal(model[0].weight, reference[0].weight) and torch.equal(model.table, reference.table)
            assert "table" not in model.state_dict()  # still a non-persistent buffer
        with pytest.raises(RuntimeError, match="shared read-only"):
            engine_modes.refuse_reload(client.model)
    finally:
        daemon.attachment.close()
        client.attachment.close()


def test_entry_bytes_is_zero_without_a_server_or_an_entry(server, socket_dir, tmp_path):
    assert engine_modes.entry_bytes(fingerprint(), tmp_path / "none") == 0
    assert engine_modes.entry_bytes(fingerprint(), socket_dir) == 0


def test_registrations_forget_what_a_build_added():
    table = {"kept": 1}
    registrations = engine_modes.Registrations([table])
    with registrations.recorded():
        table["layer.0"] = 2
    registrations.forget()
    assert table == {"kept": 1}


def test_a_model_whose_post_processing_emptied_weights_is_not_published(server, socket_dir):
    import torch

    model = StandIn.build()
    model[1].weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # as vLLM's CPU oneDNN repacking leaves it
    with pytest.raises(RuntimeError, match="left 1 parameters empty \\(1.weight\\)"):
        engine_modes.publish_model(model, fingerprint(), device="cpu", socket_dir=socket_dir)
    assert engine_modes.entry_bytes(fingerprint(), socket_dir) == 0
