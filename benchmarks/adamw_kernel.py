"""AdamW's kernel on a CPU, torch's foreach against its fused one (the default since issue 35), like for like.

1. The optimizer step alone, in one process on one thread, the two kernels alternating round by round over the same
   parameters (their ratio per round holds while a shared machine's speed drifts): the debug model, planner_validate's
   d256 and memory_matrix's wide 61M-parameter shape.
2. Whole training runs through the CLI (`scaletrain train`), the two alternating run by run (`--repeats` pairs,
   which goes first alternating too: a fixed order read 6% slower for the second on the debug model), each started
   from a bare interpreter (hardware.run_from_small_parent: a child's ru_maxrss includes its parent's): each run's
   median step time after the first two steps and rank 0's peak RSS (metrics.jsonl's mem_peak_mib), for the debug
   model on one process and the 61M shape under ddp and fsdp on two.

    python benchmarks/adamw_kernel.py [--rounds 9] [--repeats 3] [--no-cli]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scaletrain.config import OptimizerConfig  # noqa: E402
from scaletrain.hardware import run_from_small_parent  # noqa: E402
from scaletrain.metrics import cpu_features  # noqa: E402
from scaletrain.models import ModelArgs, build_model  # noqa: E402
from scaletrain.optim.optimizers import build_optimizer  # noqa: E402

KERNELS = ("foreach", "fused")
# name -> (dim, layers, heads, kv heads, ffn, vocabulary)
SHAPES = {
    "debug (0.8M)": (128, 4, 4, 2, 352, 256),
    "d256 (3.1M)": (256, 4, 4, 2, 704, 256),
    "wide (61M)": (1024, 4, 16, 4, 4096, 512),
}
WIDE = ["--model.dim", "1024", "--model.ffn_hidden", "4096", "--model.n_layers", "4", "--model.vocab_size", "512",
        "--model.n_heads", "16", "--model.n_kv_heads", "4", "--data.seq_len", "32", "--training.micro_batch", "1",
        "--training.global_batch", "2"]  # fmt: skip
RUNS = {
    "debug n=1": ["--nproc", "1"],
    "wide n=2 ddp": ["--nproc", "2", *WIDE],
    "wide n=2 fsdp": ["--nproc", "2", "--parallel.data_parallel", "fsdp", *WIDE],
}
COMMON = ["--training.steps", "12", "--training.eval_interval", "0", "--checkpoint.enabled", "false",
          "--metrics.progress", "false", "--metrics.log_interval", "1"]  # fmt: skip


def step_alone(rounds: int) -> None:
    torch.set_num_threads(1)
    print(f"{'optimizer step alone':<22} {'foreach ms':>10} {'fused ms':>9} {'fused/foreach per round':>24}")
    for name, (dim, layers, heads, kv, ffn, vocab) in SHAPES.items():
        args = ModelArgs(
            dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv, ffn_hidden=ffn, vocab_size=vocab
        )
        model = build_model(args, 0, "cpu")
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opts = {k: build_optimizer(model, OptimizerConfig(implementation=k)) for k in KERNELS}
        times: dict[str, list[float]] = {k: [] for k in KERNELS}
        for _ in range(rounds + 1):  # the first round allocates the moments: not counted
            for k, opt in opts.items():
                start = time.perf_counter()
                opt.step()
                times[k].append(time.perf_counter() - start)
        ratios = sorted(b / a for a, b in zip(times["foreach"][1:], times["fused"][1:]))
        med = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}
        print(f"{name:<22} {med['foreach']:>10.2f} {med['fused']:>9.2f} "
              f"{statistics.median(ratios):>10.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})")  # fmt: skip


def one_run(args: list[str], kernel: str) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "scaletrain", "train", "--config", str(ROOT / "configs" / "debug.toml"),
               *COMMON, *args, "--optimizer.implementation", kernel, "--run.dir", tmp]  # fmt: skip
        run_from_small_parent(cmd, dict(os.environ), cwd=ROOT, check=True, capture_output=True)
        rows = [json.loads(line) for line in Path(tmp, "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in rows[2:]), max(r["mem_peak_mib"] for r in rows)


def cli_runs(repeats: int) -> None:
    print(f"\n{'CLI run':<16} {'foreach s':>9} {'fused s':>8} {'fused/foreach (pairs)':>32} {'peak MiB':>16}")
    for name, args in RUNS.items():
        got: dict[str, list[tuple[float, float]]] = {k: [] for k in KERNELS}
        for i in range(repeats):
            for k in KERNELS[:: 1 - 2 * (i % 2)]:
                got[k].append(one_run(args, k))
        t = {k: statistics.median(x[0] for x in v) for k, v in got.items()}
        pairs = ", ".join(f"{b[0] / a[0]:.2f}" for a, b in zip(got["foreach"], got["fused"]))
        mem = {k: statistics.median(x[1] for x in v) for k, v in got.items()}
        print(f"{name:<16} {t['foreach']:>9.4f} {t['fused']:>8.4f} {t['fused'] / t['foreach']:>10.3f} ({pairs}) "
              f"{mem['foreach']:>7.0f} -> {mem['fused']:.0f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-cli", action="store_true")
    opt = ap.parse_args()
    print(f"CPU: {cpu_features()}; torch {torch.__version__}")
    step_alone(opt.rounds)
    if not opt.no_cli:
        cli_runs(opt.repeats)


if __name__ == "__main__":
    main()
