"""The kit's abstract test classes; combine them with ``ConformanceFixtures`` in a ``Test*`` subclass.

- :class:`ParityTests`: the mapped model equals the disk load tensor by tensor
  and output by output, nothing stays on meta, tied weights stay tied, the
  mapped tensors live in the arenas (zero-copy).
- :class:`ModeTests`: each mode's own path (off, daemon's first start, client)
  loads, and puts every tensor on the requested device.
- :class:`FingerprintTests`: every fingerprint field changed alone gives an
  explicit mismatch naming that field, and (non-strict) a logged fallback to disk.
- :class:`FlipTests`: every adapter option and the request's dtype, quantization
  and device flipped on a published entry: a miss, or exactly the client's own disk load.
- :class:`QuantizationTests`: refused methods fail before any weight is read.
- :class:`CrashTests`: a SIGKILLed server leaves an attached model's outputs unchanged.
- :class:`FreshProcessTests`: a load in a fresh process with another hash seed publishes the same
  fingerprint, bytes and outputs.
- :class:`ConfigTests`: every scalar of every declared JSON file, one byte of every safetensors file under the
  checkpoint, changed on a copy: another fingerprint, or the same model.
- :class:`ConformanceTests`: all of them.

Grouped by what their outcome depends on, for a suite that runs the kit on many models of one adapter:

- :class:`ArchitectureTests` (parity, modes, flips, crash, fresh process, config, refit): the model's architecture decides the outcome
  (its layers, tied weights, post-processing): run them on every architecture the adapter supports.
- :class:`AdapterTests` (fingerprint, quantization refusals): the core's and the adapter's identity rules,
  which no architecture changes (each check perturbs the fingerprint or the declared method, not the
  model): run them once per adapter (and quantization), on any one model.
"""

from __future__ import annotations

import logging
import shutil
import typing
import warnings

import attrs
import pytest

from weightcache.conformance.assertions import (
    assert_same_model,
    assert_same_outputs,
    difference_message,
    failures,
    flatten_outputs,
    model_tensors,
    tied_groups,
)
from weightcache.conformance.dtype_checks import DtypeTests
from weightcache.conformance.fixtures import FP8_BLOCK, adapter_facade, fresh, load, refused_quantization_skips
from weightcache.conformance.flips import REQUEST_FIELDS, field_flips, judge, option_flips
from weightcache.conformance.outside_checks import ConfigTests, FreshProcessTests
from weightcache.conformance.refit import RefitTests
from weightcache.core.errors import FingerprintMismatch, UnsupportedQuantization
from weightcache.core.fingerprint import FIELDS, Fingerprint
from weightcache.core.server.server_process import ServerProcess

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.request import LoadRequest, ModelDescription

REFUSED_METHODS = ("fp8", "fp8-tensor", "marlin", "awq", "gptq", "bitsandbytes", "conformance-unknown-method")
"""Methods every adapter must refuse: per-tensor FP8 (two spellings), Marlin, AWQ, GPTQ, bitsandbytes, an unknown one."""

DECLARED_METHODS = ("fp8", "marlin", "awq", "gptq", "bitsandbytes", "conformance-unknown-method")
"""Methods a checkpoint may declare itself (``declare_quantization``); ``fp8`` is per-tensor (no block size)."""

EXTRA_KEY = "conformance"


def changed_fingerprint(fingerprint: Fingerprint, field: str) -> tuple[Fingerprint, str]:
    """``fingerprint`` with ``field`` alone changed, and the name a mismatch report must give for it."""
    value = getattr(fingerprint, field)
    if field == "extra":
        return attrs.evolve(fingerprint, extra={**value, EXTRA_KEY: "changed"}), mismatch_name(field)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"the kit does not know how to change fingerprint field {field!r} of type {type(value).__name__}")
    changed = value + 1 if isinstance(value, int) else (f"{value}+conformance" if value else "conformance")
    changes: dict[str, typing.Any] = {field: changed}  # one field, named at run time
    return attrs.evolve(fingerprint, **changes), field


def mismatch_name(field: str) -> str:
    """The name a mismatch report gives for ``field`` changed by :func:`changed_fingerprint`."""
    return f"extra.{EXTRA_KEY}" if field == "extra" else field


