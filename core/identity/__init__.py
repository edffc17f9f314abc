"""What a checkpoint is, before any weight is read: content digests, safetensors headers, hub ids, a load's fingerprint."""
