"""QK-clip's cost and effect (optimizer.qk_clip, scaletrain/optim/qk_clip.py) on one process: the median time of a training
step (forward, backward, optimizer step) with QK-clip off, measuring only (τ too high to clip) and clipping, the
three alternated step by step so that a machine shared with other jobs moves them alike; and the largest logit of
each step without the clip and with it, from the same initial weights and batches.

    python benchmarks/qk_clip.py [--dim 256 --layers 4 --heads 4 --kv-heads 4] [--seq 256] [--batch 8] \\
        [--steps 12] [--lr 1e-2] [--tau 0]

--tau 0: half the largest logit of the unclipped run's first step. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from scaletrain.config import OptimizerConfig, ParallelConfig, TrainingConfig
from scaletrain.job import build_core
from scaletrain.models import ModelArgs, build_model
from scaletrain.parallel.mesh import ParallelDims

CPU = torch.device("cpu")


def build(a: argparse.Namespace, tau: float):
    args = ModelArgs(dim=a.dim, n_layers=a.layers, n_heads=a.heads, n_kv_heads=a.kv_heads, ffn_hidden=4 * a.dim,
                     vocab_size=512, max_seq_len=a.seq)  # fmt: skip
    pcfg = ParallelConfig()
    opt = OptimizerConfig(lr=a.lr, warmup_steps=2, qk_clip=tau)
    tcfg = TrainingConfig(micro_batch=a.batch, grad_clip=1.0, steps=a.steps)
    _, opts, runner = build_core(build_model(args, 0, CPU), ParallelDims.from_config(pcfg, 1), pcfg, tcfg, opt,
                                 device=CPU, n_microbatches=1)  # fmt: skip
    return runner, opts


def batches(a: argparse.Namespace) -> list:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 512, (a.steps, a.batch, a.seq + 1), generator=g)
    return [(b[:, :-1], b[:, 1:]) for b in x]


def step(runner, opts, x, y) -> float:
    t0 = time.perf_counter()
    runner.forward_backward(x, y)
    runner.clip()
    opts.step()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    for k, v in dict(dim=256, layers=4, heads=4, kv_heads=4, seq=256, batch=8, steps=12).items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--tau", type=float, default=0.0)
    a = p.parse_args()
    torch.manual_seed(0)
    data = batches(a)
    measure = build(a, 1e30)  # measures every step, never clips
    step(*measure, *data[0])
    tau = a.tau or 0.5 * measure[1].qk_clip.metrics()["max_attn_logit"]
    measure = build(a, 1e30)
    runs = {"off": build(a, 0.0), "measure_only": measure, "clip": build(a, tau)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    logits: dict[str, list[float]] = {"measure_only": [], "clip": []}
    clipped: list[int] = []
    for x, y in data:
        for name, (runner, opts) in runs.items():
            times[name].append(step(runner, opts, x, y))
            if name in logits:
                logits[name].append(round(opts.qk_clip.metrics()["max_attn_logit"], 3))
        clipped.append(runs["clip"][1].qk_clip.metrics()["qk_clipped_heads"])
    median = {k: statistics.median(v[2:]) for k, v in times.items()}
    out = {
        "shape": vars(a) | {"tau": tau, "threads": torch.get_num_threads()},
        "step_s_median": median,
        "overhead_measure_pct": 100 * (median["measure_only"] / median["off"] - 1),
        "overhead_clip_pct": 100 * (median["clip"] / median["off"] - 1),
        "max_attn_logit_unclipped": logits["measure_only"],
        "max_attn_logit_clipped_run": logits["clip"],
        "qk_clipped_heads": clipped,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
