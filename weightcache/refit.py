"""weightcache's live refit: a trainer publishes a new version of a served model from its tensors; engines that
attached it switch in place (``LoadedModel.refit``). docs/refit.md says how, what is guaranteed and what it costs."""

from weightcache._faces import serve

NAMES, __getattr__, __dir__ = serve(__name__, __file__)
"""Each name of this module and the private module that holds it (listed in the stub beside this file)."""

__all__ = list(NAMES)
