"""What the silent-data-corruption check costs (issue 25 part 2), and that it raises no false alarm.

    python benchmarks/sdc.py [--steps 200] [--interval 100] [--repeats 3] [--modes ddp,zero1,zero2,fsdp,hsdp]
        [--nproc 2]

1. No false alarm: per mode, one run of --steps steps checked at every step (sdc_interval 1): no sdc_detected event.
2. Cost, end to end: the same run (ddp, --nproc ranks, --steps steps) with the check off and at --interval, in
   alternation --repeats times; the median step time of each run (the first 5 steps, warm-up, left out), the
   median over the repeats and the spread (min-max).
3. Cost, measured directly, timed in this process on the run's model: one check's work (record after the update,
   verify: two passes over the parameters), the per-step watch at rest of the slices no other rank holds (two
   passes, after the update and before the next: the whole model under zero1 or one process, 1/nproc of it under
   fsdp/zero2, nothing under ddp/hsdp), and the replay witness (the fingerprint of a step's logits); each as a
   fraction of the measured ddp step time. On a shared CPU the end-to-end difference is within the noise; these
   are the figures to read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--metrics.progress", "false", "--metrics.tensorboard", "false", "--training.threads", "1"]


def train(run: Path, steps: int, nproc: int, mode: str, interval: int, spikes: bool = False) -> list[dict]:
    """One run; `spikes`: with loss/grad-norm spike detection on (z 4), whose spikes replay on the buddies."""
    cmd = [sys.executable, "-m", "scaletrain", "train", "--config", "configs/debug.toml", "--run.dir", str(run),
           "--nproc", str(nproc), *QUICK, "--training.steps", str(steps), "--training.eval_interval", "0",
           "--metrics.log_interval", "1", "--parallel.data_parallel", mode,
           "--checkpoint.snapshot_interval", str(max(interval, 1) * max(1, 100 // max(interval, 1))),
           "--resilience.sdc_interval", str(interval)]  # fmt: skip
    if mode == "hsdp":
        cmd += ["--parallel.dp_replicate", "2", "--training.micro_batch", "2"]
    if spikes:
        cmd += ["--resilience.spike_zscore", "4"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]


def step_times(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [m["step_time_s"] for m in records if m["step"] > 5]


def check_cost(run: Path, nproc: int, repeats: int = 20) -> tuple[float, float, float]:
    """Seconds, in one process on this run's model, of one check's work (record, verify), of one step's watch at
    rest over the whole model (fingerprints before and after the update), and of the per-step witness (the
    fingerprint of one rank's logits of a step: micro-batches x micro_batch x seq_len x vocabulary, as the output
    layer's hook reads them)."""
    from scaletrain.checkpoint.run_model import load_run_model
    from scaletrain.resilience.sdc import SdcCheck, fingerprint

    model, cfg = load_run_model(run)[:2]
    check = SdcCheck(1, [model], 0, None, watch_all=True)
    per_rank = cfg.training.global_batch // nproc
    logits = torch.randn(per_rank, cfg.data.seq_len, model.args.vocab_size)

    def best(fn) -> float:
        out = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            out = min(out, time.perf_counter() - t0)
        return out

    def one_check() -> None:
        check.record(1)
        check.verify(1, "after_update")

    def one_watch() -> None:
        check.watch()
        check.rested()
        check._drift.tolist()  # noqa: SLF001  (the device work done; read once per check in a run)

    check.rested()
    return best(one_check), best(one_watch), best(lambda: fingerprint(logits))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--interval", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="ddp,zero1,zero2,fsdp,hsdp")
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for mode in args.modes.split(","):
            nproc = 4 if mode == "hsdp" else args.nproc
            seen = train(tmp / f"clean-{mode}", args.steps, nproc, mode, 1, spikes=True)
            found = [e for e in seen if e["kind"] == "sdc_detected"]
            causes = [e["cause"] for e in seen if e["kind"] == "spike_cause"]
            print(f"no false alarm: {mode} x{nproc}, {args.steps} steps checked at every step: "
                  f"{len(found)} sdc_detected event(s); spikes replayed on the buddies: {causes}")  # fmt: skip
            assert not found, found
        medians: dict[int, list[float]] = {0: [], args.interval: []}
        for r in range(args.repeats):
            for interval in medians:
                run = tmp / f"cost-{interval}-{r}"
                train(run, args.steps, args.nproc, "ddp", interval)
                medians[interval].append(statistics.median(step_times(run)))
        for interval, m in medians.items():
            label = "sdc off" if interval == 0 else f"sdc_interval {interval}"
            print(f"ddp x{args.nproc}, {label}: median step {statistics.median(m) * 1e3:.2f} ms "
                  f"(spread {min(m) * 1e3:.2f}-{max(m) * 1e3:.2f} ms over {len(m)} runs)")  # fmt: skip
        off, on = statistics.median(medians[0]), statistics.median(medians[args.interval])
        print(
            f"end to end: {100 * (on - off) / off:+.2f}% step time (within the spread above on a shared CPU)"
        )
        cost, watch, witness = check_cost(tmp / "cost-0-0", args.nproc)
        print(f"one check's work (2 passes over the parameters, one process): {cost * 1e3:.3f} ms = "
              f"{100 * cost / off:.1f}% of a step; at sdc_interval {args.interval}: "
              f"{100 * cost / args.interval / off:.3f}% per step")  # fmt: skip
        print(f"watch at rest every step, the whole model (zero1, one process): {watch * 1e3:.3f} ms = "
              f"{100 * watch / off:.2f}% of a step; fsdp/zero2 x{args.nproc} (a 1/{args.nproc} shard): "
              f"{100 * watch / args.nproc / off:.2f}%; ddp/hsdp: none")  # fmt: skip
        print(f"the replay's witness every step (fingerprint of the rank's logits): {witness * 1e3:.3f} ms = "
              f"{100 * witness / off:.2f}% of a step")  # fmt: skip


if __name__ == "__main__":
    main()
