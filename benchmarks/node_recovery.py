"""Recovery after a node loss, side by side on the same job (issue 34): the debug model on simulated nodes
(tests/cluster/nodes.py), 2 nodes x 2 workers, a random node killed whole (every process, its /dev/shm) every
--kill-every seconds and a replacement booted at once under the same name, for --minutes. Three ways back:

- memory: snapshots every --interval steps, each rank's replica in a rank of the other node; no storage save.
- storage: a storage checkpoint every --interval steps (DCP on the shared run directory); no memory tier.
- torchft: two replica groups, one per node (fault_tolerance.group), the lighthouse on a third node that is not
  killed; group 0 also saves storage checkpoints every --interval steps (it owns the run directory).

The torchrun jobs keep their rendezvous in a file on the shared filesystem (docs/launching.md: no node hosts it,
so any node may die). For each kill: seconds from the kill to the next step committed (logged) after it, and the
steps trained again (the newest step logged before the kill minus the step the job went on from). Over the drill:
goodput (resilience/goodput.py: productive step time / wall time, of group 0 for torchft) and distinct steps
committed. Needs root.

    python benchmarks/node_recovery.py [--minutes 10] [--kill-every 60] [--interval 5] [--modes memory,storage,torchft]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scaletrain.resilience.goodput import compute_goodput  # noqa: E402
from tests.cluster.nodes import NODE_ENV, Cluster, Node, problem, torchrun  # noqa: E402

LIGHTHOUSE_PORT = 29510
COMMON = ["--training.steps", "1000000", "--training.micro_batch", "2", "--training.eval_interval", "0",
          "--metrics.log_interval", "1", "--metrics.tensorboard", "false", "--training.threads", "1"]  # fmt: skip


def _records(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or a line being written
        return []


class Job:
    """One mode's job on its cluster: start, the node commands, and the committed steps each group logged."""

    def __init__(self, mode: str, args: argparse.Namespace, cluster: Cluster, tmp: Path) -> None:
        self.mode, self.cluster, self.tmp, self.run = mode, cluster, tmp, tmp / "run"
        k = str(args.interval)
        if mode == "torchft":
            self.victims = cluster.nodes[1:3]
            self.dirs = [self.run, self.run / "replicas" / "group-1"]
        else:
            self.victims = cluster.nodes[0:2]
            self.dirs = [self.run]
            tier = ["--checkpoint.snapshot_interval", k, "--checkpoint.interval", "0"]
            if mode == "storage":
                tier = ["--checkpoint.snapshot_interval", "0", "--checkpoint.interval", k]
            quick = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
            self.cmd = torchrun("2", 2, "--run.dir", str(self.run), *COMMON, *tier, max_restarts=1000,
                                endpoint=str(tmp / "rendezvous"), rdzv_conf=f"store_type=file,{quick}")  # fmt: skip
        self.interval = k

    def node_cmd(self, node: Node) -> list[str]:
        if self.mode != "torchft":
            return self.cmd
        group = self.cluster.nodes.index(node) - 1
        return [sys.executable, "-m", "scaletrain", "train", "--config", "configs/debug.toml", "--nproc", "4",
                "--max-restarts", "1000", "--run.dir", str(self.run), *COMMON, "--metrics.progress", "false",
                "--checkpoint.interval", self.interval, "--fault_tolerance.enabled", "true",
                "--fault_tolerance.lighthouse", f"http://node0:{LIGHTHOUSE_PORT}",
                "--fault_tolerance.group", str(group), "--fault_tolerance.address", node.hostname]  # fmt: skip

    def start(self, node: Node, again: int = 0) -> None:
        env = NODE_ENV if self.mode != "torchft" else {"OMP_NUM_THREADS": "1"}
        node.start(self.node_cmd(node), env=env, log=self.tmp / f"{node.hostname}-{again}.log")

    def boot(self) -> None:
        if self.mode == "torchft":
            head = self.cluster.nodes[0]
            lighthouse = [str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind",
                          f"{head.address}:{LIGHTHOUSE_PORT}", "--min_replicas", "1", "--join_timeout_ms", "1000",
                          "--heartbeat_timeout_ms", "2000"]  # fmt: skip
            head.start(lighthouse, env={"OMP_NUM_THREADS": "1"}, log=self.tmp / "lighthouse.log")
        for node in self.victims:
            self.start(node)

    def next_step(self, seen: list[int], since: float, t0: float) -> int:
        """Wait for the next step committed after a kill at `since` (wall clock; `seen`: the records each group had
        then), not one that was in flight: torchrun's, the first record of the job re-formed after it (a `start`
        event); torchft's, the survivors' first step without the killed group (replicas 1). Returns the step the
        job went on from (its checkpoint's or snapshot's step; for torchft the step before, none trained again)."""
        at_start = None  # the records there were when the re-formed job started
        while time.monotonic() - t0 < 600:
            if self.mode == "torchft":
                new = [
                    m for r, n in zip(self.logged(), seen, strict=True) for m in r[n:] if m["replicas"] == 1
                ]
                if new:
                    return new[0]["step"] - 1
            else:
                starts = [
                    e
                    for e in _records(self.run / "events.jsonl")
                    if e["kind"] == "start" and e["time"] > since
                ]
                if starts and at_start is None:
                    at_start = len(self.logged()[0])
                if at_start is not None and len(self.logged()[0]) > at_start:
                    return starts[0]["step"]
            time.sleep(0.1)
        raise RuntimeError(f"{self.mode}: no step within 600 s of a kill")

    def logged(self) -> list[list[dict]]:
        return [_records(d / "metrics.jsonl") for d in self.dirs]


