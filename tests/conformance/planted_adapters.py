"""Adapters with one planted bug each, built on the adapter guide's example (TinyLM, examples/tinylm-adapter).

``test_planted_bugs.py`` installs them through a ``weightcache.adapters`` entry point each
(its ``ENTRY_POINTS``) and runs the kit on them as their author would; each must fail by
the check meant to catch its bug. ``ScaleInExtra`` is the control: the same option,
done right, passes. The last three carry bugs no load inside one process shows: a
post-process that depends on the process's hash seed, a config.json field folded into the weights
but not into the fingerprint, a checkpoint tensor kept outside parameters and buffers.
"""

from __future__ import annotations

import attrs
import safetensors
import safetensors.torch
import torch
from weightcache_example import TinyLM, plugin, read_config

from weightcache.core.hookspecs import hookimpl
from weightcache.core.identity.declared import CheckpointFiles
from weightcache.core.load.rebind import rebind_module
from weightcache.core.options import AdapterOption
from weightcache.core.request import ModelDescription

SCALE = AdapterOption("multiply fc1.weight by this while loading (default: 1.0)", type=float, default=1.0, alternatives=(2.0,))


class Example:
    """The example adapter, hook for hook: what every planted bug changes one thing of."""

    weightcache_describe = staticmethod(plugin.weightcache_describe)
    weightcache_load = staticmethod(plugin.weightcache_load)
    weightcache_post_process = staticmethod(plugin.weightcache_post_process)
    weightcache_rebind = staticmethod(plugin.weightcache_rebind)
    weightcache_example_inputs = staticmethod(plugin.weightcache_example_inputs)
    weightcache_checkpoint_conventions = staticmethod(plugin.weightcache_checkpoint_conventions)


class RebindNudgesOneUlp(Example):
    """Rebind nudges one element of fc1.bias by one ulp (a subtle loader bug).

    The element is the first whose nudge reaches the forward's output for the kit's example inputs on this CPU: how a
    one-ulp change in a hidden bias survives gelu and fc2's sums depends on the machine's floating-point path (an
    AVX2-only CPU rounds index 3's away where an AVX-512 one does not), and the kit must see the bug on every machine.
    """

    @staticmethod
    @hookimpl
    def weightcache_rebind(request, tensors, manifest, description):
        model = plugin.weightcache_rebind(request=request, tensors=tensors, manifest=manifest, description=description)
        inputs = plugin.weightcache_example_inputs(request=request, model=model)
        with torch.no_grad():
            expected = model(**inputs)
            bias = model.fc1.bias.detach().clone()
            for index in range(bias.numel()):
                nudged = bias.clone()
                nudged[index] = torch.nextafter(bias[index], torch.tensor(float("inf")))
                model.fc1.bias = torch.nn.Parameter(nudged, requires_grad=False)
                if not torch.equal(model(**inputs), expected):
                    return model
        raise AssertionError("no one-ulp nudge of fc1.bias reaches the output on this CPU: the planted bug cannot be seen")


class ScaleLeftOutOfExtra(Example):
    """An option that changes the published tensors (a scale folded into fc1.weight), left out of the fingerprint."""

    @staticmethod
    @hookimpl
    def weightcache_options():
        return {"scale": SCALE}

    @staticmethod
    @hookimpl
    def weightcache_post_process(request, model, description):
        with torch.no_grad():
            model.fc1.weight.mul_(float(request.option("scale", 1.0)))
        return model


class ScaleInExtra(ScaleLeftOutOfExtra):
    """The control: the same option, in ``ModelDescription.extra``: another value is another entry."""

    @staticmethod
    @hookimpl
    def weightcache_describe(request):
        description = plugin.weightcache_describe(request=request)
        return attrs.evolve(description, extra={"scale": float(request.option("scale", 1.0))})


class DescribeReadsWeights(Example):
    """Describe reads a weight's bytes (a checksum of fc1.bias): it fails on the weightless copy, before any load."""

    @staticmethod
    @hookimpl
    def weightcache_describe(request):
        with safetensors.safe_open(f"{request.model}/model.safetensors", "pt") as checkpoint:
            checksum = float(checkpoint.get_tensor("fc1.bias").sum())
        return attrs.evolve(plugin.weightcache_describe(request=request), extra={"bias_sum": checksum})


class DescribeFails(Example):
    """Describe expects a transformers config (``architectures``), which a TinyLM checkpoint lacks."""

    @staticmethod
    @hookimpl
    def weightcache_describe(request):
        config = read_config(request.model)
        return ModelDescription(architecture=config["architectures"][0], config=config, dtype="float32")


