"""Muon vs AdamW (optimizer.name): validation loss at equal tokens, each optimizer at its best lr of a small sweep,
on a ~30M-parameter Llama by default (dim 512, 8 layers, ffn 1536, byte tokenizer; --dim/--layers/--ffn); and the step-time cost of Muon under fsdp
on 2 and 4 ranks. Every run is the real `scaletrain train` (its loop, data, eval, metrics), one after another.

    python benchmarks/muon.py [--dim 512 --layers 8 --ffn 1536] [--steps 50] [--seq 128] [--batch 16] [--eval-every 10] \\
        [--adamw-lrs 1e-3,3e-3,1e-2] [--muon-lrs 1e-3,3e-3,1e-2] [--ranks 2,4] [--time-steps 6] \\
        [--plot docs/images/muon_vs_adamw.png]

Prints one JSON object: each run's validation losses by step, the best lr of each optimizer, and per world size
the median step time of AdamW and Muon (steps after the first two; min-max beside it). A machine shared with
other jobs moves the times; the losses are deterministic for a seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["--metrics.progress", "false", "--metrics.tensorboard", "false", "--checkpoint.interval", "0"]


def model_args(a: argparse.Namespace) -> list[str]:
    """The model: by default ~30M parameters (dim 512, 8 layers of 8 heads, ffn 1536; byte vocabulary)."""
    return ["--model.dim", str(a.dim), "--model.n_layers", str(a.layers), "--model.n_heads", str(a.dim // 64),
            "--model.n_kv_heads", str(a.dim // 64), "--model.ffn_hidden", str(a.ffn)]  # fmt: skip


def train(
    run: Path, opt: str, lr: float, a: argparse.Namespace, *, nproc: int = 1, steps: int, evals: int
) -> Path:
    cmd = [sys.executable, "-m", "scaletrain", "train", "--config", "configs/debug.toml", "--run.dir", str(run),
           *model_args(a), *QUIET, "--optimizer.name", opt, "--optimizer.lr", str(lr),
           "--optimizer.warmup_steps", str(max(2, steps // 10)), "--training.steps", str(steps),
           "--data.seq_len", str(a.seq), "--training.global_batch", str(a.batch),
           "--training.micro_batch", str(a.batch // nproc), "--training.eval_interval", str(evals),
           "--training.eval_sequences", "16", "--metrics.log_interval", "1",
           "--training.threads", str(max(1, a.threads // nproc))]  # fmt: skip
    if nproc > 1:
        cmd += ["--nproc", str(nproc), "--parallel.data_parallel", "fsdp"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True, timeout=a.timeout)
    return run


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def val_curve(run: Path) -> dict[int, float]:
    return {e["step"]: e["val_loss"] for e in _jsonl(run / "events.jsonl") if e["kind"] == "eval"}


def step_times(run: Path) -> list[float]:
    return [m["step_time_s"] for m in _jsonl(run / "metrics.jsonl") if m["step"] > 2]


def sweep(a: argparse.Namespace, tmp: Path) -> dict:
    out: dict = {}
    for opt, lrs in (("adamw", a.adamw_lrs), ("muon", a.muon_lrs)):
        curves = {
            lr: val_curve(train(tmp / f"{opt}-{lr}", opt, lr, a, steps=a.steps, evals=a.eval_every))
            for lr in lrs
        }
        best = min(lrs, key=lambda lr: curves[lr][max(curves[lr])])
        out[opt] = {
            "curves": {str(lr): c for lr, c in curves.items()},
            "best_lr": best,
            "final": curves[best],
        }
    return out


def timing(a: argparse.Namespace, tmp: Path) -> dict:
    out = {}
    for n in a.ranks:
        row = {}
        for opt in ("adamw", "muon"):
            times = step_times(
                train(tmp / f"time-{opt}-{n}", opt, 3e-3, a, nproc=n, steps=a.time_steps, evals=0)
            )
            row[opt] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}
        row["muon_over_adamw"] = row["muon"]["median_s"] / row["adamw"]["median_s"]
        out[f"fsdp{n}"] = row
    return out


def plot(result: dict, path: Path, a: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for opt, color in (("adamw", "tab:blue"), ("muon", "tab:red")):
        r = result["sweep"][opt]
        for lr, curve in r["curves"].items():
            best = float(lr) == r["best_lr"]
            steps = sorted(int(s) for s in curve)
            ax.plot(steps, [curve[s] if s in curve else curve[str(s)] for s in steps], color=color,
                    alpha=1.0 if best else 0.3, lw=2 if best else 1,
                    label=f"{opt} lr {lr}" + (" (best)" if best else ""))  # fmt: skip
    ax.set_xlabel(f"step ({a.batch} x {a.seq} tokens each)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"Muon vs AdamW, Llama dim {a.dim} x {a.layers} layers, equal tokens")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--adamw-lrs", type=floats, default=[1e-3, 3e-3, 1e-2])
    p.add_argument("--muon-lrs", type=floats, default=[1e-3, 3e-3, 1e-2])
    p.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    p.add_argument("--time-steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "images" / "muon_vs_adamw.png")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = {"sweep": sweep(a, Path(tmp)), "timing": timing(a, Path(tmp)) if a.ranks else {}}
    plot(result, a.plot, a)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
