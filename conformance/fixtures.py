"""The kit's fixtures: what an adapter author provides, what they may change, and what the kit builds from them.

Subclass :class:`ConformanceFixtures` together with the test classes of
``weightcache.conformance.checks`` and override fixtures as methods (keep
``scope="class"``):

- required: ``adapter_name``, ``model_path`` (raise NotImplementedError unless
  ``--weightcache-adapter`` / ``--weightcache-model`` are given);
- configuration: ``quantization``, ``device``, ``dtype``, ``load_options``,
  ``plugins``;
- capabilities: ``supports_fp8``, ``expected_tied``, ``declare_quantization``,
  ``example_inputs``, ``long_inputs``, ``run_model``.

Each has a command-line form too (``--weightcache-*``, see ``weightcache.conformance.OPTIONS``),
so ``weightcache conformance`` accepts everything a subclass can set; ``expected_tied`` and
``declare_quantization`` default to what the adapter's ``weightcache_checkpoint_conventions``
says, so an adapter that implements it needs neither flag.

Before any check, ``_weightcache_precheck`` runs the pre-check (``weightcache.conformance.precheck``)
on the real checkpoint; if it fails, the first check errors with its one line and the session stops.

Every class shares one server, one publish, one disk load and one mapped
model across its checks (class-scoped fixtures).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import typing
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest

from weightcache.conformance.assertions import flatten_outputs
from weightcache.conformance.kit_loads import fresh as fresh
from weightcache.conformance.kit_loads import load as load
from weightcache.conformance.precheck import PrecheckFailed, precheck
from weightcache.conformance.verdict import NO_FORWARD
from weightcache.conformance.weightless import copy_without_weights
from weightcache.core.flow.example_inputs import run_with_inputs

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.flow.plugins import Adapter, Plugins
    from weightcache.core.request import CheckpointConventions, ExampleInputs, LoadRequest

FP8_BLOCK = "fp8-block"

HF_DECLARATIONS: dict[str, dict[str, typing.Any]] = {
    "fp8": {"quant_method": "fp8", "activation_scheme": "static"},
    "marlin": {"quant_method": "marlin", "bits": 4, "group_size": 128},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True},
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
    "conformance-unknown-method": {"quant_method": "conformance-unknown-method"},
}
"""``quantization_config`` blocks a transformers checkpoint declares for each refused method."""


def declare_hf_quantization(checkpoint: Path, method: str) -> None:
    """Make the transformers checkpoint ``checkpoint`` declare ``method`` in its config.json."""
    path = Path(checkpoint) / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = dict(HF_DECLARATIONS.get(method) or {"quant_method": method})
    path.write_text(json.dumps(config, indent=2))


def inputs_from_spec(spec: str, model: "torch.nn.Module") -> "ExampleInputs":
    """Inputs from ``MODULE:FUNCTION``, called with the model."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"inputs {spec!r}: expected MODULE:FUNCTION (e.g. my_package.testing:example_inputs)")
    return getattr(importlib.import_module(module), name)(model)


def declaration_from_spec(spec: "str | Callable[[Path, str], None] | None") -> Callable[[Path, str], None] | None:
    """``declare_quantization`` from its command-line or ``CheckpointConventions`` form: ``hf-config`` (default),
    ``none``, ``MODULE:FUNCTION`` or the function itself."""
    if callable(spec):
        return spec
    if spec in (None, "", "hf-config"):
        return declare_hf_quantization
    if spec == "none":
        return None
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"declare-quantization {spec!r}: expected hf-config, none or MODULE:FUNCTION")
    return getattr(importlib.import_module(module), name)


def _option(pytest_request, name: str):
    return pytest_request.config.getoption(name, None)


@attrs.frozen
class DeclarationSource:
    """Where the kit's way of making a checkpoint declare a quantization method came from, for its messages."""

    text: str
    assumed: bool
    """True when neither the adapter nor the command line said it: the kit assumed transformers' convention."""

    def __str__(self) -> str:
        return self.text


