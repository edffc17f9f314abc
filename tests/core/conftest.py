"""The fleet's fixtures, for the fleet's test modules (test_fleet.py and its neighbours): etcd with its network, and a
factory of nodes on it; each test kills every process it started and removes every namespace and veth."""

from __future__ import annotations

import pytest

from tests.core.fleet_support import Fleet, Node


@pytest.fixture
def network_fleet():
    """The fleet (etcd and its network) and its nodes; every process is killed and every namespace removed at the end."""
    fleet = Fleet.open()
    nodes: list[Node] = []

    def node(name: str, share: bool = True) -> Node:
        started = fleet.node(name)
        nodes.append(started)
        if share:
            started.share()
        return started

    try:
        yield fleet, node
    finally:
        try:
            for started in nodes:
                started.close()
        finally:
            fleet.close()


@pytest.fixture
def fleet(network_fleet):
    """etcd, and a factory of nodes on it."""
    yielded, node = network_fleet
    return yielded.etcd, node
