"""Data-parallel communication: DDP communication hooks (bf16/fp16 compression, PowerSGD with its error-feedback
state checkpointed), FSDP2 prefetch, and the bytes each rank sends per step (`comm_bytes` in metrics.jsonl).

Bytes are counted as a ring algorithm puts them on the wire per rank (what NCCL and gloo's ring run): an
all-reduce of S bytes over W ranks sends 2(W-1)/W x S, an all-gather or reduce-scatter of S (unsharded) bytes
sends (W-1)/W x S. What is counted is what each collective is handed: DDP's hooks count the tensors they
all-reduce, FSDP2's all-gathers and reduce-scatters are counted by wrapping its own collective objects."""

from __future__ import annotations

import logging
import math
import zlib
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.nn.parallel import DistributedDataParallel as DDP

from scaletrain.config import ParallelConfig

log = logging.getLogger(__name__)


def all_reduce_wire(nbytes: float, world: int) -> float:
    """Bytes one rank sends in a ring all-reduce of `nbytes`: a reduce-scatter then an all-gather."""
    return 2 * (world - 1) / world * nbytes


def gather_wire(nbytes: float, world: int) -> float:
    """Bytes one rank sends in a ring all-gather (or reduce-scatter) whose unsharded tensor has `nbytes`."""
    return (world - 1) / world * nbytes


class CommMeter(Stateful):
    """The data-parallel bytes this rank sent, per step, and the one piece of communication state that resumes
    (PowerSGD's). `counted` is False where other traffic (tp, pp, cp) is not counted: then nothing is reported
    rather than a part presented as the whole."""

    def __init__(self, counted: bool = True) -> None:
        self.counted = counted
        self.total = 0.0
        self.per_step = 0.0  # DDP without a hook: every gradient all-reduced once per step (DDP's C++ path)
        self.steps = 0
        self._mark = (0.0, 0)
        self.powersgd: PowerSGD | None = None

    def add(self, nbytes: float) -> None:
        self.total += nbytes

    def step_started(self) -> None:
        self.steps += 1
        self.total += self.per_step

    def read(self) -> dict[str, float]:
        """{"comm_bytes": mean bytes sent per step since the last read}; {} when not counted or no step ran."""
        total, steps = self.total - self._mark[0], self.steps - self._mark[1]
        self._mark = (self.total, self.steps)
        if not self.counted or steps <= 0:
            return {}
        return {"comm_bytes": total / steps}

    def state_dict(self) -> dict:
        return self.powersgd.state_dict() if self.powersgd is not None else {}

    def load_state_dict(self, sd: dict) -> None:
        if self.powersgd is not None:
            self.powersgd.load_state_dict(sd)


# -- DDP ------------------------------------------------------------------------------------------------------


def _count_hook(hook, dtype: torch.dtype):
    """torch's bf16/fp16 compression hook, counting the half-precision bucket it all-reduces."""

    def counted(state: tuple[dist.ProcessGroup, CommMeter], bucket):  # unannotated: see PowerSGD._hook
        group, meter = state
        meter.add(all_reduce_wire(bucket.buffer().numel() * dtype.itemsize, group.size()))
        return hook(group, bucket)

    return counted


def apply_comm_hook(ddp: DDP, pcfg: ParallelConfig, meter: CommMeter, group: dist.ProcessGroup) -> None:
    """parallel.grad_compression on a DDP module (validate allows it only for ddp/zero1 without tp/pp/cp)."""
    kind = pcfg.grad_compression
    if kind == "none":
        grads = sum(p.numel() * p.element_size() for p in ddp.parameters() if p.requires_grad)
        meter.per_step += all_reduce_wire(grads, group.size())
        return
    if kind in ("bf16", "fp16"):
        hook = default_hooks.bf16_compress_hook if kind == "bf16" else default_hooks.fp16_compress_hook
        dtype = torch.bfloat16 if kind == "bf16" else torch.float16
        ddp.register_comm_hook((group, meter), _count_hook(hook, dtype))
    else:
        meter.powersgd = PowerSGD(ddp, group, pcfg, meter)
    log.info("DDP gradient compression: %s", kind)


# A bucket's layout: (parameter name, offset in the bucket's flat buffer, shape) for each of its gradients.
Layout = tuple[tuple[str, int, tuple[int, ...]], ...]