def declaration_source(pytest_request: typing.Any, plugins: "Plugins | None", adapter: str) -> DeclarationSource:
    """How the checkpoint copy declared its method: ``--declare-quantization``, the adapter's
    ``weightcache_checkpoint_conventions``, or the kit's assumption (transformers' ``quantization_config``)."""
    spec = _option(pytest_request, "weightcache_declare_quantization")
    if spec:
        return DeclarationSource(f"declared by --declare-quantization {spec}", False)
    if adapter_facade(plugins, adapter).implements("weightcache_checkpoint_conventions"):
        return DeclarationSource("declared the way the adapter's weightcache_checkpoint_conventions says", False)
    return DeclarationSource("written as transformers' quantization_config in config.json, the kit's default", True)


def _required_option(pytest_request, name: str, fixture: str, flag: str):
    value = _option(pytest_request, name)
    if not value:
        cli = flag.replace("--weightcache-", "--")
        raise NotImplementedError(f"override the {fixture} fixture, or pass {flag} (pytest) / {cli} (weightcache conformance)")
    return value


def adapter_facade(plugins: "Plugins | None", name: str) -> "Adapter":
    """The adapter ``name`` from ``plugins`` (default: the installed ones)."""
    from weightcache.core.flow.plugins import installed_plugins

    return (plugins or installed_plugins()).adapter(name)


@contextlib.contextmanager
def refused_quantization_skips(load_request: "LoadRequest") -> Iterator[None]:
    """A model that rightly refuses the requested method skips the checks that need it loaded (one reason, not 58 errors)."""
    from weightcache.core.errors import UnsupportedQuantization

    try:
        yield
    except UnsupportedQuantization as exc:
        if load_request.quantization in (None, "none"):
            raise
        pytest.skip(f"the adapter refuses {load_request.quantization} for this model: {exc.reason}")


def stop_session(pytest_request: "pytest.FixtureRequest", failure: PrecheckFailed) -> typing.NoReturn:
    """Raise ``failure`` in this check and stop the session after it: no further check could pass."""
    pytest_request.session.shouldstop = str(failure)
    raise failure