def _perturb_fingerprint(monkeypatch, field: str) -> str:
    """Make every fingerprint the loader computes differ in ``field`` alone; returns the expected mismatch name.

    This stands for an engine whose environment differs from the one that
    published (another torch, GPU, rank...): the real load path then runs as is.
    """
    from weightcache.core.identity import identity

    original = identity.fingerprint_for

    def perturbed(request: "LoadRequest", description: "ModelDescription", checkpoint: str | None = None) -> Fingerprint:
        return changed_fingerprint(original(request, description, checkpoint), field)[0]

    monkeypatch.setattr(identity, "fingerprint_for", perturbed)
    return mismatch_name(field)


def _skip_if_allowlisted(method: str, allowlist) -> None:
    if method in allowlist:
        pytest.skip(
            f"the adapter validated {method!r} itself (weightcache_quantization_allowlist); check it with quantization={method!r}"
        )


class ParityTests:
    """The mapped model is the disk load, bit for bit."""

    def test_mapped_model_comes_from_the_cache(self, disk_model, mapped_model, published):
        assert disk_model.source == "disk", f"mode 'off' gave source {disk_model.source!r}"
        assert mapped_model.source == "cache", (
            f"mode 'client' gave source {mapped_model.source!r}: {mapped_model.fallback_reason}"
        )
        assert mapped_model.attachment.digest == published.digest, "attached another entry than the one published"
        mismatched = mapped_model.fingerprint.mismatched_fields(published.fingerprint)
        assert not mismatched, f"the fingerprints of the published entry and of the mapped model differ in {mismatched}"

    def test_daemon_mode_attaches_the_published_entry(
        self, load_request, plugins, weightcache_server, published, run_model, example_inputs, disk_model
    ):
        """Mode ``daemon`` with a server running and the entry published attaches it (no second load)."""
        loaded = load(load_request, "daemon", plugins, weightcache_server.socket_dir, strict=True)
        try:
            assert (loaded.source, loaded.mode) == ("cache", "daemon"), f"mode 'daemon' gave {loaded.source!r} / {loaded.mode!r}"
            assert loaded.attachment is not None and loaded.attachment.digest == published.digest, (
                "mode 'daemon' attached another entry than the one published"
            )
            assert_same_model(loaded.model, disk_model.model, run_model, example_inputs, "daemon mode")
        finally:
            loaded.close()

    def test_same_tensor_names(self, disk_model, mapped_model):
        disk = model_tensors(disk_model.model)
        mapped = model_tensors(mapped_model.model)
        missing, extra = sorted(set(disk) - set(mapped)), sorted(set(mapped) - set(disk))
        assert not missing and not extra, (
            f"the mapped model lacks {len(missing)} tensors of the disk load: {missing[:20]}; "
            f"it has {len(extra)} the disk load lacks: {extra[:20]}"
        )

    def test_tensor_parity(self, disk_model, mapped_model):
        """Name, kind (parameter or buffer), dtype, shape, stride and the sha256 of the bytes, tensor by tensor."""
        disk = model_tensors(disk_model.model)
        mapped = model_tensors(mapped_model.model)
        problems = []
        for name in sorted(set(disk) & set(mapped)):
            notes = mapped[name].differences(disk[name])
            if notes:
                facts = mapped[name]
                problems.append(f"{name} ({facts.dtype} on {facts.device}): " + "; ".join(notes))
        assert not problems, failures("tensors of the mapped model differ from the disk load", problems)

    def test_no_tensor_left_on_meta(self, mapped_model, device):
        import torch

        wanted = torch.device(device).type
        problems = [  # a tensor attribute may live on the host beside GPU weights (an engine's CPU-side scale)
            f"{facts.name} ({facts.dtype}) is on {facts.device}"
            for facts in model_tensors(mapped_model.model).values()
            if facts.device == "meta" or (facts.kind != "attribute" and torch.device(facts.device).type != wanted)
        ]
        assert not problems, failures(f"tensors of the mapped model not on {device}", problems)

    def test_tied_weights_stay_tied(self, disk_model, mapped_model, expected_tied):
        disk, mapped = tied_groups(disk_model.model), tied_groups(mapped_model.model)
        for group in expected_tied:
            for label, groups in (("disk load", disk), ("mapped model", mapped)):
                assert any(set(group) <= g for g in groups), (
                    f"{sorted(group)} are not tied in the {label}; tied: {sorted(map(sorted, groups))}"
                )
        lost = [sorted(g) for g in disk - mapped]
        gained = [sorted(g) for g in mapped - disk]
        assert not lost and not gained, (
            f"tied weights differ: tied on disk but not mapped (or grouped otherwise): {lost}; "
            f"tied only in the mapped model: {gained}"
        )

    def test_mapped_tensors_are_zero_copy(self, mapped_model):
        """Every tensor of the manifest is a view of a mapped arena, not a copy."""
        attachment = mapped_model.attachment
        ranges = []
        for arena in attachment.arenas:
            base = arena.bytes_view().data_ptr()
            ranges.append((base, base + arena.spec.size))
        tensors = model_tensors(mapped_model.model)
        names = [record.name for record in attachment.manifest.tensors] + list(attachment.manifest.aliases)
        problems = []
        for name in names:
            facts = tensors.get(name)
            if facts is None:
                problems.append(f"{name} is in the manifest but not in the model")
            elif facts.tensor.numel() and not any(lo <= facts.tensor.data_ptr() < hi for lo, hi in ranges):
                problems.append(f"{name} ({facts.dtype} on {facts.device}) does not lie in any mapped arena (a copy?)")
        assert not problems, failures("mapped tensors that are not views of the arenas", problems)

    def test_fp8_block_weights_are_quantized(self, quantization, mapped_model):
        """With fp8-block, some weights are float8_e4m3fn, each with a float32 ``weight_scale_inv``."""
        if quantization != FP8_BLOCK:
            pytest.skip("unquantized")
        tensors = model_tensors(mapped_model.model)
        fp8 = [name for name, facts in tensors.items() if facts.dtype == "float8_e4m3fn"]
        assert fp8, "quantization fp8-block was requested but no tensor of the model is float8_e4m3fn"
        problems = []
        for name in fp8:
            scale = tensors.get(name + "_scale_inv")
            if scale is None or scale.dtype != "float32":
                problems.append(f"{name} has no float32 {name}_scale_inv beside it")
        assert not problems, failures("FP8 weights without block scales", problems)

    def test_disk_forward_is_deterministic(self, disk_model, run_model, example_inputs, disk_outputs):
        """Control: two forwards of the disk load agree, else bit-identity cannot be judged."""
        again = flatten_outputs(run_model(disk_model.model, example_inputs))
        for name in disk_outputs:
            message = difference_message(again[name], disk_outputs[name])
            assert message is None, f"the disk load alone is not deterministic on {name}: {message}; fix the inputs or run_model"

    def test_forward_outputs_bit_identical(self, mapped_model, run_model, example_inputs, disk_outputs):
        outputs = flatten_outputs(run_model(mapped_model.model, example_inputs))
        assert_same_outputs(outputs, disk_outputs, "mapped model")

    def test_long_forward_outputs_bit_identical(self, mapped_model, run_model, long_inputs, long_disk_outputs):
        """The same on the second, longer input: code a short input never reaches may read tensors left behind."""
        outputs = flatten_outputs(run_model(mapped_model.model, long_inputs))
        assert_same_outputs(outputs, long_disk_outputs, "mapped model, long input")

    def test_every_checkpoint_tensor_is_accounted_for(self, load_request, plugins, published, conventions):
        """Each tensor of the checkpoint's declared weight files is published, consumed by a published tensor, or declared
        unused."""
        from weightcache.conformance.accounting import ADVICE, published_names, unaccounted
        from weightcache.core.flow.loader import resolved
        from weightcache.core.identity.safetensors_io import checkpoint_tensors

        request = resolved(load_request)
        declared = adapter_facade(plugins, request.adapter).checkpoint_files(request)
        names = [
            (info.name, f"{info.dtype} {list(info.shape)} in {info.file.name}")
            for info in checkpoint_tensors(request.model, declared)
        ]
        problems = unaccounted(names, published_names(published.manifest), conventions)
        assert not problems, failures(f"checkpoint tensors a client never gets; {ADVICE}", problems)


