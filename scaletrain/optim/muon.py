"""Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable for LLM Training"): the momentum of each hidden
matrix orthogonalised by a Newton-Schulz iteration, for every parallel layout; AdamW for the other parameters, in
the same optimizer so that one state dict, one LR schedule and one checkpoint cover both."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

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


def newton_schulz_flops(shape: tuple[int, ...], steps: int) -> float:
    """FLOPs of `newton_schulz` on a matrix (or a stack of them) of `shape`: per iteration the Gram matrix
    (2 m^2 n), its square (2 m^3) and the product with X (2 m^2 n), m <= n the short side. What the ranks split
    between them, and the planner's count (planning/estimators/muon.py)."""
    m, n = sorted(shape[-2:])
    return math.prod(shape[:-2]) * steps * (4 * m * m * n + 2 * m**3)


# Whole fp32 matrices exchanged per collective. A call has a fixed cost (a rendezvous of every rank, a launch) paid
# per bucket instead of per matrix, and a step of several buckets lets the next bucket's exchange run while this
# one is orthogonalised. One block of the 30M benchmark model is 13.6 MB: about a block per bucket.
BUCKET_BYTES = 16 * 2**20


@dataclass
class Job:
    """One matrix of a Muon step: its parameter, the update to orthogonalise (this rank's shard of it where the
    parameter is sharded), the lr multiplier of its step, the rank that orthogonalises it, the dim sharded."""

    p: torch.Tensor
    update: torch.Tensor
    alpha: float
    owner: int = 0
    dim: int = 0

    def piece(self, n: int, r: int) -> tuple[int, int, torch.Size]:
        """Offset, length and shape of rank r's shard of the whole update, as DTensor's Shard(dim) places it
        (torch.chunk's split: ceil(L/n) rows each, the last ones shorter or empty)."""
        length = self.p.shape[self.dim]
        chunk = -(-length // n)
        start = min(r * chunk, length)
        size = min(start + chunk, length) - start
        shape = list(self.p.shape)
        shape[self.dim] = size
        return start, size, torch.Size(shape)


def _buckets(jobs: list[Job], n: int, steps: int) -> list[list[Job]]:
    """`jobs` in order, cut every BUCKET_BYTES, each given an owner among n ranks: within a bucket the costliest
    first to the least loaded rank so far (loads carried over buckets; ties to the lowest rank), so each rank
    orthogonalises about 1/n of the FLOPs. Every rank computes the same answer from the same shapes."""
    out: list[list[Job]] = [[]]
    size = 0
    for j in jobs:
        if size >= BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(j)
        size += 4 * j.p.numel()
    load = [0.0] * n
    for bucket in out:
        for j in sorted(bucket, key=lambda j: -newton_schulz_flops(j.p.shape, steps)):
            j.owner = min(range(n), key=lambda r: (load[r], r))
            load[j.owner] += newton_schulz_flops(j.p.shape, steps)
    return [b for b in out if b]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _apply(job: Job, ortho: torch.Tensor, shrink: float) -> None:
    """W <- W (1 - lr wd) - lr s O on this rank's shard (the same two element-wise ops a DTensor would run)."""
    w = _local(job.p)
    w.mul_(shrink)
    w.add_(ortho.view(w.shape).to(w.dtype), alpha=job.alpha)


def _sharded_exchange(jobs: list[Job], group: dist.ProcessGroup, steps: int, shrink: float) -> None:
    """Orthogonalise `jobs`, each sharded over `group` along its `dim`, and apply them. Per bucket one
    all_to_all sends every shard to its matrix's owner only, the owner orthogonalises the matrices it assembled,
    and a second all_to_all sends each rank its shard of the results back: each rank receives about 1/n of the
    matrices whole and sends them back once (a gather to all and a broadcast back receive all of them twice). The next
    bucket's gather is on the wire while this bucket is orthogonalised, and this bucket's scatter while the next
    one is. fp32 on the wire: newton_schulz runs in fp32 anyway, and a bf16 shard widened to fp32 is exact."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    buckets = _buckets(jobs, n, steps)
    device = _local(jobs[0].update).device

    def gather(bucket: list[Job]) -> tuple:
        send = [_local(j.update).reshape(-1).float() for o in range(n) for j in bucket if j.owner == o]
        sends = [sum(_local(j.update).numel() for j in bucket if j.owner == o) for o in range(n)]
        recvs = [sum(j.piece(n, r)[2].numel() for j in bucket if j.owner == me) for r in range(n)]
        recv = torch.empty(sum(recvs), device=device)
        work = dist.all_to_all_single(recv, torch.cat(send) if send else recv[:0], recvs, sends,
                                      group=group, async_op=True)  # fmt: skip
        return work, recv, recvs, sends

    def scatter(bucket: list[Job], gathered: tuple) -> tuple:
        work, recv, recvs, sends = gathered
        work.wait()
        mine = [j for j in bucket if j.owner == me]
        by_rank = [
            seg.split([j.piece(n, r)[2].numel() for j in mine]) for r, seg in enumerate(recv.split(recvs))
        ]
        send = []
        orthos = []
        for i, j in enumerate(mine):
            full = torch.cat([by_rank[r][i].view(j.piece(n, r)[2]) for r in range(n)], dim=j.dim)
            orthos.append(newton_schulz(full, steps))
        for r in range(n):
            send += [o.narrow(j.dim, *j.piece(n, r)[:2]).reshape(-1) for j, o in zip(mine, orthos)]
        back = torch.empty(sum(sends), device=device)
        work = dist.all_to_all_single(back, torch.cat(send) if send else back[:0], sends, recvs,
                                      group=group, async_op=True)  # fmt: skip
        return work, back, sends

    def finish(bucket: list[Job], scattered: tuple) -> None:
        work, back, sends = scattered
        work.wait()
        for o, seg in enumerate(back.split(sends)):
            theirs = [j for j in bucket if j.owner == o]
            for j, ortho in zip(theirs, seg.split([_local(j.update).numel() for j in theirs])):
                _apply(j, ortho, shrink)

    gathered = gather(buckets[0])
    previous = None
    for i, bucket in enumerate(buckets):
        nxt = gather(buckets[i + 1]) if i + 1 < len(buckets) else None
        scattered = scatter(bucket, gathered)
        if previous is not None:
            finish(*previous)
        previous, gathered = (bucket, scattered), nxt
    finish(*previous)


def _replicated_exchange(jobs: list[Job], group: dist.ProcessGroup, steps: int, shrink: float) -> None:
    """Orthogonalise `jobs`, whole and equal on every rank of `group` (DDP's replicas), and apply them: each rank
    orthogonalises its owned ~1/n, and one all_gather per bucket hands every rank every result (padded to the
    largest share). The next bucket is orthogonalised while this one's results travel."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    previous = None
    for bucket in [*_buckets(jobs, n, steps), None]:
        if bucket is not None:
            mine = [newton_schulz(j.update, steps).reshape(-1) for j in bucket if j.owner == me]
            shares = [sum(j.p.numel() for j in bucket if j.owner == r) for r in range(n)]
            buf = torch.zeros(max(shares), device=bucket[0].update.device)
            if mine:
                buf[: shares[me]] = torch.cat(mine)
            outs = [torch.empty_like(buf) for _ in range(n)]
            work = dist.all_gather(outs, buf, group=group, async_op=True)
        if previous is not None:
            done, (pwork, pouts) = previous
            pwork.wait()
            for r, out in enumerate(pouts):
                theirs = [j for j in done if j.owner == r]
                for j, ortho in zip(theirs, out.split([j.p.numel() for j in theirs])):
                    _apply(j, ortho, shrink)
        previous = (bucket, (work, outs)) if bucket is not None else None


def _sharded_dim(t: DTensor) -> int | None:
    """The one mesh dim `t` is sharded over by a plain Shard (the others replicate it): FSDP, HSDP, zero2, TP
    alone. None for the rest (TP x FSDP's strided shards, EP's expert meshes)."""
    sharded = [k for k, pl in enumerate(t.placements) if not pl.is_replicate()]
    if len(sharded) == 1 and type(t.placements[sharded[0]]) is Shard:
        return sharded[0]
    return None


class Muon(torch.optim.AdamW):
    """Muon for the param groups marked `muon: True`, AdamW (this class's parent, unchanged) for the others.

    A Muon step per matrix W with gradient G: B <- lerp(B, G, 1 - momentum) (torch.optim.Muon's buffer), U = the
    Nesterov look-ahead lerp(G, B, momentum) (or B), O = newton_schulz(U), W <- W (1 - lr wd) - lr s O with s from
    `update_scale`. State: `momentum_buffer`, shaped and placed as the parameter, so DCP saves and reshards it by
    name as it does AdamW's moments, and a `step` count.

    Distributed (issue 40): Newton-Schulz needs the whole matrix, and each rank orthogonalises about 1/N of the
    matrices (by FLOPs), in buckets of several matrices per collective:
    - a DTensor sharded over one mesh dim (FSDP, HSDP's shard dim, zero2, TP alone): `_sharded_exchange`, an
      all_to_all of the shards to each matrix's owner and one back, per bucket, overlapped with the next bucket;
    - a plain tensor replicated over `replicas` (DDP: its gradients are all-reduced, every rank holds them whole):
      `_replicated_exchange`, each rank orthogonalises its share and an all_gather per bucket shares the results;
    - a plain tensor without `replicas` (one process, pipeline stages without data parallelism, ZeRO-1's shard of
      whole parameters, spread by ZeRO's own partition) or a replicated DTensor: orthogonalised where it is;
    - any other placement (TP x FSDP's strided shards, EP's expert meshes): gathered
      whole with `full_tensor()`, orthogonalised by one owner taken in turn over the mesh, and broadcast back
      along each mesh dim (one matrix per collective: the general path every placement DTensor has goes through).
    Every path applies the owner's very bits on every rank, so replicas stay bitwise equal, and orthogonalises
    exactly the tensor one process would: the result equals the single process's up to the gradients' own
    reduction order. benchmarks/muon_cost.py measures the step time against AdamW's."""

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
        replicas: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach,
                         fused=fused)  # fmt: skip
        muon = dict(muon=False, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, adjust_lr=adjust_lr)
        self.defaults.update(muon)
        # The ranks that hold this optimizer's plain matrices whole and equal (DDP's data-parallel group): they
        # split the Newton-Schulz work. Not a default: ZeRO-1 rebuilds this class per shard without it.
        self.replicas = replicas if replicas is not None and dist.get_world_size(replicas) > 1 else None
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
        turn = 0  # whose turn it is to orthogonalise the next matrix of the general (per-matrix) path
        for group in groups:
            if group["muon"]:
                turn = self._muon_step(group, turn)
        return loss

    def _muon_step(self, group: dict, turn: int) -> int:
        lr, beta = group["lr"], group["momentum"]
        jobs = []
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
            jobs.append(Job(p, update, -lr * update_scale(p.shape, group["adjust_lr"])))
        return self.orthogonalise(jobs, group["ns_steps"], 1 - lr * group["weight_decay"], turn)

    def orthogonalise(self, jobs: list[Job], steps: int, shrink: float, turn: int = 0) -> int:
        """W <- W shrink + alpha newton_schulz(U) for every job, each by the path its placement takes (the class
        docstring); returns the general path's next turn. Every rank of a mesh calls it with the same jobs."""
        sharded: dict[tuple, list[Job]] = {}  # by (mesh, mesh dim): one exchange per process group
        replicated: list[Job] = []
        for job in jobs:
            update = job.update
            if isinstance(update, DTensor) and (k := _sharded_dim(update)) is not None:
                job.dim = update.placements[k].dim
                sharded.setdefault((update.device_mesh, k), []).append(job)
            elif isinstance(update, DTensor) and not all(pl.is_replicate() for pl in update.placements):
                ortho, turn = self._gathered(update, steps, turn)
                _apply(job, ortho.to_local(), shrink)
            elif not isinstance(update, DTensor) and self.replicas is not None:
                replicated.append(job)
            else:  # whole here, and every rank holding it computes the same: nothing to send
                _apply(job, newton_schulz(_local(update), steps), shrink)
        for (mesh, k), group in sharded.items():
            _sharded_exchange(group, mesh.get_group(k), steps, shrink)
        if replicated:
            _replicated_exchange(replicated, self.replicas, steps, shrink)
        return turn

    def _gathered(self, update: DTensor, steps: int, turn: int) -> tuple[DTensor, int]:
        """newton_schulz of the whole `update` by the rank whose turn it is, placed as `update` is; and the next
        turn. The general path: any placement, one matrix per collective."""
        mesh, placements = update.device_mesh, update.placements
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
