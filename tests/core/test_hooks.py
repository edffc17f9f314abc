"""One test per hook spec, each calling the hook through a real adapter (the meta-test checks every spec has one here)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import attrs
import pytest

from tests import zygote
from weightcache.core.flow.loader import prepare
from weightcache.core.flow.plugins import installed_plugins
from weightcache.core.load.export import ArenaBuilder
from weightcache.core.request import ForwardUnavailable, LoadRequest

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def hf():
    return installed_plugins().adapter("hf")


def test_hook_weightcache_options(hf):
    assert {"model_class", "block_size", "exclude"} <= set(hf.options())
    assert all(option.help and option.typed for option in hf.options().values())


def test_hook_weightcache_describe(hf, model_dir):
    """The dtype is resolved before it enters the fingerprint: asking for none or for the stored one is one entry."""
    path = model_dir("llama")
    unset = prepare(LoadRequest(model=str(path)))
    explicit = prepare(LoadRequest(model=str(path), dtype="float32"))
    assert unset.description.dtype == explicit.description.dtype == "float32"
    assert unset.description.architecture == "LlamaForCausalLM" and unset.description.engine == "transformers"
    assert unset.fingerprint.digest == explicit.fingerprint.digest
    assert prepare(LoadRequest(model=str(path), dtype="bfloat16")).fingerprint.dtype == "bfloat16"


def test_hook_weightcache_quantization_allowlist(hf, model_dir):
    assert hf.quantization_allowlist(LoadRequest(model=str(model_dir("llama")))) == ()


def test_hook_weightcache_load(hf, model_dir):
    """With a builder, a checkpoint that is exactly the model is read straight into the arenas."""
    request = LoadRequest(model=str(model_dir("llama")))
    plain = hf.load(request, None)
    with ArenaBuilder("cpu") as builder:
        direct = hf.load(request, builder)
        weight = direct.model.embed_tokens.weight
        assert builder.locate(weight) is not None, "the embedding was not read into an arena"
        assert torch.equal(weight, plain.model.embed_tokens.weight)
        del direct, weight


def test_hook_weightcache_load_tensors(hf, model_dir):
    """A state dict in the checkpoint's naming builds the model the files build; the caller's tensors stay untouched."""
    from safetensors.torch import load_file

    path = model_dir("llama")
    request = LoadRequest(model=str(path))
    state = load_file(str(path / "model.safetensors"))
    before = {name: tensor.clone() for name, tensor in state.items()}
    with ArenaBuilder("cpu") as builder:
        model = hf.load_tensors(request, state, builder)
    plain = hf.load(request, None)
    for name, tensor in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert model.lm_head.weight is not model.model.embed_tokens.weight or plain.lm_head.weight is plain.model.embed_tokens.weight
    assert all(torch.equal(state[name], before[name]) for name in state)


def test_hook_weightcache_post_process(hf, model_dir):
    prepared = prepare(LoadRequest(model=str(model_dir("llama")), quantization="fp8-block"))
    model = hf.load(prepared.request, None)
    model = hf.post_process(prepared.request, model, prepared.description)
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.float8_e4m3fn
    assert model.lm_head.weight.dtype == torch.float32  # excluded by default


def test_hook_weightcache_export(hf, model_dir):
    """The core default places every parameter and buffer, non-persistent buffers too."""
    request = LoadRequest(model=str(model_dir("bert")))
    model = hf.load(request, None)
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    with ArenaBuilder("cpu") as builder:
        manifest = hf.export(request, model, builder)
    recorded = {record.name for record in manifest.tensors} | set(manifest.aliases)
    assert names <= recorded, sorted(names - recorded)
    assert any(not record.persistent for record in manifest.tensors), "BERT's position_ids (non-persistent) were not exported"


def test_hook_weightcache_manifest_extra(hf, model_dir):
    request = LoadRequest(model=str(model_dir("llama")))
    assert hf.manifest_extra(request, hf.load(request, None)) == {"model_class": "LlamaForCausalLM", "dtype": "float32"}


def test_hook_weightcache_rebind(hf, model_dir):
    """Rebind builds the model on meta around mapped tensors, zero-copy."""
    request = LoadRequest(model=str(model_dir("llama")))
    model = hf.load(request, None)
    extra = hf.manifest_extra(request, model)
    with ArenaBuilder("cpu") as builder:
        manifest = attrs.evolve(hf.export(request, model, builder), extra=extra)  # as the loader does
        builder.seal()
        tensors = manifest.views(builder.arenas)
        rebound = hf.rebind(request, tensors, manifest, prepare(request).description)
        assert rebound.lm_head.weight.data_ptr() == tensors["lm_head.weight"].data_ptr()
        assert not any(p.device.type == "meta" for p in rebound.parameters())
        del rebound, tensors


def test_hook_weightcache_checkpoint_conventions(hf, model_dir):
    """hf checkpoints declare quantization in config.json (the core default); the kit reads it instead of a flag; the
    tensors transformers renames while loading (Mixtral's experts fused) are held by the names it gives them."""
    conventions = hf.checkpoint_conventions(LoadRequest(model=str(model_dir("llama"))))
    assert (conventions.quantization_declaration, conventions.tied) == ("hf-config", ())
    assert conventions.consumed_tensors("model.layers.0.mlp.gate_proj.weight") is None, "kept under its own name"
    experts = hf.checkpoint_conventions(LoadRequest(model=str(model_dir("mixtral")))).consumed_tensors
    assert experts("model.layers.0.block_sparse_moe.experts.1.w1.weight") == "model.layers.0.mlp.experts.gate_up_proj"


def test_hook_weightcache_checkpoint_files(hf, model_dir, tmp_path):
    """hf declares the core default: the root's weights, config.json and generation_config.json, all in the identity;
    a sharded checkpoint's index comes with its shards."""
    import shutil

    from weightcache.core.identity.declared import CheckpointFiles

    path = model_dir("llama")
    declared = hf.checkpoint_files(LoadRequest(model=str(path)))
    assert declared == CheckpointFiles()
    names = [str(file.relative_to(path)) for file in declared.files(path)]
    assert names == ["model.safetensors", "config.json", "generation_config.json"], names
    copy = shutil.copytree(path, tmp_path / "copy")
    before = prepare(LoadRequest(model=str(copy))).fingerprint.checkpoint
    with open(copy / "generation_config.json", "a") as fh:
        fh.write("\n")
    assert prepare(LoadRequest(model=str(copy))).fingerprint.checkpoint != before


@pytest.mark.parametrize(
    ("kind", "keys"),
    [
        ("llama", {"input_ids", "attention_mask"}),
        ("bert", {"input_ids", "attention_mask", "token_type_ids"}),
        ("t5", {"input_ids", "attention_mask", "decoder_input_ids"}),
        ("bart", {"input_ids", "attention_mask", "decoder_input_ids"}),
    ],
)
def test_hook_weightcache_example_inputs(hf, model_dir, kind, keys):
    """The core default builds inputs from the forward signature; the forward runs on them."""
    request = LoadRequest(model=str(model_dir(kind)))
    model = hf.load(request, None)
    inputs = hf.example_inputs(request, model)
    assert set(inputs) == keys
    with torch.inference_mode():
        model(**inputs)


def test_hook_weightcache_example_inputs_says_why_it_cannot(hf):
    class Opaque(torch.nn.Module):
        def forward(self, batch):
            return batch

    result = hf.example_inputs(LoadRequest(model="/nowhere"), Opaque())
    assert isinstance(result, ForwardUnavailable) and "Opaque.forward(batch)" in result.reason


def test_hook_weightcache_warm_up(model_dir):
    """Warm-up imports the model's module, so a timed load or a standby's takeover pays no import."""
    code = textwrap.dedent("""
        import sys
        from weightcache.core.flow.loader import prepare
        from weightcache.core.request import LoadRequest
        prepared = prepare(LoadRequest(model=sys.argv[1]))
        assert "transformers.models.llama.modeling_llama" not in sys.modules
        prepared.adapter.warm_up(prepared.request)
        assert "transformers.models.llama.modeling_llama" in sys.modules
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(model_dir("llama"))], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_warm_up_for_a_publish_imports_nothing_where_the_hf_layout_is_remembered(model_dir, tmp_path):
    """``weightcache load`` warms up ``for_publish``: with the model's layout remembered the hf adapter skips
    transformers (the publish needs none), and without it imports the model's module as before."""
    code = textwrap.dedent("""
        import sys
        from weightcache.core.flow.loader import prepare
        from weightcache.core.request import LoadRequest
        prepared = prepare(LoadRequest(model=sys.argv[1]))
        prepared.adapter.warm_up(prepared.request, for_publish=True)
        print("IMPORTED", "transformers" in sys.modules)
    """)
    path = model_dir("llama")
    env = {**os.environ, "WEIGHTCACHE_CACHE_DIR": str(tmp_path / "store")}
    before = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=240, env=env)
    assert before.returncode == 0 and "IMPORTED True" in before.stdout, before.stderr[-3000:]
    learn = (
        "import sys\nfrom weightcache.adapters.hf.loading import load_into_arenas\n"
        "from weightcache.adapters.hf.identity import read_config\nfrom weightcache.core.device import Device\n"
        "from weightcache.core.load.export import ArenaBuilder\nfrom weightcache.core.request import LoadRequest\n"
        "with ArenaBuilder(Device.parse('cpu')) as builder:\n"
        "    assert load_into_arenas(LoadRequest(model=sys.argv[1]), read_config(sys.argv[1]), builder) is not None\n"
    )
    # Only learns the layout into the store (its own start is not what is checked here): forked where the rules allow.
    learned = zygote.run([sys.executable, "-c", learn, str(path)], capture_output=True, text=True, timeout=240, env=env)
    assert learned.returncode == 0, learned.stderr[-3000:]
    after = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=240, env=env)
    assert after.returncode == 0 and "IMPORTED False" in after.stdout, (after.stdout, after.stderr[-3000:])


