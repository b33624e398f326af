"""A node's workers die with its torchrun agent (issue 41), on simulated nodes (tests/cluster/nodes.py): own network
namespace and address, hostname, /dev/shm and pids. The documented many-nodes command, 2 nodes x 2 workers."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.cluster.nodes import NODE_ENV, Cluster, problem, torchrun
from tests.helpers import events

pytestmark = pytest.mark.skipif(problem() is not None, reason=str(problem()))
WORKER = (
    "-m scaletrain train"  # a worker's command line (the agent's reads "torchrun ... -m scaletrain train")
)


def _workers(node) -> list[int]:
    return [p for p in node.processes(WORKER) if p != node.agent()]


def _wait(what, timeout: float, why: str):
    deadline = time.monotonic() + timeout
    while not (value := _or_none(what)):
        assert time.monotonic() < deadline, why
        time.sleep(0.1)
    return value


def _or_none(what):
    try:
        return what()
    except FileNotFoundError:  # the run directory is not there yet
        return None


def test_kill_9_of_a_nodes_agent_ends_its_workers_the_survivors_name_it_and_the_job_reforms(tmp_path):
    """kill -9 of node1's torchrun agent (as the OOM killer or an operator ends it): node1's workers are gone within
    a few seconds (not training on as orphans), node0's ranks record the loss of node1 and its ranks, and a restarted
    agent on node1 rejoins: the job re-forms from the newest checkpoint and finishes."""
    run = tmp_path / "run"
    args = ["--run.dir", str(run), "--training.steps", "60", "--training.micro_batch", "2",
            "--checkpoint.interval", "10", "--training.eval_interval", "0"]  # fmt: skip
    with Cluster(2) as cluster:
        node0, node1 = cluster.nodes
        for node in cluster.nodes:
            node.start(
                torchrun("2", 2, *args, max_restarts=1), env=NODE_ENV, log=tmp_path / f"{node.hostname}.log"
            )
        _wait(
            lambda: any(e["step"] >= 10 for e in events(run, "checkpoint_saved")),
            180,
            "no checkpoint at step 10",
        )
        assert len(_workers(node1)) == 2
        os.kill(node1.agent(), signal.SIGKILL)
        killed = time.monotonic()
        _wait(lambda: not _workers(node1), 5, f"node1's workers outlived their agent: {_workers(node1)}")
        gone_s = time.monotonic() - killed
        # The survivors see the broken connections at once and name the node; their agent restarts them, and they
        # wait in the rendezvous for a second node.
        lost = _wait(lambda: events(run, "peer_lost"), 60, "no peer_lost event")
        assert [(e["node"], e["ranks"], e["seen_by"]) for e in lost] == [("node1", [2, 3], "node0")]
        assert (
            node0.status.exists() is False
        )  # node0's agent waits for node1 (--nnodes 2), it has not given up
        node1.kill()
        node1.start(torchrun("2", 2, *args, max_restarts=1), env=NODE_ENV, log=tmp_path / "node1-again.log")
        assert node0.wait(240) == 0 and node1.wait(60) == 0
    starts = events(run, "start")
    resumed_at = max(e["step"] for e in events(run, "checkpoint_saved") if e["time"] < lost[0]["time"])
    assert [s["step"] for s in starts] == [0, resumed_at]  # re-formed once, from the newest checkpoint
    assert starts[0]["nodes"] == {"node0": {"address": node0.address, "ranks": [0, 1]},
                                  "node1": {"address": node1.address, "ranks": [2, 3]}}  # fmt: skip
    # The re-formed job spans both nodes again (the rendezvous may number them the other way round).
    again = starts[1]["nodes"]
    assert {h: (r["address"], len(r["ranks"])) for h, r in again.items()} == {
        "node0": (node0.address, 2), "node1": (node1.address, 2)}  # fmt: skip
    assert events(run, "end")[-1]["step"] == 60
    print(f"node1's workers ended {gone_s:.2f}s after its agent")
