"""The hf adapter's remembered layout: a publish built from it is the publish built from the skeleton, record for record.

Real checkpoints of every architecture the tests build (save_pretrained, random weights), real arenas, a
real private store directory; the CLI runs in a fresh process, and a remembered layout must spare it transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.adapters.test_hf_checkpoints import SMALL, assert_attaches_like_from_pretrained
from weightcache.adapters.hf import identity, layout
from weightcache.adapters.hf.hooks import weightcache_manifest_extra
from weightcache.adapters.hf.layout_key import layout_key
from weightcache.adapters.hf.loading import load_into_arenas
from weightcache.core.device import Device
from weightcache.core.identity.digests import DigestStore
from weightcache.core.load.export import ArenaBuilder, collect_tensors, export_module
from weightcache.core.request import LoadRequest


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    """An empty private store of this test's own (the process-wide default store is per directory)."""
    directory = tmp_path / "store"
    monkeypatch.setenv("WEIGHTCACHE_CACHE_DIR", str(directory))
    return directory


def publish_view(path, dtype: str | None = None):
    """What a publish of ``path`` would describe: the manifest's records, aliases, the adapter's extra and the bytes of
    every tensor that was not read from the checkpoint (computed buffers); plus the model class the load returned."""
    request = LoadRequest(model=str(path), dtype=dtype)
    config = identity.read_config(str(path))
    with ArenaBuilder(Device.parse("cpu")) as builder:
        model = load_into_arenas(request, config, builder)
        if model is None:  # the checkpoint needs transformers' own loading (Mixtral's experts are fused on load)
            return None, None
        extra = weightcache_manifest_extra(request, model)
        built_as = type(model).__name__
        items, _ = collect_tensors(model)
        computed = {item.name: _bytes(item.tensor) for item in items if item.kind != "parameter"}
        manifest = export_module(model, builder)
        records = [
            (r.name, r.kind, r.dtype, r.shape, r.stride, r.storage_offset, r.arena, r.offset, r.nbytes, r.persistent)
            for r in manifest.tensors
        ]
        return {"records": records, "aliases": manifest.aliases, "extra": extra, "computed": computed}, built_as


def _bytes(tensor) -> bytes:
    import torch

    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def layout_entries(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith("layout-"))


def version_view(request, tensors):
    """What a version built from ``tensors`` with ``request``'s quantization publishes: every record, alias and the
    adapter's extra, and the bytes of every tensor (the quantised weights and their scales among them); plus the class
    the model was built as. An adapter's refusal (a model with nothing to quantise) is the view instead."""
    from weightcache.adapters.hf.hooks import weightcache_describe
    from weightcache.adapters.hf.loading import load_tensors, post_process
    from weightcache.core.errors import UnsupportedQuantization

    model = load_tensors(request, tensors)
    built_as = type(model).__name__
    try:
        model = post_process(request, model, weightcache_describe(request))
    except UnsupportedQuantization as exc:
        return str(exc), built_as
    items, _ = collect_tensors(model)
    with ArenaBuilder(Device.parse("cpu")) as builder:
        manifest = export_module(model, builder)
        records = [(r.name, r.kind, r.dtype, r.shape, r.stride, r.arena, r.offset, r.nbytes) for r in manifest.tensors]
        view = {
            "records": records,
            "aliases": manifest.aliases,
            "extra": weightcache_manifest_extra(request, model),
            "bytes": {item.name: _bytes(item.tensor) for item in items},
        }
    return view, built_as


@pytest.mark.parametrize("kind", SMALL)
def test_a_quantised_version_from_the_remembered_layout_is_the_one_from_the_skeleton(store_dir, model_dir, kind):
    """A version from a trainer's tensors with block-FP8 on publish: the first is built on the skeleton, which leaves
    the layout behind; the next on the layout (its Linear layers are ``torch.nn.Linear``, which quantisation converts),
    with the same records and the same bytes."""
    from safetensors.torch import load_file

    path = model_dir(kind, "bfloat16")
    tensors = {name: t for file in sorted(path.glob("*.safetensors")) for name, t in load_file(file).items()}
    request = LoadRequest(model=str(path), quantization="fp8-block")
    first, built_first = version_view(request, tensors)
    again, built_again = version_view(request, tensors)
    assert again == first
    if built_first == "LayoutModel" or layout_entries(store_dir) or built_again == "LayoutModel":
        assert built_first != "LayoutModel" and built_again == "LayoutModel", "the second version uses the layout"
        assert len(layout_entries(store_dir)) == 1, "the first version remembers the layout"
    if isinstance(first, dict):  # else both refused alike: GPT-2's Conv1D layers hold nothing block-FP8 can quantise
        assert any(r[2] == "float8_e4m3fn" for r in first["records"]), "nothing was quantised"


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", SMALL)
def test_a_publish_from_the_remembered_layout_is_the_publish_from_the_skeleton(store_dir, model_dir, kind, stored):
    path = model_dir(kind, stored)
    first, built_first = publish_view(path)
    if first is None:
        assert not layout_entries(store_dir), "a checkpoint transformers must convert leaves no layout"
        assert publish_view(path) == (None, None)
        return
    assert len(layout_entries(store_dir)) == 1, "the first load remembers the layout"
    again, built_again = publish_view(path)
    assert built_first != "LayoutModel" and built_again == "LayoutModel", "the second load uses the layout"
    assert again == first


