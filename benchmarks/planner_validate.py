"""The planner's predictions beside measurements on this CPU: calibrate once, then train each layout for a few
steps through the real CLI and compare rank 0's peak RSS and its fastest 2-step window after the first
(metrics.jsonl) with what `plan --config` predicts for that rank.

    python benchmarks/planner_validate.py [--cache DIR] [--no-calibrate] [--steps 12] [--repeats 3] [--only N,...]
                                          [--measured RUNS.json] [--published] [--gpu]

--gpu, on a GPU host: calibrate its GPU, then the 125M and 1B presets on one GPU (GPU_LAYOUTS), the peak memory
compared as the allocator's peak against the prediction less the per-device constant (CUDA context, NCCL).
A GPU run: `python benchmarks/planner_validate.py --gpu --repeats 2 --steps 12` (never run: no GPU so far).

Each layout is measured --repeats times, in rounds (every layout once, then again), and compared by the median of
its runs: on a shared 2-core machine one run's step time moves by up to ±25% from the next. The spread is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scaletrain.hardware import (  # noqa: E402
    cuda_available,
    run_from_small_parent,  # noqa: E402
    usable_cpus,
)
from scaletrain.parallel.layout import Layout  # noqa: E402
from scaletrain.planning.commands import plan_one  # noqa: E402
from scaletrain.planning.estimators.inputs import parse_unvalidated  # noqa: E402

CONFIG = str(ROOT / "configs" / "debug.toml")
D256 = ["--model.dim", "256", "--model.n_layers", "4", "--model.n_heads", "4", "--model.n_kv_heads", "2"]
D256 += ["--model.ffn_hidden", "704"]
FSDP = ["--parallel.data_parallel", "fsdp"]
BF16 = ["--precision.compute", "bf16"]
# (processes, model, layout overrides): data, tensor, pipeline and context parallel, three recompute policies.
LAYOUTS: list[tuple[int, str, list[str]]] = [
    (1, "debug", []),
    (1, "debug", ["--memory.recompute", "full"]),
    (2, "debug", ["--parallel.data_parallel", "ddp"]),
    (2, "debug", [*FSDP, "--memory.recompute", "selective"]),
    (2, "debug", [*FSDP, "--parallel.tp", "2"]),
    (2, "debug", [*FSDP, "--parallel.pp", "2"]),
    (2, "debug", [*FSDP, "--parallel.cp", "2"]),
    (4, "debug", FSDP),
    (4, "debug", [*FSDP, "--parallel.tp", "2", "--memory.recompute", "full"]),
    (8, "debug", FSDP),
    (1, "d256", []),
    (1, "d256", ["--memory.recompute", "selective"]),
    (2, "d256", ["--parallel.data_parallel", "ddp", "--memory.recompute", "full"]),
    (2, "d256", [*FSDP, "--parallel.tp", "2", "--parallel.sequence_parallel", "true"]),
    (4, "d256", [*FSDP, "--parallel.pp", "2"]),
    (2, "d256", [*FSDP, "--parallel.cp", "2", "--memory.recompute", "selective"]),
    # bf16 (autocast on one process and under ddp, FSDP2's policy under fsdp), recompute on and off.
    (1, "d256", BF16),
    (2, "d256", [*BF16, "--parallel.data_parallel", "ddp", "--memory.recompute", "selective"]),
    (2, "d256", [*BF16, *FSDP, "--memory.recompute", "full"]),
    (4, "debug", [*BF16, *FSDP]),
]
COMMON = ["--data.seq_len", "128", "--training.global_batch", "8", "--training.eval_interval", "0"]
COMMON += ["--training.threads", "1"]  # one thread per process: the calibrated rate, and robust to load
COMMON += ["--checkpoint.enabled", "false", "--metrics.progress", "false", "--metrics.tensorboard", "false"]


# --gpu, on a GPU host: the 125M and 1B presets on one GPU in bf16 at seq 2048, without and with selective
# recompute, after `plan --calibrate` has measured that GPU (calibrate_gpu); predicted with its calibrated profile.
GPU_LAYOUTS = [(1, m, rc) for m in ("125M", "1B") for rc in ([], ["--memory.recompute", "selective"])]
GPU_COMMON = ["--training.device", "cuda", "--precision.compute", "bf16", "--data.seq_len", "2048"]
GPU_COMMON += ["--training.global_batch", "8", "--training.micro_batch", "4", "--training.eval_interval", "0"]
GPU_COMMON += [
    "--checkpoint.enabled",
    "false",
    "--metrics.progress",
    "false",
    "--metrics.tensorboard",
    "false",
]


def _size(args: list[str], key: str) -> int:
    return int(args[args.index(key) + 1]) if key in args else 1


def overrides(n: int, model: str, layout: list[str], steps: int, gpu: bool = False) -> list[str]:
    if gpu:
        logs = ["--training.steps", str(steps), "--metrics.log_interval", "2"]
        return [*GPU_COMMON, *logs, "--model.preset", model, *layout]
    dp = n // (
        _size(layout, "--parallel.tp") * _size(layout, "--parallel.pp") * _size(layout, "--parallel.cp")
    )
    pp = _size(layout, "--parallel.pp")
    micro = max(1, min(4, 8 // dp // pp))  # a pipeline needs at least pp micro-batches
    out = [*COMMON, "--training.steps", str(steps), "--metrics.log_interval", "2"]
    return out + (D256 if model == "d256" else []) + layout + ["--training.micro_batch", str(micro)]


def measure(n: int, args: list[str], run_dir: Path, env: dict) -> dict:
    cmd = [sys.executable, "-m", "scaletrain", "train", "--config", CONFIG, "--nproc", str(n)]
    # Not straight from this process: its peak RSS (torch is imported here) would be folded into the run's.
    full = [*cmd, *args, "--run.dir", str(run_dir)]
    proc = run_from_small_parent(full, env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    records = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    # Peak RSS at the end; the fastest 2-step window after the first (warm-up) one: the window least disturbed by
    # other processes on a shared machine, as calibration's figures are best-of timings too.
    return {**records[-1], "step_time_s": min(r["step_time_s"] for r in records[1:])}


def describe(n: int, model: str, layout: list[str]) -> str:
    keys = {"--parallel.tp": "tp", "--parallel.pp": "pp", "--parallel.cp": "cp", "--memory.recompute": "rc"}
    parts = [f"{v}={layout[layout.index(k) + 1]}" for k, v in keys.items() if k in layout]
    mode = (
        layout[layout.index("--parallel.data_parallel") + 1]
        if "--parallel.data_parallel" in layout
        else "ddp"
    )
    sp = " sp" if "--parallel.sequence_parallel" in layout else ""
    bf16 = " bf16" if "--precision.compute" in layout else ""
    return f"{model:<5} n={n} {mode}{sp}{bf16} {' '.join(parts)}"


def published() -> None:
    """The planner beside published Llama 3 runs on their hardware (benchmarks/published_runs.py, the table of
    docs/planner.md): tokens/s and peak memory per GPU, predicted against published."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from published_runs import table

    print(table())


