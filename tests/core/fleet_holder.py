"""A node that lists itself as a holder of a content, for the fleet tests: a liar (other bytes) or a node about to die.

    python -m tests.core.fleet_holder SPEC.json

SPEC: ``etcd``, ``node``, ``secret``, ``fingerprint`` (JSON), ``manifest`` (the manifest's canonical JSON text it
serves), ``arenas`` (one file per arena whose bytes it serves, or ``null`` for random bytes of ``sizes[i]``),
``sizes``, ``content`` (a content record to declare first, or ``null``) and ``relay`` (optional: list a relay record
that says every arena is checked, instead of a holding; ``"landing"``: one that has checked none and lists all of
arena 0 as landed). It registers the manifest and the arenas with the real NIXL
transport, writes its record under a lease it renews, prints ``ready`` and waits to be killed.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import sys
import time

from weightcache.core.fingerprint import Fingerprint
from weightcache.core.node.fleet.config import FleetConfig
from weightcache.core.node.fleet.nixl import NixlTransport
from weightcache.core.node.fleet.records import Content, Holding, Landing, Relay, manifest_sha256
from weightcache.core.node.fleet.registry import FleetRegistry
from weightcache.core.node.fleet.transport import Region


def main(path: str) -> None:
    spec = json.loads(open(path).read())
    devices = os.environ.get("WEIGHTCACHE_FLEET_DEVICES", "lo")
    config = FleetConfig((spec["etcd"],), spec["secret"].encode(), spec["node"], deadline_s=2.0, devices=devices)
    registry = FleetRegistry(config)
    link = NixlTransport(f"{spec['node']}-{os.getpid()}", config.devices)
    data = spec["manifest"].encode()
    manifest_buffer = ctypes.create_string_buffer(data, len(data))
    maps, regions = [], []
    for file, size in zip(spec["arenas"], spec["sizes"], strict=True):
        block = mmap.mmap(-1, size)
        block.write(open(file, "rb").read() if file else os.urandom(size))
        maps.append(block)
        regions.append(Region(ctypes.addressof(ctypes.c_char.from_buffer(block)), size))
    manifest_region = Region(ctypes.addressof(manifest_buffer), len(data))
    reach = link.share([manifest_region, *regions])
    lease = registry.store.grant(30)
    fingerprint = Fingerprint.from_json(spec["fingerprint"])
    if spec.get("content"):
        registry.declare(Content.from_json(spec["content"]), lease)
    if spec.get("relay") == "landing":
        landing = Landing(0, regions[0].length, regions[0])
        registry.relay(Relay(spec["node"], fingerprint, link.name, reach, manifest_region, (), landing), lease)
    elif spec.get("relay"):
        registry.relay(Relay(spec["node"], fingerprint, link.name, reach, manifest_region, tuple(regions)), lease)
    else:
        holding = Holding(spec["node"], fingerprint, manifest_sha256(data), link.name, reach, manifest_region, tuple(regions))
        registry.hold(holding, lease)
    print("ready", flush=True)
    while True:
        time.sleep(5)
        registry.store.keepalive(lease)


if __name__ == "__main__":
    main(sys.argv[1])
