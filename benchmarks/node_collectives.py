"""Collective throughput across simulated nodes vs within one node (issue 34): gloo all-reduce and all-gather of
1 MiB to 256 MiB between two ranks, each on its own simulated node (network namespace, veth pair through a bridge:
tests/cluster/nodes.py) and both on one node. Median and min-max over the repeats, as time and as bus bandwidth
(NCCL's convention: all-reduce 2(n-1)/n x size / t, all-gather (n-1)/n x gathered size / t), and the (latency per
ring step, bandwidth) fitted to the planner's ring formulas (planning/estimators/time.py), beside what its CPU
profile assumes for "inter-node" (DEFAULT_CPU: calibration measures only local ranks). Needs root.

    python benchmarks/node_collectives.py [--sizes-mib 1,4,16,64,256] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scaletrain.planning.estimators.hardware import DEFAULT_CPU, load_profile  # noqa: E402
from scaletrain.planning.measure import fit_line  # noqa: E402
from tests.cluster.nodes import Cluster, problem  # noqa: E402

MiB = 2**20
PORT = 29517


def worker(rank: int, world: int, master: str, sizes: list[int], repeats: int, out: str) -> None:
    """One rank: every op and size, a barrier before each timed call; rank 0 writes {op: {size: [seconds]}}."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{PORT}", rank=rank, world_size=world)
    times: dict[str, dict[int, list[float]]] = {"all_reduce": {}, "all_gather": {}}
    for size in sizes:
        x = torch.ones(size // 4)  # fp32
        parts = [torch.empty(size // 4 // world) for _ in range(world)]
        mine = torch.ones(size // 4 // world)
        ops = {
            "all_reduce": lambda x=x: dist.all_reduce(x),
            "all_gather": lambda parts=parts, mine=mine: dist.all_gather(parts, mine),  # gathers `size` bytes
        }
        for name, op in ops.items():
            op()  # warm-up: the pairs' buffers
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                op()
                times[name].setdefault(size, []).append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def _worker_cmd(rank: int, world: int, master: str, args: argparse.Namespace, out: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", str(rank), "--world", str(world),
            "--master", master, "--sizes-mib", args.sizes_mib, "--repeats", str(args.repeats), "--out", str(out)]  # fmt: skip


def measure(across: bool, args: argparse.Namespace, out: Path) -> dict:
    """Two ranks: on two nodes (across) or on one; returns rank 0's times."""
    env = {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
    with Cluster(2 if across else 1) as cluster:
        head = cluster.nodes[0]
        head.start(_worker_cmd(0, 2, head.address, args, out), env=env)
        time.sleep(1.0)  # the node's init has started
        if across:
            other = cluster.nodes[1]
            other.start(_worker_cmd(1, 2, head.address, args, out), env=env)
            other.wait(timeout=1800)
        else:
            head.run(_worker_cmd(1, 2, head.address, args, out), env=env, timeout=1800)
        assert head.wait(timeout=120) == 0, "rank 0 failed"
    return json.loads(out.read_text())


def _fit(op: str, times: dict[str, list[float]], n: int = 2) -> tuple[float, float]:
    """(latency per ring step, bytes/s) of the planner's formula fitted to the medians (calibrate's convention)."""
    factor = (2 if op == "all_reduce" else 1) * (n - 1) / n
    steps = (2 if op == "all_reduce" else 1) * (n - 1)
    xs = [factor * int(s) for s in times]
    a, b = fit_line(xs, [statistics.median(t) for t in times.values()])
    return a / steps, 1.0 / max(b, 1e-15)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", default="1,4,16,64,256")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--master", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    sizes = [int(s) * MiB for s in args.sizes_mib.split(",")]
    if args.worker >= 0:
        worker(args.worker, args.world, args.master, sizes, args.repeats, args.out)
        return 0
    if why := problem():
        print(why, file=sys.stderr)
        return 2
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs")
    scratch = Path(tempfile.gettempdir()) / f"node_collectives-{os.getpid()}.json"
    results = {}
    for where, across in (("within one node", False), ("across two nodes", True)):
        results[where] = measure(across, args, scratch)
    scratch.unlink(missing_ok=True)
    print(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(
        "\ngloo, 2 ranks, fp32; time median (min-max) over",
        args.repeats,
        "calls; bus bandwidth at the median",
    )
    print(f"{'op':<11}{'MiB':>5}  {'within one node':>28}  {'across two nodes':>28}  across/within")
    for op in ("all_reduce", "all_gather"):
        for size in sizes:
            cells, medians = [], []
            for where in results:
                t = results[where][op][str(size)]
                med = statistics.median(t)
                bus = (1.0 if op == "all_reduce" else 0.5) * size / med  # 2(n-1)/n or (n-1)/n with n = 2
                cells.append(
                    f"{med * 1e3:8.1f} ms ({min(t) * 1e3:.0f}-{max(t) * 1e3:.0f}) {bus / 1e9:5.2f} GB/s"
                )
                medians.append(med)
            print(f"{op:<11}{size // MiB:>5}  {cells[0]:>28}  {cells[1]:>28}  {medians[1] / medians[0]:.2f}x")
    print("\nfitted to the planner's ring formulas (latency per step, bandwidth per direction):")
    for op in ("all_reduce", "all_gather"):
        for where in results:
            lat, bw = _fit(op, results[where][op])
            print(f"  {op:<11} {where:<17} {lat * 1e6:8.0f} us  {bw / 1e9:6.2f} GB/s")
    profile = load_profile("cpu")
    print(f"planner's CPU profile ({profile.source}): inter-node {profile.inter_bw / 1e9:.2f} GB/s, "
          f"{profile.inter_latency * 1e6:.0f} us per step (DEFAULT_CPU: {DEFAULT_CPU.inter_bw / 1e9:.2f} GB/s, "
          f"{DEFAULT_CPU.inter_latency * 1e6:.0f} us); intra {profile.intra_bw / 1e9:.2f} GB/s, "
          f"{profile.intra_latency * 1e6:.0f} us; devices_per_node {profile.devices_per_node}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
