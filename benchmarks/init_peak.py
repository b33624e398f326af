"""Peak resident memory per rank while the model is built and sharded: sharded initialisation (job.build's path:
meta -> parallelize -> materialise this rank's share) against the old path (build_model: the whole model on every
rank, then parallelize), beside the memory check's estimate of the initialisation peak (issue 23).

    python benchmarks/init_peak.py --nproc 4 --layers 28 --dim 1024 [--old] [--steps 2]

With --steps N the ranks then train N AdamW steps on random tokens (one sequence of --seq per rank) and report each
step's peak too, beside the memory check's estimate of a step (per_rank_bytes' total).

Measured by the kernel: /proc/self/clear_refs resets VmHWM before the build, VmHWM is read after; glibc's mmap
threshold is pinned so that freed tensors go back to the system. CPU, gloo, fsdp over all ranks."""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaletrain.config import ParallelConfig, TrainingConfig  # noqa: E402
from scaletrain.hardware import CPU_OVERHEAD_BYTES  # noqa: E402
from scaletrain.models import ModelArgs, build_meta_model, build_model  # noqa: E402
from scaletrain.parallel.mesh import ParallelDims  # noqa: E402
from scaletrain.parallel.parallelize import parallelize  # noqa: E402
from scaletrain.planning.estimators.memory import per_rank_bytes  # noqa: E402

GiB = 2**30


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def rank_main(rank: int, world: int, port: int, a: argparse.Namespace, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    dist.init_process_group("gloo", rank=rank, world_size=world)
    args = ModelArgs(**shape(a))
    pcfg = ParallelConfig(data_parallel="fsdp")
    dims = ParallelDims.from_config(pcfg, world)
    dims.build_mesh("cpu")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before, t0 = _kib("VmRSS"), time.perf_counter()
    cpu = torch.device("cpu")
    if a.old:
        model = parallelize(build_model(args, 0, cpu), dims, pcfg, device=cpu, n_microbatches=1).parts[0]
    else:
        model = parallelize(
            build_meta_model(args), dims, pcfg, device=cpu, n_microbatches=1, init_seed=0
        ).parts[0]
    row = [rank, (_kib("VmHWM") - before) * 1024, _kib("VmHWM") * 1024, time.perf_counter() - t0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, args.vocab_size, (1, a.seq + 1), generator=torch.Generator().manual_seed(rank))
    for _ in range(a.steps):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        row += [_kib("VmHWM") * 1024, time.perf_counter() - t0, loss.item()]
    q.put(tuple(row))
    dist.barrier()
    dist.destroy_process_group()


def shape(a: argparse.Namespace) -> dict:
    return dict(dim=a.dim, n_layers=a.layers, n_heads=a.dim // 64, n_kv_heads=a.dim // 128,
                ffn_hidden=a.ffn or int(2.75 * a.dim), vocab_size=a.vocab, max_seq_len=a.seq)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=0)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--steps", type=int, default=0, help="AdamW steps to train after the build")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument(
        "--old", action="store_true", help="today's path before issue 23: the whole model per rank"
    )
    a = p.parse_args()
    args = ModelArgs(**shape(a))
    full = sum(t.nbytes for t in build_meta_model(args).parameters())
    est = per_rank_bytes(args, ParallelConfig(data_parallel="fsdp"), TrainingConfig(micro_batch=1), a.seq, a.nproc,
                         overhead_bytes=CPU_OVERHEAD_BYTES)  # fmt: skip
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=rank_main, args=(r, a.nproc, port, a, q)) for r in range(a.nproc)]
    for pr in procs:
        pr.start()
    rows = []
    while len(rows) < len(procs):  # a rank the kernel kills (exit -9: out of memory) must not hang the others
        if not q.empty():
            rows.append(q.get())
        elif dead := [(i, pr.exitcode) for i, pr in enumerate(procs) if pr.exitcode not in (None, 0)]:
            sys.exit(f"ranks died (rank, exit code; -9 is the kernel's OOM killer): {dead}")
        else:
            time.sleep(1)
    rows.sort()
    for pr in procs:
        pr.join()
    print(f"model {full / 4 / 1e9:.2f}B parameters, {full / GiB:.2f} GiB fp32; fsdp over {a.nproc} ranks; "
          f"{'old path (whole model per rank)' if a.old else 'sharded init'}")  # fmt: skip
    print(f"estimate: init {(est['init'] - CPU_OVERHEAD_BYTES) / GiB:.3f} GiB + overhead; step total {est['total'] / GiB:.3f} GiB")  # fmt: skip
    for rank, grew, hwm, secs, *steps in rows:
        line = f"rank {rank}: init grew {grew / GiB:.3f} GiB (peak RSS {hwm / GiB:.3f} GiB) in {secs:.1f} s"
        for i in range(0, len(steps), 3):
            peak, took, loss = steps[i : i + 3]
            line += f"; step {i // 3 + 1}: peak RSS {peak / GiB:.3f} GiB, {took:.1f} s, loss {loss:.4f}"
        print(line)


if __name__ == "__main__":
    main()
