"""The conformance kit's own pieces: light import, tensor assertions, fingerprint changes, weightless copies, CLI."""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
import textwrap

import attrs
import pytest

import weightcache.conformance
from weightcache.conformance.assertions import (
    assert_tensors_identical,
    bit_identical,
    difference_message,
    flatten_outputs,
    tensor_digest,
    tied_groups,
)
from weightcache.conformance.checks import changed_fingerprint, mismatch_name
from weightcache.conformance.weightless import copy_without_weights
from weightcache.core.fingerprint import FIELDS, Fingerprint

torch = pytest.importorskip("torch")


def _python(code: str, *args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(code), *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def test_plugin_module_is_light():
    """Loading the plugin (and the CLI's command module) imports neither torch nor the kit's classes."""
    proc = _python("""
        import sys
        import weightcache.conformance, weightcache.conformance.command
        from weightcache.core.cli.cli import build_parser
        build_parser()
        heavy = sorted(m for m in ("torch", "transformers", "safetensors", "weightcache.conformance.checks") if m in sys.modules)
        assert not heavy, heavy
    """)
    assert proc.returncode == 0, proc.stderr


def test_lazy_exports():
    for name in weightcache.conformance.__all__:
        assert getattr(weightcache.conformance, name) is not None
    with pytest.raises(AttributeError):
        weightcache.conformance.NoSuchThing  # noqa: B018


def test_required_fixtures_raise_not_implemented(tmp_path):
    """A subclass that gives neither fixtures nor options errors with a message saying what to provide."""
    (tmp_path / "test_bare.py").write_text(
        textwrap.dedent("""
        from weightcache.conformance import ConformanceFixtures, ConformanceTests

        class TestBare(ConformanceFixtures, ConformanceTests):
            pass
    """)
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "test_bare.py",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "tensor_parity",
            "--tb=line",
            "-rE",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout
    assert (
        "NotImplementedError: override the adapter_name fixture, or pass --weightcache-adapter NAME (pytest) / --adapter NAME (weightcache conformance)"
        in proc.stdout
    )


# ------------------------------------------------------------------ assertions


def test_difference_message_names_largest_difference():
    expected = torch.zeros(2, 3)
    actual = expected.clone()
    actual[1, 2] = 0.5
    actual[0, 0] = -0.25
    assert difference_message(expected, expected.clone()) is None
    message = difference_message(actual, expected)
    assert message.startswith("2 of 6 elements differ, largest difference 0.5 at index [1, 2]")
    with pytest.raises(
        AssertionError,
        match=r"lm_head.weight: torch.float32 on cpu \(mapped\) differs from the disk load "
        r"\(torch.float32 on cpu\): 2 of 6 elements differ, largest difference 0.5",
    ):
        assert_tensors_identical("lm_head.weight", actual, expected)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.int64, torch.bool])
def test_difference_message_other_dtypes(dtype):
    expected = torch.tensor([[1, 0], [0, 1]]).to(dtype)
    actual = torch.tensor([[1, 0], [1, 1]]).to(dtype)
    assert "1 of 4 elements differ, largest difference 1 at index [1, 0]" in difference_message(actual, expected)


