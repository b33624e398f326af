"""Muon's step time against AdamW's under fsdp (issue 40), measured in one spawn per world size, and the planner's
prediction of both at 1M-token steps on 64 GPUs.

The ~30M-parameter model of benchmarks/muon.py (dim 512, 8 layers of 8 heads, ffn 1536; vocabulary 512), fp32,
seq 128. For each world size (`--ranks`) and tokens per step (`--tokens`), the gloo ranks build one model per
optimizer with `build_core` (as train.py does: the same fsdp wrapping, step runner and clipping) and train them in
alternation, A B A B ... (`--pairs` pairs after one warm-up step each), on the same batches: each pair's ratio
sees the same load of a shared machine. A step is timed between two barriers (its slowest rank); the optimizer
step alone is timed the same way. Micro-batches of `--micro` tokens per rank bound the activations' memory.
`--before FILE`: a muon.py of an earlier commit (`git show REV:scaletrain/optim/muon.py > FILE`), timed as a third
optimizer in the same alternation (its class swapped onto the built Muon).

    python benchmarks/muon_cost.py [--ranks 2,4] [--tokens 2048,16384] [--pairs 3] [--micro 1024] [--before FILE]

Prints one JSON object: the CPU, the load average before and after each case, per case each optimizer's median
step and optimizer-step time with min-max, the CPU seconds of all ranks in each, and Muon's per-pair ratio to
AdamW in wall time and in CPU time (median, min-max; on a machine busier than its cores the CPU time is the steadier
figure, but it cannot show what runs concurrently); then the
planner's step_time for AdamW and Muon with the 30M model on this CPU's default profile (the measured cases) and on
64 H100s (fsdp 64, 1M tokens per step).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scaletrain.config import MemoryConfig, OptimizerConfig, ParallelConfig, TrainingConfig
from scaletrain.hardware import cpu_features
from scaletrain.job import build_core
from scaletrain.models import ModelArgs, build_model
from scaletrain.parallel.mesh import ParallelDims
from scaletrain.planning.estimators.hardware import DEFAULT_CPU, GPUS
from scaletrain.planning.estimators.time import step_time

SEQ = 128
ARGS = ModelArgs(
    dim=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_hidden=1536, vocab_size=512, max_seq_len=SEQ
)
OPTS = {name: OptimizerConfig(name=name, lr=3e-3, warmup_steps=2) for name in ("adamw", "muon")}


def _rank(
    rank: int, world: int, port: int, tokens: int, micro: int, pairs: int, before: str, out: str
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    pcfg = ParallelConfig(data_parallel="fsdp")
    dims = ParallelDims.from_config(pcfg, world)
    dims.build_mesh("cpu")
    local = tokens // SEQ // world
    per_micro = max(1, min(local, micro // SEQ))
    tcfg = TrainingConfig(micro_batch=per_micro, grad_clip=1.0, steps=2 * pairs + 2)
    built = {}
    names = ["adamw", "muon"] + (["before"] if before else [])
    for name in names:
        cfg = OPTS["muon" if name == "before" else name]
        built[name] = build_core(build_model(ARGS, 0, torch.device("cpu")), dims, pcfg, tcfg, cfg,
                                 device=torch.device("cpu"), n_microbatches=local // per_micro)  # fmt: skip
    if before:  # the earlier Muon's step on the same param groups and state
        spec = importlib.util.spec_from_file_location("muon_before", before)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for opt in built["before"][1].optimizers:
            opt.__class__ = module.Muon
            opt.__dict__.pop("step", None)  # the LR scheduler's wrapper, bound to the class it saw
    g = torch.Generator().manual_seed(rank)
    times: dict[str, list[tuple[float, ...]]] = {n: [] for n in names}
    for i in range(pairs + 1):
        x = torch.randint(0, ARGS.vocab_size, (local, SEQ + 1), generator=g)
        for name in names:
            _, optimizers, runner = built[name]
            dist.barrier()
            start, cpu0 = time.perf_counter(), time.process_time()
            runner.forward_backward(x[:, :-1], x[:, 1:])
            runner.clip()
            dist.barrier()
            mid, cpu1 = time.perf_counter(), time.process_time()
            optimizers.step()
            dist.barrier()
            end, cpu2 = time.perf_counter(), time.process_time()
            # CPU seconds of every rank (gloo's threads included): the work, which a loaded machine stretches less
            cpu = torch.tensor([cpu2 - cpu0, cpu2 - cpu1], dtype=torch.float64)
            dist.all_reduce(cpu)
            if i > 0:  # the first step allocates the optimizers' state
                times[name].append((end - start, end - mid, *cpu.tolist()))
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


COLUMNS = ("step_s", "optimizer_s", "step_cpu_s", "optimizer_cpu_s")


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def measure(world: int, tokens: int, a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.json")
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        load = os.getloadavg()[0]
        mp.spawn(_rank, args=(world, port, tokens, a.micro, a.pairs, a.before or "", out), nprocs=world)
        times = json.loads(Path(out).read_text())
    row: dict = {"load_before": load, "load_after": os.getloadavg()[0]}
    for name, ts in times.items():
        row[name] = {k: _spread([t[i] for t in ts]) for i, k in enumerate(COLUMNS)}
    for name in times:
        if name != "adamw":
            for i, k in ((0, "over_adamw"), (2, "cpu_over_adamw")):
                row[f"{name}_{k}"] = _spread([m[i] / w[i] for m, w in zip(times[name], times["adamw"])])
    return row


def predicted(world: int, tokens: int, profile, *, gpus_per_node: int | None = None) -> dict:
    """The planner's step time of AdamW and Muon, and their ratio, for the benchmark model under fsdp."""
    out = {}
    for name, opt in OPTS.items():
        batch = tokens // SEQ
        t = step_time(ARGS, ParallelConfig(data_parallel="fsdp"),
                      TrainingConfig(micro_batch=max(1, min(batch // world, 8)), global_batch=batch), MemoryConfig(),
                      SEQ, world, profile, global_batch=batch, gpus_per_node=gpus_per_node, optimizer=opt)  # fmt: skip
        out[name] = {k: t[k] for k in ("step_time_s", "optimizer_s", "muon_s") if k in t}
        if name == "muon":
            out[name].update(ns_s=t["muon_ns_s"], comm_s=t["muon_comm_s"])
    out["muon_over_adamw"] = out["muon"]["step_time_s"] / out["adamw"]["step_time_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--ranks", type=ints, default=[2, 4])
    p.add_argument("--tokens", type=ints, default=[2048, 16384])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--micro", type=int, default=1024, help="tokens per micro-batch per rank")
    p.add_argument("--before", default="", help="an earlier muon.py to time beside (see the docstring)")
    p.add_argument("--predict-only", action="store_true")
    a = p.parse_args()
    result: dict = {"cpu": cpu_features(), "cpus": os.cpu_count(), "measured": {}, "predicted": {}}
    for world in [] if a.predict_only else a.ranks:
        for tokens in a.tokens:
            result["measured"][f"fsdp{world}_{tokens}"] = measure(world, tokens, a)
            print(
                json.dumps({f"fsdp{world}_{tokens}": result["measured"][f"fsdp{world}_{tokens}"]}),
                file=sys.stderr,
            )
    for world in a.ranks:
        for tokens in a.tokens:
            result["predicted"][f"cpu_fsdp{world}_{tokens}"] = predicted(world, tokens, DEFAULT_CPU)
    for tokens in (2048 * 64, 2**20):
        result["predicted"][f"h100_fsdp64_{tokens}"] = predicted(64, tokens, GPUS["h100"], gpus_per_node=8)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
