"""The one flow every adapter runs: the installed adapters and the core's default hooks, preparing and publishing a
load, the mode runner (``load_model``, ``run``) and the API for engine forks."""
