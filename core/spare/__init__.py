"""Engines that start before they are needed: the warm spare (``weightcache standby``), CUDA set-up that overlaps
imports, compile artifacts kept beside the weights."""
