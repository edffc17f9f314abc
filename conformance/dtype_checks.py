"""The kit's checks at every dtype the adapter accepts, not only the one its class runs at.

A flag post-processing sets in one dtype only (an upcast, a scale that bfloat16 needs) is invisible to a kit that
ran in float32: the class's own checks pass, and an engine in bfloat16 attaches a model its disk load would not
give. So the kit publishes, attaches and loads from disk again at float32 and at bfloat16 (each the class's dtype
is not), comparing tensors and outputs. A dtype the adapter refuses before reading a weight (describe raises, or
resolves another dtype) skips, saying so.
"""

from __future__ import annotations

import attrs
import pytest

from weightcache.conformance.assertions import assert_same_model
from weightcache.conformance.fixtures import adapter_facade, fresh, load, refused_quantization_skips

DTYPES = ("float32", "bfloat16")
"""The dtypes every adapter that accepts them is checked at."""


class DtypeTests:
    """Publish, attach and load from disk at each of ``DTYPES`` the class does not run at: the same tensors and outputs."""

    @pytest.mark.parametrize("other_dtype", DTYPES)
    def test_other_dtype_attaches_its_disk_load(
        self, other_dtype, load_request, plugins, weightcache_server, published, run_model
    ):
        from weightcache.core.flow.loader import prepare, publish

        dtype = other_dtype
        if published.fingerprint.dtype == dtype:
            pytest.skip(f"the class's own checks run at {dtype}")
        request = attrs.evolve(load_request, dtype=dtype)
        with refused_quantization_skips(request):
            try:
                prepared = prepare(fresh(request), plugins)
            except Exception as exc:  # refused before a weight is read: the adapter does not load this dtype
                pytest.skip(f"the adapter does not accept dtype {dtype} ({type(exc).__name__}: {exc})")
            if prepared.description.resolved_dtype() != dtype:
                pytest.skip(f"the adapter loads {prepared.description.resolved_dtype()} when asked for {dtype}")
            disk = load(request, "off", plugins)
        try:
            publish(prepared, weightcache_server.socket_dir)
            mapped = load(request, "client", plugins, weightcache_server.socket_dir, strict=True)
            try:
                inputs = adapter_facade(plugins, request.adapter).example_inputs(request, disk.model)
                assert_same_model(mapped.model, disk.model, run_model, inputs, f"at dtype {dtype}", label=dtype)
            finally:
                mapped.close()
        finally:
            disk.close()