def test_bit_identity_is_by_bytes():
    nan = torch.tensor([float("nan"), 0.0])
    assert bit_identical(nan, nan.clone())  # NaN == NaN by bits
    assert not bit_identical(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert "signed zeros" in difference_message(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert "dtype" in difference_message(torch.zeros(2), torch.zeros(2, dtype=torch.float64))


def test_digest_ignores_strides_not_values():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert tensor_digest(base.t()) == tensor_digest(base.t().contiguous())
    assert tensor_digest(base) != tensor_digest(base.t().contiguous())
    assert tensor_digest(torch.tensor(1.5)) == tensor_digest(torch.tensor([1.5]))


def test_tied_groups():
    model = torch.nn.Sequential(torch.nn.Embedding(4, 3), torch.nn.Linear(3, 4, bias=False))
    assert tied_groups(model) == set()
    model[1].weight = model[0].weight
    assert tied_groups(model) == {frozenset({"0.weight", "1.weight"})}


def test_flatten_outputs():
    a, b = torch.zeros(1), torch.ones(1)
    flat = flatten_outputs({"logits": a, "hidden": (b, None), "cache": object()})
    assert flat == {"output.logits": a, "output.hidden[0]": b}


# ------------------------------------------------------------------ fingerprints


def _fingerprint() -> Fingerprint:
    values = {name: ("x" if name != "cuda_version" else "") for name in FIELDS}
    ints = {"tp_size", "tp_rank", "pp_size", "pp_rank", "dp_size", "ep_size", "ep_rank", "protocol_version"}
    values.update({name: 1 for name in ints}, extra={"backend": "a"})
    return Fingerprint(**values)


@pytest.mark.parametrize("field", FIELDS)
def test_changed_fingerprint_changes_one_field(field):
    original = _fingerprint()
    changed, name = changed_fingerprint(original, field)
    assert name == mismatch_name(field)
    assert original.mismatched_fields(changed) == (name,)
    assert changed.digest != original.digest


# ------------------------------------------------------------------ weightless copies


def test_weightless_copy_keeps_headers_and_fails_reads(model_dir, tmp_path):
    import safetensors.torch
    from safetensors import SafetensorError

    from weightcache.core.errors import InvalidCheckpoint
    from weightcache.core.identity.safetensors_io import read_header

    def raw_header(file):
        data = file.read_bytes()
        return data[: 8 + int.from_bytes(data[:8], "little")]

    source = model_dir("llama", sharded=True)
    copy = copy_without_weights(source, tmp_path / "copy")
    assert (copy / "config.json").read_bytes() == (source / "config.json").read_bytes()
    shards = sorted(copy.glob("*.safetensors"))
    assert len(shards) > 1
    for shard in shards:
        assert shard.stat().st_size < (source / shard.name).stat().st_size
        assert raw_header(shard) == read_header(source / shard.name).raw
        with pytest.raises(SafetensorError):
            safetensors.torch.load_file(shard)
        with pytest.raises(InvalidCheckpoint, match="shorter than its header says"):
            read_header(shard)  # weightcache refuses the cut-off file as the disk load does


# ------------------------------------------------------------------ CLI


def test_cli_help_lists_options():
    proc = subprocess.run(
        [sys.executable, "-m", "weightcache.core.cli.cli", "conformance", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )
    assert proc.returncode == 0, proc.stderr
    for option in ("--adapter", "--model", "--quant", "--json", "--device", "--inputs"):
        assert option in proc.stdout


def test_cli_table(capsys):
    from weightcache.conformance.command import print_table

    summary = {
        "adapter": "hf",
        "model": "m",
        "quantization": "none",
        "device": "cpu",
        "passed": False,
        "exit_code": 1,
        "counts": {"passed": 2, "failed": 1, "error": 0, "skipped": 0},
        "seconds": 1.0,
        "collection_errors": [],
        "checks": [
            {"check": "test_a[x]", "group": "test_a", "outcome": "passed", "duration_s": 0.1, "message": ""},
            {"check": "test_a[y]", "group": "test_a", "outcome": "failed", "duration_s": 0.1, "message": "boom"},
            {"check": "test_b", "group": "test_b", "outcome": "passed", "duration_s": 0.1, "message": ""},
        ],
    }
    print_table(summary)
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()]
    assert ["a", "FAIL", "1", "1", "0"] in rows and ["b", "PASS", "1", "0", "0"] in rows
    assert "1 check (test_a[y]) failed: boom" in out and "FAILED (pytest exit status 1)" in out


def test_cli_table_says_each_distinct_failure_once_and_why_checks_skipped(capsys):
    """A broken model makes many checks error with one message: the table says it once, with how many."""
    from weightcache.conformance.command import print_table

    errors = [
        {"check": f"test_{n}", "group": f"test_{n}", "outcome": "error", "duration_s": 0.1, "message": "same cause"}
        for n in "abcde"
    ]
    skipped = [{"check": "test_f", "group": "test_f", "outcome": "skipped", "duration_s": 0.0, "message": "no forward here"}]
    summary = {
        "adapter": "hf",
        "model": "m",
        "quantization": "none",
        "device": "cpu",
        "passed": False,
        "exit_code": 1,
        "counts": {"passed": 0, "failed": 0, "error": 5, "skipped": 1},
        "seconds": 1.0,
        "collection_errors": [],
        "checks": errors + skipped,
    }
    print_table(summary)
    out = capsys.readouterr().out
    assert out.count("same cause") == 1 and "5 checks (test_a, test_b, test_c and 2 more) error: same cause" in out
    assert "1 (test_f): no forward here" in out


def test_cli_stops_at_once_on_an_unknown_adapter(tmp_path):
    """No check runs, none can pass: one line, a non-zero exit."""
    (tmp_path / "config.json").write_text("{}")
    proc = subprocess.run(
        [sys.executable, "-m", "weightcache.core.cli.cli", "conformance", "--adapter", "nosuch", "--model", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert proc.stderr.startswith(
        "weightcache: error: weightcache conformance pre-check failed: no weightcache adapter named 'nosuch'"
    ), proc.stderr
    assert "passed" not in proc.stdout and "CHECK" not in proc.stdout, proc.stdout


def test_fingerprint_fields_are_all_covered():
    """The kit changes every field of the fingerprint; a new field needs no change in the kit unless its type is new."""
    fingerprint = _fingerprint()
    for field in FIELDS:
        changed_fingerprint(fingerprint, field)
    assert set(FIELDS) == {f.name for f in attrs.fields(Fingerprint)}


def test_every_conformance_module_is_documented():
    for info in pkgutil.iter_modules(weightcache.conformance.__path__, "weightcache.conformance."):
        module = importlib.import_module(info.name)
        assert (module.__doc__ or "").strip(), f"{info.name} has no docstring"


def test_config_leaves_are_every_scalar_and_each_changes():
    from weightcache.conformance.config_fields import field_name, perturbed, scalar_leaves, skip_reason, with_changes

    config = {"dim": 4, "eps": 1e-6, "tie": True, "act": "gelu", "window": None, "rope": {"factor": 2.0}, "types": ["a", "b"]}
    names = [field_name(path) for path, _ in scalar_leaves(config)]
    assert names == ["dim", "eps", "tie", "act", "window", "rope.factor", "types.0", "types.1"]
    for path, value in scalar_leaves(config):
        changed = with_changes(config, [path])
        assert changed != config and dict(scalar_leaves(changed))[path] == perturbed(value)
    assert config["rope"] == {"factor": 2.0}, "the original stays as it was"
    assert skip_reason("transformers_version", ()) and skip_reason("text_config.use_cache", [("*.use_cache", "why")]) == "why"
    assert skip_reason("dim", [("*.use_cache", "why")]) is None


def test_linked_copy_links_the_weights_and_copies_the_config(tmp_path):
    from weightcache.conformance.config_fields import linked_copy

    source = tmp_path / "ckpt"
    source.mkdir()
    (source / "config.json").write_text("{}")
    (source / "model.safetensors").write_bytes(b"weights")
    copy = linked_copy(source, tmp_path / "copy")
    assert (copy / "model.safetensors").is_symlink() and (copy / "model.safetensors").read_bytes() == b"weights"
    assert not (copy / "config.json").is_symlink() and (copy / "config.json").read_text() == "{}"


def test_long_inputs_repeat_token_sequences_and_leave_pixels():
    import torch

    from weightcache.conformance.long_inputs import lengthen
    from weightcache.core.request import ForwardUnavailable

    ids = torch.arange(6).reshape(2, 3)
    longer = lengthen({"input_ids": ids, "position_ids": ids, "pixel_values": torch.zeros(2, 3, 4, 4)}, 7)
    assert longer["input_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 0], [3, 4, 5, 3, 4, 5, 3]]
    assert longer["position_ids"].tolist() == [list(range(7))] * 2
    assert longer["pixel_values"].shape == (2, 3, 4, 4)
    assert lengthen(ids, 7).shape == (2, 7) and lengthen((ids,), 7)[0].shape == (2, 7)
    assert isinstance(lengthen({"pixel_values": torch.zeros(2, 3, 4, 4)}, 7), ForwardUnavailable)
    assert isinstance(lengthen({"input_ids": ids}, 3), ForwardUnavailable), "no longer than the context allows"


def test_checkpoint_tensors_are_published_consumed_or_declared_unused():
    from weightcache.conformance.accounting import unaccounted
    from weightcache.core.request import CheckpointConventions

    conventions = CheckpointConventions(
        consumed_tensors=[("(.*)[.][qk]_proj[.]weight", r"\1.qk_proj.weight")], unused_tensors={"rotary[.].*": "recomputed"}
    )
    names = [(name, "here") for name in ("a.weight", "l.q_proj.weight", "l.k_proj.weight", "rotary.inv_freq", "x.v_proj.weight")]
    assert unaccounted(names, {"a.weight", "l.qk_proj.weight"}, conventions) == [
        "x.v_proj.weight (here) is neither published, nor consumed by a published tensor, nor declared unused"
    ]
    assert unaccounted([("l.q_proj.weight", "here")], {"a.weight"}, conventions) == [
        "l.q_proj.weight (here) is declared consumed by l.qk_proj.weight, which is not published"
    ]
    with pytest.raises(ValueError, match="pairs of strings"):
        CheckpointConventions(unused_tensors=[("only a pattern",)])
