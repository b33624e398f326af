"""Pipeline bubble on CPU: the measured idle share of GPipe, 1F1B and interleaved 1F1B beside the ideal.

Each of pp gloo processes runs its stage(s) of a Llama model under `apply_pp`. Every stage's forward, backward
(and weight-backward) compute and the loss are timed from inside the torch schedule; the rest of the step's wall
time is bubble: bubble = 1 - busy / step time, averaged over ranks and steps (after warm-up). The ideal is
(p-1)/(m+p-1) for GPipe and 1F1B and (p-1)/(v·m+p-1) for interleaved 1F1B (Narayanan et al. 2021), which assume
equal stage times and free communication.

    python benchmarks/pipeline.py [--pp 2] [--microbatches 4 8] [--schedules gpipe 1f1b interleaved_1f1b]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from scaletrain.hardware import usable_cpus
from scaletrain.models import ModelArgs, build_meta_model, cross_entropy
from scaletrain.parallel.pipeline import apply_pp, ideal_bubble, stages_per_rank

CPU = torch.device("cpu")


class Busy:
    """Seconds spent in timed calls on this rank."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def _worker(rank: int, pp: int, port: int, opts: argparse.Namespace, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(opts.threads)
    dist.init_process_group("gloo", rank=rank, world_size=pp)
    mesh = init_device_mesh("cpu", (pp,), mesh_dim_names=("pp",))
    args = ModelArgs(
        dim=opts.dim,
        n_layers=opts.layers,
        n_heads=opts.dim // 64,
        n_kv_heads=opts.dim // 64,
        ffn_hidden=int(opts.dim * 8 / 3) // 64 * 64,
        vocab_size=opts.vocab,
        max_seq_len=opts.seq_len,
    )
    rows = []
    for schedule in opts.schedules:
        for m in opts.microbatches:
            busy = Busy()
            model = build_meta_model(args)
            model.to_empty(device=CPU)
            torch.manual_seed(0)
            model.init_weights(CPU)
            parts = apply_pp(
                model,
                mesh,
                schedule=schedule,
                n_microbatches=m,
                virtual_stages=opts.virtual_stages,
                device=CPU,
                loss_fn=busy.wrap(cross_entropy),
            )
            del model
            for stage in parts.stages:
                for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                    setattr(stage, name, busy.wrap(getattr(stage, name)))
            g = torch.Generator().manual_seed(1)
            x = torch.randint(0, args.vocab_size, (m * opts.mb_size, args.max_seq_len + 1), generator=g)
            fractions, times = [], []
            for step in range(opts.warmup + opts.steps):
                dist.barrier()  # every rank starts the step together: waiting for a late peer is not bubble
                busy.seconds = 0.0
                t0 = time.perf_counter()
                parts.step(x[:, :-1], x[:, 1:])
                total = time.perf_counter() - t0
                for mod in parts.modules:
                    mod.zero_grad(set_to_none=True)
                if step >= opts.warmup:
                    fractions.append(1 - busy.seconds / total)
                    times.append(total)
            gathered = [None] * pp
            dist.all_gather_object(gathered, (statistics.mean(fractions), statistics.median(times)))
            rows.append((schedule, m, gathered))
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved_1f1b"])
    ap.add_argument("--virtual-stages", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--mb-size", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    opts = ap.parse_args()

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, opts.pp, port, opts, out)) for r in range(opts.pp)]
    for p in procs:
        p.start()
    rows = out.get()
    for p in procs:
        p.join()

    p = opts.pp
    print(
        f"pp={p}, {opts.layers} layers, dim {opts.dim}, seq {opts.seq_len}, {opts.mb_size} sequences per "
        f"micro-batch, {opts.threads} thread(s) per process, {usable_cpus()} usable CPUs, load average "
        f"{os.getloadavg()[0]:.1f} (anything above {opts.pp * opts.threads} means shared cores)"
    )
    head = f"{'schedule':<18}{'m':>3}{'v':>3}{'step ms':>9}{'bubble':>9}  {'per rank':<16}{'ideal':>8}{'ideal v·m':>11}"
    print(head)
    print("-" * len(head))
    for schedule, m, gathered in rows:
        v = stages_per_rank(schedule, opts.virtual_stages)
        measured = statistics.mean(f for f, _ in gathered)
        per_rank = " ".join(f"{f:.0%}" for f, _ in gathered)
        step_ms = 1000 * max(t for _, t in gathered)
        inter = f"{ideal_bubble(p, m, v):.0%}" if v > 1 else "-"
        print(
            f"{schedule:<18}{m:>3}{v:>3}{step_ms:>9.0f}{measured:>9.0%}  {per_rank:<16}{ideal_bubble(p, m):>8.0%}"
            f"{inter:>11}"
        )
    print("""
bubble = 1 - (time inside stage forward/backward and the loss) / (step wall time), mean over ranks.
ideal = (p-1)/(m+p-1) (GPipe, 1F1B); ideal v·m = (p-1)/(v·m+p-1) (interleaved, v stages per rank).
The ideal figures assume equal stage times and free, instant communication. On CPU neither holds, and the
idle time measured here includes more than the schedule's bubble: every activation and gradient goes through
gloo over loopback TCP (copies and syscalls while no stage computes), each schedule action costs Python
dispatch and a process wake-up, and the first and last stages carry the embedding and the output projection
plus loss (unequal stage times). Interleaving divides the ideal bubble by v but doubles the sends, so on CPU it
gains less than v. When processes share cores (load above the process count), time a process spends
descheduled inside a compute call counts as busy, which can push the figure below the ideal: compare
schedules from one run, and trust absolute figures only on an idle machine.""")


if __name__ == "__main__":
    main()
