"""The engines' refit entries (``weightcache.adapters.engine_refit``, under vLLM's worker extension and SGLang's custom
weight loaders) on a model attached from a real server: a version a trainer published is fetched and checksummed
while the engine serves (``prefetch``), and the switch afterwards needs nothing but the swap."""

from __future__ import annotations

import pytest

from tests.core.test_refit import outputs, pointers, trained
from tests.helpers import assert_tensors_equal
from weightcache.adapters import engine_refit
from weightcache.core.errors import VersionNotFound
from weightcache.core.flow.loader import prepare, publish
from weightcache.core.flow.modes import load_model
from weightcache.core.refit import publish_version
from weightcache.core.request import LoadRequest


@pytest.fixture
def engine_and_trainer(server, model_dir):
    """An engine attached as a client to version 0, and version 1 published by a trainer; the fresh load of v1."""
    path = model_dir("llama")
    publish(prepare(LoadRequest(model=str(path))), server.socket_dir)
    engine = load_model(str(path), mode="client", socket_dir=server.socket_dir, strict=True)
    publish_version(str(path), trained(path, 1), 1, socket_dir=server.socket_dir)
    try:
        yield engine, path
    finally:
        engine.close()


def test_a_prefetched_version_is_checksummed_before_the_switch_which_needs_no_server(server, engine_and_trainer):
    """Everything but the swap happens in ``prefetch``: once it ended, the switch succeeds with the server gone (a
    switch that fetched then would fail to connect)."""
    engine, _ = engine_and_trainer
    was, before = outputs(engine.model), pointers(engine.model)
    assert engine_refit.prefetch(engine.model, 1) == 0  # returns at once, still on version 0
    _version, fetch = getattr(engine.model, engine_refit.PREFETCH_ATTR)
    pending = fetch.result(timeout=120)  # mapped and checksummed (fetch_version) in its own thread
    assert pending is not None and pending.version == 1
    assert_tensors_equal("logits while the version is fetched", outputs(engine.model), was)
    server.kill()
    assert engine_refit.update_weights(engine.model, None, 1) == 1
    assert pointers(engine.model) == before, "a tensor moved"
    assert not hasattr(engine.model, engine_refit.PREFETCH_ATTR)
    assert not bool((outputs(engine.model) == was).all()), "version 1 computes other logits than version 0"


def test_a_switch_to_another_version_than_the_prefetched_one_fetches_it_and_drops_the_prefetch(engine_and_trainer):
    engine, _ = engine_and_trainer
    engine_refit.prefetch(engine.model, 1)
    with pytest.raises(VersionNotFound):
        engine_refit.update_weights(engine.model, None, 7)
    assert not hasattr(engine.model, engine_refit.PREFETCH_ATTR)
    assert engine_refit.update_weights(engine.model, None, 1) == 1  # fetched again, as without a prefetch


def test_a_prefetch_that_fails_is_reported_by_the_switch_and_the_model_stays_on_its_version(engine_and_trainer):
    engine, _ = engine_and_trainer
    was = outputs(engine.model)
    engine_refit.prefetch(engine.model, 5)  # no such version: the thread's error waits for the switch
    with pytest.raises(VersionNotFound):
        engine_refit.update_weights(engine.model, None, 5)
    assert engine_refit.attachment_of(engine.model).version == 0
    assert_tensors_equal("logits after a failed switch", outputs(engine.model), was)
