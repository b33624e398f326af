"""Llama-family decoder in plain PyTorch: RMSNorm, RoPE, grouped-query attention via SDPA, SwiGLU.

No parallelism lives here. The model is built on the meta device and materialised with `init_weights()`, so that
parallel wrappers can shard it before any memory is allocated. Stages of a pipeline may drop the embedding, the
final norm and the output (they are then `None`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models.attention import (
    AttentionKernel,
    attention_masks,
    document_positions,
    max_logits,
    sink_attention,
)
from scaletrain.models.init import trunc_normal
from scaletrain.models.loss import output_loss
from scaletrain.models.mla import LATENT_NORM_EPS, MLA, mla_init_names
from scaletrain.models.moe import MoE, compile_disabled, is_moe_layer, moe_init_plan
from scaletrain.models.mtp import MTP, mtp_loss

if TYPE_CHECKING:
    from scaletrain.models.kv_cache import KVCache, LayerCache


@dataclass
class ModelArgs:
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 352
    vocab_size: int = 320
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: str = "none"
    rope_scaling_factor: float = 8.0
    rope_original_max_len: int = 8192
    rope_yarn_truncate: bool = True  # YaRN: round its correction range to whole dims (GPT-OSS: false)
    max_seq_len: int = 256
    tie_embeddings: bool = False
    init_std: float = 0.02
    attention: str = "auto"  # models.attention.AttentionBackend
    loss: str = "chunked"  # model.loss: "chunked", "whole" or "whole_compiled" (models/loss.output_loss)
    window: int = 0  # sliding-window attention: query i sees keys i - window < j <= i; 0 = off
    window_every: int = 1  # the window on layers 0, k, 2k, ... (1: every layer)
    # Mixture of experts (models/moe.py, docs/moe.md); n_experts 0 is the dense model.
    n_experts: int = 0
    top_k: int = 2
    moe_hidden: int = 0  # each expert's SwiGLU hidden size; 0: ffn_hidden
    shared_experts: int = 0  # DeepSeek-MoE's always-on experts, as one SwiGLU of moe_hidden x shared_experts
    router: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    norm_topk: bool = True
    moe_every: int = 1  # MoE on blocks k-1, 2k-1, ...
    first_dense: int = 0  # the first blocks stay dense
    capacity_factor: float = 0.0  # 0: dropless
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    n_group: int = 1  # DeepSeek-V3's group-limited routing: experts in n_group groups, ...
    topk_group: int = 1  # ... each token's top_k taken from its topk_group best groups
    route_scale: float = 1.0  # the routed weights' multiplier (DeepSeek-V3's routed_scaling_factor)
    # Model families (docs/models.md). `family` only names the Hugging Face adapter a checkpoint converts with
    # (checkpoint/hf/families.py) and the preset group; the computation is chosen by the feature switches below.
    family: str = "llama"
    head_size: int = 0  # channels per attention head; 0: dim // n_heads (Qwen3 and GPT-OSS set it apart)
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3)
    attention_bias: bool = False  # biases on q, k, v and the output projection (GPT-OSS)
    attention_sinks: bool = False  # a learned logit per head in every softmax's denominator (GPT-OSS)
    moe_bias: bool = False  # biases on the router and the experts' projections (GPT-OSS)
    swiglu_limit: float = 0.0  # > 0: GPT-OSS's clamped SwiGLU in the experts (moe._gpt_oss_loop)

    # Multi-head latent attention (DeepSeek-V2/V3, models/mla.py) in place of grouped-query attention when
    # kv_lora_rank > 0 (n_kv_heads and head_size are then unused).
    q_lora_rank: int = 0  # 0: queries projected straight from the hidden state
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Multi-token prediction (DeepSeek-V3, models/mtp.py): 1 adds its module and its loss, weighted by mtp_loss_coef.
    mtp_depth: int = 0
    mtp_loss_coef: float = 0.3  # DeepSeek-V3's lambda for its first 10T tokens (0.1 after)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """The channels RoPE rotates in each query and key: MLA's rotary part, else the whole head."""
        return self.qk_rope_head_dim if self.mla else self.head_dim


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the compute dtype: the mean of squares loses precision in bf16.
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies of RoPE (Su et al. 2021), optionally rescaled for long context as in Llama 3.1."""
    half = args.rope_dim // 2
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, half, dtype=torch.float64) / half))
    if args.rope_scaling == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        low_freq_factor, high_freq_factor = 1.0, 4.0
        old_len = args.rope_original_max_len
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_len / low_freq_factor, old_len / high_freq_factor
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * inv_freq / args.rope_scaling_factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > low_wavelen, inv_freq / args.rope_scaling_factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(mid, blended, inv_freq)
    if args.rope_scaling == "yarn":
        inv_freq = _yarn(args, inv_freq)
    return inv_freq.float()


# YaRN's ramp bounds (Peng et al. 2023): dims rotating more than 32 times over the original context keep their
# frequency, dims rotating less than once are interpolated by `factor`, linearly in between.
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


def _yarn(args: ModelArgs, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN's frequencies (GPT-OSS, DeepSeek-V3; as transformers' _compute_yarn_parameters)."""
    dim, old_len = args.rope_dim, args.rope_original_max_len

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(args.rope_theta))

    low, high = correction_dim(YARN_BETA_FAST), correction_dim(YARN_BETA_SLOW)
    if args.rope_yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
    return inv_freq / args.rope_scaling_factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(args: ModelArgs) -> float:
    """YaRN's scale of cos and sin, 0.1 ln(factor) + 1 (its mscale); 1 for every other RoPE."""
    factor = args.rope_scaling_factor
    return 0.1 * math.log(factor) + 1.0 if args.rope_scaling == "yarn" and factor > 1 else 1.0


