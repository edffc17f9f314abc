"""Copies between tiers and nodes are named backends behind one interface, chosen from one table (``BACKENDS``);
quantization methods are plugins of one registry; arena backends come from a table too.

Every backend the table names is reachable and is what its name says; an unknown name, or a backend of another kind,
is refused with one line that lists the known ones; and no module of the core picks a backend around the table.
tests/core/test_outside_plugins.py registers a method and a transport from an outside package.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.core.support import make_fingerprint
from weightcache.core.errors import UnsupportedQuantization
from weightcache.core.fingerprint import HOST_TIER
from weightcache.core.node import backends
from weightcache.core.node.backends import BACKENDS, REACHES, CopyBackend, TierCopy, backend_class
from weightcache.core.node.fill import Source
from weightcache.core.node.fleet.transport import Transport, transport
from weightcache.core.node.seeding import TorchDistributedLink
from weightcache.core.quantization import method as registry
from weightcache.core.quantization import methods
from weightcache.core.quantization.allowlist import check_quantization

CORE = Path(backends.__file__).parents[1]
KINDS = {"tiers": TierCopy, "nodes": Transport, "group": TorchDistributedLink}


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_the_table_names_is_reachable_and_is_what_its_name_says(name):
    found = backend_class(name, CopyBackend)
    assert found.name == name and found.reach in REACHES, (found, found.reach)
    assert backend_class(name, KINDS[found.reach]) is found


def test_an_unknown_backend_is_refused_with_the_known_ones():
    with pytest.raises(ValueError) as raised:
        transport("rdma", "agent")
    assert str(raised.value) == (
        "unknown copy backend 'rdma'; the Transport backends are nixl (BACKENDS in weightcache.core.node.backends)"
    )


def test_a_backend_of_another_kind_is_refused():
    with pytest.raises(ValueError, match=r"^'peer_gpu' is a tiers copy, not a Transport; the Transport backends are nixl "):
        backend_class("peer_gpu", Transport)
    with pytest.raises(ValueError, match="the TierCopy backends are host_tier, peer_gpu "):
        backend_class("nixl", TierCopy)


def test_each_source_of_the_node_names_a_tier_copy_of_the_table():
    fingerprint = make_fingerprint()
    for tier, expected in ((HOST_TIER, "host_tier"), ("GPU-8f3e2a1b-0000", "peer_gpu")):
        source = Source(fingerprint, tier, 1)
        assert source.backend == expected and issubclass(backend_class(source.backend, TierCopy), TierCopy)


def test_the_host_tier_can_fill_any_gpu():
    assert backend_class("host_tier", TierCopy)().unusable(HOST_TIER, 3) is None


def test_no_module_of_the_core_picks_a_backend_around_the_table():
    """A backend class is made only through ``backend_class`` (the table), never by its own name elsewhere."""
    classes = [where.partition(":")[2] for where in BACKENDS.values()]
    made = re.compile(rf"\b({'|'.join(classes)})\(")
    found = []
    for path in sorted(CORE.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if made.search(line) and not line.lstrip().startswith("class "):
                found.append(f"{path.relative_to(CORE)}:{number}: {line.strip()}")
    assert not found, "backends made around BACKENDS:\n" + "\n".join(found)
    assert not [p for p in CORE.rglob("*.py") if "TRANSPORTS" in p.read_text()], "a second table of transports"


@pytest.mark.parametrize("name", sorted(registry.BUILTIN))
def test_every_built_in_quantization_method_is_registered_under_its_name(name):
    found = registry.quantization_method(name)
    assert isinstance(found, registry.QuantizationMethod) and found.name == name
    assert type(found).__module__ == registry.BUILTIN[name].partition(":")[0]
    check_quantization(name)
    check_quantization(name.upper())


def test_no_quantization_method_is_registered_and_refused_at_once():
    assert not {name for method in methods.METHODS for name in (method.name, *method.aliases)} & set(registry.table())


def test_the_arena_backend_of_a_device_comes_from_the_tables():
    from weightcache.core import arena

    assert set(arena.BY_DEVICE_KIND.values()) <= set(arena.ARENA_BACKENDS)
    assert type(arena.backend_for_device("cpu")).__name__ == arena.ARENA_BACKENDS["host"].partition(":")[2]
    with pytest.raises(ValueError, match=r"^unknown arena backend 'rdma'; use 'host' or 'cuda'$"):
        arena.backend("rdma")


@pytest.mark.parametrize(
    ("asked", "reason"),
    [
        ("fp8-tensor", methods.PER_TENSOR_FP8),
        ("FP8_PER_TENSOR", methods.PER_TENSOR_FP8),
        ("awq", methods.method_named("awq").refused),
        ("int3-magic", methods.UNKNOWN),
    ],
)
def test_a_method_outside_the_table_or_refused_by_it_gives_its_reason(asked, reason):
    with pytest.raises(UnsupportedQuantization) as raised:
        check_quantization(asked)
    assert raised.value.reason == reason and raised.value.method == asked.lower()
