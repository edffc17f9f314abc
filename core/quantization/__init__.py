"""Quantization methods whose whole effect lives in tensors, so their results can be cached raw."""
