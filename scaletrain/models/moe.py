"""Mixture-of-experts feed-forward in plain PyTorch: a top-k router, SwiGLU experts run as grouped matmuls over
tokens sorted by expert, optional shared experts (DeepSeek-MoE), and the per-sequence balance and z losses.

Nothing here talks to other ranks: expert parallel wraps `MoE.experts` from outside (parallel/expert_parallel.py)
and receives the tokens already sorted by expert with the counts over all experts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from functools import partial
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models.init import trunc_normal

log = logging.getLogger(__name__)


class ModelArgs(Protocol):
    """The fields of llama.ModelArgs this module reads (a protocol: llama imports this module, not the reverse)."""

    dim: int
    ffn_hidden: int
    n_experts: int
    top_k: int
    moe_hidden: int
    router: str
    norm_topk: bool
    moe_every: int
    first_dense: int
    capacity_factor: float
    aux_loss_coef: float
    z_loss_coef: float
    moe_bias: bool
    swiglu_limit: float
    n_group: int
    topk_group: int
    route_scale: float


# MoEConfig field -> ModelArgs field where the names differ; the rest keep their name (resolve_model_args, and the
# HF adapters' inverse).
MOE_FIELDS = {"hidden": "moe_hidden", "every": "moe_every", "bias": "moe_bias"}


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Set every MoE layer's `aux_loss_scale` in `model` (whatever wraps it): 1/n_microbatches (x the fp16 loss
    scale). The step runner calls it before each forward; the value travels on the modules, not in a global."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.aux_loss_scale = float(scale)


def is_moe_layer(args: ModelArgs, layer_id: int) -> bool:
    """Blocks k-1, 2k-1, ... (k = moe_every) from first_dense on are MoE; all others keep the dense SwiGLU."""
    return (
        args.n_experts > 0 and layer_id >= args.first_dense and (layer_id + 1) % max(args.moe_every, 1) == 0
    )


class _AuxLossScaler(torch.autograd.Function):
    """Identity on the MoE output whose backward also seeds d(aux)/d(router) with `scale` (the layer's
    aux_loss_scale when its forward ran), so the aux losses train the router without being added to the reported
    (LM) loss or threaded through the step."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # Router logits in fp32 at least: a bf16 softmax over many experts mis-ranks near ties and its probabilities
    # feed the balance loss. float64 stays float64 (the reference tests).
    return torch.promote_types(x.dtype, torch.float32)


