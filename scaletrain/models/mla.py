"""Multi-head latent attention (MLA; DeepSeek-V2, DeepSeek-AI 2024, and V3): queries and keys/values come from
low-rank latents, and each head's query and key have a part without position (qk_nope_head_dim) and a part that
carries RoPE (qk_rope_head_dim), the latter one key shared by all heads. A decoding cache holds only the kv latent
and the shared rotary key per token: kv_lora_rank + qk_rope_head_dim numbers, against 2 x heads x head_dim for
multi-head attention.

Plain PyTorch like llama.py; llama.py builds it (with its RMSNorms) in place of `Attention` when
model.kv_lora_rank > 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models.attention import AttentionKernel

if TYPE_CHECKING:
    from scaletrain.models.kv_cache import LayerCache

# The eps of the latents' RMSNorms: DeepSeek's reference code and transformers' DeepseekV3Attention build them with
# the RMSNorm default, 1e-6, whatever rms_norm_eps the blocks' norms use.
LATENT_NORM_EPS = 1e-6


class ModelArgs(Protocol):
    """The fields of llama.ModelArgs this module reads (a protocol: llama imports this module, not the reverse)."""

    dim: int
    n_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention: str


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ... as DeepSeek's weights are laid out (transformers'
    rope_interleave). x: [batch, seq, heads, d]; cos/sin: [seq, d] or [batch, seq, d] in llama.rope_cache's
    cat(angles, angles) layout (the first half holds pair i's angle). The result is de-interleaved (all first
    elements, then all second ones): queries and keys get the same permutation, so their dot products are those of
    the interleaved rotation."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(-2), sin[..., :half].unsqueeze(-2)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class MLA(nn.Module):
    """MLA with the naming of torchtitan's DeepSeek-V3: wq (or wq_a, q_norm, wq_b when q_lora_rank > 0), wkv_a
    (the kv latent and the shared rotary key), kv_norm, wkv_b (latent to each head's nope key and value), wo."""

    def __init__(self, args: ModelArgs, q_norm: nn.Module | None, kv_norm: nn.Module, window: int = 0):
        """window: as llama.Attention's. q_norm: RMSNorm(q_lora_rank) when q_lora_rank > 0, else None; kv_norm: RMSNorm(kv_lora_rank) (llama.py
        builds them, as it builds the MoE's shared experts)."""
        super().__init__()
        self.window = window
        self.nope, self.rope = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = args.v_head_dim, args.kv_lora_rank
        qk_head = self.nope + self.rope
        if args.q_lora_rank > 0:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = q_norm
            self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * qk_head, bias=False)
        else:
            self.wq = nn.Linear(args.dim, args.n_heads * qk_head, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = kv_norm
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (self.nope + self.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_head_dim, args.dim, bias=False)
        # SDPA's default scale, 1/sqrt(nope + rope), is MLA's (without YaRN's mscale, which import refuses).
        self.sdpa = AttentionKernel(args.attention)
        # Decoding steps after the prompt attend in the latent space (`_absorbed`); False: keys and values expanded.
        self.absorb = True

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        masks: dict | None = None,
        kv: LayerCache | None = None,
    ) -> torch.Tensor:
        """As llama.Attention.forward; cos/sin are of qk_rope_head_dim. kv caches the latent and the rotary key."""
        bsz, seqlen, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        # Head counts from the tensors (-1), as llama.Attention.
        q_nope, q_rope = q.view(bsz, seqlen, -1, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_norm(latent)
        q_rope = apply_rope_interleaved(q_rope, cos, sin)
        k_rope = apply_rope_interleaved(
            k_rope.unsqueeze(2), cos, sin
        )  # [b, s, 1, rope]: one key for all heads
        if kv is not None:
            decoding = kv.owner.pos > 0
            # Cached as one "head": [b, 1, len, kv_lora_rank] and [b, 1, len, rope], expanded per head below.
            latent, k_rope = kv.update(latent.unsqueeze(1), k_rope.transpose(1, 2))
            latent, k_rope = latent.squeeze(1), k_rope.transpose(1, 2)
            if decoding and self.absorb:
                return self._absorbed(q_nope, q_rope, latent, k_rope, masks)
        keys = latent.shape[1]
        k_nope, v = (
            self.wkv_b(latent)
            .view(bsz, keys, -1, self.nope + self.v_head_dim)
            .split([self.nope, self.v_head_dim], dim=-1)
        )
        heads = k_nope.shape[2]
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, heads, -1)], dim=-1).transpose(1, 2)
        v = v.transpose(1, 2)
        mask = masks[self.window] if masks is not None else None
        out = self.sdpa(q, k, v) if mask is None else self.sdpa(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def _absorbed(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, masks
    ) -> torch.Tensor:
        """Attention with wkv_b absorbed (DeepSeek-V2, section 2.1.3): q_nope . (W_UK c) = (W_UK^T q_nope) . c, and
        the values' W_UV applied once to the attended latent, so a step reads the cache's latents as they are
        instead of expanding every cached position to each head's key and value. q_*: [b, s, heads, ·] of the new
        positions; latent [b, len, r] and k_rope [b, len, 1, rope] of every position so far."""
        bsz, seqlen = q_nope.shape[:2]
        w = self.wkv_b.weight.view(-1, self.nope + self.v_head_dim, self.kv_lora_rank)  # [heads, nope + v, r]
        w_uk, w_uv = w.split([self.nope, self.v_head_dim], dim=1)
        q = torch.cat([torch.einsum("bshn,hnr->bshr", q_nope, w_uk), q_rope], dim=-1).transpose(1, 2)
        k = torch.cat([latent, k_rope.squeeze(2)], dim=-1).unsqueeze(1)  # one key "head" shared by all
        mask = masks[self.window] if masks is not None else None
        scale = (self.nope + self.rope) ** -0.5  # the scale of the expanded form, not of the latent's width
        out = F.scaled_dot_product_attention(
            q, k, latent.unsqueeze(1), attn_mask=mask, scale=scale, enable_gqa=True
        )
        out = torch.einsum("bhsr,hvr->bshv", out, w_uv)
        return self.wo(out.reshape(bsz, seqlen, -1))


def mla_init_names(args: ModelArgs) -> tuple[list[str], list[str]]:
    """(weights drawn with the init std, RMSNorm weights set to one) of one block's MLA, by name under the block,
    in RNG order; `attention.wo` is drawn with the depth-scaled std as in every block (llama.Transformer.init_plan)."""
    q = ["attention.wq_a", "attention.wq_b"] if args.q_lora_rank > 0 else ["attention.wq"]
    norms = ["attention.q_norm.weight"] if args.q_lora_rank > 0 else []
    return [*q, "attention.wkv_a", "attention.wkv_b"], [*norms, "attention.kv_norm.weight"]


def mla_kv_cache_bytes(args: ModelArgs, n_layers: int, tokens: int, elt: int) -> int:
    """Bytes MLA's decoding cache holds for `tokens` positions: the latent and the rotary key, per layer."""
    return n_layers * tokens * (args.kv_lora_rank + args.qk_rope_head_dim) * elt