class ConformanceFixtures:
    """Fixtures of the conformance kit; override them as methods in your subclass."""

    # ------------------------------------------------------------- required

    @pytest.fixture(scope="class")
    @classmethod
    def adapter_name(cls, request) -> str:
        """The adapter's name in the ``weightcache.adapters`` entry points (or in ``plugins``)."""
        return _required_option(request, "weightcache_adapter", "adapter_name", "--weightcache-adapter NAME")

    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, request) -> str:
        """The checkpoint the kit loads (small is better: it is loaded a few dozen times)."""
        return _required_option(request, "weightcache_model", "model_path", "--weightcache-model PATH")

    # ------------------------------------------------------------- configuration

    @pytest.fixture(scope="class")
    @classmethod
    def quantization(cls, request) -> str | None:
        """The quantization method to check (``fp8-block``), None for the checkpoint's own."""
        return _option(request, "weightcache_quant")

    @pytest.fixture(scope="class")
    @classmethod
    def device(cls, request) -> str:
        """Where the engine loads the model: ``cpu`` (default), ``cuda`` or ``cuda:N``."""
        return _option(request, "weightcache_device") or "cpu"

    @pytest.fixture(scope="class")
    @classmethod
    def dtype(cls, request) -> str | None:
        """The dtype of unquantized weights (None: as the checkpoint stores them)."""
        return _option(request, "weightcache_dtype")

    @pytest.fixture(scope="class")
    @classmethod
    def load_options(cls, request) -> dict:
        """Adapter options passed to ``load_model`` (e.g. ``{"model_class": "AutoModel"}`` for hf); ``--weightcache-option KEY=VALUE``."""
        from weightcache.core.options import parse_options

        return parse_options(_option(request, "weightcache_option") or [])

    @pytest.fixture(scope="class")
    @classmethod
    def plugins(cls):
        """A ``weightcache.core.flow.plugins.Plugins`` holding the adapter, or None for the installed entry points."""
        return None

    # ------------------------------------------------------------- capabilities

    @pytest.fixture(scope="class")
    @classmethod
    def supports_fp8(cls, request) -> bool:
        """Whether the adapter implements block-wise FP8; if not, it must refuse ``fp8-block`` requests (``--weightcache-no-fp8``)."""
        return not _option(request, "weightcache_no_fp8")

    @pytest.fixture(scope="class")
    @classmethod
    def expected_tied(cls, request, conventions) -> tuple[tuple[str, ...], ...]:
        """Groups of names that must share memory in both models (e.g. ``(("lm_head.weight", "embed.weight"),)``).

        Command line: ``--weightcache-tied lm_head.weight,embed.weight`` (repeatable); default: the
        adapter's ``weightcache_checkpoint_conventions``.
        """
        groups = _option(request, "weightcache_tied")
        if not groups:
            return conventions.tied
        return tuple(tuple(name.strip() for name in group.split(",") if name.strip()) for group in groups)

    @pytest.fixture(scope="class")
    @classmethod
    def declare_quantization(cls, request, conventions):
        """``f(checkpoint_dir, method)`` making a checkpoint copy declare ``method``, or None if the adapter has no such notion.

        Command line: ``--weightcache-declare-quantization hf-config|none|MODULE:FUNCTION``; default:
        the adapter's ``weightcache_checkpoint_conventions`` (whose own default writes transformers'
        ``quantization_config`` into ``config.json``, what the hf, vllm and sglang adapters read).
        """
        spec = _option(request, "weightcache_declare_quantization")
        return declaration_from_spec(spec or conventions.quantization_declaration)

    @pytest.fixture(scope="class")
    @classmethod
    def example_inputs(cls, request, load_request, plugins, disk_model):
        """Fixed inputs for the forward checks: ``--weightcache-inputs MODULE:FUNCTION``, else the adapter's
        ``weightcache_example_inputs`` hook (whose core default builds them from the model's forward signature).

        ``ForwardUnavailable(reason)`` makes the kit skip its forward checks with that reason.
        """
        spec = _option(request, "weightcache_inputs")
        if spec:
            return inputs_from_spec(spec, disk_model.model)
        return adapter_facade(plugins, load_request.adapter).example_inputs(load_request, disk_model.model)

    @pytest.fixture(scope="class")
    @classmethod
    def run_model(cls, device):
        """``f(model, inputs) -> output``: how to call the model (default: keywords for a dict, no grad)."""
        return lambda model, inputs: run_with_inputs(model, inputs, device)

    # ------------------------------------------------------------- built by the kit

    @pytest.fixture(scope="class")
    @classmethod
    def load_request(cls, request, adapter_name, model_path, quantization, device, dtype, load_options) -> "LoadRequest":
        """The engine's request the kit loads in every mode."""
        from weightcache.core.request import LoadRequest

        try:
            return LoadRequest(
                model=str(model_path),
                adapter=adapter_name,
                dtype=dtype,
                device=device,
                quantization=quantization,
                options=dict(load_options),
            )
        except ValueError as exc:
            failure = PrecheckFailed(str(exc))
        stop_session(request, failure)

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _weightcache_precheck(cls, request, load_request, supports_fp8):
        """The pre-check on the real checkpoint; if it fails no check can pass: the first errors, the session stops (one line)."""
        from weightcache.core.errors import WeightCacheError

        failure = None
        try:
            precheck(load_request, request.getfixturevalue("plugins"))  # an adapter refused at registration fails here too
        except PrecheckFailed as exc:
            failure = exc
        except WeightCacheError as exc:
            failure = PrecheckFailed(str(exc))
        if failure is not None:
            stop_session(request, failure)
        if load_request.quantization == FP8_BLOCK and not supports_fp8:
            pytest.skip("the adapter does not support fp8-block (supports_fp8 is False)")

    @pytest.fixture(scope="class")
    @classmethod
    def conventions(cls, load_request, plugins) -> "CheckpointConventions":
        """The adapter's ``weightcache_checkpoint_conventions`` for the checkpoint (how it declares quantization, what it ties)."""
        return adapter_facade(plugins, load_request.adapter).checkpoint_conventions(load_request)

    @pytest.fixture(scope="class")
    @classmethod
    def adapter_allowlist(cls, load_request, plugins) -> tuple[str, ...]:
        """Methods the adapter validated beyond the core's (``weightcache_quantization_allowlist``)."""
        return adapter_facade(plugins, load_request.adapter).quantization_allowlist(load_request)

    @pytest.fixture(scope="class")
    @classmethod
    def weightcache_server(cls):
        """A ``weightcache serve`` process of the kit's own, on a private socket directory."""
        from weightcache.core.server.server_process import ServerProcess

        server = ServerProcess.start()
        try:
            yield server
        finally:
            server.close()

    @pytest.fixture(scope="class")
    @classmethod
    def published(cls, load_request, plugins, weightcache_server):
        """The model loaded from disk into arenas and published to ``weightcache_server``."""
        from weightcache.core.flow.loader import prepare, publish

        with refused_quantization_skips(load_request):
            return publish(prepare(fresh(load_request), plugins), weightcache_server.socket_dir)

    @pytest.fixture(scope="class")
    @classmethod
    def disk_model(cls, load_request, plugins):
        """The model loaded from disk (mode ``off``): the reference."""
        with refused_quantization_skips(load_request):
            loaded = load(load_request, "off", plugins)
        try:
            yield loaded
        finally:
            loaded.close()

    @pytest.fixture(scope="class")
    @classmethod
    def mapped_model(cls, load_request, plugins, weightcache_server, published):
        """The model attached to the published entry (mode ``client``, strict)."""
        loaded = load(load_request, "client", plugins, weightcache_server.socket_dir, strict=True)
        try:
            yield loaded
        finally:
            loaded.close()

    @pytest.fixture(scope="class")
    @classmethod
    def disk_outputs(cls, disk_model, run_model, example_inputs):
        """The disk model's output tensors on ``example_inputs``, by path (``output.logits``); skips without a forward."""
        from weightcache.core.request import ForwardUnavailable

        if isinstance(example_inputs, ForwardUnavailable):
            pytest.skip(f"{NO_FORWARD}: {example_inputs.reason}")
        outputs = flatten_outputs(run_model(disk_model.model, example_inputs))
        if not outputs:
            raise AssertionError("the model's output holds no tensor; override run_model to return tensors")
        return outputs

    @pytest.fixture(scope="class")
    @classmethod
    def fresh_process(cls, load_request, plugins, run_model, tmp_path_factory):
        """Fresh processes loading the model, each with another hash seed, the second with another thread count
        (``weightcache.conformance.fresh_process``)."""
        from weightcache.conformance.fresh_process import FreshProcess, variants

        started = []
        try:
            for seed, threads in variants():
                workdir = tmp_path_factory.mktemp("fresh-process")
                started.append(FreshProcess.start(load_request, plugins, run_model, workdir, seed=seed, threads=threads))
            yield started
        finally:
            for process in started:
                process.close()

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _weightcache_fresh_process_early(cls, request, _weightcache_precheck):
        """Start ``fresh_process`` as the class begins when its check will run, so that its start overlaps the others."""
        from weightcache.conformance.fresh_process import CHECKS

        if any(item.cls is request.cls and item.originalname in CHECKS for item in request.session.items):
            request.getfixturevalue("fresh_process")

    @pytest.fixture(scope="class")
    @classmethod
    def long_inputs(cls, example_inputs, disk_model):
        """The second, longer input: the example's token sequences lengthened as far as the model's context allows,
        capped (``weightcache.conformance.long_inputs``); ``ForwardUnavailable(reason)`` when they cannot be."""
        from weightcache.conformance.long_inputs import context_length, lengthen

        return lengthen(example_inputs, context_length(disk_model.model))

    @pytest.fixture(scope="class")
    @classmethod
    def long_disk_outputs(cls, disk_model, run_model, long_inputs, disk_outputs):
        """The disk model's output tensors on ``long_inputs``, by path; skips when there is no longer input."""
        from weightcache.core.request import ForwardUnavailable

        if isinstance(long_inputs, ForwardUnavailable):
            pytest.skip(f"no longer input: {long_inputs.reason}")
        return flatten_outputs(run_model(disk_model.model, long_inputs))

    @pytest.fixture(scope="class")
    @classmethod
    def weightless_checkpoint(cls, model_path, tmp_path_factory) -> Path:
        """A copy of the checkpoint whose weight bytes are cut off (see ``weightcache.conformance.weightless``)."""
        return copy_without_weights(model_path, tmp_path_factory.mktemp("weightless"))
