"""Straggler detection: every few steps the ranks share their mean busy time per step (their own work, not time
spent waiting for peers), and any rank slower than a multiple of the other ranks' median is named with its node (a
thermally throttled GPU, a slow host or disk slows the whole group); across nodes, each node's link is timed too,
and a node whose link is that much slower than the others' is named with its ranks (a degraded NIC or cable)."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.resilience.membership import host_of_each_rank

LINK_PROBE_BYTES = 4 << 20
"""What each node's first rank sends the next node's at a check: enough that the time is the link's bandwidth rather
than its latency (0.3 ms at 100 Gb/s), little beside a step's gradient traffic."""
LINK_PROBES = 3
"""Probes per check, the fastest kept: a pause of the process (a page fault, a busy core) lengthens one probe, not
all three (measured on simulated nodes: one probe of a healthy link took 5x the other's)."""
_ASK, _PROBE = 7341, 7342  # point-to-point tags of the link probe


class StragglerMonitor:
    """Collects this rank's busy time per step; `check` compares it with the other ranks' every `interval` steps.

    What to record matters: in lock-step training every rank waits for the slowest at the gradient collectives, so
    wall-clock step times even out across ranks (the fast ones spend the difference waiting). Record time a rank
    spends on its own work, not waiting on peers: resilience/busy.py gives CPU time on CPU and the device time of
    the step's compute (CUDA events) on a GPU. The median of the
    other ranks is the reference because it ignores the slow minority it is meant to find (a mean would be pulled
    toward them), and with two ranks it is simply the peer.
    """

    def __init__(self, factor: float, interval: int, nodes: dict[str, dict] | None = None) -> None:
        if factor <= 1 or interval < 1:
            raise ValueError(f"straggler factor must be > 1 and interval >= 1, got {factor} and {interval}")
        self.factor = factor
        self.interval = interval
        # {hostname: {"address", "ranks"}} over the ranks of the group `check` is given (membership.node_of_each_rank,
        # gathered once at the start): names each slow rank's node, and, with two nodes or more, the links timed.
        self.nodes = nodes or {}
        self._sum = 0.0
        self._count = 0

    def record(self, busy_s: float) -> None:
        self._sum += busy_s
        self._count += 1

    def check(self, step: int, group: Any = None) -> list[dict[str, Any]]:
        """At every `interval`-th step, time each node's link (two nodes or more), all-gather each rank's mean busy
        time since the last check and that time, and return the stragglers: one `{"cause": "compute", "rank",
        "node", "busy_s", "median_s", "ratio"}` per rank slower than factor x the median of the other ranks, and one
        `{"cause": "link", "node", "ranks", "link_s", "median_s", "ratio"}` per node whose link is (global ranks).
        Other steps, and a single process, return [] without communicating.

        Every rank of `group` (None: the default group) must call it at the same steps: it is a collective. CPU
        tensors are sent, so pass a gloo group when the default one is NCCL.
        """
        if step % self.interval != 0:
            return []
        mean = self.mean()
        self._sum, self._count = 0.0, 0
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return []
        link = link_seconds(self.nodes, group)
        # float64: step times of microseconds and of minutes side by side, no rounding worth a thought.
        mine = torch.tensor([mean, link], dtype=torch.float64)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, mine, group=group)

        def global_rank(r: int) -> int:
            return dist.get_global_rank(group, r) if group is not None else r

        hosts = host_of_each_rank(self.nodes) if self.nodes else None
        slow = [
            {
                "cause": "compute",
                **s,
                "rank": global_rank(s["rank"]),
                "node": hosts[s["rank"]] if hosts else None,
            }
            for s in slow_ranks([row[0].item() for row in rows], self.factor)
        ]
        for s in slow_links(self.nodes, [row[1].item() for row in rows], self.factor):
            slow.append({**s, "ranks": [global_rank(r) for r in s["ranks"]]})
        return slow

    def mean(self) -> float:
        """This rank's mean busy seconds per step since the last check (NaN before any step)."""
        return self._sum / self._count if self._count else math.nan


