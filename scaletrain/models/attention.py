"""Attention kernels behind one call: `fn(q, k, v)` (causal) or `fn(q, k, v, mask)` on [batch, heads, seq, head_dim].

Attention modules hold such a callable as a plain attribute, so that a parallelism (e.g. ring attention for
context parallel) can swap the kernel without the model knowing about it. `AttentionKernel` is the one place that
calls `scaled_dot_product_attention` or FlexAttention; `attention_masks` builds the document and sliding-window
masks once per forward, and `document_ids` / `document_positions` derive documents from packed token ids.
`max_logits` measures each head's largest logit under the same masks, for QK-clip.
"""

from __future__ import annotations

import logging
import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

log = logging.getLogger(__name__)

AttentionBackend = Literal["auto", "flash", "efficient", "cudnn", "math", "flex"]
_FORCED = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
# What is already logged (backend, device, dtype, masked): the choice is logged once per process, not per call.
_logged: set[tuple] = set()
_compiled_flex = None


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention through PyTorch's SDPA (flash / memory-efficient kernels where the device has them).
    Grouped-query attention: k and v may have fewer heads than q."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    mask: torch.Tensor | BlockMask | None,
) -> torch.Tensor:
    """Attention whose softmax over each query's keys has one more term, exp(sink of the head), in the denominator
    (GPT-OSS's attention sinks): softmax([scores, sink]) without the sink's column. q: [batch, heads, seq, d];
    k, v: [batch, kv_heads, keys, d] (grouped-query); sinks: [heads]; mask as `attention_masks` gives (None:
    causal over equal lengths). Computed plainly, with the [batch, heads, seq, keys] scores in fp32 held at once:
    no fused kernel takes a sink (FlexAttention's score_mod cannot add a term to the denominator)."""
    b, h, s, d = q.shape
    rep = h // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-2, -1)).float() * d**-0.5
    i = torch.arange(s, device=q.device)[:, None] + (k.shape[2] - s)
    j = torch.arange(k.shape[2], device=q.device)[None, :]
    if mask is None:
        keep = (j <= i)[None, None]
    elif isinstance(mask, BlockMask):
        bi = torch.arange(b, device=q.device)[:, None, None, None]
        keep = mask.mask_mod(bi, torch.zeros_like(bi), i[None, None], j[None, None])
    else:
        keep = mask
    scores = scores.masked_fill(~keep, -math.inf)
    sink = sinks.float().view(1, h, 1, 1).expand(b, h, s, 1)
    lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1, keepdim=True)
    return (scores - lse).exp().to(v.dtype) @ v


