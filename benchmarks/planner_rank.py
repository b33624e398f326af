"""Does the planner's search pick what is fastest on this CPU (issue 35 item 4)? Search the layouts of a config on N
processes (`scaletrain plan --model ... --devices N --device cpu`, on this CPU's probe or calibrated profile),
train the top K through the real CLI (`scaletrain train --config ... --nproc N` with each plan's overrides) in
interleaved rounds, and print rank, predicted and measured step time (median of the rounds, min-max) with the
load average of each round. The first-ranked layout should be within 10% of the best measured.

    nice -n -10 python benchmarks/planner_rank.py [--config configs/debug.toml] [--nproc 4] [--top 5]
                                                  [--rounds 3] [--steps 22] [--measured RUNS.json]

Run it at high priority (`nice -n -10`, as root) on a shared machine: other work then takes little of the cores.
Each run's figure is the median of its 2-step windows after the first (the steady state), and each layout's the
median of its runs. --measured re-predicts saved runs after a change to the time model (measures nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scaletrain.hardware import run_from_small_parent, usable_cpus  # noqa: E402
from scaletrain.parallel.layout import Layout  # noqa: E402
from scaletrain.planning.commands import profile_for  # noqa: E402
from scaletrain.planning.estimators.inputs import model_args, parse_unvalidated  # noqa: E402
from scaletrain.planning.estimators.search import estimate, search  # noqa: E402

QUIET = ["--training.eval_interval", "0", "--checkpoint.enabled", "false", "--metrics.progress", "false"]
QUIET += ["--metrics.tensorboard", "false", "--metrics.log_interval", "2"]
# What breaks a ranking down: the time model's parts, in step_time's sum.
PARTS = ("compute_s", "tp_comm_s", "cp_comm_s", "pp_p2p_s", "dp_comm_exposed_s", "bubble_s", "optimizer_s")


def ranked(config: str, nproc: int, top: int):
    """The top `top` plans of `config`'s model on nproc CPU processes, as `plan --model` ranks them (its seq_len and
    global batch), and the profile they were ranked on."""
    cfg = parse_unvalidated(config, [])
    seeded = ["--training.global_batch_tokens", str(cfg.training.global_batch * cfg.data.seq_len)]
    cfg = parse_unvalidated(config, seeded)
    profile = profile_for(cfg, "cpu")
    plans, _, _ = search(cfg, model_args(cfg), nproc, profile, profile.devices_per_node)
    return plans[:top], profile


def train_once(config: str, nproc: int, overrides: list[str], steps: int, run_dir: Path) -> dict:
    """One run through the CLI: the median and the fastest of its 2-step windows after the first."""
    cmd = [sys.executable, "-m", "scaletrain", "train", "--config", config, "--nproc", str(nproc)]
    cmd += [*overrides, *QUIET, "--training.steps", str(steps), "--run.dir", str(run_dir)]
    proc = run_from_small_parent(cmd, dict(os.environ), cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(overrides)} failed:\n{proc.stderr[-3000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    windows = [json.loads(x)["step_time_s"] for x in lines if x.strip()][1:]
    return {"median": statistics.median(windows), "min": min(windows), "windows": windows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(ROOT / "configs" / "debug.toml"))
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each layout, interleaved")
    ap.add_argument("--steps", type=int, default=22)
    ap.add_argument("--measured", default="", help="saved runs (JSON this script wrote): re-predict only")
    ap.add_argument("--save", default="", help="where to write the runs (JSON)")
    opt = ap.parse_args()
    plans, profile = ranked(opt.config, opt.nproc, opt.top)
    print(f"{opt.config} on {opt.nproc} processes, profile: {profile.source}")
    if opt.measured:
        saved = json.loads(Path(opt.measured).read_text())
        runs, loads = saved["runs"], saved["loads"]
        # Re-predict the layouts that were measured (the ranking may have changed since).
        plans = []
        for over in saved["overrides"]:
            cfg = parse_unvalidated(opt.config, over)
            plans.append(estimate(cfg, model_args(cfg), Layout.of(cfg, opt.nproc), profile))
        order = sorted(
            range(len(plans)), key=lambda i: plans[i].time["step_time_s"]
        )  # ranked as now predicted
        plans, runs = [plans[i] for i in order], [runs[i] for i in order]
    else:
        runs, loads = [[] for _ in plans], []
        with tempfile.TemporaryDirectory() as tmp:
            # A first run prepares (tokenises) the data, so no measured run pays for it.
            train_once(opt.config, opt.nproc, plans[0].overrides(), 3, Path(tmp) / "warm")
            for r in range(opt.rounds):
                for i, plan in enumerate(plans):
                    got = train_once(
                        opt.config, opt.nproc, plan.overrides(), opt.steps, Path(tmp) / f"{i}-{r}"
                    )
                    runs[i].append(got)
                loads.append(open("/proc/loadavg").read().split()[:3])
                print(f"round {r + 1}/{opt.rounds}: load average {' '.join(loads[-1])}", flush=True)
        save = {"overrides": [p.overrides() for p in plans], "runs": runs, "loads": loads}
        out = Path(opt.save or Path(tempfile.gettempdir()) / f"planner_rank_{Path(opt.config).stem}.json")
        out.write_text(json.dumps(save))
        print(f"runs saved to {out}")
    print(f"{'rank':>4} {'layout':<58} {'pred s':>8} {'meas s':>8} {'min-max':>15} {'pred/meas':>9}")
    measured = [statistics.median(r["median"] for r in rs) for rs in runs]
    for i, (plan, rs) in enumerate(zip(plans, runs)):
        spread = f"{min(r['median'] for r in rs):.4f}-{max(r['median'] for r in rs):.4f}"
        pred = plan.time["step_time_s"]
        print(f"{i + 1:>4} {plan.describe():<58} {pred:>8.4f} {measured[i]:>8.4f} {spread:>15} "
              f"{pred / measured[i]:>9.3f}")  # fmt: skip
        print("       " + ", ".join(f"{k[:-2]} {plan.time[k] * 1e3:.1f}" for k in PARTS if plan.time.get(k)))
    best = min(measured)
    first = measured[0] / best - 1
    verdict = "within" if first <= 0.10 else "NOT within"
    print(f"ranked first: {100 * first:+.1f}% of the best measured ({verdict} 10%); rank of the best measured: "
          f"{measured.index(best) + 1}; load average per round: {'; '.join(' '.join(x) for x in loads)} "
          f"on {usable_cpus()} CPUs")  # fmt: skip


if __name__ == "__main__":
    main()