class Router(nn.Module):
    """Scores every expert for every token and picks the top k. The routing bias (DeepSeek-V3's auxiliary-loss-free
    balancing) is added to the scores for the choice only; the weights come from the unbiased scores."""

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        score: str = "softmax",
        norm_topk: bool = True,
        n_group: int = 1,
        topk_group: int = 1,
        scale: float = 1.0,
        bias: bool = False,
    ):
        """n_group, topk_group: group-limited routing (DeepSeek-V3), off with n_group 1; scale: the routed
        weights' multiplier (its routed_scaling_factor)."""
        super().__init__()
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"moe.router {score!r} is unknown: choose softmax or sigmoid")
        self.top_k, self.score, self.norm_topk = top_k, score, norm_topk
        self.n_group, self.topk_group, self.scale = n_group, topk_group, scale
        self.gate = nn.Linear(dim, n_experts, bias=bias)  # GPT-OSS's router has a learned bias
        # Persistent: it is learned state (moved by the load, not by gradients) and must survive a resume.
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32), persistent=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, dim]. Returns weights [T, k] and experts [T, k] (int64), logits [T, E] and the per-token
        probabilities [T, E] the balance loss uses (softmax; for sigmoid the scores normalised to sum 1)."""
        dtype = _compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):  # autocast would run the gate in bf16
            bias = None if self.gate.bias is None else self.gate.bias.to(dtype)
            logits = F.linear(x.to(dtype), self.gate.weight.to(dtype), bias)
        if self.score == "sigmoid":
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(-1, keepdim=True)
        else:
            scores = probs = torch.softmax(logits, dim=-1)
        choice = scores.detach() + self.expert_bias.to(dtype)
        if self.n_group > 1:
            choice = self._best_groups(choice)
        _, experts = torch.topk(choice, self.top_k, dim=-1)
        weights = scores.gather(-1, experts)
        # Sigmoid scores are independent, so their top k need normalising to be a mixture (DeepSeek-V3).
        if self.score == "sigmoid" or self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.scale != 1.0:
            weights = weights * self.scale
        return weights, experts, logits, probs

    def _best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` [T, E] with the experts outside each token's topk_group best groups set to -inf. A group's
        score is the sum of its two best (biased) scores, as DeepSeek-V3 and transformers' DeepseekV3TopkRouter
        rank them; under expert parallel with groups laid on ranks this bounds the ranks a token travels to."""
        t, e = choice.shape
        groups = choice.view(t, self.n_group, e // self.n_group)
        best = groups.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices
        keep = torch.zeros(t, self.n_group, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
        return groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)


def _local(w: torch.Tensor) -> torch.Tensor:
    # Under expert parallel the weights are DTensors sharded on the expert dim; compute on this rank's experts.
    return w.to_local() if hasattr(w, "to_local") else w


def _swiglu_loop(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, counts: torch.Tensor):
    """One matmul per expert over its contiguous rows (a segment loop, never a loop over tokens)."""
    chunks = x.split(counts.tolist())
    outs = [(F.silu(c @ w1[e].T) * (c @ w3[e].T)) @ w2[e].T for e, c in enumerate(chunks)]
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


# GPT-OSS's SwiGLU: gate * sigmoid(ALPHA * gate) in place of silu (OpenAI 2025, gpt-oss model card).
GPT_OSS_ALPHA = 1.702


def _gpt_oss_loop(
    x: torch.Tensor,
    w: tuple[torch.Tensor, ...],
    b: tuple[torch.Tensor | None, ...],
    counts: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """The segment loop with GPT-OSS's experts: w = (w1, w2, w3), b = their biases ([E, H], [E, D], [E, H]) or
    None; limit > 0 is its clamped SwiGLU: the gate clamped above at limit, the up projection to [-limit, limit],
    then gate * sigmoid(1.702 gate) * (up + 1). limit 0: plain SwiGLU with the biases."""
    (w1, w2, w3), (b1, b2, b3) = w, b
    outs = []
    for e, c in enumerate(x.split(counts.tolist())):
        gate, up = c @ w1[e].T, c @ w3[e].T
        if b1 is not None:
            gate, up = gate + b1[e], up + b3[e]
        if limit > 0:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            h = gate * torch.sigmoid(GPT_OSS_ALPHA * gate) * (up + 1)
        else:
            h = F.silu(gate) * up
        outs.append(h @ w2[e].T + (b2[e] if b2 is not None else 0))
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


def _swiglu_grouped(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, counts: torch.Tensor
):
    """All experts in three grouped GEMMs; offs are the cumulative row ends of the groups."""
    offs = counts.cumsum(0).to(torch.int32)
    h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))
    h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)


# torch.compiler.disable as a decorator imports torch._dynamo at once: 0.33 s of the start-up of every process that
# imports the model (measured, torch 2.13 CPU). torch._disable_dynamo applies the same disable at the first call
# instead (torch.optim marks its own methods so); under torch.compile both graph-break at the call.
compile_disabled = torch._disable_dynamo

# Devices on which the grouped kernel passed its probe (True) or failed it (False), by str(device).
_GROUPED_OK: dict[str, bool] = {}


