"""weightcache for adapter authors: the hook marker, the values hooks take and return, and the helpers hooks use.

An adapter is a pluggy plugin registered in the ``weightcache.adapters`` entry-point group (docs/adapter-guide.md):
``from weightcache.adapter import hookimpl, ModelDescription``. The conformance kit that proves an adapter right is
``weightcache.conformance``. Each name loads its module on first use."""

from weightcache._faces import serve

NAMES, __getattr__, __dir__ = serve(__name__, __file__)
"""Each name of this module and the private module that holds it (listed in the stub beside this file)."""

__all__ = list(NAMES)
