"""Adapters through entry points and in-process registration: discovery, blocking, broken adapters, checked hooks, options."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest

from weightcache.core.errors import AdapterNotFound, InvalidAdapter, UnknownOption
from weightcache.core.flow.plugins import Plugins
from weightcache.core.hookspecs import hookimpl
from weightcache.core.request import LoadRequest


def _adapter_module(name: str = "mine", **hooks) -> types.ModuleType:
    """A module with marked hook functions ``hooks`` (the three required ones by default)."""
    module = types.ModuleType(name)

    @hookimpl
    def weightcache_describe(request):
        raise AssertionError("not called in these tests")

    @hookimpl
    def weightcache_load(request, builder):
        raise AssertionError("not called in these tests")

    @hookimpl
    def weightcache_rebind(request, tensors, manifest):
        raise AssertionError("not called in these tests")

    defaults = {
        "weightcache_describe": weightcache_describe,
        "weightcache_load": weightcache_load,
        "weightcache_rebind": weightcache_rebind,
    }
    for hook, function in {**defaults, **hooks}.items():
        if function is not None:
            setattr(module, hook, function)
    return module


def test_the_built_in_adapters_register_through_the_entry_point_group():
    assert "hf" in Plugins.installed().names()


def test_an_environment_variable_blocks_adapters_by_name(monkeypatch):
    monkeypatch.setenv("WEIGHTCACHE_BLOCK_ADAPTERS", "hf, other")
    plugins = Plugins.installed()
    assert "hf" not in plugins.names()
    with pytest.raises(AdapterNotFound, match="blocked by \\$WEIGHTCACHE_BLOCK_ADAPTERS"):
        plugins.adapter("hf")


def test_an_unknown_adapter_names_the_usable_ones():
    with pytest.raises(AdapterNotFound, match=r"no weightcache adapter named 'nope'.*Usable adapters: .*hf"):
        Plugins.installed().adapter("nope")


def test_a_misspelt_hook_is_refused_at_registration_with_a_suggestion():
    @hookimpl
    def weightcache_rebnd(request, tensors, manifest):
        return None

    with pytest.raises(
        InvalidAdapter, match="weightcache_rebnd is not a weightcache hook \\(did you mean weightcache_rebind\\?\\)"
    ):
        Plugins.from_modules({"mine": _adapter_module(weightcache_rebnd=weightcache_rebnd)})


def test_a_missing_required_hook_is_refused_before_anything_is_published():
    with pytest.raises(InvalidAdapter, match="the required hook weightcache_rebind is missing"):
        Plugins.from_modules({"mine": _adapter_module(weightcache_rebind=None)})


def test_a_hook_without_the_marker_is_refused():
    def weightcache_post_process(request, model, description):
        return model

    with pytest.raises(InvalidAdapter, match="weightcache_post_process lacks the @hookimpl marker"):
        Plugins.from_modules({"mine": _adapter_module(weightcache_post_process=weightcache_post_process)})


def test_a_hook_with_an_argument_its_spec_lacks_is_refused():
    @hookimpl
    def weightcache_load(request, builder, flavour):
        return None

    with pytest.raises(InvalidAdapter, match="flavour"):
        Plugins.from_modules({"mine": _adapter_module(weightcache_load=weightcache_load)})


def test_unknown_options_are_refused_with_the_ones_the_adapter_takes():
    adapter = Plugins.installed().adapter("hf")
    adapter.check_options(LoadRequest(model="/x", options={"model_class": "AutoModel"}))
    with pytest.raises(UnknownOption, match=r"takes no option 'attn_implementation'.*model_class"):
        adapter.check_options(LoadRequest(model="/x", options={"attn_implementation": "eager"}))


BROKEN_PACKAGE = {
    "broken_adapter/__init__.py": "raise ImportError('a dependency of broken_adapter is missing')\n",
    "misspelt_adapter/__init__.py": textwrap.dedent("""
        from weightcache.core.hookspecs import hookimpl

        @hookimpl
        def weightcache_describe(request): ...

        @hookimpl
        def weightcache_lod(request, builder): ...

        @hookimpl
        def weightcache_rebind(request, tensors, manifest): ...
    """),
    "broken_dist-0.0.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: broken-dist\nVersion: 0.0.0\n",
    "broken_dist-0.0.0.dist-info/entry_points.txt": (
        "[weightcache.adapters]\nbroken = broken_adapter\nmisspelt = misspelt_adapter\n"
    ),
}


def test_a_broken_installed_adapter_is_reported_by_name_and_the_others_keep_working(tmp_path):
    """Two installed adapters, one failing to import and one with a misspelt hook: hf still loads; each names its defect."""
    for relative, text in BROKEN_PACKAGE.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    code = textwrap.dedent("""
        import logging, sys
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
        from weightcache.core.flow.plugins import Plugins
        from weightcache.core.errors import AdapterNotFound
        plugins = Plugins.installed()
        print("names", plugins.names())
        plugins.adapter("hf")
        for name in ("broken", "misspelt"):
            try:
                plugins.adapter(name)
            except AdapterNotFound as exc:
                print("refused", exc)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "hf" in out.split("names", 1)[1].splitlines()[0]
    assert "adapter 'broken' is broken and was skipped" in out and "a dependency of broken_adapter is missing" in out
    assert "WEIGHTCACHE_BLOCK_ADAPTERS=broken" in out
    assert "weightcache_lod is not a weightcache hook (did you mean weightcache_load?)" in out
    assert "refused no weightcache adapter named 'broken': it is installed but broken" in out
    assert "refused no weightcache adapter named 'misspelt': it is installed but broken" in out


def test_a_retired_hook_name_is_refused_with_its_successor():
    @hookimpl
    def weightcache_quantize(request, model, description):
        return model

    with pytest.raises(InvalidAdapter, match="weightcache_quantize was retired: rename it to weightcache_post_process"):
        Plugins.from_modules({"old": _adapter_module(weightcache_quantize=weightcache_quantize)})


def test_hook_results_are_checked_at_the_boundary_naming_adapter_and_hook(tmp_path):
    from weightcache.core.request import ModelDescription

    @hookimpl
    def weightcache_options():
        return ["scale"]

    @hookimpl
    def weightcache_describe(request):
        return ModelDescription(architecture="X", config={})

    adapter = Plugins.from_modules(
        {"odd": _adapter_module(weightcache_options=weightcache_options, weightcache_describe=weightcache_describe)}
    ).adapter("odd")
    with pytest.raises(InvalidAdapter, match=r"^weightcache_options of adapter 'odd' does not fit .*returned a list") as info:
        adapter.options()
    assert info.value.hook == "weightcache_options"
    with pytest.raises(InvalidAdapter, match=r"^weightcache_describe of adapter 'odd' .*has no dtype; set dtype="):
        adapter.describe(LoadRequest(model=str(tmp_path)))


def test_an_option_value_its_declaration_does_not_allow_is_refused(tmp_path):
    from weightcache.core.errors import InvalidOption
    from weightcache.core.options import AdapterOption

    @hookimpl
    def weightcache_options():
        return {"scale": AdapterOption("a scale", type=float)}

    adapter = Plugins.from_modules({"typed": _adapter_module(weightcache_options=weightcache_options)}).adapter("typed")
    adapter.check_options(LoadRequest(model=str(tmp_path), options={"scale": 2}))
    with pytest.raises(InvalidOption, match=r"adapter 'typed' option 'scale' = 'big': expected a float, got str"):
        adapter.check_options(LoadRequest(model=str(tmp_path), options={"scale": "big"}))