def drill(mode: str, args: argparse.Namespace, tmp: Path, rng: random.Random) -> dict:
    kills = []
    with Cluster(3 if mode == "torchft" else 2) as cluster:
        job = Job(mode, args, cluster, tmp)
        job.boot()
        deadline = time.monotonic() + 600
        while not any(job.logged()):
            assert time.monotonic() < deadline, f"{mode}: no step in 600 s"
            time.sleep(0.5)
        t0 = time.monotonic()
        print(f"{mode}: training (load {os.getloadavg()[0]:.1f})", flush=True)
        while time.monotonic() - t0 < args.minutes * 60:
            time.sleep(max(0.0, args.kill_every - 1))
            if time.monotonic() - t0 > args.minutes * 60:
                break
            victim = rng.choice(job.victims)
            seen = [len(r) for r in job.logged()]
            last = max((r[-1]["step"] for r in job.logged() if r), default=0)
            killed, load, wall_clock = time.monotonic(), os.getloadavg()[0], time.time()
            victim.kill()
            job.start(victim, again=len(kills) + 1)  # the replacement, with an empty /dev/shm
            first = job.next_step(seen, wall_clock, killed)
            kill = dict(node=victim.hostname, to_next_step_s=round(time.monotonic() - killed, 1),
                        recomputed=max(0, last - first), load=round(load, 1), time=wall_clock)  # fmt: skip
            kills.append(kill)
            print(f"{mode}: {json.dumps(kill)}", flush=True)
            # The next kill comes --kill-every seconds after this one was recovered from.
        wall = time.monotonic() - t0
        steps = {m["step"] for r in job.logged() for m in r}
    goodput = compute_goodput(job.run)
    # torchft: the killed group's way back, from the kill to its replica_joined (it heals from the live peer).
    joins = [e["time"] for e in _records(job.run / "events.jsonl") if e["kind"] == "replica_joined"]
    for k in kills:
        k["rejoined_s"] = next((round(t - k["time"], 1) for t in sorted(joins) if t > k["time"]), None)
    # torchft: the steps a group missed (its slice of the global batch dropped), counted where the survivor logged.
    alone = sum(m.get("replicas") == 1 for r in job.logged() for m in r)
    return dict(mode=mode, kills=kills, distinct_steps=len(steps), drill_s=round(wall), group_steps_missed=alone,
                steps_per_s=round(len(steps) / wall, 2), goodput=round(goodput["goodput"], 3))  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="the drill's length for each mode")
    p.add_argument(
        "--kill-every", type=float, default=60.0, help="seconds from one recovery to the next kill"
    )
    p.add_argument("--interval", type=int, default=5, help="steps between snapshots or checkpoints")
    p.add_argument("--modes", default="memory,storage,torchft")
    p.add_argument("--seed", type=int, default=0, help="which nodes die")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    if why := problem():
        print(why, file=sys.stderr)
        return 2
    results = []
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"node-recovery-{mode}-") as tmp:
            results.append(drill(mode, args, Path(tmp), random.Random(args.seed)))
        print(json.dumps(results[-1]), flush=True)
    print(f"\n{args.minutes:g}-minute drill per mode, a node killed {args.kill_every:g} s after each recovery, "
          f"snapshot/checkpoint every {args.interval} steps; load at the end {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'mode':<9}{'kills':>6}  {'kill -> next step s, median (min-max)':>38}  {'recomputed':>10}  "
          f"{'goodput':>7}  {'steps/s':>7}  torchft: kill -> group rejoined s")  # fmt: skip
    for r in results:
        t = [k["to_next_step_s"] for k in r["kills"]] or [float("nan")]
        again = [k["recomputed"] for k in r["kills"]]
        print(f"{r['mode']:<9}{len(r['kills']):>6}  {statistics.median(t):>24.1f} ({min(t):.1f}-{max(t):.1f})"
              f"  {sum(again):>10}  {r['goodput']:>7.3f}  {r['steps_per_s']:>7.2f}  "
              f"{[k['rejoined_s'] for k in r['kills']] if r['mode'] == 'torchft' else ''}"
              f"{'; group-steps missed ' + str(r['group_steps_missed']) if r['mode'] == 'torchft' else ''}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
