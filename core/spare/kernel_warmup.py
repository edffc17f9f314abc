"""One pass of a transformer forward's ops on small tensors: the first-call costs of torch's dispatcher and of the
device's kernels (lazily loaded CUDA modules, cuBLAS's handle and workspace) paid before a model's first forward."""

from __future__ import annotations

import typing

if typing.TYPE_CHECKING:
    import torch


def run_transformer_ops(
    device: "torch.device", dtypes: "typing.Sequence[torch.dtype]", heads: int, length: int, head_dim: int
) -> None:
    """Linear, SiLU, RMS norm, causal SDPA, softmax, argmax, embedding, cat, transpose and matmul once per dtype on
    ``device``, on tensors of ``heads`` × ``length`` × ``head_dim`` (no random numbers are drawn)."""
    import torch
    import torch.nn.functional as F

    width = heads * head_dim
    with torch.no_grad():
        for dtype in dtypes:
            x = torch.ones(1, heads, length, head_dim, dtype=dtype, device=device)
            w = torch.ones(2 * width, width, dtype=dtype, device=device)
            h = F.linear(x.transpose(1, 2).reshape(length, width), w)
            h = F.silu(h) * h
            h = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(dtype)
            F.scaled_dot_product_attention(x, x, x, is_causal=True)
            torch.softmax(h.float(), dim=-1).argmax(-1)
            F.embedding(torch.tensor([[0, 1]], device=device), w)
            torch.cat([x, x], dim=-1).transpose(1, 2).contiguous()
            torch.matmul(x, x.transpose(-1, -2))
