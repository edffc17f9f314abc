"""A load's checks run once: ``check`` finds the adapter and checks the options and the method asked for; ``prepare`` of
a checked request only describes the model (and checks a method the checkpoint declares that nobody asked for).

Counted in an adapter's own hooks (the adapter guide's example, with counters), not in the core.
"""

from __future__ import annotations

import collections
import json

import pytest

from tests.helpers import EXAMPLE_SRC, past_the_racy_window
from weightcache import UnsupportedQuantization
from weightcache.adapter import AdapterOption, LoadRequest, hookimpl
from weightcache.core.flow import loader
from weightcache.engine import Plugins


@pytest.fixture
def counting(monkeypatch, tmp_path):
    """(plugins holding a counting copy of the example adapter, its call counter, a TinyLM checkpoint)."""
    monkeypatch.syspath_prepend(str(EXAMPLE_SRC))
    import weightcache_example
    from weightcache_example import plugin

    calls: collections.Counter = collections.Counter()

    class Counting:
        weightcache_load = staticmethod(plugin.weightcache_load)
        weightcache_rebind = staticmethod(plugin.weightcache_rebind)

        @staticmethod
        @hookimpl
        def weightcache_options():
            calls["options"] += 1
            return {"note": AdapterOption("free text, changes nothing", type=str, alternatives=("other",))}

        @staticmethod
        @hookimpl
        def weightcache_quantization_allowlist(request):
            calls["allowlist"] += 1
            return ()

        @staticmethod
        @hookimpl
        def weightcache_describe(request):
            calls["describe"] += 1
            return plugin.weightcache_describe(request=request)

    checkpoint = weightcache_example.save_checkpoint(tmp_path / "tinylm")
    return Plugins.from_modules({"counting": Counting}), calls, checkpoint


def test_prepare_of_a_checked_request_checks_nothing_again(counting):
    plugins, calls, checkpoint = counting
    checked = loader.check(LoadRequest(model=str(checkpoint), adapter="counting", options={"note": "hi"}), plugins)
    assert calls == {"options": 1, "allowlist": 1}
    prepared = loader.prepare(checked)
    assert calls == {"options": 1, "allowlist": 1, "describe": 1}
    assert prepared.request == checked.request and prepared.description.architecture == "TinyLM"


def test_prepare_of_a_plain_request_checks_it_first(counting):
    plugins, calls, checkpoint = counting
    prepared = loader.prepare(LoadRequest(model=str(checkpoint), adapter="counting"), plugins)
    assert calls == {"options": 1, "allowlist": 1, "describe": 1} and prepared.adapter.name == "counting"


def test_a_method_asked_for_is_refused_before_describe(counting):
    plugins, calls, checkpoint = counting
    with pytest.raises(UnsupportedQuantization, match="awq"):
        loader.check(LoadRequest(model=str(checkpoint), adapter="counting", quantization="awq"), plugins)
    assert calls["describe"] == 0


def test_a_method_the_checkpoint_declares_is_refused_after_describe(counting):
    """Nobody asked for GPTQ, the checkpoint declares it: the check of the described method still runs."""
    plugins, calls, checkpoint = counting
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    checked = loader.check(LoadRequest(model=str(checkpoint), adapter="counting"), plugins)
    with pytest.raises(UnsupportedQuantization, match="gptq"):
        loader.prepare(checked)
    assert calls == {"options": 1, "allowlist": 1, "describe": 1}


def test_a_tier_is_checked_once_when_made_and_publish_takes_it_as_it_is(counting):
    plugins, _, checkpoint = counting
    prepared = loader.prepare(LoadRequest(model=str(checkpoint), adapter="counting"), plugins)
    with pytest.raises(ValueError, match="--tier host needs a CUDA --device, not cpu"):
        loader.Tier("host", prepared.request.device)
    with pytest.raises(ValueError, match="unknown tier 'gpu'; expected one of device, host, both"):
        loader.Tier("gpu", prepared.request.device)
    with pytest.raises(ValueError, match="--tier both needs a CUDA --device"):  # a caller's string is checked the same way
        loader.publish(prepared, tier="both")
    tier = loader.Tier("device", prepared.request.device)
    assert (tier.on_device, tier.on_host) == (True, False)


def _counting_stats(monkeypatch) -> collections.Counter:
    """A count of the weight-file versions taken (``FileKey.of``: one stat each), by file name."""
    from weightcache.core.identity.digests import FileKey

    seen: collections.Counter = collections.Counter()
    real = FileKey.of.__func__  # type: ignore[attr-defined]

    def of(cls, path):
        seen[str(path).rsplit("/", 1)[-1]] += 1
        return real(cls, path)

    monkeypatch.setattr(FileKey, "of", classmethod(of))
    return seen


def test_a_cache_load_stats_each_weight_file_once(counting, monkeypatch):
    """What ``check_first_sight`` saw identifies the checkpoint: ``remembered`` and ``identify`` stat no declared file
    (weights and config.json) again."""
    plugins, _, checkpoint = counting
    request = LoadRequest(model=str(checkpoint), adapter="counting")
    past_the_racy_window(checkpoint)
    first = loader.prepare(request, plugins)
    first.check_first_sight()
    expected = first.identify()  # first sight: hashed, and remembered from now on
    seen = _counting_stats(monkeypatch)
    prepared = loader.prepare(request, plugins)
    prepared.check_first_sight()
    assert prepared.remembered() == expected and prepared.identify() == expected
    files = [*(path.name for path in checkpoint.glob("*.safetensors")), "config.json"]  # the declared files
    assert sorted(seen) == sorted(files) and set(seen.values()) == {1}, seen


def test_the_cli_passes_the_headers_it_read_so_nothing_is_stat_ed_again(counting, monkeypatch):
    from weightcache.core.identity.safetensors_io import check_checkpoint

    plugins, _, checkpoint = counting
    request = LoadRequest(model=str(checkpoint), adapter="counting")
    past_the_racy_window(checkpoint)
    expected = loader.prepare(request, plugins).identify()
    headers = check_checkpoint(checkpoint)
    seen = _counting_stats(monkeypatch)
    prepared = loader.prepare(request, plugins)
    prepared.check_first_sight(headers)
    # The headers are the weight files' versions; the declared config files (no header) are stat'ed once, here.
    assert prepared.remembered() == expected and seen == {"config.json": 1}, seen
