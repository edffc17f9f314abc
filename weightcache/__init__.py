"""weightcache: keep an inference engine's final weights resident outside the engine; attach them zero-copy.

This package is weightcache's public API for people who load and serve models: every name in ``__all__``, imported
from here (``from weightcache import load_model, ServerProcess``). Each other audience has a public module of its own:
``weightcache.adapter`` (adapter authors), ``weightcache.engine`` (engine forks and integrations), ``weightcache.refit``,
``weightcache.fleet``, ``weightcache.errors`` and ``weightcache.conformance`` (the kit); docs/api.md lists them. The
modules under ``weightcache.core`` and ``weightcache.adapters`` are private and may move between minor versions.

The names and the modules that hold them are listed once, in ``__init__.pyi`` beside this file (type checkers read it
as the package's stub). Importing this package loads nothing heavy (no torch): each name loads its module on first use.
The names 0.2.0 served here that now live in another public module (:data:`MOVED`) still import from here for one minor
version, each with a ``DeprecationWarning`` that names the new import.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import typing
import warnings

# In a checkout this folder holds only the public face, and the layers are its neighbours (core/, adapters/,
# conformance/, which an install maps under this package): a checkout on sys.path before an install, as pytest's
# rootdir or a script run from the checkout puts it, finds them there.
_checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_checkout, "core", "hookspecs.py")) and _checkout not in __path__:
    __path__.append(_checkout)

from weightcache import _faces  # noqa: E402
from weightcache.core import __version__ as __version__  # noqa: E402
from weightcache.core import old_paths  # noqa: E402

NAMES, _serve, _dir = _faces.serve(__name__, __file__)
"""Each public name and the private module that holds it."""

__all__ = list(NAMES)

MOVED_SINCE = "0.3.0"
MOVED_GOES_IN = "0.4.0"

MOVED: dict[str, str] = {
    name: module
    for module, names in {
        "weightcache.engine": (
            "attach",
            "Attachment",
            "ATTACHMENT_ATTR",
            "CacheOptions",
            "compile_ahead",
            "CompileArtifactsUnavailable",
            "compiled_forward",
            "CompiledForward",
            "Connection",
            "fingerprint",
            "Origin",
            "Plugins",
            "prepare",
            "Prepared",
            "publish",
            "publish_artifacts",
            "publish_checkpoint",
            "publish_compiled",
            "publish_model",
            "publish_state",
            "Published",
            "rebind",
            "restore_artifacts",
            "restore_compiled",
            "run",
            "Standby",
            "StandbyError",
            "Tier",
        ),
        "weightcache.adapter": (
            "AdapterOption",
            "ArenaBuilder",
            "ArenaError",
            "check_no_meta",
            "check_quantization",
            "checkpoint_files",
            "checkpoint_tensors",
            "CheckpointConventions",
            "convert_model_to_fp8_skeleton",
            "default_store",
            "dequantize_weight",
            "DigestStore",
            "dtype_name",
            "env_switch",
            "export_module",
            "Fingerprint",
            "ForwardUnavailable",
            "Fp8BlockConfig",
            "Fp8BlockLinear",
            "hookimpl",
            "importing",
            "InvalidManifest",
            "load_prequantized",
            "LoadRequest",
            "looks_like_hub_id",
            "Manifest",
            "meta_parameters",
            "ModelDescription",
            "quantize_model",
            "quantize_weight",
            "read_checkpoint",
            "rebind_module",
            "RebindError",
            "Slot",
            "tensor_attributes",
            "TensorInfo",
            "TensorRecord",
            "to_dtype",
            "usable_cpus",
        ),
        "weightcache.fleet": (
            "FleetUnavailable",
            "PullFailed",
            "receive_entry",
            "SeedFailed",
            "SeedRefused",
            "send_entry",
        ),
        "weightcache.refit": (
            "publish_version",
            "PublishedVersion",
            "stage_version",
            "StagedVersion",
        ),
        "weightcache.conformance": (
            "AdapterTests",
            "ArchitectureTests",
            "assert_tensors_identical",
            "ConformanceFixtures",
            "ConformanceTests",
            "CrashTests",
            "FingerprintTests",
            "FlipTests",
            "model_tensors",
            "ModeTests",
            "ParityTests",
            "QuantizationTests",
            "RefitTests",
            "tensor_digest",
            "tied_groups",
        ),
    }.items()
    for name in names
}
"""Each name that 0.2.0 served from ``weightcache`` and that lives in another public module now: that module."""


FACES = (
    "weightcache",
    "weightcache.adapter",
    "weightcache.engine",
    "weightcache.refit",
    "weightcache.fleet",
    "weightcache.errors",
)
"""The public modules that list their names in a stub, in the order a name is looked for (``weightcache.conformance``,
the kit, is a package of its own)."""


def public_names() -> dict[str, dict[str, str]]:
    """Each public module of :data:`FACES` and its names, each with the private module that holds it."""
    return {face: _faces.stub_names(importlib.util.find_spec(face).origin or "") for face in FACES}


def __getattr__(name: str) -> typing.Any:
    if name in MOVED:
        warnings.warn(
            f"weightcache.{name} is deprecated since weightcache {MOVED_SINCE} and goes in {MOVED_GOES_IN}: "
            f"use from {MOVED[name]} import {name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(MOVED[name]), name)
    return _serve(name)


def __dir__() -> list[str]:
    return _dir()


old_paths.keep_old_paths()