class FingerprintTests:
    """Each fingerprint field changed alone: an explicit mismatch naming exactly that field, then a fallback."""

    @pytest.mark.parametrize("field", FIELDS)
    def test_fingerprint_mismatch_is_explicit(self, field, load_request, plugins, weightcache_server, published, monkeypatch):
        expected = _perturb_fingerprint(monkeypatch, field)
        with pytest.raises(FingerprintMismatch) as info:
            load(load_request, "client", plugins, weightcache_server.socket_dir, strict=True)
        assert info.value.fields == (expected,), (
            f"changing fingerprint field {field!r} alone must be reported as ({expected!r},), got {info.value.fields}"
        )
        assert info.value.closest == published.digest, "the mismatch must name the published entry as the closest"

    @pytest.mark.parametrize("field", FIELDS)
    def test_fingerprint_mismatch_falls_back_to_disk(
        self,
        field,
        load_request,
        plugins,
        weightcache_server,
        published,
        run_model,
        example_inputs,
        disk_model,
        monkeypatch,
        caplog,
    ):
        expected = _perturb_fingerprint(monkeypatch, field)
        with caplog.at_level(logging.WARNING, logger="weightcache"):
            loaded = load(load_request, "client", plugins, weightcache_server.socket_dir, strict=False)
        try:
            assert loaded.source == "disk", f"a mismatch in {field!r} must fall back to disk, got source {loaded.source!r}"
            assert expected in (loaded.fallback_reason or ""), (
                f"fallback reason does not name {expected!r}: {loaded.fallback_reason!r}"
            )
            logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and expected in r.getMessage()]
            assert logged, f"no warning logged naming {expected!r}; logged: {[r.getMessage() for r in caplog.records]}"
            assert_same_model(
                loaded.model, disk_model.model, run_model, example_inputs, f"fallback ({field} changed)", label="fallback"
            )
        finally:
            loaded.close()

    def test_each_adapter_extra_field_mismatch_is_explicit(
        self, load_request, plugins, weightcache_server, published, monkeypatch
    ):
        """Every field the adapter itself adds to the fingerprint (``ModelDescription.extra``) is compared and named."""
        from weightcache.core.identity import identity

        keys = sorted(published.fingerprint.extra)
        if not keys:
            pytest.skip("the adapter adds no fields of its own to the fingerprint (ModelDescription.extra is empty)")
        original = identity.fingerprint_for
        for key in keys:

            def perturbed(
                request: "LoadRequest", description: "ModelDescription", checkpoint: str | None = None, key: str = key
            ) -> Fingerprint:
                fingerprint = original(request, description, checkpoint)
                return attrs.evolve(fingerprint, extra={**fingerprint.extra, key: ["changed by the kit", fingerprint.extra[key]]})

            monkeypatch.setattr(identity, "fingerprint_for", perturbed)
            with pytest.raises(FingerprintMismatch) as info:
                load(load_request, "client", plugins, weightcache_server.socket_dir, strict=True)
            assert info.value.fields == (f"extra.{key}",), (
                f"changing extra.{key} alone must be reported as that field, got {info.value.fields}"
            )