def slow_ranks(per_rank: list[float], factor: float) -> list[dict[str, float]]:
    """One `{"rank", "busy_s", "median_s", "ratio"}` per position of `per_rank` (mean busy seconds per step, one per
    rank) slower than `factor` x the median of the others. A rank with no steps since the last check (just
    restarted) has no time to compare: NaN, left out."""
    slow = []
    for i, t in enumerate(per_rank):
        # The median of the OTHER ranks: with many ranks it is the median, and with two it is the peer (the
        # median of both could never be exceeded by a factor of 2 or more).
        others = [x for j, x in enumerate(per_rank) if j != i and math.isfinite(x)]
        if not others or not math.isfinite(t):
            continue
        median = statistics.median(others)
        if median > 0 and t > factor * median:
            slow.append({"rank": i, "busy_s": t, "median_s": median, "ratio": t / median})
    return slow


def slow_links(nodes: dict[str, dict], link_s: list[float], factor: float) -> list[dict[str, Any]]:
    """One `{"cause": "link", "node", "ranks", "link_s", "median_s", "ratio"}` per node of `nodes` whose link took
    more than `factor` x the other nodes' median to send the probe. `link_s`: each rank's `link_seconds` (a node's
    first rank holds the time of the previous node's link; the other ranks NaN)."""
    if len(nodes) < 2:
        return []
    names = list(nodes)
    # node i's link, as node i+1's first rank timed it
    sent = [link_s[nodes[names[(i + 1) % len(names)]]["ranks"][0]] for i in range(len(names))]
    return [
        {"cause": "link", "node": names[s["rank"]], "ranks": nodes[names[s["rank"]]]["ranks"], "link_s": s["busy_s"],
         "median_s": s["median_s"], "ratio": s["ratio"]}
        for s in slow_ranks(sent, factor)
    ]  # fmt: skip


def link_seconds(nodes: dict[str, dict], group: Any = None) -> float:
    """On each node's first rank: the seconds the previous node's first rank took to send it LINK_PROBE_BYTES (the
    fastest of LINK_PROBES); NaN on the other ranks, and with fewer than two nodes. The nodes form a ring in the
    table's order, each timed by the next. The receiver asks for each probe and starts its clock, so the time is one
    way: the sender's link out (and the receiver's in). Alternate nodes send in turn (two phases, three for an odd
    count), so no node sends while it receives: a slow sender's queue would hold up its own acknowledgements of what
    it receives and make its peer's link look slow too. Only the first ranks take part; the others go on to the
    gather that follows."""
    firsts = [row["ranks"][0] for row in nodes.values()]
    me, k = dist.get_rank(group), len(firsts)
    if k < 2 or me not in firsts:
        return math.nan
    i = firsts.index(me)

    def phase(j: int) -> int:
        return 2 if k % 2 and j == k - 1 else j % 2

    def peer(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    seconds = math.nan
    for now in range(3 if k % 2 else 2):
        if phase(i) == now:
            _send_probes(peer(firsts[(i + 1) % k]), group)
        if phase((i - 1) % k) == now:
            seconds = _receive_probes(peer(firsts[i - 1]), group)
    return seconds


def _send_probes(to: int, group: Any) -> None:
    asked, probe = torch.empty(1), torch.zeros(LINK_PROBE_BYTES // 4)
    for _ in range(LINK_PROBES):
        dist.recv(asked, src=to, group=group, tag=_ASK)
        dist.send(probe, dst=to, group=group, tag=_PROBE)


def _receive_probes(sender: int, group: Any) -> float:
    received, fastest = torch.empty(LINK_PROBE_BYTES // 4), math.inf
    for _ in range(LINK_PROBES):
        arriving = dist.irecv(received, src=sender, group=group, tag=_PROBE)
        started = time.perf_counter()
        dist.send(torch.ones(1), dst=sender, group=group, tag=_ASK)
        arriving.wait()
        fastest = min(fastest, time.perf_counter() - started)
    return fastest


def describe(s: dict[str, Any]) -> str:
    """One straggler of `StragglerMonitor.check`, as the console says it."""
    if s["cause"] == "link":
        return (
            f"straggler: node {s['node']} (ranks {s['ranks']}): its link takes {s['link_s']:.3f}s to send "
            f"{LINK_PROBE_BYTES >> 20} MiB, {s['ratio']:.1f}x the other nodes' median {s['median_s']:.3f}s"
        )
    where = f" on {s['node']}" if s.get("node") else ""
    return (
        f"straggler: rank {s['rank']}{where} works {s['busy_s']:.3f}s per step, {s['ratio']:.1f}x the median "
        f"{s['median_s']:.3f}s"
    )
