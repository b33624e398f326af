"""Straggler detection over 3 gloo ranks in lock step: the rank slowed by a `slow:` fault is named, the others are
not, although every rank's wall-clock step time is the same (the fast ones wait for it in the all-reduce)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from scaletrain.config import FaultConfig
from scaletrain.resilience import straggler
from scaletrain.resilience.faults import FaultInjector
from scaletrain.resilience.straggler import StragglerMonitor
from tests.distributed.spawn import spawn

WORK_S = 0.02


def _busy(seconds: float) -> None:
    """Burn `seconds` of this process's CPU time. Each rank's own work is measured on the busy clock, so three ranks
    sharing two cores (or a loaded CI machine) do not shrink the fast ranks' busy time and inflate the ratio."""
    deadline = time.process_time() + seconds
    while time.process_time() < deadline:
        pass


def _ranks(rank: int, world_size: int, out: str) -> None:
    run_dir = Path(out)
    injector = FaultInjector(
        [FaultConfig(kind="slow", rank=2, factor=4.0, step=5)],
        rank=rank,
        run_dir=run_dir,
        event=lambda *a, **k: None,
    )
    monitor = StragglerMonitor(factor=2.0, interval=4)
    reports, walls = {}, []
    for step in range(1, 9):
        w0, c0 = time.perf_counter(), time.process_time()  # the Guard's busy clock on CPU
        _busy(WORK_S)  # each rank's own work
        injector.at_step_end(step, time.process_time() - c0, time.process_time)
        dist.all_reduce(torch.ones(1))  # lock step, as the gradient all-reduce makes it
        monitor.record(time.process_time() - c0)
        walls.append(time.perf_counter() - w0)
        if step == 3:
            assert monitor.check(step, None) == []  # not a check step: no collective, nothing named
        if step % 4 == 0:
            reports[step] = monitor.check(step, dist.group.WORLD)
    (run_dir / f"rank{rank}.json").write_text(json.dumps({"reports": reports, "walls": walls}))


def test_the_slow_rank_is_named_on_every_rank_although_wall_times_are_equal(tmp_path):
    spawn(_ranks, 3, str(tmp_path))
    walls = []
    for rank in range(3):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        reports = got["reports"]
        walls.append(sum(got["walls"][5:]))
        assert reports["4"] == []  # steps 1-4: nobody is slow yet
        (slow,) = reports["8"]  # steps 5-8: rank 2 works 4x as long
        assert slow["rank"] == 2
        # At most 4x: the fault's extra 3x work spins on wall time, so a contended core gives it less, never more.
        assert 2.0 < slow["ratio"] < 4.5 and abs(slow["busy_s"] - slow["ratio"] * slow["median_s"]) < 1e-9
    # Wall-clock time of the slowed steps is (nearly) the same on every rank: it could not have named the straggler.
    assert max(walls) < 1.5 * min(walls), walls


def test_one_process_returns_nothing_and_bad_settings_are_refused():
    monitor = StragglerMonitor(factor=2.0, interval=1)
    monitor.record(1.0)
    assert monitor.check(1) == []
    with pytest.raises(ValueError, match="factor must be > 1"):
        StragglerMonitor(factor=1.0, interval=10)


def _links(rank: int, world_size: int, out: str, slow_node: str) -> None:
    # Each rank a node of its own but for "b", which holds two; the slow node's first rank waits before each probe it
    # sends, as a slow link delays it (the receiver's clock runs from its request).
    names = ["a", "b", "c", "d"][: world_size - 1]
    ranks = {"a": [0], "b": [1, 2], "c": [3], "d": [4]}
    nodes = {n: {"address": f"10.0.0.{i}", "ranks": ranks[n]} for i, n in enumerate(names)}
    if rank == nodes[slow_node]["ranks"][0]:

        def late(to, group):  # straggler._send_probes, 200 ms late with each probe
            asked, probe = torch.empty(1), torch.zeros(straggler.LINK_PROBE_BYTES // 4)
            for _ in range(straggler.LINK_PROBES):
                dist.recv(asked, src=to, group=group, tag=straggler._ASK)
                time.sleep(0.2)
                dist.send(probe, dst=to, group=group, tag=straggler._PROBE)

        straggler._send_probes = late
    # Factor 20: a 4 MiB loopback send takes ~1 ms quiet, several under the suite's load (5 ranks on 2 cores), and at
    # factor 3 a loaded link was named beside the slow one (the clean-clone suite, 2026-12-07).
    monitor = StragglerMonitor(factor=20.0, interval=1, nodes=nodes)
    monitor.record(0.01)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(monitor.check(1, dist.group.WORLD)))


@pytest.mark.parametrize(("world_size", "slow_node"), [(4, "c"), (5, "a")])
def test_a_slow_link_names_its_node_and_ranks_on_every_rank(tmp_path, world_size, slow_node):
    """3 nodes (three turns of the probe) and 4 (two), one of which sends late: every rank names that node and its
    ranks, with the link as the cause; no link is named but its, no rank as slow in its own work."""
    spawn(_links, world_size, str(tmp_path), slow_node)
    ranks = {"a": [0], "b": [1, 2], "c": [3], "d": [4]}[slow_node]
    for rank in range(world_size):
        (found,) = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (found["cause"], found["node"], found["ranks"]) == ("link", slow_node, ranks)
        assert found["link_s"] >= 0.2 and found["ratio"] > 20