class QuantizationTests:
    """Methods outside the allowlist fail with UnsupportedQuantization before any weight is read."""

    def test_weightless_copy_cannot_load(self, load_request, plugins, weightless_checkpoint, disk_model):
        """Control: on the copy without weight bytes, describe succeeds and the weight read fails.

        The copy differs from the real checkpoint (which loads: ``disk_model``) in its weight
        bytes alone, so a load that fails after describe succeeded failed reading weights.
        """
        from weightcache.core.flow.loader import load_from_disk, prepare

        request = fresh(attrs.evolve(load_request, model=str(weightless_checkpoint)))
        try:
            prepared = prepare(request, plugins)
        except UnsupportedQuantization as exc:
            pytest.fail(f"a plain load was refused as {exc.method!r}: {exc}")
        except Exception as exc:
            pytest.fail(
                f"weightcache_describe failed on the weightless copy, whose configs and safetensors headers are intact "
                f"({type(exc).__name__}: {exc}); describe may read configs and headers, never weight bytes"
            )
        try:
            model = load_from_disk(prepared)
        except Exception:
            return  # describe passed, the real checkpoint loads: the weight read failed, as it must
        del model
        pytest.fail(
            f"the adapter loaded {weightless_checkpoint}, whose weight bytes are cut off; does it read weights elsewhere?"
        )

    @pytest.mark.parametrize("mode", ["off", "client", "daemon"])
    @pytest.mark.parametrize("method", REFUSED_METHODS)
    def test_requested_method_refused_before_reading_weights(
        self, method, mode, load_request, plugins, weightless_checkpoint, weightcache_server, adapter_allowlist
    ):
        _skip_if_allowlisted(method, adapter_allowlist)
        request = attrs.evolve(load_request, model=str(weightless_checkpoint), quantization=method)
        with pytest.raises(UnsupportedQuantization) as info:
            load(request, mode, plugins, weightcache_server.socket_dir).close()
        assert info.value.method == method, f"refused as {info.value.method!r}, expected {method!r}"

    @pytest.mark.parametrize("method", DECLARED_METHODS)
    def test_declared_method_refused_before_reading_weights(
        self, method, request, load_request, plugins, weightless_checkpoint, declare_quantization, adapter_allowlist, tmp_path
    ):
        from weightcache.conformance.fixtures import declaration_source

        _skip_if_allowlisted(method, adapter_allowlist)
        if declare_quantization is None:
            pytest.skip("the adapter has no checkpoint-declared quantization (declare_quantization is None)")
        source = declaration_source(request, plugins, load_request.adapter)
        checkpoint = tmp_path / "declared"
        shutil.copytree(weightless_checkpoint, checkpoint)
        declare_quantization(checkpoint, method)
        declared = attrs.evolve(load_request, model=str(checkpoint), quantization=None)
        try:
            load(declared, "off", plugins).close()
        except UnsupportedQuantization as exc:
            assert exc.method == method, f"refused as {exc.method!r}, expected {method!r} ({source})"
            return
        except Exception as exc:
            if source.assumed:
                pytest.skip(
                    f"the adapter never said how its checkpoints declare a quantization method, and it does not read "
                    f"the convention the kit assumed ({source}: it failed with {type(exc).__name__}); declare it: "
                    "weightcache_checkpoint_conventions returning CheckpointConventions(quantization_declaration="
                    "'hf-config' | 'none' | 'MODULE:FUNCTION'), or pass --declare-quantization"
                )
            raise AssertionError(
                f"{method!r} declared by the checkpoint ({source}) was not refused with UnsupportedQuantization before "
                f"a weight was read: {type(exc).__name__}: {exc}; weightcache_describe must report the method the "
                "checkpoint declares as ModelDescription.quantization"
            ) from None
        pytest.fail(
            f"{method!r} declared by the checkpoint ({source}) was loaded from a copy without weight bytes: "
            "weightcache_describe must report it as ModelDescription.quantization"
        )

    def test_fp8_block_refused_when_unsupported(self, supports_fp8, load_request, plugins, weightless_checkpoint):
        if supports_fp8:
            pytest.skip("the adapter supports fp8-block")
        request = attrs.evolve(load_request, model=str(weightless_checkpoint), quantization=FP8_BLOCK)
        with pytest.raises(UnsupportedQuantization):
            load(request, "off", plugins).close()


