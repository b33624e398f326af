"""Training-loop overhead: scaletrain's full `train()` against a bare PyTorch loop with the same model math.

Both run the same Llama module, batch, AdamW settings and gradient clipping on the same threads; the bare loop has
no data loader, schedule, metrics or logging. Rounds alternate (scaletrain, bare, scaletrain, ...) so that noise
from a shared machine hits both sides alike; the ratio of median step times is the figure to quote.

    python benchmarks/throughput.py [--steps 30] [--rounds 5] [--preset debug] [--seq-len 256] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from scaletrain.hardware import cpu_features
from scaletrain.models import build_meta_model, resolve_model_args
from scaletrain.train import train
from scaletrain.validate import load_config


def scaletrain_step_times(args, run_dir: Path) -> list[float]:
    cfg = load_config(
        None,
        [
            "--model.preset",
            args.preset,
            "--data.seq_len",
            str(args.seq_len),
            "--training.steps",
            str(args.steps),
            "--training.global_batch",
            str(args.batch),
            "--training.micro_batch",
            str(args.batch),
            "--training.eval_interval",
            "0",
            "--training.threads",
            str(args.threads),
            "--metrics.log_interval",
            "5",
            "--metrics.progress",
            "false",
            "--metrics.tensorboard",
            "false",
            "--run.dir",
            str(run_dir),
            "--training.precision",
            args.precision,
        ],
    )
    train(cfg)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in rows[1:]]  # per-step means of 5-step windows; the first is warm-up


def bare_step_times(args) -> list[float]:
    """nanoGPT-style: forward, loss, backward, clip, step. Nothing else."""
    from scaletrain.config import ModelConfig

    torch.set_num_threads(args.threads)
    margs = resolve_model_args(ModelConfig(preset=args.preset), 257, args.seq_len)
    model = build_meta_model(margs)
    model.to_empty(device="cpu")
    model.init_weights()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.95),
        foreach=True,
    )
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16")
    times = []
    for _ in range(args.steps):
        x = torch.randint(0, margs.vocab_size, (args.batch, args.seq_len + 1))
        t0 = time.perf_counter()
        with autocast:
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    return times[args.warmup :]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--preset", default="debug")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    args = p.parse_args()
    ours, bare, ratios = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            mine, theirs = scaletrain_step_times(args, Path(tmp) / f"run{r}"), bare_step_times(args)
            ours += mine
            bare += theirs
            ratios.append(statistics.median(theirs) / statistics.median(mine))
    tokens = args.batch * args.seq_len
    t_ours, t_bare = statistics.median(ours), statistics.median(bare)
    print(
        f"\n{args.preset} preset, {args.precision}, batch {args.batch} x {args.seq_len} tokens, "
        f"{args.threads} threads, {args.rounds} alternating rounds of {args.steps} steps (first {args.warmup} "
        "of each dropped)"
    )
    print(f"  CPU: {cpu_features()}")
    print(f"  bare PyTorch loop : {tokens / t_bare:10.0f} tokens/s  (median step {t_bare * 1e3:.1f} ms)")
    print(f"  scaletrain train(): {tokens / t_ours:10.0f} tokens/s  (median step {t_ours * 1e3:.1f} ms)")
    print(f"  ratio scaletrain / bare = {t_bare / t_ours:.3f}  (target >= 0.97)")
    print(
        f"  per-round ratios: {', '.join(f'{r:.3f}' for r in ratios)}  (min {min(ratios):.3f}, median "
        f"{statistics.median(ratios):.3f}, max {max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
