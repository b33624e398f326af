"""fault_tolerance across simulated nodes (issue 34 item 5): the torchft lighthouse on node0, replica group 0 on node1
and group 1 on node2, each node with its own network namespace and address, hostname, /dev/shm and pids, the run
directory shared. Each node types the documented command (docs/resilience.md, "Across nodes")."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scaletrain.resilience.fault_tolerance import torchft_installed
from tests.cluster.nodes import Cluster, Node, problem
from tests.helpers import QUICK, events, read_jsonl

pytestmark = [
    pytest.mark.skipif(problem() is not None, reason=str(problem())),
    pytest.mark.skipif(not torchft_installed(), reason="torchft not installed: pip install 'scaletrain[ft]'"),
]
PORT = 29510  # the lighthouse's
STALL_S = (
    15.0  # the survivors' first step alone, from the previous step's end (heartbeat 2 s + join 1 s + retries)
)


def _lighthouse(node: Node) -> list[str]:
    return [str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", f"{node.address}:{PORT}",
            "--min_replicas", "1", "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "2000"]  # fmt: skip


def _group(group: int, node: Node, run: Path) -> list[str]:
    """The command of replica group `group` on `node`: the same on every node but for group and address."""
    return [sys.executable, "-m", "scaletrain", "train", "--config", "configs/debug.toml", "--nproc", "2",
            "--max-restarts", "1", "--run.dir", str(run), "--training.steps", "100000",
            "--training.eval_interval", "0", "--metrics.log_interval", "1", *QUICK,
            "--fault_tolerance.enabled", "true", "--fault_tolerance.lighthouse", f"http://node0:{PORT}",
            "--fault_tolerance.group", str(group), "--fault_tolerance.address", node.hostname]  # fmt: skip


def _wait(what, timeout: float, why: str):
    deadline = time.monotonic() + timeout
    while not (value := _or_none(what)):
        assert time.monotonic() < deadline, why
        time.sleep(0.2)
    return value


def _or_none(what):
    try:
        return what()
    except FileNotFoundError:  # not written yet
        return None


def _metrics(run: Path, group: int) -> list[dict]:
    return read_jsonl(
        run / "metrics.jsonl" if group == 0 else run / "replicas" / f"group-{group}" / "metrics.jsonl"
    )


def _listening(node: Node) -> list[tuple[str, int]]:
    """Every listening TCP socket of the node's network namespace: (local address, port)."""
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{node.init_pid}/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state != "0A":  # LISTEN
                continue
            raw, port = bytes.fromhex(local.split(":")[0]), int(local.split(":")[1], 16)
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # little-endian words
            address = socket.inet_ntop(family, words).removeprefix("::ffff:")
            found.append((address, port))
    return found


PROBE = """
import socket, sys
for address, port in ((a, int(p)) for a, p in (x.rsplit(":", 1) for x in sys.argv[1:])):
    try:
        socket.create_connection((address, port), timeout=2).close()
        print("open", address, port)
    except OSError:
        print("closed", address, port)
"""


def _probe(node: Node, targets: list[tuple[str, int]]) -> dict[tuple[str, int], str]:
    """Connect from inside `node`'s namespace to each (address, port): "open" or "closed"."""
    out = subprocess.run(["ip", "netns", "exec", node.netns, sys.executable, "-c", PROBE,
                          *(f"{a}:{p}" for a, p in targets)], capture_output=True, text=True, check=True)  # fmt: skip
    return {(a, int(p)): state for state, a, p in (line.split() for line in out.stdout.splitlines())}


