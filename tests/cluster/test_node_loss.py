"""A node lost whole (issue 34, item 3), on simulated nodes (tests/cluster/nodes.py), 2 nodes x 2 workers, memory
snapshots every 2 steps. The drill: no storage checkpoint yet, node1 is killed with its /dev/shm and a replacement
boots under the same name; the job must go on from the newest snapshot, which only node0's memory still holds (the
replicas of node1's ranks), not start over. With --nnodes 1:2: node0 goes on alone, resharded from storage, and
takes node1 back when it returns."""

from __future__ import annotations

import sys
import time

import fsspec
import pytest

from scaletrain.checkpoint.integrity import committed_steps
from scaletrain.resilience.membership import lost_peer
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
# For the --nnodes 1:2 drill: the round that re-forms without node1 first waits for its dead agent to miss 3
# heartbeats, 1 s apart here (not 5 s), and then forms 1 s after the last join, not the default 30 s (as
# test_partition's). (The fixed 2-node job waits for neither: its round forms when the replacement joins.)
QUICK_RDZV = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


def _wait(what, timeout: float, why: str):
    deadline = time.monotonic() + timeout
    while not (value := _or_none(what)):
        assert time.monotonic() < deadline, why
        time.sleep(0.05)
    return value


def logged(run, step: int) -> bool:
    return step in [m["step"] for m in read_jsonl(run / "metrics.jsonl") if "loss" in m]


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
        # Killed after the snapshot of step 4 and step 5: mid-interval, so that a step is (usually) trained again.
        _wait(lambda: [e for e in events(run, "memory_snapshot") if e["step"] >= 2 * SNAPSHOT] and logged(run, 5),
              180, "no memory snapshot at step 4 and step 5")  # fmt: skip
        killed = time.time()
        node1.kill()  # every process of node1 and its /dev/shm: node1's own snapshots and the replicas it held
        lost = _wait(lambda: events(run, "peer_lost"), 60, "no peer_lost event")
        node1.start(cmd, env=NODE_ENV, log=tmp_path / "node1-again.log")  # a replacement, empty /dev/shm
        assert node0.wait(180) == 0 and node1.wait(60) == 0

    starts = events(run, "start")
    assert len(starts) == 2, "the job re-forms once"
    before = [e["step"] for e in events(run, "memory_snapshot") if e["time"] < starts[1]["time"]]
    resumed = starts[1]["step"]
    # The newest snapshot reported, or the one under way when node1 died if only its last agreement was left: every
    # copy it needs was then complete on node0 (ranks 0-1's own, ranks 2-3's replicas), and the restore checked
    # their checksums (a drill with the kill delayed at random resumed at 6 with 4 the newest reported).
    newest = max(before)
    assert resumed in (newest, newest + SNAPSHOT) and resumed > 0, (
        f"resumed at {resumed}, newest reported {newest}"
    )
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
    # after the snapshot it resumed from, at most the snapshot interval. The first gives the same loss again, bit
    # for bit (the same weights and batch: the data position exact); a later one to the equivalence contract's
    # 1e-5, which holds only if the optimizer state came back too. Not bit for bit: a restarted DDP reduces its
    # first step's gradients in one bucket of parameter order and then rebuilds its buckets in the order the
    # gradients came, so on 4 ranks a few elements are summed in another order than the first attempt summed them
    # (last-bit differences; a resume from the snapshot of step 8 differed at step 10 by 2e-7, docs/resilience.md).
    records = [m for m in read_jsonl(run / "metrics.jsonl") if "loss" in m]
    first, again = records[: -(STEPS - resumed)], records[-(STEPS - resumed) :]
    assert [m["step"] for m in first] == list(range(1, len(first) + 1))
    assert [m["step"] for m in again] == list(range(resumed + 1, STEPS + 1))
    twice = [m["step"] for m in first if m["step"] > resumed]
    assert len(twice) <= SNAPSHOT, f"steps {twice} trained twice"
    if twice:
        assert first[twice[0] - 1]["loss"] == again[0]["loss"]
        for before, after in zip(first[twice[0] - 1 :], again[: len(twice)]):
            assert before["loss"] == pytest.approx(after["loss"], rel=1e-5), (before, after)
    assert events(run, "end")[-1]["step"] == STEPS
    print(f"kill -> peer_lost {lost[0]['time'] - killed:.1f}s, -> resumed start {starts[1]['time'] - killed:.1f}s "
          f"(restore {loaded['seconds']:.3f}s), -> step {resumed + 1} done "
          f"{starts[1]['time'] + again[0]['step_time_s'] - killed:.1f}s; steps trained twice: {twice}")  # fmt: skip


