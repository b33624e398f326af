"""A node lost whole, recovered from the other node's memory (issue 34, item 3), on simulated nodes
(tests/cluster/nodes.py): 2 nodes x 2 workers, memory snapshots every 2 steps and no storage checkpoint yet. node1
is killed with its /dev/shm and a replacement boots under the same name: the job must go on from the newest
snapshot, which only node0's memory still holds (the replicas of node1's ranks), not start over."""

from __future__ import annotations

import time

import pytest

from tests.cluster.nodes import NODE_ENV, Cluster, problem, torchrun
from tests.helpers import events, read_jsonl

pytestmark = pytest.mark.skipif(problem() is not None, reason=str(problem()))
SNAPSHOT = 2  # checkpoint.snapshot_interval
STEPS = 20
# No storage save before the end (interval 0, interval_minutes' 30 min never come): memory is the only copy.
# Deterministic, so a step trained again after the resume must give the loss it gave the first time, which holds
# only if the weights, the optimizer state and the data position all came back exactly.
ARGS = ["--training.steps", str(STEPS), "--training.micro_batch", "2", "--training.eval_interval", "0",
        "--training.deterministic", "true", "--metrics.log_interval", "1",
        "--checkpoint.snapshot_interval", str(SNAPSHOT), "--checkpoint.interval", "0"]  # fmt: skip


def _wait(what, timeout: float, why: str):
    deadline = time.monotonic() + timeout
    while not (value := _or_none(what)):
        assert time.monotonic() < deadline, why
        time.sleep(0.05)
    return value


def _or_none(what):
    try:
        return what()
    except FileNotFoundError:  # the run directory is not there yet
        return None


def test_a_node_lost_whole_resumes_from_the_snapshot_in_the_other_nodes_memory(tmp_path):
    run = tmp_path / "run"
    cmd = torchrun("2", 2, "--run.dir", str(run), *ARGS, max_restarts=1)
    with Cluster(2) as cluster:
        node0, node1 = cluster.nodes
        for node in cluster.nodes:
            node.start(cmd, env=NODE_ENV, log=tmp_path / f"{node.hostname}.log")
        _wait(lambda: [e for e in events(run, "memory_snapshot") if e["step"] >= 2 * SNAPSHOT], 180,
              "no memory snapshot at step 4")  # fmt: skip
        killed = time.time()
        node1.kill()  # every process of node1 and its /dev/shm: node1's own snapshots and the replicas it held
        lost = _wait(lambda: events(run, "peer_lost"), 60, "no peer_lost event")
        node1.start(cmd, env=NODE_ENV, log=tmp_path / "node1-again.log")  # a replacement, empty /dev/shm
        assert node0.wait(180) == 0 and node1.wait(60) == 0

    starts = events(run, "start")
    assert len(starts) == 2, "the job re-forms once"
    before = [e["step"] for e in events(run, "memory_snapshot") if e["time"] < starts[1]["time"]]
    resumed = starts[1]["step"]
    assert resumed == max(before) > 0, f"resumed at {resumed}, the newest snapshot was {max(before)}"
    assert [(e["node"], e["ranks"], e["seen_by"]) for e in lost] == [("node1", [2, 3], "node0")]
    # node0 kept ranks 0 and 1 (the rendezvous orders nodes by hostname); node1's ranks took their snapshots from
    # the replicas node0's ranks held.
    assert {h: r["ranks"] for h, r in starts[1]["nodes"].items()} == {"node0": [0, 1], "node1": [2, 3]}
    (loaded,) = events(run, "checkpoint_loaded")
    assert (loaded["step"], loaded["source"]) == (resumed, "memory")
    assert loaded["from_peers"] == [
        {"rank": 2, "node": "node1", "from_rank": 0, "from_node": "node0"},
        {"rank": 3, "node": "node1", "from_rank": 1, "from_node": "node0"},
    ]
    # The resumed job logged steps resumed+1..STEPS once each. Trained twice: the steps the first attempt logged
    # after the snapshot it resumed from, at most the snapshot interval; each gave the same loss again (the same
    # weights, optimizer state and batches: the data position exact).
    records = [m for m in read_jsonl(run / "metrics.jsonl") if "loss" in m]
    first, again = records[: -(STEPS - resumed)], records[-(STEPS - resumed) :]
    assert [m["step"] for m in first] == list(range(1, len(first) + 1))
    assert [m["step"] for m in again] == list(range(resumed + 1, STEPS + 1))
    twice = [m["step"] for m in first if m["step"] > resumed]
    assert len(twice) <= SNAPSHOT, f"steps {twice} trained twice"
    assert [m["loss"] for m in first if m["step"] > resumed] == [m["loss"] for m in again[: len(twice)]]
    assert events(run, "end")[-1]["step"] == STEPS
    print(f"kill -> peer_lost {lost[0]['time'] - killed:.1f}s, -> resumed start {starts[1]['time'] - killed:.1f}s "
          f"(restore {loaded['seconds']:.3f}s), -> step {resumed + 1} done "
          f"{starts[1]['time'] + again[0]['step_time_s'] - killed:.1f}s; steps trained twice: {twice}")  # fmt: skip