class CrashTests:
    """An attached engine does not depend on the server staying alive; a new engine falls back to disk."""

    def test_outputs_survive_server_sigkill(self, load_request, plugins, run_model, example_inputs, disk_model):
        from weightcache.core.flow.loader import prepare, publish

        server = ServerProcess.start()
        try:
            with refused_quantization_skips(load_request):
                publish(prepare(fresh(load_request), plugins), server.socket_dir)
            loaded = load(load_request, "client", plugins, server.socket_dir, strict=True)
            try:
                assert loaded.source == "cache", f"attach failed: {loaded.fallback_reason}"
                server.kill()
                assert server.proc.returncode is not None, "the server survived SIGKILL"
                assert_same_model(loaded.model, disk_model.model, run_model, example_inputs, "after the server was SIGKILLed")
            finally:
                loaded.close()
            fallback = load(load_request, "client", plugins, server.socket_dir, strict=False)
            try:
                assert fallback.source == "disk" and fallback.fallback_reason, (
                    "with the server dead, mode 'client' must fall back to disk"
                )
                assert_same_model(
                    fallback.model, disk_model.model, run_model, example_inputs, "fallback with the server dead", label="fallback"
                )
            finally:
                fallback.close()
        finally:
            server.close()


class ModeTests:
    """Each mode runs its own path to the requested device; a mistake on one path fails that mode's check by name."""

    @pytest.mark.parametrize("mode", ["off", "daemon", "client"])
    def test_mode_loads_on_the_requested_device(self, mode, request, load_request, plugins, weightcache_server):
        """off: load + post_process; daemon: a first start on an empty server (load, publish, attach); client: attach + rebind."""
        import torch

        if mode == "client":
            request.getfixturevalue("published")  # only this mode needs the kit's entry: the others run their own paths
        server = ServerProcess.start() if mode == "daemon" else weightcache_server
        try:
            with refused_quantization_skips(load_request):
                try:
                    loaded = load(load_request, mode, plugins, server.socket_dir, strict=True)
                except UnsupportedQuantization:
                    raise
                except Exception as exc:
                    pytest.fail(f"mode {mode!r} failed in the adapter's hooks: {type(exc).__name__}: {exc}{_device_hint(exc)}")
            try:
                wanted = load_request.device.torch()
                misplaced = [
                    f"{facts.name} ({facts.dtype}) is on {facts.device}"
                    for facts in model_tensors(loaded.model).values()
                    if facts.kind != "attribute" and _misplaced(torch.device(facts.device), wanted)
                ]
                assert not misplaced, failures(f"mode {mode!r}: tensors not on the requested {wanted}", misplaced)
            finally:
                loaded.close()
        finally:
            if server is not weightcache_server:
                server.close()