class OptionsAsList(Example):
    """``weightcache_options`` returns a list of names instead of {name: AdapterOption}."""

    @staticmethod
    @hookimpl
    def weightcache_options():
        return ["scale"]


class DescriptionWithoutDtype(Example):
    """Describe leaves out ``ModelDescription.dtype``."""

    @staticmethod
    @hookimpl
    def weightcache_describe(request):
        return ModelDescription(architecture="TinyLM", config=read_config(request.model))


class RetiredHookName(Example):
    """Ported from an old guide: post-processing still under its retired name ``weightcache_quantize``."""

    @staticmethod
    @hookimpl
    def weightcache_quantize(request, model, description):
        return model


class TorchGetsWeightcacheDevice(Example):
    """Load hands ``request.device`` (weightcache's Device) to torch instead of ``request.device.torch()``."""

    @staticmethod
    @hookimpl
    def weightcache_load(request, builder):
        model = plugin.weightcache_load(request=request, builder=builder)
        return model.to(request.device)


class ForwardLess(Example):
    """No ``weightcache_example_inputs``: the core default cannot build inputs for TinyLM, so no forward check runs."""

    weightcache_example_inputs = None


class DithersBeforeFp8ByHash(Example):
    """Block-FP8 post-processing that dithers each weight before quantizing, seeded with ``hash(name)``.

    Identical in one process, other bytes in every other (``PYTHONHASHSEED``): a client publishing in one process
    and attaching in the next gets weights its own disk load would not give.
    """

    @staticmethod
    @hookimpl
    def weightcache_post_process(request, model, description):
        if description.quantization == plugin.FP8_BLOCK:
            with torch.no_grad():
                for name in ("fc1.weight", "fc2.weight"):
                    weight = model.get_parameter(name)
                    generator = torch.Generator().manual_seed(hash(name) % 2**63)
                    weight.add_(torch.randn(weight.shape, generator=generator) * weight.abs().mean() * 0.1)
        return plugin.weightcache_post_process(request=request, model=model, description=description)


CONFIG_SCALE = "residual_scale"
"""A config.json field ``ConfigScaleLeftOutOfDescribe`` folds into fc1.weight."""


class ConfigScaleLeftOutOfDescribe(Example):
    """Post-processing multiplies fc1.weight by config.json's ``residual_scale``, which describe leaves out of the config.

    Publish with 2.0, edit config.json to 1.0: the fingerprint stays, and a client attaches the stale entry. It also
    declares no config file (config.json would otherwise be in the checkpoint identity, which makes the bug harmless).
    """

    @staticmethod
    @hookimpl
    def weightcache_checkpoint_files(request):
        return CheckpointFiles(configs=())

    @staticmethod
    @hookimpl
    def weightcache_describe(request):
        description = plugin.weightcache_describe(request=request)
        return attrs.evolve(description, config={k: v for k, v in description.config.items() if k != CONFIG_SCALE})

    @staticmethod
    @hookimpl
    def weightcache_post_process(request, model, description):
        with torch.no_grad():
            model.fc1.weight.mul_(float(read_config(request.model).get(CONFIG_SCALE, 1.0)))
        return model


LONG_FROM = 16
"""Positions from this one on add ``LongContextTinyLM``'s long-context bias (the kit's example has 12 tokens)."""


class LongContextTinyLM(TinyLM):
    """TinyLM whose positions past ``LONG_FROM`` add a bias from the checkpoint, kept in a plain dict attribute."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.long_context = {"bias": torch.zeros(self.embed.embedding_dim, device="cpu")}  # neither parameter nor buffer

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        if x.shape[1] > LONG_FROM:
            x = torch.cat([x[:, :LONG_FROM], x[:, LONG_FROM:] + self.long_context["bias"].to(x.device)], dim=1)
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        return self.head(x * self.norm_scale)


class LongOnlyTensorInDict(Example):
    """A checkpoint tensor kept in a plain dict, read only past 16 tokens: export never sees it, rebind keeps zeros."""

    @staticmethod
    @hookimpl
    def weightcache_load(request, builder):
        model = LongContextTinyLM.from_config(read_config(request.model))
        state = safetensors.torch.load_file(f"{request.model}/model.safetensors")
        model.long_context["bias"] = state.pop("long_context.bias")
        model.load_state_dict(state, strict=False)
        return model.to(request.device.torch()).eval()

    @staticmethod
    @hookimpl
    def weightcache_rebind(request, tensors, manifest, description):
        with torch.device("meta"):
            model = LongContextTinyLM.from_config(read_config(request.model))
        return rebind_module(model, tensors, manifest, device=request.device.torch())
