"""Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable for LLM Training"): the momentum of each hidden
matrix orthogonalised by a Newton-Schulz iteration, for every parallel layout; AdamW for the other parameters, in
the same optimizer so that one state dict, one LR schedule and one checkpoint cover both."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

# Jordan's quintic (torch.optim.Muon's and Moonlight's): the slope at 0 is pushed as high as it goes, so 5 steps
# lift small singular values fast, at the price of landing in ~[0.7, 1.2] instead of exactly 1.
NS5 = (3.4445, -4.7750, 2.0315)
EPS = 1e-7
# The group keys that make a param group a Muon group; zero1 copies them into its shards' groups.
MUON_KEYS = ("muon", "lr", "momentum", "nesterov", "ns_steps", "adjust_lr")


def newton_schulz(
    g: torch.Tensor, steps: int = 5, coefficients: tuple[float, float, float] = NS5, eps: float = EPS
) -> torch.Tensor:
    """U S' V^T for G = U S V^T, S' ~ 1 (the orthogonal factor U V^T, approximately): `steps` iterations of
    X <- aX + (bA + cA^2)X, A = XX^T, from X = G/|G|_F (so every singular value starts in [0, 1]). In fp32,
    whatever G's dtype: the distributed owner must compute exactly what one process computes. A 3-D G ([E, A, B],
    MoE experts) is orthogonalised per matrix. The iteration runs on the wide orientation (A <= B): the Gram
    matrix XX^T is then the smaller one."""
    a, b, c = coefficients
    x = g.to(torch.float32)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.mT if tall else x


def update_scale(shape: torch.Size, adjust_lr: str) -> float:
    """The lr multiplier of a matrix of `shape` (the last two dims: one expert of a 3-D weight).
    match_rms_adamw: 0.2 sqrt(max(A, B)) gives the update the RMS of AdamW's (~0.2), so AdamW's lr and weight
    decay transfer (Liu et al. 2025); original: sqrt(max(1, A/B)) (Jordan)."""
    rows, cols = shape[-2], shape[-1]
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The parameters Muon steps: every trainable 2-D or 3-D weight except the embedding and the output head
    (their rows are looked up one token at a time, not a linear map of the whole residual stream; Jordan 2024
    and Moonlight keep them on AdamW). Works on a DDP-wrapped part and on a pipeline stage without them."""
    inner = getattr(model, "module", model)  # DDP wraps the model in .module
    skip = {
        id(p)
        for name in ("tok_embeddings", "output")
        if (m := getattr(inner, name, None)) is not None
        for p in m.parameters()
    }
    return [p for p in model.parameters() if p.requires_grad and p.ndim in (2, 3) and id(p) not in skip]


def _coordinate(index: int, shape: tuple[int, ...]) -> list[int]:
    """The mesh coordinate of the `index`-th rank of a mesh of `shape` (row-major)."""
    out = []
    for size in reversed(shape):
        out.append(index % size)
        index //= size
    return out[::-1]