@compile_disabled
def _probe_grouped_mm(device: torch.device) -> bool:
    """Once per device: the grouped kernel against the segment loop, forward and backward, on groups of odd
    sizes including an empty one (kernels have hung on empty groups and needed aligned offsets in some versions)."""
    try:
        return _grouped_matches_loop(device)
    except (RuntimeError, NotImplementedError) as e:
        log.info("torch._grouped_mm unusable on %s (%s); experts run as a loop of matmuls", device, e)
        return False


def _grouped_matches_loop(device: torch.device) -> bool:
    gen = torch.Generator(device=device).manual_seed(0)
    counts = torch.tensor([5, 0, 19, 8], device=device)
    shapes = ((32, 64), (4, 96, 64), (4, 64, 96), (4, 96, 64))  # x, w1, w2, w3
    inputs = [torch.randn(s, device=device, generator=gen) * (1 if len(s) == 2 else 0.1) for s in shapes]
    results = []
    # Also when first called while generating (inference mode) or under autocast.
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
        for fn in (_swiglu_grouped, _swiglu_loop):
            leaves = [t.clone().requires_grad_() for t in inputs]
            out = fn(*[t.to(torch.bfloat16) for t in leaves], counts)
            grads = torch.autograd.grad(out.float().square().sum(), leaves)
            results.append([out.float(), *grads])
    return all(torch.allclose(a, b, rtol=0.05, atol=0.05) for a, b in zip(*results))


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the expert matmuls run in: autocast's where it is on (it does not cover _grouped_mm), else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def grouped_mm_usable(x: torch.Tensor) -> bool:
    """torch._grouped_mm's fast kernels (CUDA, bf16, compute capability 9.0 or more), once they pass the probe."""
    if not hasattr(torch, "_grouped_mm") or not x.is_cuda or matmul_dtype(x) != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    key = str(x.device)
    if key not in _GROUPED_OK:
        _GROUPED_OK[key] = _probe_grouped_mm(x.device)
    return _GROUPED_OK[key]