def document_ids(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """Document index of every token of packed [batch, seq] ids, counted from 0 in each row. The end-of-document
    token belongs to the document it ends (as Megatron-LM's reset_attention_mask): the token after it starts the
    next one. The derivation needs only the tokens, so the loader's (inputs, targets) interface stays as it is."""
    eod = (tokens == eod_id).to(torch.int32)
    return (eod.cumsum(dim=1) - eod).to(torch.int32)


def document_positions(doc: torch.Tensor) -> torch.Tensor:
    """RoPE positions [batch, seq] that restart at 0 at each document's first token."""
    idx = torch.arange(doc.shape[1], device=doc.device).expand_as(doc)
    starts = torch.ones_like(doc, dtype=torch.bool)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def uses_flex(backend: str, device: torch.device) -> bool:
    """FlexAttention when asked, and for masked attention under auto on CUDA (where it compiles to a fused
    kernel that skips fully masked blocks); elsewhere masked SDPA with a boolean mask."""
    return backend == "flex" or (backend == "auto" and device.type == "cuda")


def attention_masks(
    backend: str, windows: set[int], doc: torch.Tensor | None, seq_len: int, device: torch.device
) -> dict[int, torch.Tensor | BlockMask | None] | None:
    """The mask of every window in `windows` (0: none), built once per forward and shared by the layers: None
    where attention is plainly causal; None in all when nothing restricts it (the unmasked causal path)."""
    if doc is None and windows <= {0}:
        return None
    flex = uses_flex(backend, device)
    out: dict[int, torch.Tensor | BlockMask | None] = {}
    for w in windows:
        if doc is None and w == 0:
            out[w] = None
        elif flex:
            out[w] = _block_mask(doc, w, seq_len, device)
        else:
            out[w] = _bool_mask(doc, w, seq_len, device)
    return out


def _bool_mask(doc: torch.Tensor | None, window: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[batch or 1, 1, seq, seq], True where query i may see key j: j <= i, in its document, i - window < j."""
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    keep = j <= i
    if window > 0:
        keep = keep & (i - window < j)
    keep = keep[None, None]
    if doc is not None:
        keep = keep & (doc[:, None, :, None] == doc[:, None, None, :])
    return keep


def _block_mask(doc: torch.Tensor | None, window: int, seq_len: int, device: torch.device) -> BlockMask:
    """The same rule as `_bool_mask` as a FlexAttention block mask (its fully masked blocks are skipped)."""

    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx <= q_idx
        if window > 0:
            keep = keep & (q_idx - window < kv_idx)
        if doc is not None:
            keep = keep & (doc[b, q_idx] == doc[b, kv_idx])
        return keep

    batch = doc.shape[0] if doc is not None else None
    return create_block_mask(mask_mod, batch, None, seq_len, seq_len, device=device)


# Logits held at once by `max_logits` (32 Mi elements: 64 MiB in bf16, 128 MiB in fp32): the queries are taken in
# chunks of this many scores.
_MAX_LOGIT_CHUNK = 2**25


def _logit_chunk_rows(batch: int, heads: int, seq: int) -> int:
    """Queries per chunk of `max_logits`: as many as keep a chunk's scores within _MAX_LOGIT_CHUNK (at least one)."""
    return max(1, _MAX_LOGIT_CHUNK // (batch * heads * seq))


def max_logits_bytes(batch: int, heads: int, seq: int, elt: int) -> int:
    """The most `max_logits` holds at once on [batch, heads, seq, ·] queries of `elt` bytes: the largest chunk's
    scores in that dtype and their fp32 copy (one array where the dtype is fp32), its causal mask and the mask's
    negation over the batch (bool), and a chunk-row of bytes more for the index vectors and per-head maxima
    (live bytes measured within 10% above by tests/unit/test_qk_clip.py). For the planner's memory estimate."""
    rows = min(_logit_chunk_rows(batch, heads, seq), seq)
    scores = batch * heads * rows * seq
    return scores * (elt + (4 if elt != 4 else 0)) + (2 + batch) * rows * seq + 8 * (rows + seq) + 12 * heads


@torch.no_grad()
def max_logits(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | BlockMask | None = None
) -> torch.Tensor:
    """The largest attention logit q_i·k_j / sqrt(head_dim) (SDPA's default scale) of each query head, over the
    batch and every pair the layer lets attend: causal for mask None, else the boolean mask or the block mask's
    rule. q: [batch, heads, seq, head_dim], k: [batch, kv_heads, seq, head_dim], the same positions (training, not
    decoding); grouped-query: query head h reads kv head h // (heads / kv_heads), as SDPA's enable_gqa. Returns
    [heads] in fp32. For QK-clip (scaletrain/optim/qk_clip.py).

    Chunked over the queries so that at most _MAX_LOGIT_CHUNK scores exist at once, never the whole
    [batch, heads, seq, seq] matrix; every mask here is causal, so a chunk reads only the keys up to its last query
    (half the products of the whole matrix). The products are computed in q's dtype, as the kernel reads them
    (fp32 accumulation; under bf16 the maximum carries bf16's rounding, relative 2^-8)."""
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, s, d)
    out = torch.full((hkv, hq // hkv), -math.inf, device=q.device)
    rows = _logit_chunk_rows(b, hq, s)
    for i0 in range(0, s, rows):
        i1 = min(s, i0 + rows)
        i, j = torch.arange(i0, i1, device=q.device), torch.arange(i1, device=q.device)
        logits = torch.einsum("bkgid,bkjd->bkgij", qg[:, :, :, i0:i1], k[:, :, :i1]).float()
        if mask is None:
            keep = (j[None, :] <= i[:, None])[None]
        elif isinstance(mask, BlockMask):
            bi = torch.arange(b, device=q.device)[:, None, None]
            keep = mask.mask_mod(bi, torch.zeros_like(bi), i[None, :, None], j[None, None, :])
        else:
            keep = mask[:, 0, i0:i1, :i1]
        logits.masked_fill_(~keep.expand(b, -1, -1)[:, None, None], -math.inf)
        out = torch.maximum(out, logits.amax(dim=(0, 3, 4)))
        # Freed before the next chunk's scores exist, not after them (issue 35: 2.3x the estimate live at once).
        del logits, keep
    # Scaled once at the end: rounding is monotonic, so the scaled maximum is the maximum of the scaled logits.
    return out.reshape(hq) * d**-0.5


class AttentionKernel:
    """The attention call of every layer: SDPA (the backend torch picks under `auto`, or the one forced with
    `sdpa_kernel`) for causal and boolean-masked attention, FlexAttention for block masks. Logs once what runs."""

    def __init__(self, backend: AttentionBackend = "auto"):
        self.backend = backend

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | BlockMask | None = None,
    ) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        if not torch.compiler.is_compiling():
            _log_choice(self.backend, q, k, mask)
        if isinstance(mask, BlockMask) or (self.backend == "flex" and mask is None):
            return _flex(q, k, v, mask, gqa)
        # A boolean mask under flex comes only from a KVCache's decode step (a few queries): plain SDPA takes it.
        if self.backend in ("auto", "flex"):
            if mask is None:
                return causal_sdpa(q, k, v)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        with sdpa_kernel(_FORCED[self.backend]):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa
            )


def _flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask | None, gqa: bool
) -> torch.Tensor:
    """FlexAttention, compiled once per process: uncompiled it materialises the whole score matrix."""
    global _compiled_flex
    if mask is None:
        mask = _block_mask(None, 0, q.shape[2], q.device)
    if torch.compiler.is_compiling():
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=mask, enable_gqa=gqa)


