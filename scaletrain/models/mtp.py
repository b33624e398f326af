"""Multi-token prediction (DeepSeek-V3, DeepSeek-AI 2024, section 2.2; model.mtp_depth 1): one more transformer
block that, at position i, combines the main model's hidden state with the embedding of token i+1 and predicts
token i+2 through the shared output head. Its cross-entropy, weighted by model.mtp_loss_coef, is added to the
training loss (a denser signal per sequence); evaluation and generation never run it.

Plain PyTorch; llama.py builds it (its norms and block) and calls `mtp_loss` inside the forward that computes the
loss, so FSDP's root unit has the shared embedding and output gathered around it.
"""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.models.loss import output_loss


class MTP(nn.Module):
    """DeepSeek-V3's MTP module: h' = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)]), then a block, then a final norm
    (the names and the concatenation order of DeepSeek's checkpoint: embedding first)."""

    def __init__(self, dim: int, enorm: nn.Module, hnorm: nn.Module, block: nn.Module, norm: nn.Module):
        super().__init__()
        self.enorm, self.hnorm = enorm, hnorm
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = norm

    def forward(self, h: torch.Tensor, next_emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        x = self.eh_proj(torch.cat([self.enorm(next_emb), self.hnorm(h)], dim=-1))
        return self.norm(self.block(x, cos, sin))


def mtp_loss(
    mtp: MTP,
    h: torch.Tensor,
    targets: torch.Tensor,
    embed: nn.Module,
    output: nn.Module,
    cos: torch.Tensor,
    sin: torch.Tensor,
    coef: float,
    mode: str = "chunked",
) -> torch.Tensor:
    """coef x the MTP cross-entropy, summed over its seq - 1 positions and scaled by seq / (seq - 1), so that the
    step's mean over batch x seq tokens (loss.token_mean) adds coef x the MTP module's mean loss. h: the main
    model's last hidden states before its final norm, [batch, seq, dim]; targets: [batch, seq] (token i+1 at i);
    mode: model.loss, as the main loss."""
    seq = targets.shape[1]
    if seq < 2:
        return h.new_zeros((), dtype=torch.float32)
    cut = (
        ...,
        slice(0, seq - 1),
        slice(None),
    )  # positions 0..seq-2, whether cos is [seq, d] or [batch, seq, d]
    x = mtp(h[:, :-1], embed(targets[:, :-1]), cos[cut], sin[cut])
    return output_loss(output, x, targets[:, 1:], mode) * (coef * seq / (seq - 1))