class GroupedExperts(nn.Module):
    """E SwiGLU experts with nn.Linear-style weights stacked on dim 0: expert e is w2[e] (silu(w1[e] x) * w3[e] x)."""

    def __init__(self, dim: int, hidden: int, n_experts: int, bias: bool = False, limit: float = 0.0):
        """bias, limit: GPT-OSS's experts (biases on the three projections; its clamped SwiGLU, `_gpt_oss_loop`)."""
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.limit = limit
        # Biases flat, [E * H] and [E * D]: 1-D as every bias, so no weight decay and no Muon step reads them as
        # matrices; sharded on dim 0 (expert parallel, FSDP) each rank still holds whole experts' rows.
        self.b1 = nn.Parameter(torch.empty(n_experts * hidden)) if bias else None
        self.b2 = nn.Parameter(torch.empty(n_experts * dim)) if bias else None
        self.b3 = nn.Parameter(torch.empty(n_experts * hidden)) if bias else None

    def forward(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x_sorted: [N, dim], rows grouped by expert in expert order; counts: [E_local] rows per local expert."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        if self.b1 is not None or self.limit > 0:  # GPT-OSS: no grouped kernel takes its biases and clamp
            b = (self.b1, self.b2, self.b3)
            b = tuple(None if t is None else _local(t).view(w.shape[0], -1) for t, w in zip(b, (w1, w2, w3)))
            return _gpt_oss_loop(x_sorted, (w1, w2, w3), b, counts, self.limit)
        if grouped_mm_usable(x_sorted):
            bf16 = torch.bfloat16
            return _swiglu_grouped(x_sorted.to(bf16), w1.to(bf16), w2.to(bf16), w3.to(bf16), counts)
        return _swiglu_loop(x_sorted, w1, w2, w3, counts)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        for name, init in moe_init_plan(std, out_std, False, self.b1 is not None):
            if name.startswith("experts."):
                init(getattr(self, name.split(".")[-1]))


def moe_init_plan(
    std: float, out_std: float, shared: bool, biased: bool = False
) -> list[tuple[str, Callable[[torch.Tensor], None]]]:
    """(name under the MoE block, in-place init on the whole tensor) in RNG order: the experts like the dense SwiGLU
    (w2 depth-scaled), the shared experts alike, then the router gate N(0, std). Part of Transformer.init_plan."""

    plan = [
        ("experts.w1", trunc_normal(std)),
        ("experts.w3", trunc_normal(std)),
        ("experts.w2", trunc_normal(out_std)),
    ]
    if shared:
        plan += [("shared.w1.weight", trunc_normal(std)), ("shared.w3.weight", trunc_normal(std))]
        plan += [("shared.w2.weight", trunc_normal(out_std))]
    plan.append(("router.gate.weight", partial(nn.init.normal_, std=std)))
    # GPT-OSS's biases start at zero (no RNG draw: the entries above draw as without them).
    return plan + [
        (n, nn.init.zeros_) for n in ("experts.b1", "experts.b2", "experts.b3", "router.gate.bias") if biased
    ]


def histogram(index: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0..n-1 occurs in `index` (int64, shape [n]). A 1-D scatter_add rather than bincount: its
    shape is static (torch.compile traces it) and it is deterministic on CUDA under deterministic mode."""
    index = index.reshape(-1)
    return torch.zeros(n, dtype=torch.int64, device=index.device).scatter_add_(
        0, index, torch.ones_like(index)
    )


def capacity_keep(experts: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """experts: [B, S, k]. True for the assignments kept: the first `capacity` of each sequence to each expert, in
    token order (GShard's per-group capacity, with the sequence as the group)."""
    bsz = experts.shape[0]
    flat = experts.reshape(bsz, -1)  # token-major: assignment j of token s is at s * k + j
    key = (flat + n_experts * torch.arange(bsz, device=flat.device).unsqueeze(1)).reshape(-1)
    order = torch.argsort(key, stable=True)
    sizes = histogram(key, bsz * n_experts)
    starts = sizes.cumsum(0) - sizes
    rank_sorted = torch.arange(key.numel(), device=key.device) - starts[key[order]]
    rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
    return (rank < capacity).reshape(experts.shape)


def balance_loss(experts: torch.Tensor, probs: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch/GShard load-balancing loss per sequence, averaged over sequences: sum_e f_e P_e with
    f_e = count_e E / (k S) (1 when balanced, no gradient) and P_e the sequence's mean router probability.
    Per sequence, so any split of the batch over data-parallel ranks averages to the same loss.
    experts: [B, S, k]; probs: [B, S, E]."""
    bsz, seqlen, top_k = experts.shape
    seq = torch.arange(bsz, device=experts.device).view(bsz, 1, 1)
    counts = histogram(experts + n_experts * seq, bsz * n_experts).view(bsz, n_experts).to(probs.dtype)
    f = counts * n_experts / (top_k * seqlen)
    return (f * probs.mean(1)).sum(-1).mean()


def _in_backward() -> bool:
    # Activation recompute runs the forward again inside backward: its routing must not be counted twice.
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """Routed SwiGLU experts (+ shared ones) in place of a block's dense feed-forward."""

    def __init__(self, args: ModelArgs, shared: nn.Module | None = None):
        """shared: the shared experts as one SwiGLU of hidden moe_hidden x shared_experts (llama.py builds it, as
        it builds the dense FeedForward), added for every token; None: none."""
        super().__init__()
        hidden = args.moe_hidden or args.ffn_hidden
        self.n_experts, self.top_k = args.n_experts, args.top_k
        self.capacity_factor = args.capacity_factor
        self.aux_loss_coef, self.z_loss_coef = args.aux_loss_coef, args.z_loss_coef
        # What d(loss)/d(aux) is in backward: the LM loss is divided by the micro-batch count (and multiplied by the
        # fp16 loss scale) before backward, so the aux losses must be too or their weight would depend on the
        # layout (Megatron-LM's MoEAuxLossAutoScaler). Its owner, the step runner, sets it (set_aux_loss_scale).
        self.aux_loss_scale = 1.0
        self.router = Router(
            args.dim,
            args.n_experts,
            args.top_k,
            args.router,
            args.norm_topk,
            args.n_group,
            args.topk_group,
            args.route_scale,
            bias=args.moe_bias,
        )
        self.experts = GroupedExperts(args.dim, hidden, args.n_experts, args.moe_bias, args.swiglu_limit)
        self.shared = shared
        # Load statistics for the metrics monitor, which reads and zeroes them; not checkpointed.
        e = args.n_experts
        self.register_buffer("tokens_per_expert", torch.zeros(e, dtype=torch.float32), persistent=False)
        for name in ("dropped_tokens", "routed_tokens", "aux_loss_sum", "z_loss_sum", "forwards"):
            self.register_buffer(name, torch.zeros((), dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, dim = x.shape
        x_flat = x.reshape(-1, dim)
        weights, experts, logits, probs = self.router(x_flat)
        experts3 = experts.view(bsz, seqlen, self.top_k)
        keep = None
        if self.capacity_factor > 0:
            capacity = math.ceil(self.capacity_factor * seqlen * self.top_k / self.n_experts)
            keep = capacity_keep(experts3, self.n_experts, capacity).reshape(-1)
        out = self._dispatch(x_flat, weights.reshape(-1), experts.reshape(-1), keep)
        if self.shared is not None:
            out = out + self.shared(x_flat)
        out = out.view(bsz, seqlen, dim)
        if torch.is_grad_enabled():
            aux = balance_loss(experts3, probs.view(bsz, seqlen, -1), self.n_experts)
            z = torch.logsumexp(logits, dim=-1).pow(2).mean()
            if not _in_backward():
                self._record(experts, keep, aux, z)
            loss = self.aux_loss_coef * aux + self.z_loss_coef * z
            if loss.requires_grad and (self.aux_loss_coef > 0 or self.z_loss_coef > 0):
                out = _AuxLossScaler.apply(out, loss, self.aux_loss_scale)
        return out

    def _dispatch(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, keep: torch.Tensor | None
    ) -> torch.Tensor:
        """Sort token-expert pairs by expert, run the experts on contiguous rows, scatter the weighted rows back."""
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)
        if keep is not None:
            token, weights, experts = token[keep], weights[keep], experts[keep]
        counts = histogram(experts, self.n_experts)
        order = torch.argsort(experts, stable=True)
        token = token[order]
        y = self.experts(x[token], counts)
        y = y * weights[order].unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))

    @torch.no_grad()
    def _record(
        self, experts: torch.Tensor, keep: torch.Tensor | None, aux: torch.Tensor, z: torch.Tensor
    ) -> None:
        # Counted as routed, before any capacity drop, so the monitor sees the router's real imbalance.
        self.tokens_per_expert += histogram(experts, self.n_experts).to(self.tokens_per_expert.dtype)
        self.routed_tokens += experts.numel()
        if keep is not None:
            self.dropped_tokens += (~keep).sum().float()
        # Unweighted (as Megatron-LM logs them): 1.0 is a perfectly balanced router whatever the coefficient.
        self.aux_loss_sum += aux.detach().float()
        self.z_loss_sum += z.detach().float()
        self.forwards += 1

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        """Router gate N(0, std); experts like the dense SwiGLU (w2 depth-scaled); zero bias and statistics."""
        params = dict(self.named_parameters())
        for name, init in moe_init_plan(std, out_std, self.shared is not None, self.experts.b1 is not None):
            init(params[name])
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        self.router.expert_bias.zero_()
        self.reset_stats()

    @torch.no_grad()
    def reset_stats(self) -> None:
        for name in (
            "tokens_per_expert",
            "dropped_tokens",
            "routed_tokens",
            "aux_loss_sum",
            "z_loss_sum",
            "forwards",
        ):
            getattr(self, name).zero_()