def rope_cache(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """cos and sin for every position, shape [max_seq_len, 2, rope_dim] (the rotate-half layout of HF Llama)."""
    inv_freq = rope_frequencies(args).to(device)
    pos = torch.arange(args.max_seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(pos, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    scale = rope_attention_factor(args)
    return torch.stack([angles.cos() * scale, angles.sin() * scale], dim=1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim]; cos/sin: [seq, head_dim] or [batch, seq, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)).type_as(x)


def layer_window(args: ModelArgs, layer_id: int) -> int:
    """The sliding window of layer `layer_id`: model.window on layers 0, k, 2k, ... for k = window_every (so
    k = 2 alternates local and global layers, as Gemma 2 and GPT-3's banded layers), else 0 (full causal)."""
    return args.window if args.window > 0 and layer_id % max(args.window_every, 1) == 0 else 0


class HeadSinks(nn.Module):
    """One learned logit per attention head, added to the denominator of its softmax (GPT-OSS; Xiao et al. 2023's
    attention sink as a parameter): a head may attend to nothing."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_heads))

    def local(self) -> torch.Tensor:
        """This rank's heads' sinks (tensor parallel shards them by head, as the heads)."""
        w = self.weight
        return w.to_local() if hasattr(w, "to_local") else w


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, window: int = 0):
        super().__init__()
        self.window = window  # 0: full causal; else this layer's sliding window (selects its mask)
        self.head_dim = args.head_dim
        bias = args.attention_bias
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=bias)
        # Qwen3's QK-norm: one RMSNorm of head_dim channels shared by all heads, applied before RoPE.
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        # GPT-OSS's attention sinks, a module so that tensor parallel can split them by head as it splits wq.
        self.sinks = HeadSinks(args.n_heads) if args.attention_sinks else None
        # The attention kernel, a plain callable (not a module): context parallel swaps in ring attention, which
        # takes no mask (validate refuses document masking and the window under cp).
        self.sdpa = AttentionKernel(args.attention)
        # QK-clip (optimizer.qk_clip, scaletrain/optim/qk_clip.py) sets this to a [local heads] tensor: training forwards
        # then raise it to each head's largest attention logit; None (the default) measures nothing.
        self.max_logits: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        masks: dict | None = None,
        kv: LayerCache | None = None,
    ) -> torch.Tensor:
        """masks: window -> mask, from `attention_masks` (None: plain causal). kv: this layer's part of a
        KVCache (decoding): the keys and values of earlier positions, to which this call's are appended."""
        bsz, seqlen, _ = x.shape
        # Head counts come from the tensors (-1), so a tensor-parallel shard with fewer heads runs unchanged.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if kv is not None:
            k, v = kv.update(k, v)
        mask = masks[self.window] if masks is not None else None
        if self.max_logits is not None and self.training and kv is None:
            self._record_max_logits(q, k, mask)
        if self.sinks is not None:
            out = sink_attention(q, k, v, self.sinks.local(), mask)
        else:
            out = self.sdpa(q, k, v) if mask is None else self.sdpa(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    @compile_disabled
    def _record_max_logits(self, q: torch.Tensor, k: torch.Tensor, mask: object) -> None:
        """Raise `max_logits` to this forward's per-head maxima (after RoPE: the logits the kernel computes). Run
        again by a recomputed forward, it finds the same maxima; a max over micro-batches needs no count."""
        torch.maximum(self.max_logits, max_logits(q, k, mask), out=self.max_logits)


@contextmanager
def logits_unmeasured(module: nn.Module) -> Iterator[None]:
    """Within, the attention layers of `module` measure no logit maxima (QK-clip): for a forward on placeholder
    inputs, such as the one torch's pipelining runs on uninitialised tensors to learn a stage's shapes."""
    held = [
        (m, m.max_logits) for m in module.modules() if isinstance(m, Attention) and m.max_logits is not None
    ]
    for m, _ in held:
        m.max_logits = None
    try:
        yield
    finally:
        for m, t in held:
            m.max_logits = t


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def build_feed_forward(args: ModelArgs, layer_id: int) -> FeedForward | MoE:
    """The dense SwiGLU, or on MoE layers (`is_moe_layer`) the routed experts with their shared SwiGLU."""
    if not is_moe_layer(args, layer_id):
        return FeedForward(args.dim, args.ffn_hidden)
    hidden = (args.moe_hidden or args.ffn_hidden) * args.shared_experts
    return MoE(args, shared=FeedForward(args.dim, hidden) if hidden > 0 else None)


def build_attention(args: ModelArgs, window: int) -> Attention | MLA:
    """Grouped-query attention, or multi-head latent attention (with its latents' RMSNorms) when args.mla."""
    if not args.mla:
        return Attention(args, window)
    q_norm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS) if args.q_lora_rank > 0 else None
    return MLA(args, q_norm, RMSNorm(args.kv_lora_rank, LATENT_NORM_EPS), window)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        # Fixed at construction, so a pipeline stage keeps each layer's own window.
        self.attention = build_attention(args, layer_window(args, layer_id))
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = build_feed_forward(args, layer_id)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        masks: dict | None = None,
        kv: LayerCache | None = None,
    ) -> torch.Tensor:
        # masks by keyword: the tensor-parallel plan's PrepareModuleInput lays out the positional inputs only.
        x = x + self.attention(self.attention_norm(x), cos, sin, masks=masks, kv=kv)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Its block is the block after the last (a MoE block where those are).
        self.mtp: MTP | None = None
        if args.mtp_depth:
            norms = [RMSNorm(args.dim, args.norm_eps) for _ in range(3)]
            self.mtp = MTP(args.dim, norms[0], norms[1], TransformerBlock(args, args.n_layers), norms[2])
        # Not persistent: recomputed by init_weights, so checkpoints hold only learned state.
        self.register_buffer("rope", rope_cache(args), persistent=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        targets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens: [batch, seq] ids (or hidden states on a later pipeline stage). positions: token positions,
        [seq] or [batch, seq], for when a sequence is split (context parallel); default 0..seq-1. document_ids:
        [batch, seq] (`attention.document_ids`) for document masking: a token attends only within its document,
        and its RoPE position counts from the document's first token. cache: a `KVCache` for decoding: `tokens`
        continue the sequence it holds (positions from cache.pos on), and their keys and values are added to it.
        targets: [batch, seq] next-token ids: the forward then returns the summed cross-entropy (fp32 scalar) instead
        of the logits, computed as model.loss says: in chunks that never hold the whole logits (`loss.output_loss`,
        issue 40), or over the whole micro-batch. Inside the forward, so FSDP2's root unit has the output weight
        gathered around it. A stage without the output ignores them."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if document_ids is not None:
            assert positions is None, "document masking with split sequences (cp) is refused by validate"
            positions = document_positions(document_ids)
        if cache is not None:
            assert positions is None, "decoding with a cache takes neither positions nor document_ids"
            positions = cache.positions(h.shape[1], h.device)
        rope = self.rope[: h.shape[1]] if positions is None else self.rope[positions]
        cos, sin = rope.unbind(-2)
        # Layer keys are the global layer ids, also on a pipeline stage and under block wrappers.
        windows = {layer_window(self.args, int(i)) for i in self.layers}
        if cache is None:
            masks = attention_masks(self.args.attention, windows, document_ids, h.shape[1], h.device)
            for layer in self.layers.values():
                h = layer(h, cos, sin, masks=masks)
        else:
            masks = cache.masks(self.args.attention, windows, h.shape[1], h.device)
            for name, layer in self.layers.items():
                h = layer(h, cos, sin, masks=masks, kv=cache.layers[name])
            cache.advance(h.shape[1])
        last = h
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        if targets is None:
            return self.output(h)
        loss = output_loss(self.output, h, targets, self.args.loss)
        if self.mtp is not None and self.training:
            coef, mode = self.args.mtp_loss_coef, self.args.loss
            loss = loss + mtp_loss(
                self.mtp, last, targets, self.tok_embeddings, self.output, cos, sin, coef, mode
            )
        return loss

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Set every parameter (after `to_empty`) and the buffers, drawing from the global RNG in `init_plan`'s
        order. A sharded model is materialised by parallel/materialize.py from the same plan."""
        self.init_buffers(buffer_device or self.rope.device)
        if self.args.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            # to_empty() allocates each parameter anew, which unties them: tie again.
            self.output.weight = self.tok_embeddings.weight
        params = dict(self.named_parameters())
        for name, init in self.init_plan():
            if name in params:
                init(params[name])

    @torch.no_grad()
    def init_buffers(self, device: torch.device) -> None:
        """The RoPE table and the MoE blocks' routing bias and load statistics: no RNG draws."""
        self.rope = rope_cache(self.args, device)
        blocks = [*self.layers.values(), *([self.mtp.block] if self.mtp is not None else [])]
        for layer in blocks:
            if isinstance(layer.feed_forward, MoE):
                layer.feed_forward.init_buffers()

    def init_plan(self) -> list[tuple[str, Callable[[torch.Tensor], None]]]:
        """(parameter name, what sets it in place) for every parameter of the whole model (all `args.n_layers`
        layers, also on a pipeline stage), in the order they draw from the global RNG: the one definition of the
        initial weights for the single-process and the sharded paths. Each init works on the whole tensor.
        Residual-branch outputs are scaled by 1/sqrt(2·layers) (GPT-2, Radford et al. 2019) so the residual
        stream's variance does not grow with depth. A tied output is the embedding: not listed."""
        args, std = self.args, self.args.init_std
        depth_std = std / math.sqrt(2 * args.n_layers)
        plan = [("tok_embeddings.weight", partial(nn.init.normal_, std=std))]
        # The MTP module's block is drawn like a block n_layers (models/mtp.py).
        blocks = [(f"layers.{i}.", i) for i in range(args.n_layers)]
        for p, i in blocks + ([("mtp.block.", args.n_layers)] if args.mtp_depth else []):
            moe = is_moe_layer(args, i)
            # Dense blocks draw from the RNG in the same order as before MoE existed (golden losses stay equal).
            gqa = ["attention.wq", "attention.wk", "attention.wv"]
            attention, norms = mla_init_names(args) if args.mla else (gqa, [])
            names = [*attention, *(() if moe else ("feed_forward.w1", "feed_forward.w3"))]
            plan += [(p + n, nn.init.ones_) for n in norms]
            plan += [(f"{p}{n}.weight", trunc_normal(std)) for n in names]
            names = ["attention.wo", *(() if moe else ("feed_forward.w2",))]
            plan += [(f"{p}{n}.weight", trunc_normal(depth_std)) for n in names]
            if moe:
                hidden = (args.moe_hidden or args.ffn_hidden) * args.shared_experts
                plan += [
                    (p + "feed_forward." + n, init)
                    for n, init in moe_init_plan(std, depth_std, hidden > 0, args.moe_bias)
                ]
            plan += [(f"{p}attention_norm.weight", nn.init.ones_), (f"{p}ffn_norm.weight", nn.init.ones_)]
            if args.qk_norm:  # no RNG draw: the plan's other entries draw as without QK-norm
                plan += [(f"{p}attention.{n}.weight", nn.init.ones_) for n in ("q_norm", "k_norm")]
            # GPT-OSS's attention biases and sinks start at zero: no RNG draw either.
            if args.attention_bias:
                plan += [(f"{p}attention.{n}.bias", nn.init.zeros_) for n in ("wq", "wk", "wv", "wo")]
            if args.attention_sinks:
                plan.append((f"{p}attention.sinks.weight", nn.init.zeros_))
        if args.mtp_depth:
            plan.append(("mtp.eh_proj.weight", trunc_normal(std)))
            plan += [(f"mtp.{n}.weight", nn.init.ones_) for n in ("enorm", "hnorm", "norm")]
        plan.append(("norm.weight", nn.init.ones_))
        if not args.tie_embeddings:
            plan.append(("output.weight", trunc_normal(args.dim**-0.5)))
        # The MTP module draws last, so that switching it on leaves every other initial weight as it was.
        mtp = [entry for entry in plan if entry[0].startswith("mtp.")]
        return [entry for entry in plan if not entry[0].startswith("mtp.")] + mtp


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Total, without the input embedding (the N of the 6N FLOPs rule), and active: what one token uses, i.e.
    non_embedding less the routed experts it is not sent to (top_k of E). Works on meta models."""
    total = sum(p.numel() for p in model.parameters())
    emb = model.tok_embeddings.weight.numel() if getattr(model, "tok_embeddings", None) is not None else 0
    tied = getattr(model, "args", None) is not None and model.args.tie_embeddings
    # A tied table is also the output projection, whose matmul costs FLOPs: keep it in N.
    non_embedding = total if tied else total - emb
    idle = 0
    for m in model.modules():
        if isinstance(m, MoE):
            routed = sum(p.numel() for p in m.experts.parameters())
            idle += routed - routed * m.top_k // m.n_experts
    return {"total": total, "non_embedding": non_embedding, "active": non_embedding - idle}