def test_groups_on_other_nodes_than_the_lighthouse_bind_their_address_heal_over_the_network_and_stop_together(
    tmp_path,
):
    """node1 (group 0) and node2 (group 1) train through the lighthouse on node0.

    - Every listening socket on a group's node is bound to that node's cluster address: not reachable from node0
      at a second address of the same node, nor over loopback inside it (the same ports are open at the cluster
      address, so the probe itself works).
    - node2 is killed whole: group 0 trains alone (steps with replicas 1) after a bounded stall; node2 started
      again heals from node1's checkpoint server over the network and rejoins, and both groups train together.
    - SIGTERM to node1's launcher alone: both groups stop after the same step, group 0 saves it, both exit 0 and
      hold the same parameters."""
    run = tmp_path / "run"
    with Cluster(3) as cluster:
        node0, node1, node2 = cluster.nodes
        env = {"OMP_NUM_THREADS": "1"}
        node0.start(_lighthouse(node0), env=env, log=tmp_path / "node0.log")
        for g, node in ((0, node1), (1, node2)):
            node.start(_group(g, node, run), env=env, log=tmp_path / f"{node.hostname}.log")
        _wait(
            lambda: any(m["replicas"] == 2 for m in _metrics(run, 1)),
            240,
            "the groups did not train together",
        )

        # -- Bind addresses: every server of a group (its store, ManagerServer, checkpoint server, gloo) on the
        # node's cluster address only.
        for node in (node0, node1, node2):
            listening = _listening(node)
            assert listening and all(a == node.address for a, _ in listening), (node.hostname, listening)
        second = (
            node1.address.rsplit(".", 1)[0] + ".201"
        )  # node1 gets a second address on the cluster network
        subprocess.run(["ip", "-n", node1.netns, "addr", "add", f"{second}/24", "dev", "eth0"], check=True)
        ports = [p for _, p in _listening(node1)]
        seen = _probe(node0, [(a, p) for p in ports for a in (node1.address, second)])
        seen |= _probe(node1, [("127.0.0.1", p) for p in ports])
        assert all(seen[node1.address, p] == "open" for p in ports), seen
        assert all(seen[second, p] == "closed" and seen["127.0.0.1", p] == "closed" for p in ports), seen

        # -- A whole node lost: group 1's node dies; group 0 goes on alone, then group 1 comes back and heals.
        node2.kill()
        _wait(
            lambda: sum(m["replicas"] == 1 for m in _metrics(run, 0)) >= 3, 60, "group 0 did not train alone"
        )
        node2.start(_group(1, node2, run), env=env, log=tmp_path / "node2-again.log")
        joined = _wait(
            lambda: [e for e in events(run, "replica_joined") if e["group"] == 1], 180, "no rejoin"
        )
        alone = [m for m in _metrics(run, 0) if m["replicas"] == 1]
        _wait(lambda: _metrics(run, 0)[-1]["step"] > joined[0]["step"] + 2, 60, "no step after the rejoin")

        # -- SIGTERM to one node's launcher: every group stops after the same step.
        os.kill(node1.agent(), signal.SIGTERM)
        assert node1.wait(120) == 0 and node2.wait(60) == 0
    stops = {
        g: [e["step"] for e in events(run if g == 0 else run / "replicas/group-1", "preempted")]
        for g in (0, 1)
    }
    assert stops[0] == stops[1] and len(stops[0]) == 1, stops
    [stop] = stops[0]
    assert stop in [e["step"] for e in events(run, "checkpoint_saved")]
    done = {e["group"]: e for e in events(run, "replica_done")}
    assert done[0]["step"] == done[1]["step"] == stop and done[0]["params_sha256"] == done[1]["params_sha256"]
    assert [m["replicas"] for m in _metrics(run, 0) if m["step"] == stop] == [2]

    # The placement and the heal: each group's processes on its own node; group 1 restarted on node2 and took
    # group 0's state from node1 over the network.
    started = events(run, "replica_started")
    assert {(e["group"], e["address"]) for e in started} == {(0, node1.address), (1, node2.address)}, started
    assert [e["group"] for e in started].count(1) == 2
    [joined] = joined
    assert joined["cause"] == "restarted" and joined["source"].startswith(f"http://{node1.address}:"), joined
    # The survivors trained alone, after a bounded stall.
    first = alone[0]
    assert first["step_time_s"] < STALL_S, first
    print(f"stall {first['step_time_s']:.1f}s; {len(alone)} steps alone; stop at {stop}")