def measure_rounds(rows, layouts, opt, env: dict) -> dict[int, list[dict]]:
    """Each row's runs, in rounds; saved to the cache as planner_validate_runs.json (for --measured)."""
    runs: dict[int, list[dict]] = {i: [] for i in rows}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(opt.repeats):
            for i in rows:
                n, model, layout = layouts[i - 1]
                args = overrides(n, model, layout, opt.steps, opt.gpu)
                runs[i].append(measure(n, args, Path(tmp) / f"run{i}-{r}", env))
            print(f"round {r + 1} of {opt.repeats} done; load average {os.getloadavg()[0]:.1f}", flush=True)
    (Path(opt.cache) / "planner_validate_runs.json").write_text(json.dumps(runs))
    return runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "scaletrain-planner-validate"))
    ap.add_argument("--no-calibrate", action="store_true")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each layout, in alternating rounds")
    ap.add_argument("--only", default="", help="comma-separated row numbers (from 1)")
    ap.add_argument(
        "--measured", default="", help="a saved planner_validate_runs.json: predict, measure nothing"
    )
    ap.add_argument(
        "--gpu", action="store_true", help="on a GPU host: calibrate it, then 125M and 1B (GPU_LAYOUTS)"
    )
    ap.add_argument("--published", action="store_true", help="only the comparison with published runs")
    opt = ap.parse_args()
    if opt.published:
        published()
        return
    env = {**os.environ, "SCALETRAIN_CACHE": opt.cache}
    os.environ["SCALETRAIN_CACHE"] = opt.cache
    layouts, kind = (GPU_LAYOUTS, _gpu_kind()) if opt.gpu else (LAYOUTS, "cpu")
    if not (opt.no_calibrate or opt.measured):
        nproc = "1" if opt.gpu else "8"  # one GPU: the layouts run on one
        subprocess.run([sys.executable, "-m", "scaletrain", "plan", "--calibrate", "--nproc", nproc], cwd=ROOT,
                       env=env, check=True)  # fmt: skip
    rows = [int(x) for x in opt.only.split(",") if x] or range(1, len(layouts) + 1)
    if opt.measured:  # re-predict a finished run's measurements (after a change to the model)
        saved = json.loads(Path(opt.measured).read_text())
        runs = {i: saved[str(i)] for i in rows}
    else:
        runs = measure_rounds(rows, layouts, opt, env)
    print(f"{'#':>2} {'layout':<34} {'mem pred':>8} {'meas':>6} {'err':>6} {'-base p':>7} {'meas':>6} "
          f"{'step pred':>9} {'meas':>7} {'err':>6}  {'runs min-max':>13}")  # fmt: skip
    worst_mem = worst_time = 0.0
    for i in rows:
        n, model, layout = layouts[i - 1]
        cfg = parse_unvalidated(CONFIG, overrides(n, model, layout, opt.steps, opt.gpu))
        plan, profile = plan_one(cfg, Layout.of(cfg, n), kind, None)
        pred_mem = plan.memory_by_pp_rank[0] / 2**20  # rank 0 is what mem_peak_mib reports
        base = profile.process_bytes(n, cfg.precision.compute) / 2**20
        mem = statistics.median(r["mem_peak_mib"] for r in runs[i])
        times = sorted(r["step_time_s"] for r in runs[i])
        step = statistics.median(times)
        # A GPU's mem_peak_mib is the allocator's peak, which leaves out what the constant stands for (the CUDA
        # context, NCCL's buffers): compare the tensors, the prediction less that constant.
        mem_err = (pred_mem - base) / mem - 1 if opt.gpu else pred_mem / mem - 1
        time_err = plan.time["step_time_s"] / step - 1
        worst_mem, worst_time = max(worst_mem, abs(mem_err)), max(worst_time, abs(time_err))
        print(
            f"{i:>2} {describe(n, model, layout):<34} {pred_mem:>8.0f} {mem:>6.0f} {100 * mem_err:>+5.1f}% "
            f"{pred_mem - base:>7.1f} {mem - base:>6.1f} {plan.time['step_time_s']:>9.4f} {step:>7.4f} "
            f"{100 * time_err:>+5.1f}%  {times[0]:.3f}-{times[-1]:.3f}",
            flush=True,
        )
    print(
        f"worst: memory {100 * worst_mem:.1f}%, step time {100 * worst_time:.1f}%; profile: {profile.source}"
    )
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {usable_cpus()} usable CPUs")


def _gpu_kind() -> str:
    import torch

    from scaletrain.planning.calibrate_gpu import gpu_kind

    if not cuda_available():
        sys.exit("--gpu: torch sees no CUDA device here")
    return gpu_kind(torch.cuda.get_device_name(0))


if __name__ == "__main__":
    main()
