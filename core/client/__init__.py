"""The engine's side of the socket: requests, an attached entry and its mapped arenas, re-publishing to a new server."""

from weightcache.core.old_paths import old_names

__getattr__ = old_names(__name__)  # the names 0.1.0's module weightcache.core.client had, warning
