"""Checkpoints in several folders (sentence-transformers, as sentence-transformers itself saves them): cached, verified
by the kit, refit-able; every declared file is in the identity; the kit names what a declaration leaves out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conformance.test_planted_bugs import adapters_env, failed_checks, kit_cli
from tests.foreign_layouts import (
    EXAMPLES,
    diffusers_adapter,
    save_diffusers_pipeline,
    save_sentence_transformer,
    st_adapter,
    to_old_layout,
)
from tests.helpers import EXAMPLE_SRC, PLANTED_DIR
from weightcache.conformance import ArchitectureTests, ConformanceFixtures
from weightcache.engine import Plugins

pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed (pip install -e '.[test]')")

ENTRY_POINTS = {
    "planted-folders": "Folders",
    "planted-dense-left-out": "DenseLeftOut",
    "planted-pooling-left-out": "PoolingLeftOut",
    "planted-thread-chunks": "ChunksByThreadCount",
    "planted-010": "WrittenFor010",
    "planted-bf16-flag": "DoublesInBfloat16",
    "planted-extra": "ExtraFollowsTheProcess",
}


@pytest.fixture(scope="module")
def st_root(tmp_path_factory) -> Path:
    return save_sentence_transformer(tmp_path_factory.mktemp("st") / "root")


@pytest.fixture(scope="module")
def st_old(tmp_path_factory) -> Path:
    return to_old_layout(save_sentence_transformer(tmp_path_factory.mktemp("st") / "old", pooling="cls"))


def plugins():
    return Plugins.from_modules({"st": st_adapter()})


class FolderFixtures(ConformanceFixtures):
    @pytest.fixture(scope="class")
    @classmethod
    def adapter_name(cls):
        return "st"

    @pytest.fixture(scope="class")
    @classmethod
    def plugins(cls):
        return plugins()

    @pytest.fixture(scope="class")
    @classmethod
    def supports_fp8(cls):
        return False


class TestSentenceTransformerRoot(FolderFixtures, ArchitectureTests):
    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, st_root):
        return str(st_root)


class TestSentenceTransformerOld(FolderFixtures, ArchitectureTests):
    """The older layout, body in 0_Transformer/: before issue 51 never cached ("holds no *.safetensors file")."""

    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, st_old):
        return str(st_old)


class TestDiffusersPipeline(FolderFixtures, ArchitectureTests):
    """A pipeline folder diffusers' save_pretrained wrote: unet/ and vae/ (with tensors of the same names), scheduler/."""

    @pytest.fixture(scope="class")
    @classmethod
    def adapter_name(cls):
        return "diffusers-pipeline"

    @pytest.fixture(scope="class")
    @classmethod
    def plugins(cls):
        return Plugins.from_modules({"diffusers-pipeline": diffusers_adapter()})

    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, tmp_path_factory):
        pytest.importorskip("diffusers", reason="diffusers is not installed (pip install -e '.[test]')")
        return str(save_diffusers_pipeline(tmp_path_factory.mktemp("diffusers") / "pipeline"))


# ------------------------------------------------------------------ every declared file is in the identity


def _fingerprint(path: Path) -> str:
    from weightcache.core.flow.loader import prepare
    from weightcache.core.request import LoadRequest

    return prepare(LoadRequest(model=str(path), adapter="st"), plugins()).fingerprint.digest