class Muon(torch.optim.AdamW):
    """Muon for the param groups marked `muon: True`, AdamW (this class's parent, unchanged) for the others.

    A Muon step per matrix W with gradient G: B <- lerp(B, G, 1 - momentum) (torch.optim.Muon's buffer), U = the
    Nesterov look-ahead lerp(G, B, momentum) (or B), O = newton_schulz(U), W <- W (1 - lr wd) - lr s O with s from
    `update_scale`. State: `momentum_buffer`, shaped and placed as the parameter, so DCP saves and reshards it by
    name as it does AdamW's moments, and a `step` count.

    Distributed: Newton-Schulz needs the whole matrix. A plain tensor (one process, DDP, pipeline stages without
    data sharding, ZeRO-1's shard of whole parameters) is whole on its rank and orthogonalised there (under DDP
    every rank computes every matrix: its gradients are already all-reduced, so nothing is sent; zero1 spreads
    that work). A DTensor (FSDP, HSDP, zero2, TP, EP and their hybrids) is gathered with `full_tensor()` (the
    all-gather over its sharded mesh dims, the same gather FSDP runs for a forward), orthogonalised by one owner
    only, taken in turn over the mesh's ranks matrix by matrix so every rank computes ~1/N of them, then broadcast
    from the owner along each mesh dim (last dim first: after dim d every rank that shares the owner's
    coordinates before d holds it) and each rank keeps its shard (`distribute_tensor` without communication).
    Why this and not a gather to the owner and a scatter back: it handles every placement DTensor has (uneven
    FSDP shards, TP x FSDP's strided shards, HSDP's replicas, EP's expert mesh) with two public collectives, and
    every rank applies the owner's very bits, so replicas stay bitwise equal and the result equals the single
    process's up to the gradients' own reduction order. Its cost: each rank receives each matrix twice (the
    gather and the broadcast) instead of once; benchmarks/muon.py measures the step time."""

    def __init__(
        self,
        params: list[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        *,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr: str = "match_rms_adamw",
        foreach: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach,
                         fused=fused)  # fmt: skip
        muon = dict(muon=False, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, adjust_lr=adjust_lr)
        self.defaults.update(muon)
        for group in self.param_groups:
            for k, v in muon.items():
                group.setdefault(k, v)
            if group["muon"] and any(p.ndim not in (2, 3) for p in group["params"]):
                raise ValueError("Muon steps 2-D matrices and 3-D stacks of them ([E, A, B] experts) only")

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 (torch.optim.Optimizer's signature)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        # AdamW's step over its groups only: the same code as a plain AdamW, so those parameters train the same.
        self.param_groups = [g for g in groups if not g["muon"]]
        try:
            super().step()
        finally:
            self.param_groups = groups
        turn = 0  # whose turn it is to orthogonalise the next gathered matrix
        for group in groups:
            if group["muon"]:
                turn = self._muon_step(group, turn)
        return loss

    def _muon_step(self, group: dict, turn: int) -> int:
        lr, decay, beta = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
                # A step count, as AdamW's states have (AdamW's __setstate__, run by load_state_dict, needs one).
                state["step"] = torch.tensor(0.0)
            state["step"] += 1
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - beta)
            update = p.grad.lerp(buf, beta) if group["nesterov"] else buf
            ortho, turn = self._orthogonalised(update, group["ns_steps"], turn)
            p.mul_(1 - lr * decay)
            p.add_(ortho.to(p.dtype), alpha=-lr * update_scale(p.shape, group["adjust_lr"]))
        return turn

    def _orthogonalised(self, update: torch.Tensor, steps: int, turn: int) -> tuple[torch.Tensor, int]:
        """newton_schulz of the whole `update`, placed as `update` is; and the next owner's turn."""
        if not isinstance(update, DTensor):
            return newton_schulz(update, steps), turn
        mesh, placements = update.device_mesh, update.placements
        if all(pl.is_replicate() for pl in placements):  # whole on every rank: no one needs to send anything
            local = newton_schulz(update.to_local(), steps)
            return DTensor.from_local(local, mesh, placements, run_check=False), turn
        full = update.full_tensor()
        owner = _coordinate(turn % mesh.size(), tuple(mesh.shape))
        ortho = (
            newton_schulz(full, steps)
            if list(mesh.get_coordinate()) == owner
            else torch.empty_like(full, dtype=torch.float32)
        )
        _broadcast(ortho, mesh, owner)
        return distribute_tensor(ortho, mesh, placements, src_data_rank=None), turn + 1


def _broadcast(t: torch.Tensor, mesh: DeviceMesh, owner: list[int]) -> None:
    """`t` from the rank at coordinate `owner` to every rank of `mesh`: along the last dim first, so that after
    dim d every rank whose coordinates before d are the owner's holds it."""
    for d in reversed(range(mesh.ndim)):
        if mesh.size(d) > 1:
            dist.broadcast(t, group=mesh.get_group(d), group_src=owner[d])
