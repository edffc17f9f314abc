"""Checkpoints as transformers' ``save_pretrained`` writes them publish and attach bit for bit like ``from_pretrained``.

Every architecture of tests/models.py, decoders and BERT-style encoders, stored in
fp32 and bf16, loaded at the stored dtype and cast to the other one; an odd-sized
Llama whose leftover buffers do not fit the arena's page rounding; two models of
a few hundred MB, where rounding hides nothing; and ``weightcache load`` in its
own process. "Like from_pretrained" means every parameter and buffer (the
non-persistent ones too) has the same dtype, shape and bits, the same weights
are tied, and the forward output is the same.
"""

from __future__ import annotations

import sys

import pytest

from tests import zygote
from tests.helpers import assert_tensors_equal
from tests.models import ARCHITECTURES, ENCODERS, LARGE
from weightcache.core.flow.loader import prepare, publish
from weightcache.core.flow.modes import load_model
from weightcache.core.request import LoadRequest

SMALL = tuple(dict.fromkeys((*ARCHITECTURES, "llama-odd", *ENCODERS)))
OTHER_DTYPE = {"float32": "bfloat16", "bfloat16": "float32"}


def from_pretrained(path, dtype: str):
    """The reference: transformers' own load of the checkpoint's architecture."""
    import json

    import torch
    import transformers

    name = json.loads((path / "config.json").read_text())["architectures"][0]
    return getattr(transformers, name).from_pretrained(path, dtype=getattr(torch, dtype)).eval()


def named_tensors(model) -> dict:
    """Every parameter and buffer under every name it has (tied and shared ones under each)."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def ties(model) -> dict[str, str]:
    """Name -> the first name of the same tensor object, for every name that shares one."""
    first: dict[int, str] = {}
    shared = {}
    for name, tensor in named_tensors(model).items():
        owner = first.setdefault(id(tensor), name)
        if owner != name:
            shared[name] = owner
    return shared


def assert_same_bits(name: str, actual, expected) -> None:
    """Same dtype, shape and bytes (so -0.0 differs from 0.0 and a nan from another nan)."""
    import torch

    assert_tensors_equal(name, actual, expected)
    if actual.numel():
        a, e = (t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in (actual, expected))
        assert torch.equal(a, e), f"{name}: equal values but {int((a != e).sum())} bytes differ"


def forward(model):
    import torch

    input_ids = torch.arange(32, dtype=torch.long).reshape(2, 16) * 31 % model.config.vocab_size
    input_ids = input_ids.to(next(model.parameters()).device)
    with torch.no_grad():
        return model(input_ids=input_ids)[0]


def assert_attaches_like_from_pretrained(path, socket_dir, dtype: str, requested: str | None) -> None:
    """A client-mode load of ``path`` at ``requested`` equals ``from_pretrained(path, dtype=dtype)`` bit for bit."""
    reference = from_pretrained(path, dtype)
    cached = load_model(str(path), mode="client", socket_dir=socket_dir, dtype=requested, strict=True)
    try:
        assert cached.source == "cache"
        actual, expected = named_tensors(cached.model), named_tensors(reference)
        assert sorted(actual) == sorted(expected), "the attached model must have exactly from_pretrained's parameters and buffers"
        for name, tensor in expected.items():
            assert_same_bits(name, actual[name], tensor)
        assert ties(cached.model) == ties(reference), "the same weights must be tied"
        assert_same_bits("output", forward(cached.model), forward(reference))
    finally:
        cached.close()


@pytest.mark.parametrize("cast", [False, True], ids=["stored-dtype", "cast"])
@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", SMALL)
def test_saved_checkpoint_publishes_and_attaches_like_from_pretrained(server, model_dir, kind, stored, cast):
    path = model_dir(kind, stored)
    requested = OTHER_DTYPE[stored] if cast else None
    published = publish(prepare(LoadRequest(model=str(path), dtype=requested)), server.socket_dir)
    assert published.created
    assert_attaches_like_from_pretrained(path, server.socket_dir, requested or stored, requested)


@pytest.mark.parametrize("kind", LARGE)
def test_a_few_hundred_megabytes_publish_and_attach_like_from_pretrained(server, model_dir, kind):
    path = model_dir(kind)
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert weights > 400e6, f"{kind} should be a realistic size, is {weights / 1e6:.0f} MB"
    publish(prepare(LoadRequest(model=str(path))), server.socket_dir)
    assert_attaches_like_from_pretrained(path, server.socket_dir, "float32", None)


@pytest.mark.parametrize("kind", ["bert", "llama-odd"])
def test_weightcache_load_command_publishes_a_saved_checkpoint(server, model_dir, kind):
    path = model_dir(kind)
    done = zygote.run(
        [sys.executable, "-m", "weightcache.core.cli.cli", "load", "--socket-dir", str(server.socket_dir), "--model", str(path)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, f"weightcache load failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
    assert done.stdout.startswith("published"), done.stdout
    assert_attaches_like_from_pretrained(path, server.socket_dir, "float32", None)


def test_a_checkpoint_that_stores_a_tied_weight_publishes_no_dead_arena(server, tmp_path):
    """Config ties the embeddings, yet the file also stores ``lm_head.weight`` with other values (a model built
    untied and saved, as ``benchmarks/restart.py`` once did): transformers ties them and ignores the stored copy,
    so must we, and no arena may be left holding only the ignored bytes (the server refuses such a CUDA arena)."""
    import json

    import torch
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
    )
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.normal_()
    model.save_pretrained(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**stored, "tie_word_embeddings": True}))

    published = publish(prepare(LoadRequest(model=str(tmp_path))), server.socket_dir)
    extents = published.manifest.arena_extents()
    assert all(extents), f"arenas {[i for i, e in enumerate(extents) if not e]} hold no tensor: {extents}"
    assert_attaches_like_from_pretrained(tmp_path, server.socket_dir, "float32", None)
