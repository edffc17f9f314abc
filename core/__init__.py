"""weightcache core: the foundation (hook specs, requests, fingerprints, devices, errors) at the top, and one folder per
layer above it: arena, quantization, layout, wire, identity, client, server, load, node, flow, cli, spare
(docs/architecture.md draws them; tests/test_layers.py holds their order).

Importing this package loads nothing heavy; torch is imported by the modules that need it.
"""

__version__ = "0.2.0"
PROTOCOL_VERSION = 2
