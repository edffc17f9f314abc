"""The kit's refit check (``weightcache.conformance.RefitTests``) on the hf adapter, and on a copy of it whose
post-processing is not re-run when a version comes from tensors: the check must fail that one."""

from __future__ import annotations

import pytest
import torch

from tests.conformance.test_hf_conformance import Fp8, HfFixtures
from weightcache.adapters.hf import hooks as hf
from weightcache.conformance import RefitTests
from weightcache.core.flow.plugins import Plugins
from weightcache.core.hookspecs import hookimpl


class TestLlamaRefit(HfFixtures, RefitTests):
    kind = "llama"


class TestLlamaFp8Refit(Fp8, TestLlamaRefit):
    pass


class TestGemmaRefit(HfFixtures, RefitTests):
    kind = "gemma"  # tied embeddings


class SkipsPostProcessOnRefit:
    """The hf adapter with a post-processing step of its own (gate_proj folded times two), which it skips on a model
    built from tensors: what an engine's adapter does when it forgets to re-run its weight processing on an update."""

    weightcache_options = staticmethod(hf.weightcache_options)
    weightcache_describe = staticmethod(hf.weightcache_describe)
    weightcache_load = staticmethod(hf.weightcache_load)
    weightcache_manifest_extra = staticmethod(hf.weightcache_manifest_extra)
    weightcache_rebind = staticmethod(hf.weightcache_rebind)

    @staticmethod
    @hookimpl
    def weightcache_load_tensors(request, tensors, builder):
        model = hf.weightcache_load_tensors(request=request, tensors=tensors, builder=builder)
        model.planted_from_tensors = True
        return model

    @staticmethod
    @hookimpl
    def weightcache_post_process(request, model, description):
        if getattr(model, "planted_from_tensors", False):
            return model
        with torch.no_grad():
            model.get_submodule("model.layers.0.mlp.gate_proj").weight.mul_(2)
        return model


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="the refit check must fail an adapter that skips post-processing")
class TestPostProcessingSkippedOnRefit(HfFixtures, RefitTests):
    @pytest.fixture(scope="class")
    @classmethod
    def adapter_name(cls):
        return "hf-skips-post-processing"

    @pytest.fixture(scope="class")
    @classmethod
    def plugins(cls):
        return Plugins.from_modules({"hf-skips-post-processing": SkipsPostProcessOnRefit})


class WithoutLoadTensors:
    """The hf adapter as written before refits: no ``weightcache_load_tensors``."""

    weightcache_options = staticmethod(hf.weightcache_options)
    weightcache_describe = staticmethod(hf.weightcache_describe)
    weightcache_load = staticmethod(hf.weightcache_load)
    weightcache_post_process = staticmethod(hf.weightcache_post_process)
    weightcache_rebind = staticmethod(hf.weightcache_rebind)


def test_the_refit_check_is_part_of_every_adapters_kit_and_knows_which_adapters_build_from_tensors():
    """``ConformanceTests`` runs it on every architecture; an adapter without the hook is skipped with that reason."""
    from weightcache.conformance import ArchitectureTests, ConformanceTests

    assert issubclass(ArchitectureTests, RefitTests) and issubclass(ConformanceTests, RefitTests)
    plugins = Plugins.from_modules({"hf-skips-post-processing": SkipsPostProcessOnRefit, "hf-before-refits": WithoutLoadTensors})
    assert plugins.adapter("hf-skips-post-processing").implements("weightcache_load_tensors")
    assert not plugins.adapter("hf-before-refits").implements("weightcache_load_tensors")
    assert not plugins.adapter("hf-before-refits").implements("weightcache_export")  # the core's default is not the adapter's
