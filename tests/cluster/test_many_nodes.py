"""The documented many-nodes launch trains the single-process model (issue 34 item 2): on 2 simulated nodes x 2
workers (own network namespace, address, hostname and /dev/shm; tests/cluster/nodes.py), each layout's losses and
grad norms equal the one-process run's within `scaletrain parity`'s tolerances at every step, and so do its final
parameters, read back from each run's final checkpoint. torchrun numbers node0's ranks 0-1 and node1's 2-3, and the
mesh puts pp outermost, then dp_replicate, dp_shard (ep innermost in it), cp, tp: so the dims below that span the
two nodes are the ones named "across"."""

from __future__ import annotations

import pytest

from scaletrain.compare.parity import (
    ATOL,
    RTOL,
    compare_run,
    final_params,
    format_result,
    run_settings,
    single_process,
)
from scaletrain.resilience.goodput import compute_goodput
from scaletrain.run.directory import RunDir
from tests.cluster.nodes import NODE_ENV, Cluster, problem, torchrun
from tests.helpers import FIXED_PEAK, ROOT, events, run_cli

pytestmark = pytest.mark.skipif(problem() is not None, reason=str(problem()))

STEPS = 3
# Deterministic kernels and 2-sample micro-batches (the one process accumulates 4 of them, each rank of a 4-way data
# parallel layout runs 1): only the layout differs from the reference.
SETTINGS = [*run_settings(STEPS), "--training.deterministic", "true", "--training.micro_batch", "2"]
DENSE, MOE = str(ROOT / "configs" / "debug.toml"), str(ROOT / "configs" / "debug_moe.toml")
FSDP = ["--parallel.data_parallel", "fsdp"]
# (name, config, layout): four launches cover the six layouts of the issue.
LAYOUTS = [
    # replicas on different nodes, each replica's shards on one node
    ("hsdp: replicate across, shard within", DENSE,
     ["--parallel.data_parallel", "hsdp", "--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"]),
    # tp's two ranks on one node; cp spans the nodes, and FSDP shards over dp_shard x cp (parallel/mesh.py), so the
    # parameter shards and their all-gathers and reduce-scatters span the nodes too
    ("tp within x cp and fsdp across", DENSE, [*FSDP, "--parallel.tp", "2", "--parallel.cp", "2"]),
    # one pipeline stage per node, each stage's parameters sharded over its node's two ranks
    ("pp across x fsdp within", DENSE,
     [*FSDP, "--parallel.pp", "2", "--parallel.dp_shard", "2", "--parallel.pp_schedule", "1f1b"]),
    # 8 experts, 2 on each rank: the tokens' all-to-all and the dense parameters' fsdp both span the nodes
    ("ep and fsdp across (MoE)", MOE, [*FSDP, "--parallel.dp_shard", "4", "--parallel.ep", "4"]),
]  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process run of each config, trained once for the module: (metrics, final parameters)."""
    done: dict[str, tuple] = {}

    def get(config: str) -> tuple[list[dict], dict]:
        if config not in done:
            run = tmp_path_factory.mktemp("reference") / "run"
            args = [*SETTINGS, *FIXED_PEAK, *single_process(), "--run.dir", str(run)]
            run_cli("train", "--config", config, *args, timeout=120)
            done[config] = (RunDir(run).read_metrics(), final_params(run))
        return done[config]

    return get


@pytest.mark.parametrize(("name", "config", "layout"), LAYOUTS, ids=[n.split(":")[0] for n, *_ in LAYOUTS])
def test_a_layout_across_two_nodes_trains_the_single_process_model(tmp_path, reference, name, config, layout):
    ref = reference(config)
    run = tmp_path / "run"
    args = [*SETTINGS, *layout, "--run.dir", str(run)]
    with Cluster(2) as cluster:
        for node in cluster.nodes:
            node.start(
                torchrun("2", 2, *args, config=config), env=NODE_ENV, log=tmp_path / f"{node.hostname}.log"
            )
        codes = [node.wait(120) for node in cluster.nodes]
        logs = "\n".join((tmp_path / f"{n.hostname}.log").read_text()[-3000:] for n in cluster.nodes)
        assert codes == [0, 0], logs
        addresses = {n.hostname: n.address for n in cluster.nodes}
    # It ran on both nodes, two ranks each, at their cluster addresses.
    (start,) = events(run, "start")
    assert {h: (r["address"], r["ranks"]) for h, r in start["nodes"].items()} == {
        "node0": (addresses["node0"], [0, 1]), "node1": (addresses["node1"], [2, 3])}  # fmt: skip
    # Goodput's parts add up without a negative one: the set-up before `start` (rendezvous, mesh, load) is restart
    # time, not step time as well (it was: goodput 1.5 on a short run on two nodes).
    accounted = compute_goodput(run)
    assert accounted["other_s"] >= 0 and accounted["goodput"] <= 1, accounted
    got = (RunDir(run).read_metrics(), final_params(run))
    assert [m["step"] for m in got[0]] == list(range(1, STEPS + 1))
    result = compare_run(name, 4, ref, got, RTOL, ATOL)
    print(format_result(result, RTOL, ATOL))
    assert result.ok, format_result(result, RTOL, ATOL)