@pytest.mark.parametrize("layout", ["root", "old"])
def test_one_byte_of_any_declared_file_is_another_fingerprint(layout, st_root, st_old, tmp_path):
    """A new Dense head (max abs diff 1.03 in the issue), a pooling config edited: each is a miss, never a stale hit."""
    source = st_root if layout == "root" else st_old
    files = st_adapter().weightcache_checkpoint_files(request=type("R", (), {"model": str(source)})()).files(source)
    names = [str(file.relative_to(source)) for file in files]
    assert "2_Dense/model.safetensors" in names and "1_Pooling/config.json" in names, names
    copy = Path(shutil.copytree(source, tmp_path / "copy"))
    before = _fingerprint(copy)
    for name in names:
        file = copy / name
        original = file.read_bytes()
        changed = bytearray(original)
        if name.endswith(".json"):
            changed += b"\n"  # still the same JSON: only the bytes differ
        else:
            changed[len(changed) // 2] ^= 1
        file.write_bytes(bytes(changed))
        assert _fingerprint(copy) != before, (
            f"{name} changed by one byte keeps the fingerprint: a client attaches the stale entry"
        )
        file.write_bytes(original)
    assert _fingerprint(copy) == before


def test_the_old_layout_is_cached_and_refit(st_old, server):
    """Published, attached from the cache, then a new version of the Dense head's tensors published from memory."""
    from weightcache import load_model
    from weightcache.adapter import checkpoint_tensors
    from weightcache.core.flow.loader import prepare, publish
    from weightcache.core.request import LoadRequest
    from weightcache.refit import publish_version

    module = st_adapter()
    publish(prepare(LoadRequest(model=str(st_old), adapter="st"), plugins()), server.socket_dir)
    attached = load_model(str(st_old), adapter="st", mode="client", socket_dir=server.socket_dir, plugins=plugins())
    try:
        assert attached.source == "cache", attached.fallback_reason
    finally:
        attached.close()
    declared = module.weightcache_checkpoint_files(request=type("R", (), {"model": str(st_old)})())
    import safetensors.torch

    state = {}
    for file in declared.weight_files(st_old):
        prefix = declared.tensor_prefix(st_old, file)
        state.update({prefix + name: t for name, t in safetensors.torch.load_file(str(file)).items()})
    assert sorted(state) == sorted(info.name for info in checkpoint_tensors(st_old, declared))
    state["2_Dense/linear.weight"] = state["2_Dense/linear.weight"] * 2
    published = publish_version(str(st_old), state, 1, adapter="st", socket_dir=server.socket_dir, plugins=plugins())
    assert published.fingerprint.version == 1  # before issue 51: LayoutMismatch, 2_Dense/linear.weight not in the checkpoint


def test_a_renaming_pattern_matching_the_empty_string_is_refused_in_one_line():
    from weightcache.adapter import CheckpointConventions

    with pytest.raises(ValueError, match=r"matches the empty string") as caught:
        CheckpointConventions(consumed_tensors=[("(.*)", "body.\\1")])
    assert "\n" not in str(caught.value)
    rename = CheckpointConventions(consumed_tensors=[("(.+)", "body.\\1")]).consumed_tensors
    from weightcache.conformance.accounting import consumer

    assert consumer(rename)("layer.bias") == "body.layer.bias"  # re.sub made it 'body.layer.biasbody.'


# ------------------------------------------------------------------ what the kit names


@pytest.fixture(scope="module")
def folders_env(tmp_path_factory) -> dict:
    site = tmp_path_factory.mktemp("planted-folders-site")
    return adapters_env(site, "weightcache-planted-folders", "planted_folders", ENTRY_POINTS, PLANTED_DIR, EXAMPLE_SRC, EXAMPLES)


def _kit(env, tmp_path, adapter, checkpoint, select):
    proc, results = kit_cli({**env, "WEIGHTCACHE_BLOCK_ADAPTERS": ""}, tmp_path, adapter, str(checkpoint), select=select)
    assert results is not None, proc.stdout + proc.stderr
    return proc, failed_checks(results)


def test_a_dense_head_left_out_of_the_declaration_is_named(folders_env, st_root, tmp_path):
    select = "declared_files or weight_files"
    _proc, failed = _kit(folders_env, tmp_path, "planted-dense-left-out", st_root, select)
    assert sorted(failed) == ["test_load_reads_only_declared_files", "test_weight_files_change_the_fingerprint_or_nothing"]
    assert "2_Dense/model.safetensors is read but not declared" in failed["test_load_reads_only_declared_files"]
    assert "2_Dense/model.safetensors changed" in failed["test_weight_files_change_the_fingerprint_or_nothing"]
    _proc, failed = _kit(folders_env, tmp_path, "planted-folders", st_root, select)
    assert not failed, failed


def test_a_pooling_config_left_out_of_the_declaration_is_named(folders_env, st_root, tmp_path):
    _proc, failed = _kit(folders_env, tmp_path, "planted-pooling-left-out", st_root, "declared_files")
    assert list(failed) == ["test_load_reads_only_declared_files"], failed
    assert "1_Pooling/config.json is read but not declared" in failed["test_load_reads_only_declared_files"]


def test_post_processing_that_follows_the_thread_count_fails_the_fresh_process_check(folders_env, example_checkpoint, tmp_path):
    _proc, failed = _kit(folders_env, tmp_path, "planted-thread-chunks", example_checkpoint, "fresh_process")
    assert list(failed) == ["test_fresh_process_publishes_the_same_model"], failed
    message = failed["test_fresh_process_publishes_the_same_model"]
    assert "threads) loads other tensors than this process published, first fc1.weight" in message, message


def test_modules_json_is_read_as_sentence_transformers_writes_it(st_root):
    modules = json.loads((st_root / "modules.json").read_text())
    assert [m["path"] for m in modules] == ["", "1_Pooling", "2_Dense", "3_Normalize"]


def test_an_adapter_without_the_quantization_convention_skips_the_declared_method_check_saying_what_to_declare(
    folders_env, example_checkpoint, tmp_path
):
    """Before issue 51 six checks failed with a raw safetensors error for a convention the adapter never claimed."""
    proc, results = kit_cli(
        {**folders_env, "WEIGHTCACHE_BLOCK_ADAPTERS": ""},
        tmp_path,
        "planted-010",
        str(example_checkpoint),
        select="declared_method",
    )
    assert results is not None and proc.returncode == 0, proc.stdout + proc.stderr
    skipped = [check for check in results["checks"] if check["outcome"] == "skipped"]
    assert skipped and all("never said how its checkpoints declare a quantization method" in c["message"] for c in skipped)
    assert "CheckpointConventions(quantization_declaration=" in skipped[0]["message"]


def test_a_flag_set_in_bfloat16_only_fails_the_other_dtype_check(folders_env, st_root, tmp_path):
    """The class runs at float32 (the checkpoint's own); the kit also runs bfloat16 and finds the outputs differ."""
    _, failed = _kit(folders_env, tmp_path, "planted-bf16-flag", st_root, "other_dtype or bit_identical")
    assert list(failed) == ["test_other_dtype_attaches_its_disk_load[bfloat16]"], failed
    assert "at dtype bfloat16" in failed["test_other_dtype_attaches_its_disk_load[bfloat16]"]
    _, failed = _kit(folders_env, tmp_path, "planted-folders", st_root, "other_dtype")
    assert not failed, failed


def test_a_manifest_extra_that_follows_the_hash_seed_fails_the_fresh_process_check(folders_env, st_root, tmp_path):
    """Tensors and outputs are the same in every process; only the published state differs."""
    _, failed = _kit(folders_env, tmp_path, "planted-extra", st_root, "fresh_process")
    assert list(failed) == ["test_fresh_process_publishes_the_same_model"], failed
    message = failed["test_fresh_process_publishes_the_same_model"]
    assert "computes another manifest extra (order is" in message, message
