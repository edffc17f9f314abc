"""weightcache for engine forks and integrations: fingerprint, publish, attach and rebind a model your engine owns;
run the load flow from an engine's own loader; keep a warm spare and compiled artifacts beside the weights.

docs/api.md and docs/engines.md show each call. Each name loads its module on first use."""

from weightcache._faces import serve

NAMES, __getattr__, __dir__ = serve(__name__, __file__)
"""Each name of this module and the private module that holds it (listed in the stub beside this file)."""

__all__ = list(NAMES)
