"""weightcache across nodes: seed an entry to another node's server, or receive one (``weightcache seed`` and
``weightcache fleet`` are the command-line forms; docs/operations.md)."""

from weightcache._faces import serve

NAMES, __getattr__, __dir__ = serve(__name__, __file__)
"""Each name of this module and the private module that holds it (listed in the stub beside this file)."""

__all__ = list(NAMES)
