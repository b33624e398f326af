"""Checkpoint cost for one state, measured in one run: a synchronous save, the training stall of an asynchronous
(two-stage) save, and a load with checksum verification.

The stall is what the training loop waits for: the `save()` call (collecting the state, starting the copy), any
wait for stage 1 (the copy to host memory) before the next optimizer step, and the per-step `poll()` that reports
the commit. Stage 2 (serialising, writing) and the commit (sha256 of every file, the marker, retention) run in the
background (the commit in its own thread, not the training thread); on a CPU they share the cores with training,
so the benchmark also reports how much slower the steps that overlap them ran (the slowdown, not a stall: nothing
waits).

    python benchmarks/checkpoint.py [--preset 125M] [--steps 12] [--threads 2]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from scaletrain.checkpoint import CheckpointManager, ModelState, TrainState
from scaletrain.config import CheckpointConfig, ModelConfig, OptimizerConfig
from scaletrain.models import build_meta_model, resolve_model_args
from scaletrain.optim.optimizers import Optimizers, build_optimizer


def build(preset: str):
    args = resolve_model_args(ModelConfig(preset=preset), 32000, 128)
    model = build_meta_model(args)
    model.to_empty(device="cpu")
    model.init_weights()
    optimizers = Optimizers([model], lambda m: build_optimizer(m, OptimizerConfig()), OptimizerConfig(), 1000)
    return model, optimizers


def step(model, opt, x) -> None:
    F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    opt.step()


def timed_steps(model, opt, x, n, ckpt=None, save_at=None) -> tuple[list[float], float]:
    times, stall = [], 0.0
    for i in range(n):
        t0 = time.perf_counter()
        if ckpt is not None and i == save_at:
            stall += ckpt.save(1000 + i)
        F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        if ckpt is not None:
            stall += ckpt.before_update()
        opt.step()
        if ckpt is not None:  # what the loop's maybe_save() does every step: report a finished commit
            t1 = time.perf_counter()
            ckpt.poll()
            stall += time.perf_counter() - t1
        times.append(time.perf_counter() - t0)
    return times, stall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="125M")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, opt = build(args.preset)
    x = torch.randint(0, model.args.vocab_size, (1, 129))
    step(model, opt, x)  # optimizer state exists from here on
    state = {"model": ModelState([model]), "optimizer": opt, "train": TrainState()}
    n_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    n_bytes += sum(v.numel() * v.element_size() for s in opt.optimizers[0].state.values() for v in s.values())
    root = Path(tempfile.mkdtemp(prefix="scaletrain-ckpt-bench-"))
    try:
        sync = CheckpointManager(
            CheckpointConfig(async_save=False, keep_last=1), str(root / "sync"), state, rank=0, world_size=1
        )
        t0 = time.perf_counter()
        sync.save(1, blocking=True)
        t_sync = time.perf_counter() - t0

        base, _ = timed_steps(model, opt, x, args.steps)
        ckpt = CheckpointManager(
            CheckpointConfig(async_save=True, keep_last=1), str(root / "async"), state, rank=0, world_size=1
        )
        with_save, stall = timed_steps(model, opt, x, args.steps, ckpt, save_at=1)
        t0 = time.perf_counter()
        ckpt.wait()
        t_drain = time.perf_counter() - t0
        commit_thread = ckpt.commit_thread
        ckpt.shutdown()
        slowdown = sum(with_save) - stall - statistics.median(base) * len(with_save)

        t0 = time.perf_counter()
        assert sync.load_latest() == 1
        t_load = time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(
        f"\n{args.preset} preset: {sum(p.numel() for p in model.parameters()):,} parameters, checkpoint state "
        f"{n_bytes / 2**20:,.0f} MiB (weights + AdamW), {args.threads} threads, local disk"
    )
    print(f"  synchronous save (write + sha256 + commit):    {t_sync:7.3f} s")
    print(
        f"  async save, training stall (blocked):          {stall:7.3f} s   = {stall / t_sync:.1%} of the "
        "synchronous save (target <= 10%)"
    )
    print(
        f"  async save, overlapping steps ran slower by:   {max(slowdown, 0):7.3f} s   (background stage 2 "
        f"shares the CPU; median step {statistics.median(base):.3f} s)"
    )
    print(f"  async save, left to drain after {args.steps} steps:    {t_drain:7.3f} s")
    print(f"  async commit ran in thread:                    {commit_thread}")
    print(f"  load with checksum verification:               {t_load:7.3f} s")


if __name__ == "__main__":
    main()
