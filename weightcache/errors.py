"""Every error weightcache raises, each a subclass of ``WeightCacheError`` with a message that says what to do next.

The ones a caller of ``load_model`` catches are also names of ``weightcache`` itself."""

from weightcache._faces import serve

NAMES, __getattr__, __dir__ = serve(__name__, __file__)
"""Each name of this module and the private module that holds it (listed in the stub beside this file)."""

__all__ = list(NAMES)
