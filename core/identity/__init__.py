"""What a checkpoint is, before any weight is read: content digests, safetensors headers, hub ids, a load's fingerprint."""

from weightcache.core.old_paths import old_names

__getattr__ = old_names(__name__)  # the names 0.1.0's module weightcache.core.identity had, warning
