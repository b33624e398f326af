"""Attention kernels behind one call: `fn(q, k, v) -> out` on [batch, heads, seq, head_dim] tensors.

Attention modules hold such a callable as a plain attribute, so that a parallelism (e.g. ring attention for
context parallel) can swap the kernel without the model knowing about it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention through PyTorch's SDPA (flash / memory-efficient kernels where the device has them).
    Grouped-query attention: k and v may have fewer heads than q."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
