"""The weightcache server (no torch, no CUDA): entries and their fds, admission, budgets, handover, systemd, metrics,
and the one way a server process is started."""