def test_with_nnodes_1_2_the_job_goes_on_alone_resharded_and_takes_the_node_back(tmp_path):
    """--nnodes 1:2: node1 dies, node0 re-forms alone (2 ranks, resharded from the 4-rank storage checkpoint, the
    same global batches); node1 comes back and is taken in (4 ranks again, resharded from what node0 saved alone).
    Two faults let the test, not the machine's speed, decide when node1 dies and returns: the first job's rank 2 (on
    node1) hangs at the start of step 7, so the first job logs step 6 and never saves step 8 however late the test
    sees the checkpoint of step 4. (With rank 1 only slower, a CI run timed out waiting for the job alone's step 8,
    most likely so: the first job passed step 9 before the test saw step 4's commit, the job alone ran to the end
    unslowed, and keep_last 3 removed step 8.) The job alone slows 30 times from step 9 (after its
    checkpoint of step 8) until the agent stops it to take node1 in, 11 slow steps of margin for a loaded machine.
    A fault fires in one job only. (Not a hang there: a hung rank ignores the agent's SIGTERM, which then waits 30 s
    to SIGKILL it; node1's hung rank dies with its node.)"""
    run = tmp_path / "run"
    faults = '[{kind="hang", rank=2, step=7}, {kind="slow", rank=0, step=9, factor=30}]'
    cmd = torchrun("1:2", 2, "--run.dir", str(run), *ARGS, "--checkpoint.interval", "4",
                   f"--resilience.inject={faults}", max_restarts=2, rdzv_conf=QUICK_RDZV)  # fmt: skip

    def committed(step: int) -> bool:  # read on disk: rank 0 reports a commit only at a later step
        return step in committed_steps(fsspec.filesystem("file"), str(run / "checkpoints"))

    with Cluster(2) as cluster:
        node0, node1 = cluster.nodes
        for node in cluster.nodes:
            node.start(cmd, env=NODE_ENV, log=tmp_path / f"{node.hostname}.log")
        hung = lambda: [e for e in events(run, "fault_injected") if e["fault"].startswith("hang")]  # noqa: E731
        _wait(
            lambda: committed(4) and logged(run, 6) and hung(),
            180,
            "no checkpoint of step 4, step 6 and hang",
        )
        # After step 6: the job alone trains 5 and 6 again. Step 5's loss depends on the weights only; step 6's on
        # step 5's update too, so it holds only if the optimizer state came back (a fresh AdamW steps otherwise).
        node1.kill()
        _wait(lambda: committed(8) and len(events(run, "start")) == 2, 120, "node0 alone did not save step 8")
        node1.start(cmd, env=NODE_ENV, log=tmp_path / "node1-again.log")
        assert node0.wait(180) == 0 and node1.wait(60) == 0

    starts = events(run, "start")
    loaded = [(e["step"], e["source"]) for e in events(run, "checkpoint_loaded")]
    back = starts[2][
        "step"
    ]  # the newest checkpoint when node1 was taken in: 8, or the save on the agent's SIGTERM
    assert [(s["step"], s["world_size"]) for s in starts] == [(0, 4), (4, 2), (back, 4)] and 8 <= back < STEPS
    assert [sorted(s["nodes"]) for s in starts] == [["node0", "node1"], ["node0"], ["node0", "node1"]]
    assert loaded == [(4, "storage"), (back, "storage")]  # the snapshots are of another world size
    assert events(run, "end")[-1]["step"] == STEPS
    # The same global batch in every phase (8 sequences of 64 tokens a step); a step trained in two world sizes
    # (5, by 4 ranks and then by 2) gives the same loss to the equivalence contract's 1e-5.
    records = [m for m in read_jsonl(run / "metrics.jsonl") if "loss" in m]
    assert all(m["tokens"] == 512 * m["step"] for m in records)
    steps = [m["step"] for m in records]
    twice = sorted({s for s in steps if steps.count(s) == 2})
    assert {5, 6} <= set(twice)
    assert sorted(set(steps)) == list(range(1, STEPS + 1)) and steps[-(STEPS - back) :] == list(
        range(back + 1, STEPS + 1)
    )
    for step in twice:
        a, b = [m["loss"] for m in records if m["step"] == step]
        assert abs(a - b) <= 1e-5 * abs(a), (step, a, b)
    print(
        f"alone from step 4 for {starts[2]['time'] - starts[1]['time']:.1f}s, node1 taken in at step {back}; "
        f"trained in two world sizes: {twice}"
    )


# One rank a node exchanging 16 MiB each way through the memory tier's exchange (what replication sends), with a
# 120 s group timeout: the time a rank stuck on a dead peer would wait.
EXCHANGE = """
import datetime, sys, torch, torch.distributed as dist
from scaletrain.checkpoint.memory_tier import exchange
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://node0:29500", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=120))
out = torch.empty(4 << 20)
print("exchanging", flush=True)
exchange([(torch.ones(4 << 20), 1 - rank)], [(out, 1 - rank)], None)
print("exchanged", flush=True)
"""


def test_a_node_killed_while_its_bytes_are_in_flight_is_named_at_once(tmp_path):
    """node1 dies while its 16 MiB are on their way to node0 (its link slowed to 8 Mbit/s, so the transfer takes
    16 s and the kill lands in it): node0's rank raises at once with an error that names node1, as it does when
    the kill comes between messages. (Waiting on the transfer itself, as the exchange did, it waited out the group's
    timeout: gloo tells a broken connection to the operations still queued on it, not to the one in flight.)"""
    with Cluster(2) as cluster:
        node0, node1 = cluster.nodes
        node1.slow("8mbit")
        for rank, node in enumerate(cluster.nodes):
            node.start(
                [sys.executable, "-c", EXCHANGE, str(rank)],
                env=NODE_ENV,
                log=tmp_path / f"{node.hostname}.log",
            )
        _wait(lambda: all("exchanging" in (tmp_path / f"node{i}.log").read_text() for i in (0, 1)), 60,
              "the exchange did not start")  # fmt: skip
        time.sleep(2)  # a few MiB of node1's are in, most still to come
        killed = time.monotonic()
        node1.kill()
        code = node0.wait(30)
        took = time.monotonic() - killed
    text = (tmp_path / "node0.log").read_text()
    assert code != 0 and "exchanged" not in text, text
    table = {n.hostname: {"address": n.address, "ranks": [i]} for i, n in enumerate(cluster.nodes)}
    assert lost_peer(text, table) == {"node": "node1", "address": node1.address, "ranks": [1]}, text
    assert took < 10, f"node0's rank took {took:.1f}s to learn of the loss"
    print(f"node0's rank raised {took:.1f}s after node1 was killed")
