"""Who is in the job: each rank's node (hostname and cluster address, gathered at the start and written into the
start event), a lease on each rank's number in the run directory (so a rank is never held by two live processes),
and the `peer_lost` event a survivor writes when a collective broke because another node's ranks are gone (issue
41)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import socket
from pathlib import Path

import torch.distributed as dist

from scaletrain.errors import UserError
from scaletrain.metrics.writer import append_event
from scaletrain.run.directory import RunDir

log = logging.getLogger("scaletrain")

LEASES = "ranks"  # <run dir>/ranks/rank-NNNNN.lock: one per rank, flock-ed by the process that holds it
# gloo's and the TCP store's words for a peer that went away, with its address: "Read error [198.18.0.2]:4783:
# Connection reset by peer", "Connection closed by peer [10.0.0.7]:29500".
PEER = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")
BROKEN = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")


def restart_count() -> int:
    """How many times torchrun's agent has re-formed this job: 0 at its first start (and outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class RankLease:
    """This process's hold on rank `rank` of the run: an exclusive flock on <run dir>/ranks/rank-NNNNN.lock, which
    the kernel drops when the process ends, however it ends. A second live process of the same rank (a worker that
    outlived its agent, met by its replacement) is refused before it trains or writes a record or a checkpoint
    shard, with the holder named. On a
    filesystem without locks (some FUSE mounts) the lease is skipped with a warning: nothing that ran is refused."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.path = Path(run_dir) / LEASES / f"rank-{rank:05d}.lock"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self.path.read_text().strip() or "another process"
            self.close()
            raise UserError(
                f"rank {rank} of this run is held by a live process ({holder}): two processes training as one rank "
                "would both write its checkpoint shards and records. End that process (a worker that outlived its "
                f"agent?) or wait for it to exit, then start again ({self.path})"
            ) from None
        except OSError as e:
            log.warning("rank %d: no lease in %s (%s): a second process of this rank would not be refused",
                        rank, self.path.parent, e.strerror)  # fmt: skip
            self.close()
            return
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the lock goes with the descriptor
            self._fd = None

    __del__ = close  # a start that failed after taking it (job.build) lets it go with the object


def node_of_each_rank(group: dist.ProcessGroup | None) -> dict[str, dict]:
    """{hostname: {"address": the address the cluster reaches it at, "ranks": [...]}} over every rank of `group`
    (one all-gather on the CPU control group, at the start): what a lost peer's address is mapped back to."""
    me = (socket.gethostname(), cluster_address())
    rows = [me]
    if group is not None:
        rows = [None] * dist.get_world_size(group)
        dist.all_gather_object(rows, me, group=group)
    table: dict[str, dict] = {}
    for rank, (host, address) in enumerate(rows):
        table.setdefault(host, {"address": address, "ranks": []})["ranks"].append(rank)
    return table


def host_of_each_rank(nodes: dict[str, dict]) -> list[str]:
    """The node table (node_of_each_rank) as each rank's hostname, in rank order."""
    by_rank = {rank: host for host, row in nodes.items() for rank in row["ranks"]}
    return [by_rank[rank] for rank in sorted(by_rank)]


def cluster_address() -> str:
    """This host's address on the route to the rendezvous host (MASTER_ADDR): its address on the cluster network,
    as the peers' sockets see it. A UDP connect sends nothing; it only picks the route."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master, int(os.environ.get("MASTER_PORT", "1"))))
        return s.getsockname()[0]
    return "127.0.0.1"


def lost_peer(error: str, nodes: dict[str, dict]) -> dict | None:
    """The other node a broken collective's error names (gloo's "Connection reset by peer" with the peer's address),
    as {"node", "address", "ranks"}; None when the error names no other node of the table."""
    if not any(word in error for word in BROKEN):
        return None
    for address in PEER.findall(error):
        for host, row in nodes.items():
            if row["address"] == address and host != socket.gethostname():
                return {"node": host, "address": address, "ranks": row["ranks"]}
    return None


def record_lost_peer(run: RunDir, error: str) -> None:
    """On a surviving rank, after a collective broke: a `peer_lost` event naming the other node whose connections
    broke and its ranks, from the table the newest start event holds, at the newest logged step. Each survivor that
    can name the node tries; the first to create the attempt's marker file (O_EXCL) writes the one event."""
    starts = [e for e in run.read_events() if e.get("kind") == "start" and "nodes" in e]
    if not starts or (lost := lost_peer(error, starts[-1]["nodes"])) is None:
        return
    marker = run.path / LEASES / f"lost-{lost['node']}-{starts[-1]['time']:.6f}"
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except OSError:
        return  # another survivor wrote it (or the directory is gone: nothing to record into)
    step = next((m["step"] for m in reversed(run.read_metrics()) if "step" in m), None)
    append_event(run.path, "peer_lost", step=step, seen_by=socket.gethostname(), **lost)
    log.error(
        "lost node %s (%s, ranks %s): its connections broke", lost["node"], lost["address"], lost["ranks"]
    )