def _log_choice(backend: str, q: torch.Tensor, k: torch.Tensor, mask: object) -> None:
    kind = "block" if isinstance(mask, BlockMask) else ("bool" if mask is not None else "causal")
    key = (backend, q.device.type, q.dtype, kind)
    if key in _logged:
        return
    _logged.add(key)
    shape = f"{q.dtype}, head_dim {q.shape[-1]}, {kind} mask" if kind != "causal" else f"{q.dtype}, causal"
    log.info("attention (model.attention=%s, %s): %s", backend, shape, _explain(backend, q, k, mask))


def _explain(backend: str, q: torch.Tensor, k: torch.Tensor, mask: object) -> str:
    """Which kernel runs and why, in one phrase."""
    if isinstance(mask, BlockMask) or backend == "flex":
        return "FlexAttention (torch.compile'd), skipping fully masked blocks"
    if backend != "auto":
        return f"SDPA forced to {_FORCED[backend].name} with sdpa_kernel"
    picked = _sdpa_choice(q, k, mask)
    if picked is None:
        return "SDPA, backend left to torch (flash > efficient > math by dtype, head_dim and mask)"
    why = _why(picked, q, mask)
    return f"SDPA, torch picks {picked}" + (f" ({why})" if why else "")


def _sdpa_choice(q: torch.Tensor, k: torch.Tensor, mask: object) -> str | None:
    """The backend SDPA would pick for these inputs (a private but cheap torch query), or None if unknown."""
    try:
        attn_mask = mask if isinstance(mask, torch.Tensor) else None
        gqa = q.shape[1] != k.shape[1]
        choice = torch._fused_sdp_choice(q, k, k, attn_mask, 0.0, attn_mask is None, enable_gqa=gqa)
        return SDPBackend(choice).name
    except Exception:  # a private API: its absence only costs the log line its detail
        return None


def _why(picked: str, q: torch.Tensor, mask: object) -> str:
    if q.device.type == "cpu":
        cap = torch.backends.cpu.get_cpu_capability()
        return f"the CPU flash kernel, {cap} vectorised" if picked == "FLASH_ATTENTION" else cap
    if picked != "FLASH_ATTENTION":
        reasons = []
        if q.dtype not in (torch.float16, torch.bfloat16):
            reasons.append("flash needs fp16/bf16")
        if mask is not None:
            reasons.append("flash takes no mask")
        if q.shape[-1] > 256 or q.shape[-1] % 8:
            reasons.append("flash needs head_dim <= 256, a multiple of 8")
        return "; ".join(reasons)
    return ""
