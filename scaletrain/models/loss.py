"""The token cross-entropy: the one definition the training step, the pipeline's last stage and evaluation use, and
the output projection fused with it in chunks of tokens, so no [tokens x vocab] fp32 logits tensor is ever whole
(issue 40; the idea of Liger's fused linear cross-entropy and torchtune's chunked loss)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# The largest logits chunk, in elements (128 MiB in fp32): a step's logits larger than this are computed a chunk of
# tokens at a time. Small vocabularies (the debug model's 320 x a few thousand tokens) stay one chunk, which is
# today's computation bit for bit; Llama 3's 128,256 get 261 tokens per chunk, two chunk-sized fp32 buffers alive
# at once (the logits and their log-softmax, which becomes their gradient in place): 0.25 GiB whatever the tokens
# per step (model.loss = "whole" computes the whole logits instead).
LOGITS_CHUNK_ELEMENTS = 2**25
# What the whole loss (model.loss = "whole", or one chunk) holds per logit at its peak, as autograd keeps it: in
# forward the logits (4 bytes in fp32; 2 under bf16 autocast, plus their fp32 copy, 4) and the fp32 log-softmax (4,
# saved for backward): 8 in fp32, 10 in bf16; in backward the saved log-softmax, nll_loss's dense gradient of it and
# log_softmax's gradient of the logits, 4 bytes each: 12 in both, the peak (measured to within 1%,
# tests/unit/test_loss.py). torchtitan's loss (F.cross_entropy of the logits' fp32 copy) is this one.
WHOLE_LOSS_BYTES_PER_LOGIT = 12
# model.loss = "whole_compiled": the same whole loss with its cross-entropy torch.compile'd, as torchtitan compiles
# its loss with the model (components/loss.py at e7c0cae, June 2025; not at 9dec370, Dec 2024). Inductor fuses the
# fp32 cast, the log-softmax and their gradient: it keeps the logits themselves for backward (and a log-sum-exp per
# token) and makes the logits' gradient in their dtype, so the peak is two logits-sized tensors of the compute
# dtype: 4 bytes a logit under bf16, 8 in fp32 (the kernel's figure: test_the_compiled_loss_holds_two_logits).
COMPILED_LOSS_LOGITS = 2


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Token-level cross-entropy in fp32 (bf16 logits lose too much in the log-sum-exp)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction=reduction)


@functools.cache
def compiled_cross_entropy() -> Callable[..., torch.Tensor]:
    """`cross_entropy` torch.compile'd (made on first use, so that importing the models imports no dynamo; compiled
    at its first call, seconds): the same function, so the same loss to fp rounding."""
    return torch.compile(cross_entropy)


def token_mean(loss_sum: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean loss per token from the summed loss a model's forward returns with targets."""
    return loss_sum / targets.numel()