def test_warm_up_in_a_thread_while_the_load_describes_the_model(model_dir):
    """``weightcache load`` warms the adapter up in a thread while its main thread describes the model: both import
    transformers at once, and neither may see it half-initialised (the warm-up used to find no model class and the
    model's module was then imported serially, inside the timed load)."""
    code = textwrap.dedent("""
        import sys, threading
        from weightcache.core.flow.loader import prepare
        from weightcache.core.flow.plugins import installed_plugins
        from weightcache.core.request import LoadRequest
        request = LoadRequest(model=sys.argv[1])
        adapter = installed_plugins().adapter(request.adapter)
        failed = []
        def warm_up():
            try:
                adapter.warm_up(request)
            except Exception as exc:
                failed.append(repr(exc))
        thread = threading.Thread(target=warm_up)
        thread.start()
        prepare(request)  # the adapter's describe, in this thread meanwhile
        thread.join()
        assert not failed, failed
        assert "transformers.models.llama.modeling_llama" in sys.modules
    """)
    alone = textwrap.dedent("""
        import sys
        from weightcache.core.flow.loader import prepare
        from weightcache.core.request import LoadRequest
        prepared = prepare(LoadRequest(model=sys.argv[1]))
        assert "transformers" not in sys.modules, "describing the model imported transformers: the read waits for it"
        import transformers
        assert prepared.description.engine_version == transformers.__version__
    """)
    proc = subprocess.run([sys.executable, "-c", alone, str(model_dir("llama"))], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for _ in range(3):  # a race: each round a fresh interpreter
        proc = subprocess.run([sys.executable, "-c", code, str(model_dir("llama"))], capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
