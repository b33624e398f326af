"""resilience.membership: the rank lease (one live process a rank) and naming the node a broken collective lost."""

import socket
import subprocess
import sys

import pytest

from scaletrain.errors import UserError
from scaletrain.resilience.membership import RankLease, lost_peer

NODES = {
    "node0": {"address": "198.18.0.1", "ranks": [0, 1]},
    "node1": {"address": "198.18.0.2", "ranks": [2, 3]},
}
GLOO = "[../gloo/transport/tcp/pair.cc:537] Read error [198.18.0.2]:4783: Connection reset by peer. This is typically"


def test_the_node_a_broken_connection_names_is_found_with_its_ranks(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "node0")
    assert lost_peer(GLOO, NODES) == {"node": "node1", "address": "198.18.0.2", "ranks": [2, 3]}
    assert (
        lost_peer(GLOO.replace("198.18.0.2", "198.18.0.1"), NODES) is None
    )  # this node's own peer: no node lost
    assert lost_peer("RuntimeError: CUDA out of memory [198.18.0.2]:4783", NODES) is None  # not a broken link
    assert lost_peer(GLOO.replace("198.18.0.2", "10.0.0.9"), NODES) is None  # no node of the job


def test_a_rank_held_by_another_live_process_is_refused_and_free_once_it_ends(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from scaletrain.resilience.membership import RankLease; "
         "lease = RankLease(sys.argv[1], 3); print('held', flush=True); time.sleep(60)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            UserError, match=rf"rank 3 of this run is held by a live process \(pid {holder.pid} on "
        ):
            RankLease(tmp_path, 3)
        RankLease(tmp_path, 2).close()  # another rank is free
    finally:
        holder.kill()
        holder.wait()
    RankLease(tmp_path, 3).close()  # the kernel dropped the dead holder's lock
