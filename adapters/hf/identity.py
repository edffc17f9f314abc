"""What a model rank is for the hf adapter, from the checkpoint's config.json alone: ``describe``, and the readers it uses
(the config, the model class to build, the dtype, the quantization)."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import threading
import typing
from pathlib import Path
from types import ModuleType

from weightcache import __version__
from weightcache.adapter import ModelDescription, dtype_name, looks_like_hub_id, quantization_names, to_dtype

if typing.TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from weightcache.adapter import LoadRequest


def read_config(model: str, revision: str | None = None) -> dict:
    """The checkpoint's config.json as a dict; for a hub id the local cache does not hold, transformers fetches it
    (and raises what it raises without weightcache, e.g. offline)."""
    if Path(model).is_file():
        raise ValueError(
            f"{model} is a file; the hf adapter takes the checkpoint directory that holds config.json and the weights "
            f"(here: {Path(model).parent})"
        )
    path = Path(model) / "config.json"
    if not Path(model).exists() and looks_like_hub_id(model):
        found = transformers_module().utils.cached_file(model, "config.json", revision=revision)
        if found is None:
            raise FileNotFoundError(
                f"{model} has no config.json in the local hub cache; download it, or pass a checkpoint directory"
            )
        path = Path(found)
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} not found: the hf adapter needs a transformers checkpoint directory (save_pretrained writes config.json)"
        ) from None
    except ValueError as exc:
        raise ValueError(
            f"{path} is not valid JSON ({exc}); the checkpoint's config is damaged: copy or download it again"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not an object; the checkpoint's config is damaged")
    return config


def architecture(config: dict) -> str:
    """The model class named by the checkpoint (``architectures[0]``), else its model_type."""
    names = config.get("architectures") or []
    return names[0] if names else str(config.get("model_type", "unknown"))


def checkpoint_quantization(config: dict) -> str:
    """The method a checkpoint declares in ``quantization_config`` (``none`` if it declares none): a registered method's
    name where one claims the declaration, else the declaration's own ``quant_method``."""
    from weightcache.adapter import declared_quantization

    return declared_quantization(config.get("quantization_config"))


def quantization_config(config: dict, requested: str | None, options: dict) -> dict:
    """The config of the method this load uses (empty when the model stays unquantized), from the registry's method:
    the checkpoint's own declaration if it is stored quantized, else the request's method with the adapter's options.

    Raises UnsupportedQuantization for a method nobody registered, or one its method refuses.
    """
    from weightcache.adapter import quantization_method

    stored = checkpoint_quantization(config)
    if stored != "none":
        return quantization_method(stored).accept(config["quantization_config"], options)
    return quantization_method(requested).accept(None, options)


class ModelClass(typing.Protocol):
    """What the adapter uses of a transformers model class (``AutoModel`` or a concrete one)."""

    def from_pretrained(self, model: str | None, **kwargs: typing.Any) -> "PreTrainedModel": ...

    def _from_config(self, config: typing.Any, **kwargs: typing.Any) -> "PreTrainedModel": ...


def class_named(name: str) -> typing.Any:
    """transformers' attribute ``name`` (a model class), its module imported under the import lock."""
    transformers = transformers_module()
    with _IMPORTING:
        return getattr(transformers, name)


def model_class(request: "LoadRequest", config: dict) -> ModelClass:
    """The transformers class to build: ``options['model_class']`` or the checkpoint's architecture."""
    transformers = transformers_module()
    name = request.option("model_class") or architecture(config)
    with _IMPORTING:  # transformers imports the class's module on first access
        cls = getattr(transformers, name, None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise ValueError(f"transformers has no model class {name!r}; pass model_class='AutoModel' (or another class)")
    model_type = config.get("model_type")
    if name.startswith("Auto") and hasattr(cls, "_model_mapping"):  # an Auto class: the concrete class it picks
        try:
            cls = cls._model_mapping[type(transformers.AutoConfig.for_model(**config))]
        except (KeyError, ValueError, TypeError):
            raise ValueError(
                f"{name} has no model class for this checkpoint's {model_type!r} config; pass the architecture's class "
                f"(e.g. {architecture(config)}) or leave model_class out"
            ) from None
    built_from = getattr(getattr(cls, "config_class", None), "model_type", None)
    if built_from and model_type and built_from != model_type:
        raise ValueError(
            f"model class {name} is built from {built_from!r} configs, but this checkpoint is a {model_type!r} model "
            f"({architecture(config)}); pass a class of its architecture, or leave model_class out"
        )
    return cls


def load_dtype(request: "LoadRequest", config: dict) -> "torch.dtype":
    """The dtype of unquantized weights: the request's, else the checkpoint's, else float32."""
    import torch

    if request.dtype:
        return to_dtype(request.dtype)
    stored = config.get("dtype") or config.get("torch_dtype")
    return to_dtype(stored) if stored else torch.float32


def load_dtype_name(request: "LoadRequest", config: dict) -> str:
    """The name of ``load_dtype`` (``"bfloat16"``), without importing torch where it is a name weightcache knows."""
    wanted = request.dtype or config.get("dtype") or config.get("torch_dtype") or "float32"
    try:
        return dtype_name(wanted)
    except ValueError:
        return str(load_dtype(request, config)).removeprefix("torch.")


_IMPORTING = threading.RLock()
"""Held while transformers or a model class is imported: ``weightcache load`` warms the adapter up in a thread while its
main thread describes the model, and a thread that imports transformers while another one does can find it half made
(no model classes yet)."""


_NEEDS_TRANSFORMERS = "the hf adapter needs transformers: `pip install 'weightcache[hf]'`"


def transformers_module() -> ModuleType:
    """transformers, imported whole (never half-initialised by another thread's import)."""
    with _IMPORTING:
        try:
            import transformers
        except ImportError:
            raise ImportError(_NEEDS_TRANSFORMERS) from None
    return transformers


def require_transformers() -> None:
    """Raise the adapter's one-line ImportError when transformers cannot be imported, without importing it."""
    try:
        found = importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):  # ValueError: an entry in sys.modules without a spec (a module set to None)
        found = False
    if not found:
        raise ImportError(_NEEDS_TRANSFORMERS)


@functools.cache
def installed_version(distribution: str) -> str:
    """``distribution``'s version as this process first found it installed (a metadata scan costs milliseconds, and a
    refit describes the model and names its layout at every version; a process keeps the code it imported)."""
    return importlib.metadata.version(distribution)


def transformers_version() -> str:
    """The installed transformers' version, without importing it (seconds in a fresh process: ``weightcache load``
    describes the model while its warm-up thread imports transformers and the model's module, and reads meanwhile)."""
    try:
        return installed_version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return transformers_module().__version__  # not installed as a distribution: ask the module (or say it is missing)


def describe(request: "LoadRequest") -> ModelDescription:
    """The description of ``request``'s model from its config.json alone (no weight is read)."""
    require_transformers()
    config = read_config(request.model, request.revision)
    if request.option("model_class"):
        model_class(request, config)  # a class of another architecture is refused here, before any weight is read
    requested = request.quantization
    method = checkpoint_quantization(config) if requested in (None, "none") else requested
    quant_config = {}
    if method in quantization_names():  # the core refuses any other with its reason, once described
        quant_config = quantization_config(config, requested, dict(request.options))
    return ModelDescription(
        architecture=request.option("model_class") or architecture(config),
        config=config,
        dtype=load_dtype(request, config),
        quantization=method,
        quantization_config=quant_config,
        adapter_version=__version__,
        engine="transformers",
        engine_version=transformers_version(),
    )