def chunk_tokens(vocab_size: int) -> int:
    """Tokens per logits chunk: as many as fit LOGITS_CHUNK_ELEMENTS (at least one)."""
    return max(1, LOGITS_CHUNK_ELEMENTS // vocab_size)


def output_loss(
    output: nn.Linear, h: torch.Tensor, targets: torch.Tensor, mode: str = "chunked"
) -> torch.Tensor:
    """Summed cross-entropy of `output(h)` against `targets` ([batch, seq]); `mode` is model.loss.

    "whole", or one chunk (a small vocabulary): `output(h)` and `cross_entropy` over the whole micro-batch, as
    before issue 40 (and as torchtitan computes it); "whole_compiled": the same with the cross-entropy compiled.
    "chunked", without the whole logits: several chunks, on a plain nn.Linear with plain tensors (one process, DDP,
    FSDP2 inside the root's forward, autocast, fp8 and QAT, which leave the output layer alone):
    `linear_cross_entropy` computes each chunk's gradient in the forward, so nothing is recomputed. Otherwise (the
    output's weight is a tensor-parallel DTensor): each chunk's `output(chunk)` and cross-entropy run under
    non-reentrant checkpoint, which frees the chunk's logits after its forward and recomputes them in its backward
    (one more output-layer forward); the module's own hooks (TP's layouts, the vocabulary-parallel loss) run as
    usual."""
    if mode == "whole_compiled":
        return compiled_cross_entropy()(output(h), targets, reduction="sum")
    n = chunk_tokens(output.weight.shape[0])  # a DTensor's shape is the whole vocabulary's
    if mode == "whole" or targets.numel() <= n:
        return cross_entropy(output(h), targets, reduction="sum")
    if _fusable(output, h):
        return linear_cross_entropy(h.flatten(0, -2), output.weight, targets.flatten(), n)
    if type(h) is torch.Tensor:  # plain hidden states (TP without sequence parallel): chunks of tokens
        pieces = zip(h.flatten(0, 1).split(n), targets.flatten().split(n), strict=True)
        pieces = [(x.unsqueeze(0), y.unsqueeze(0)) for x, y in pieces]
    else:
        # A DTensor sharded on the sequence (sequence parallel): the batch dimension is the one whose slices keep
        # that layout, so chunks are whole sequences (at least one, however long).
        rows = max(1, n // h.shape[1])
        pieces = list(zip(h.split(rows), targets.split(rows), strict=True))
    total = None
    for x, y in pieces:
        part = checkpoint(_chunk_loss, output, x, y, use_reentrant=False, preserve_rng_state=False)
        total = part if total is None else total + part
    return total


def _chunk_loss(output: nn.Module, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return cross_entropy(output(h), targets, reduction="sum")


def _fusable(output: nn.Module, h: torch.Tensor) -> bool:
    """A plain nn.Linear without bias or hooks, on plain tensors: its gradient can be computed by hand."""
    return (
        type(output) is nn.Linear
        and output.bias is None
        and type(h) is torch.Tensor
        and type(output.weight) is nn.Parameter
        and not (output._forward_hooks or output._forward_pre_hooks)
    )


def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int
) -> torch.Tensor:
    """sum_i cross_entropy(h_i @ weight.T, targets_i) for h [tokens, dim], weight [vocab, dim], `chunk` tokens at
    a time. The logits are in the compute dtype (autocast's, else the weight's) and the softmax in fp32, as
    `cross_entropy` does; the gradients are computed in the forward (Liger's approach), so the backward only
    scales them. Without autograd (evaluation) only the loss is computed."""
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h, weight, targets, chunk)
    return _chunked(h, weight, targets, chunk, with_grads=False)[0]


def _chunked(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, with_grads: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The summed loss and, `with_grads`, its fp32 gradients for h and weight, a chunk of tokens at a time."""
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    grad_h = grad_w = None
    with torch.autocast(device, enabled=False):
        hc, wc = h.to(dtype), weight.to(dtype)
        if with_grads:  # accumulated in fp32 over the chunks; handed to autograd in the inputs' dtypes
            grad_h = torch.empty(h.shape, dtype=torch.float32, device=h.device)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, h.shape[0], chunk):
            x, t = hc[start : start + chunk], targets[start : start + chunk]
            # log_softmax, as F.cross_entropy computes it (one fused kernel; logsumexp is several on a CPU).
            logp = torch.log_softmax((x @ wc.T).float(), dim=-1)
            loss -= logp.gather(1, t[:, None]).sum()
            if with_grads:
                # d(loss)/d(logits) = softmax - one_hot, in place over the chunk's log-probabilities.
                grad = logp.exp_()
                grad[torch.arange(t.shape[0], device=t.device), t] -= 1.0
                grad = grad.to(dtype)
                if dtype == torch.float32:  # straight into the fp32 buffers, no temporaries
                    torch.mm(grad, wc, out=grad_h[start : start + chunk])
                    grad_w.addmm_(grad.T, x)
                else:
                    grad_h[start : start + chunk] = grad @ wc
                    grad_w += grad.T @ x
                del grad
            # Freed before the next chunk's logits are made: one chunk's buffers alive at a time, not two (kept,
            # the live peak was 12 bytes a chunk's logit in fp32, 14 in bf16, against the 8 loss_activation_bytes
            # counts).
            del logp
    return loss, grad_h, grad_w


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int
    ) -> torch.Tensor:
        loss, grad_h, grad_w = _chunked(h, weight, targets, chunk, with_grads=True)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (h.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        return (grad_h * grad_loss).to(h_dtype), (grad_w * grad_loss).to(w_dtype), None, None


def loss_activation_bytes(
    tokens: float, vocab: int, dim: int, tp: int = 1, seq_len: int = 0, mode: str = "chunked", elt: int = 4
) -> float:
    """Bytes the loss holds at its peak for `tokens` tokens (the planner's memory model). The whole loss (`mode`
    "whole", or a single chunk): WHOLE_LOSS_BYTES_PER_LOGIT over the rank's share of the vocabulary; compiled
    ("whole_compiled"): COMPILED_LOSS_LOGITS logits of `elt` bytes (the compute dtype's) each. Several
    chunks: two fp32 buffers of one chunk's logits (logits or log-softmax, and their gradient); plus, on the fused
    path (tp 1), the fp32 gradients of the output weight and of the hidden states kept from forward to backward.
    `seq_len`: under sequence parallel, where chunks are whole sequences."""
    if mode == "whole_compiled":
        return COMPILED_LOSS_LOGITS * elt * tokens * vocab / tp
    chunk = chunk_tokens(vocab)
    if seq_len:
        chunk = max(1, chunk // seq_len) * seq_len
    if mode == "whole" or tokens <= chunk:
        return WHOLE_LOSS_BYTES_PER_LOGIT * tokens * vocab / tp
    fused = 4 * (vocab * dim + tokens * dim) if tp == 1 else 0
    return 2 * chunk * vocab * 4 / tp + fused
