"""The weightcache server (no torch, no CUDA): entries and their fds, admission, budgets, handover, systemd, metrics,
and the one way a server process is started."""

from weightcache.core.old_paths import old_names

__getattr__ = old_names(__name__)  # the names 0.1.0's module weightcache.core.server had, warning