class PowerSGD:
    """torch's PowerSGD hook on one DDP module (Vogels et al. 2019), its bytes counted, and its state as tensors
    by parameter name, so that a resume continues bit for bit.

    torch keys the error feedback and the low-rank Q factors by DDP bucket index, and the buckets change: DDP
    rebuilds them after the first step in the order the gradients became ready, and a resumed process starts again
    from its initial buckets. So the state is kept per parameter in the checkpoint and re-laid into whatever
    buckets the hook sees (`_relayout`), and new Qs are drawn per parameter (`_seed_qs`), not per bucket. Errors
    differ per rank (keys error.rank{r}.<name>); the Q factors and the step count are the same on every rank. (The
    state's RNG, which no longer draws, is still saved: checkpoints keep their keys.)"""

    def __init__(self, ddp: DDP, group: dist.ProcessGroup, pcfg: ParallelConfig, meter: CommMeter) -> None:
        self.ddp, self.meter, self.world = ddp, meter, group.size()
        self.rank = dist.get_rank(group)
        self.state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=pcfg.powersgd_rank,
            start_powerSGD_iter=pcfg.powersgd_start_iter,
            warm_start=True,  # the hook always takes the Qs in q_memory_dict: _seed_qs draws them (see there)
            use_error_feedback=True,
            random_seed=0,
        )
        self.names = {id(p): n for n, p in ddp.module.named_parameters() if p.requires_grad}
        self.params = {n: p for n, p in ddp.module.named_parameters() if p.requires_grad}
        # Warm start keeps each step's Qs for the next; without it _seed_qs draws new ones every step.
        self.warm = pcfg.powersgd_warm_start
        self.layouts: dict[int, Layout] = {}
        self.pending: dict[str, torch.Tensor] = {}  # per-parameter state not yet laid into buckets
        # CUDA futures (NCCL) run their callbacks as the work is queued, in the order of the calls: no race.
        self.serial = dist.get_backend(group) == "gloo"
        self._tail: torch.futures.Future | None = None  # the future of this step's latest bucket
        ddp.register_comm_hook(self, PowerSGD._hook)

    # -- the hook
    def _hook(self, bucket):
        # Unannotated: DDP compares the hook's annotations with dist.GradBucket and Future[Tensor] themselves, and
        # under `from __future__ import annotations` they are strings.
        if not self.serial:
            return self._compress(bucket)
        # gloo: torch's hook issues each bucket's P and Q all-reduces from callbacks on gloo's worker threads, where
        # they race the next bucket's first all-reduce, and gloo pairs collectives by the order they are issued:
        # with several buckets the ranks disagreed ("Received data size doesn't match expected size"). So a bucket
        # starts once the one before it has finished; DDP hands over the buckets in index order on every rank.
        if bucket.index() == 0:
            self._tail = None
        done, prev = torch.futures.Future(), self._tail
        self._tail = done

        def start(_: object = None) -> None:
            try:
                self._compress(bucket).add_done_callback(partial(_settle, done))
            except Exception as e:
                done.set_exception(e)

        if prev is None:
            start()
        else:
            prev.add_done_callback(start)
        return done

    def _compress(self, bucket):
        layout = self._layout(bucket)
        if self.layouts.get(bucket.index()) != layout:
            self._relayout(bucket.index(), layout, bucket.buffer())
        self._seed_qs(bucket.index(), layout, bucket.buffer())
        st = self.state
        before, plain = st.total_numel_after_compression, st.iter < st.start_powerSGD_iter
        fut = powerSGD_hook.powerSGD_hook(st, bucket)
        # The hook's own statistics: uncompressed numel plus (n + m) x r per compressed matrix, i.e. what its
        # three all-reduces (uncompressed tensors, Ps, Qs) carry; before start_iter it all-reduces the bucket.
        numel = bucket.buffer().numel() if plain else st.total_numel_after_compression - before
        self.meter.add(all_reduce_wire(numel * bucket.buffer().element_size(), self.world))
        return fut

    def _layout(self, bucket: dist.GradBucket) -> Layout:
        base = bucket.buffer().storage_offset()
        return tuple(
            (self.names[id(p)], g.storage_offset() - base, tuple(p.shape))
            for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)
        )

    def _relayout(self, index: int, layout: Layout, buffer: torch.Tensor) -> None:
        """Lay the state of this bucket's parameters into it, taking it from the old buckets that held them (and
        the old bucket of the same index), or from a loaded checkpoint. Bucket by bucket, inside the hook: DDP
        holds its reducer's lock while hooks run, so the other current buckets cannot be asked for here. Every
        parameter is in exactly one current bucket, so by the end of the step every old bucket has been moved."""
        st = self.state
        if not (st.error_dict or st.q_memory_dict or self.pending):
            self.layouts[index] = layout  # nothing to move (plain all-reduce steps)
            return
        names = {name for name, _, _ in layout}
        old = [b for b, lay in self.layouts.items() if b == index or any(n in names for n, _, _ in lay)]
        for b in old:
            self.pending.update(self._split(b, self.layouts.pop(b)))
            for d in (st.error_dict, st.p_memory_dict, st.q_memory_dict):
                d.pop(b, None)
        self._join(index, layout, buffer)
        self.layouts[index] = layout

    def _factors(self, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """(Q numel, P numel) when the hook compresses a gradient of this shape (viewed as shape[0] x rest),
        else None: torch's own rule (compressed size x min_compression_rate < uncompressed size)."""
        n = shape[0] if shape else 1
        m = math.prod(shape) // max(n, 1)
        r = min(n, m, self.state.matrix_approximation_rank)
        return (
            (m * r, n * r)
            if powerSGD_hook._should_compress(n, m, r, self.state.min_compression_rate)[0]
            else None
        )

    def _compressed(self, layout: Layout) -> list[tuple[str, int, int]]:
        """(name, Q numel, P numel) of the matrices the hook compresses, in the order it lays their Qs out: grouped
        by matrix shape in order of first appearance (powerSGD_hook's shape_to_tensors)."""
        groups: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        for name, _, shape in layout:
            if (sizes := self._factors(shape)) is not None:
                groups.setdefault((shape[0], math.prod(shape)), []).append((name, *sizes))
        return [item for group in groups.values() for item in group]

    def _split(self, b: int, layout: Layout) -> dict[str, torch.Tensor]:
        st, out = self.state, {}
        if b in st.error_dict:
            err = st.error_dict[b]
            for name, offset, shape in layout:
                out[f"error.{name}"] = err[offset : offset + math.prod(shape)].clone()
        if self.warm and b in st.q_memory_dict:
            q, at = st.q_memory_dict[b], 0
            for name, numel, _ in self._compressed(layout):
                out[f"q.{name}"] = q[at : at + numel].clone()
                at += numel
        return out

    def _seed_qs(self, b: int, layout: Layout, buffer: torch.Tensor) -> None:
        """Draw bucket b's Q factors where the hook would: at its first compressed step (every compressed step
        without warm start). torch draws one seed per bucket from its state's RNG, so its Qs depend on how the
        parameters fall into buckets, and a resumed process's first step runs in DDP's initial single bucket: a
        checkpoint saved before the first compressed step resumed into other Qs than the uninterrupted run drew.
        Here each matrix's Q comes from its parameter's name and the step's iteration: any bucketing, the same
        Qs, on every rank (the hook orthogonalises them, as it does its own draws)."""
        st = self.state
        if st.iter < st.start_powerSGD_iter or (self.warm and b in st.p_memory_dict):
            return
        compressed = self._compressed(layout)
        if not compressed:
            return
        draws = []
        for name, q_numel, _ in compressed:
            gen = torch.Generator().manual_seed(zlib.crc32(f"{name}@{st.iter}".encode()))
            draws.append(torch.randn(q_numel, generator=gen))
        st.q_memory_dict[b] = torch.cat(draws).to(buffer.device, buffer.dtype)
        # P is recomputed from Q before it is read (P = M Q): only its memory must exist.
        p_numel = sum(p for _, _, p in compressed)
        st.p_memory_dict[b] = torch.empty(p_numel, dtype=buffer.dtype, device=buffer.device)

    def _join(self, b: int, layout: Layout, buffer: torch.Tensor) -> None:
        """Build bucket b's error and Q from the pending per-parameter state (taking what it uses)."""
        st, pend = self.state, self.pending
        if any(f"error.{n}" in pend for n, _, _ in layout):
            err = torch.zeros(buffer.numel(), dtype=buffer.dtype, device=buffer.device)
            for name, offset, shape in layout:
                if f"error.{name}" in pend:
                    err[offset : offset + math.prod(shape)] = pend[f"error.{name}"]
            st.error_dict[b] = err
        compressed = self._compressed(layout)
        if compressed and all(f"q.{n}" in pend for n, _, _ in compressed):
            st.q_memory_dict[b] = torch.cat([pend[f"q.{n}"] for n, _, _ in compressed]).to(buffer.device)
            # P is recomputed from Q before it is read (P = M Q): only its memory must exist.
            p_numel = sum(p for _, _, p in compressed)
            st.p_memory_dict[b] = torch.empty(p_numel, dtype=buffer.dtype, device=buffer.device)
        for name, _, _ in layout:
            pend.pop(f"error.{name}", None)
            pend.pop(f"q.{name}", None)

    # -- Stateful
    def state_dict(self) -> dict:
        """Every key always present (zeros where torch holds nothing yet), so that a fresh process can hand this
        to DCP as the shape of what it loads."""
        live = dict(self.pending)
        for b, layout in self.layouts.items():
            live.update(self._split(b, layout))
        kind, keys, pos, has_gauss, gauss = self.state.rng.get_state()
        sd = {
            "iter": torch.tensor(self.state.iter),
            "rng_keys": torch.from_numpy(keys.astype(np.int64)),
            "rng_pos": torch.tensor([pos, has_gauss]),
            "rng_gauss": torch.tensor(gauss, dtype=torch.float64),
        }
        q_valid = True
        for name, p in self.params.items():
            zero = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            sd[f"error.rank{self.rank}.{name}"] = live.get(f"error.{name}", zero)
            sizes = self._factors(tuple(p.shape))
            if sizes is not None:
                q_valid &= f"q.{name}" in live
                sd[f"q.{name}"] = live.get(f"q.{name}", torch.zeros(sizes[0], dtype=p.dtype, device=p.device))
        sd["q_valid"] = torch.tensor(int(q_valid))
        return sd

    def load_state_dict(self, sd: dict) -> None:
        st = self.state
        st.iter = int(sd["iter"])
        pos, has_gauss = (int(v) for v in sd["rng_pos"])
        keys = sd["rng_keys"].cpu().numpy().astype(np.uint32)
        st.rng.set_state(("MT19937", keys, pos, has_gauss, float(sd["rng_gauss"])))
        mine = f"error.rank{self.rank}."
        self.pending = {f"error.{k[len(mine) :]}": v.clone() for k, v in sd.items() if k.startswith(mine)}
        if int(sd["q_valid"]):
            self.pending.update({k: v.clone() for k, v in sd.items() if k.startswith("q.")})
        st.error_dict.clear()
        st.p_memory_dict.clear()
        st.q_memory_dict.clear()
        self.layouts = {}


def _settle(done: torch.futures.Future, fut: torch.futures.Future) -> None:
    """Complete `done` with `fut`'s result or exception."""
    try:
        done.set_result(fut.value())
    except Exception as e:
        done.set_exception(e)


# -- FSDP2 ----------------------------------------------------------------------------------------------------


class _CountedAllGather(DefaultAllGather):
    def __init__(self, meter: CommMeter) -> None:
        self.meter = meter

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.meter.add(gather_wire(output_tensor.numel() * output_tensor.element_size(), group.size()))
        return super().__call__(output_tensor, input_tensor, group, async_op)


class _CountedReduceScatter(DefaultReduceScatter):
    def __init__(self, meter: CommMeter) -> None:
        self.meter = meter

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.meter.add(gather_wire(input_tensor.numel() * input_tensor.element_size(), group.size()))
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def count_fsdp(model: nn.Module, meter: CommMeter, replicas: int) -> None:
    """Count every FSDP2 unit's all-gathers and reduce-scatters (FSDP2's own collective objects, subclassed: the
    same calls, the same code path), and under HSDP the all-reduce of each sharded gradient over `replicas`."""
    gather, scatter = _CountedAllGather(meter), _CountedReduceScatter(meter)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(gather)
            m.set_custom_reduce_scatter(scatter)
            if replicas > 1:
                m.set_all_reduce_hook(
                    lambda t: meter.add(all_reduce_wire(t.numel() * t.element_size(), replicas))
                )


def set_prefetch(blocks: list[FSDPModule], depth: int) -> None:
    """parallel.fsdp_prefetch: each block issues the all-gathers of the next `depth` blocks (forward) and of the
    `depth` blocks before it (backward) as soon as its own have landed; 0 leaves FSDP2's default."""
    if depth <= 0:
        return
    for i, block in enumerate(blocks):
        ahead = blocks[i + 1 : i + 1 + depth]
        behind = [blocks[j] for j in range(i - 1, max(i - 1 - depth, -1), -1)]
        if ahead:
            block.set_modules_to_forward_prefetch(ahead)
        if behind:
            block.set_modules_to_backward_prefetch(behind)
