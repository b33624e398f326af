"""Chaos drill (issue 26): a G-group CPU job with a worker SIGKILLed every ~30 s, on today's full-restart path (the
elastic agent restarts every worker, which resume from the memory tier) and with fault_tolerance (only the
killed worker's replica group restarts and heals from a live peer), side by side: goodput, committed steps, and
what each path lost (steps recomputed after a resume; group-steps missed, i.e. global-batch slices dropped).

    python benchmarks/ft_drill.py [--minutes 10] [--kill-every 30] [--groups 3] [--config configs/debug.toml]

The killer picks a random worker (a child of a launcher's fork server) every --kill-every seconds; after --minutes
the launcher gets SIGTERM (and the whole process group SIGKILL 60 s later if it is still there).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def workers(root: int) -> list[int]:
    """Training workers under the launcher `root`: the children of its (or its groups') fork servers."""
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    parent = {p: _ppid(p) for p in pids}

    def under(p: int) -> bool:
        while p > 1:
            if p == root:
                return True
            p = parent.get(p, -1)
        return False

    return [
        p for p in pids if under(p) and "forkserver" in _cmdline(parent[p]) and "forkserver" in _cmdline(p)
    ]


def drill(mode: str, args: argparse.Namespace, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "scaletrain", "train", "--config", args.config, "--run.dir", str(run_dir),
           "--nproc", str(args.groups), "--max-restarts", "1000", "--training.steps", "1000000",
           "--training.eval_interval", "0", "--metrics.log_interval", "1", "--metrics.progress", "false",
           "--metrics.tensorboard", "false", "--training.threads", "1", "--checkpoint.snapshot_interval", "5",
           "--checkpoint.interval", "50", "--training.global_batch", "12", "--training.micro_batch", "4"]  # fmt: skip
    if mode == "ft":
        cmd += ["--fault_tolerance.enabled", "true", "--fault_tolerance.replica_groups", str(args.groups)]
    log = open(run_dir.parent / f"{mode}.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    rng, kills, t0 = random.Random(0), 0, time.monotonic()
    while time.monotonic() - t0 < args.minutes * 60 and proc.poll() is None:
        time.sleep(args.kill_every)
        alive = workers(proc.pid)
        if alive and time.monotonic() - t0 < args.minutes * 60:
            os.kill(rng.choice(sorted(alive)), signal.SIGKILL)
            kills += 1
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return summarise(mode, run_dir, kills, args.groups)


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarise(mode: str, run_dir: Path, kills: int, groups: int) -> dict:
    """From the run's records: steps committed per wall second, and what the failures cost. Full restart: downtime
    (the goodput module's restart_s) and steps trained twice (a step logged again after a resume). Fault tolerance:
    group-steps missed (a step's slice of a group that was away: dropped), counted from every group's metrics."""
    from scaletrain.resilience.goodput import compute_goodput

    events = _records(run_dir / "events.jsonl")
    times = [e["time"] for e in events]
    dirs = (
        [run_dir] + [run_dir / "replicas" / f"group-{k}" for k in range(1, groups)]
        if mode == "ft"
        else [run_dir]
    )
    trained: dict[int, set[int]] = {}
    twice = 0
    for k, d in enumerate(dirs):
        times += [e["time"] for e in _records(d / "events.jsonl")]
        for m in _records(d / "metrics.jsonl"):
            twice += mode != "ft" and m["step"] in trained
            trained.setdefault(m["step"], set()).add(k)
    steps = max(trained, default=0)
    wall = max(times) - min(times)
    out = dict(mode=mode, kills=kills, steps=steps, wall_s=round(wall, 1), steps_per_s=round(steps / wall, 3),
               failures=len([e for e in events if e["kind"] == ("replica_lost" if mode == "ft" else "failure")]))  # fmt: skip
    if mode == "ft":
        out["group_steps_missed"] = sum(groups - len(trained.get(s, ())) for s in range(1, steps + 1))
        out["slices_dropped_pct"] = round(100 * out["group_steps_missed"] / (groups * steps), 2)
        heals = [e["heal_s"] for e in events if e["kind"] == "replica_joined" and e.get("heal_s") is not None]
        out["heal_s_median"] = sorted(heals)[len(heals) // 2] if heals else None
        out["fell_behind"] = len([e for e in events if e.get("cause") == "fell_behind"])
        out["goodput_groups_1+"] = [round(compute_goodput(d)["goodput"], 3) for d in dirs[1:]]
    else:
        g = compute_goodput(run_dir)
        out.update(
            goodput=round(g["goodput"], 3), restart_s=round(g["restart_s"], 1), steps_trained_twice=twice
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--kill-every", type=float, default=30.0, help="seconds between kills")
    p.add_argument("--groups", type=int, default=3, help="replica groups of one worker each (--nproc)")
    p.add_argument("--config", default="configs/debug.toml")
    p.add_argument("--modes", default="restart,ft")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--dir", help="keep the runs and their logs here (default: a temporary directory)")
    p.add_argument("--summarise", action="store_true", help="only read back the runs kept in --dir")
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="scaletrain-ft-drill-") as tmp:
        tmp = args.dir or tmp
        for mode in args.modes.split(","):
            if args.summarise:
                results.append(summarise(mode, Path(tmp) / mode / "run", -1, args.groups))
                print(json.dumps(results[-1]), flush=True)
                continue
            (Path(tmp) / mode).mkdir(parents=True)
            results.append(drill(mode, args, Path(tmp) / mode / "run"))
            print(json.dumps(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