def _misplaced(actual: "torch.device", wanted: "torch.device") -> bool:
    """Whether ``actual`` differs from ``wanted`` (in type, or in index when both name one)."""
    if actual.type != wanted.type:
        return True
    return wanted.index is not None and actual.index is not None and actual.index != wanted.index


def _device_hint(exc: BaseException) -> str:
    if "Device" in str(exc):
        return (
            "; request.device is weightcache's Device, which torch does not take: "
            "pass request.device.torch() to .to(), torch.device(...) and factories"
        )
    return ""


class FlipTests:
    """Each request field and adapter option flipped on the published entry: a miss, or exactly the client's own disk load."""

    @pytest.mark.parametrize("field", REQUEST_FIELDS)
    def test_request_field_flip_is_a_miss_or_the_same_model(
        self, field, load_request, plugins, weightcache_server, published, supports_fp8, run_model, example_inputs
    ):
        from weightcache.core.flow.loader import prepare

        description = prepare(fresh(load_request), plugins).description
        flips = field_flips(field, load_request, description, supports_fp8)
        if not flips:
            pytest.skip(f"no other {field} to ask for here")
        problems = [
            problem
            for flip in flips
            if (problem := judge(flip, published, plugins, weightcache_server.socket_dir, run_model, example_inputs))
        ]
        assert not problems, failures(f"request field {field!r} flipped on a published entry", problems)

    def test_option_flips_are_a_miss_or_the_same_model(
        self, load_request, plugins, weightcache_server, published, run_model, example_inputs
    ):
        """Every declared option, each to its other values (``AdapterOption.alternatives``, the other boolean or choices)."""
        options = adapter_facade(plugins, load_request.adapter).options()
        if not options:
            pytest.skip("the adapter declares no option (weightcache_options)")
        flips, unflippable = option_flips(load_request, options)
        for message in unflippable:
            warnings.warn(message, DeprecationWarning, stacklevel=1)
        problems = [
            problem
            for flip in flips
            if (problem := judge(flip, published, plugins, weightcache_server.socket_dir, run_model, example_inputs))
        ]
        assert not problems, failures("adapter options flipped on a published entry", problems)


class ArchitectureTests(ParityTests, ModeTests, FlipTests, CrashTests, FreshProcessTests, ConfigTests, RefitTests, DtypeTests):
    """The checks whose outcome depends on the model's architecture: run them on every architecture."""


class AdapterTests(FingerprintTests, QuantizationTests):
    """The checks no architecture changes (fingerprint fields, quantization refusals): once per adapter suffices."""


class ConformanceTests(ArchitectureTests, AdapterTests):
    """Every check of the kit."""
