"""The token cross-entropy: the one definition the training step, the pipeline's last stage and evaluation use."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Token-level cross-entropy in fp32 (bf16 logits lose too much in the log-sum-exp)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction=reduction)