def test_the_cli_with_a_remembered_layout_never_imports_transformers_and_attaches_like_from_pretrained(
    server, model_dir, tmp_path
):
    path = model_dir("llama")
    # The CLI's own process builds the skeleton (test_hf_layout_process.py: a child does).
    learned = cli_load(server.socket_dir, path, tmp_path / "store", layout_process="0")
    assert learned.returncode == 0, learned.stderr[-3000:]
    assert "TRANSFORMERS True" in learned.stdout, "without a remembered layout, the skeleton is built"
    for entry in _entries(server.socket_dir):
        subprocess.run(
            [sys.executable, "-m", "weightcache.core.cli.cli", "evict", "--force", "--socket-dir", str(server.socket_dir), entry],
            check=True,
            capture_output=True,
        )
    known = cli_load(server.socket_dir, path, tmp_path / "store", layout_process="0")
    assert known.returncode == 0, known.stderr[-3000:]
    assert known.stdout.startswith("published"), known.stdout
    assert "TRANSFORMERS False" in known.stdout, "with the layout remembered, the CLI needs no transformers"
    assert_attaches_like_from_pretrained(path, server.socket_dir, "float32", None)


def cli_load(socket_dir, path, store, layout_process: str) -> subprocess.CompletedProcess:
    """``weightcache load`` of ``path`` in a fresh process with its own store; it prints whether it imported transformers."""
    env = {**os.environ, "WEIGHTCACHE_CACHE_DIR": str(store), "HF_HUB_OFFLINE": "1", "WEIGHTCACHE_LAYOUT_PROCESS": layout_process}
    code = (
        "import sys\nfrom weightcache.core.cli.cli import main\n"
        f"code = main(['load', '--socket-dir', {str(socket_dir)!r}, '--model', {str(path)!r}])\n"
        "print('TRANSFORMERS', 'transformers' in sys.modules)\nsys.exit(code)\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240)


def _entries(socket_dir) -> list[str]:
    from weightcache.core.client.client import Connection

    with Connection(socket_dir) as connection:
        return [entry["digest"] for entry in connection.status()["entries"]]


def _poison(store_dir, change) -> None:
    (name,) = layout_entries(store_dir)
    raw = json.loads((store_dir / name).read_bytes())
    change(raw)
    (store_dir / name).write_text(json.dumps(raw))


def _shrink_first_tensor(raw) -> None:
    raw["tensors"][0][1] = [1]  # a shape that matches no checkpoint tensor: the checkpoint no longer fits


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: raw.update(format=99),
        lambda raw: raw["tensors"].append(["float32", [4], "AAAA"]),  # 3 bytes for 16
        lambda raw: raw["modules"][1].__setitem__(2, [["weight", "parameter", 10**9, True]]),
        lambda raw: raw.pop("ties"),
        _shrink_first_tensor,
        lambda raw: raw["modules"][1].__setitem__(3, True),  # GPT-2's `transformer`, marked Linear: it has no weight
    ],
    ids=["other-format", "value-size", "dangling-reference", "missing-field", "checkpoint-does-not-fit", "linear-without-weight"],
)
def test_a_damaged_layout_entry_is_a_miss_and_the_publish_is_the_skeletons(store_dir, model_dir, damage):
    path = model_dir("gpt2")
    first, _ = publish_view(path)
    _poison(store_dir, damage)
    again, built = publish_view(path)
    assert built != "LayoutModel", "a damaged layout is not used"
    assert again == first


def test_a_layout_entry_that_is_a_link_is_not_followed(store_dir, model_dir, tmp_path):
    path = model_dir("llama")
    publish_view(path)
    (name,) = layout_entries(store_dir)
    elsewhere = tmp_path / "elsewhere.json"
    os.replace(store_dir / name, elsewhere)
    os.symlink(elsewhere, store_dir / name)
    _, built = publish_view(path)
    assert built != "LayoutModel"


def test_the_layout_key_changes_with_what_the_layout_depends_on(model_dir):
    path = model_dir("llama")
    config = identity.read_config(str(path))
    request = LoadRequest(model=str(path))
    key = layout_key(request, config, "float32")
    assert layout_key(request, {**config, "rope_theta": 5e5}, "float32") != key, "rotary frequencies differ"
    assert layout_key(request, config, "bfloat16") != key
    assert layout_key(LoadRequest(model=str(path), options={"model_class": "AutoModel"}), config, "float32") != key
    assert layout_key(request, dict(config), "float32") == key


def test_a_store_without_a_trusted_directory_remembers_no_layout(model_dir):
    store = DigestStore(None)
    assert layout.remembered(store, "layout-x.json") is None
    store.write_entry("layout-x.json", b"{}")  # nothing happens, nothing raises


def _foreign_configs():
    import transformers

    return {
        # shared modules: the encoder's and decoder's embed_tokens are the model's `shared`
        "t5": transformers.T5Config(
            vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, architectures=["T5ForConditionalGeneration"]
        ),
        # tied embeddings, q/k norms
        "qwen3-tied": transformers.Qwen3Config(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
            architectures=["Qwen3ForCausalLM"],
        ),
        # a speech encoder-decoder: convolutions, sinusoidal position buffers
        "whisper": transformers.WhisperConfig(
            vocab_size=256,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
            d_model=64,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            num_mel_bins=16,
            max_source_positions=32,
            max_target_positions=32,
            architectures=["WhisperForConditionalGeneration"],
        ),
    }


@pytest.mark.parametrize("kind", ["t5", "qwen3-tied", "whisper"])
def test_shared_modules_tied_embeddings_and_a_speech_model_publish_the_same_from_their_layout(store_dir, tmp_path, kind):
    import transformers

    config = _foreign_configs()[kind]
    path = tmp_path / kind
    getattr(transformers, config.architectures[0])(config).eval().save_pretrained(path)
    first, built_first = publish_view(path)
    again, built_again = publish_view(path)
    assert built_first != "LayoutModel" and built_again == "LayoutModel"
    assert again == first
