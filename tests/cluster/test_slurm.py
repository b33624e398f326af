"""A real Slurm (Debian's slurm-wlm and munge) on simulated nodes: slurmctld on node0, a slurmd on node1 to node4
(tests/cluster/slurm.py). The Slurm recipe, examples/slurm/train.sbatch, submitted as a user submits it: the script
as it is, its variables set for CPU nodes (CONFIG, RUN_DIR, TIME_LIMIT, NPROC_PER_NODE) and the GPU and CPU counts of
its #SBATCH lines overridden on sbatch's command line. Skipped where simulated nodes cannot be made (not root, no
namespaces) or where slurm-wlm and munge are not installed. The two jobs run side by side, each on two nodes of its
own (most of their time is waiting: process starts, Slurm noticing a dead node, a requeue's delay)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from scaletrain.run.directory import read_jsonl
from tests.cluster import nodes, slurm
from tests.cluster.nodes import Cluster
from tests.cluster.slurm import Slurm
from tests.helpers import FIXED_PEAK

why = nodes.problem() or slurm.problem()
pytestmark = pytest.mark.skipif(why is not None, reason=str(why))

CPU_CONFIG = """
[model]
preset = "debug"
[data]
seq_len = 64
[training]
steps = {steps}
global_batch = 8
micro_batch = 4
eval_interval = 0
threads = 1
[metrics]
log_interval = 1
progress = false
tensorboard = false
peak_tflops = {peak}
"""


@pytest.fixture(scope="module")
def cluster():
    with Cluster(5) as c:
        yield Slurm(c)


def _sbatch(cluster: Slurm, tmp: Path, steps: int, *options: str, **variables: str) -> tuple[str, Path]:
    """Submit the recipe from the project root, as `sbatch examples/slurm/train.sbatch`; the job id and RUN_DIR."""
    config, run = tmp / "cpu.toml", tmp / "run"
    config.write_text(CPU_CONFIG.format(steps=steps, peak=FIXED_PEAK[1]))
    env = {**cluster.env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # the venv, activated
           "CONFIG": str(config), "RUN_DIR": str(run), "NPROC_PER_NODE": "1", **variables}  # fmt: skip
    done = cluster.cluster.nodes[0].run(
        ["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1", f"--output={tmp}/slurm-%j.out",
         *options, "examples/slurm/train.sbatch"], env=env,
    )  # fmt: skip
    return done.stdout.strip(), run


def _job(cluster: Slurm, job: str) -> dict[str, str]:
    out = cluster.run(["scontrol", "show", "job", job], check=False).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def _events(run: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == kind]


def _until(what, timeout: float, why: str, tmp: Path):
    deadline = time.monotonic() + timeout
    while not (value := what()):
        if time.monotonic() > deadline:
            logs = "".join(p.read_text()[-3000:] for p in tmp.glob("slurm-*.out"))
            pytest.fail(f"{why} after {timeout:.0f}s; the job's output ends:\n{logs}")
        time.sleep(0.5)
    return value


def test_srun_runs_on_every_compute_node(cluster):
    done = cluster.run(["srun", "--nodes", "4", "--ntasks-per-node", "1", "hostname"])
    assert sorted(done.stdout.split()) == ["node1", "node2", "node3", "node4"]


@pytest.fixture(scope="module")
def time_limit_job(cluster, tmp_path_factory) -> tuple[str, Path, Path]:
    """The time-limit test's job on node3 and node4, submitted before the node test starts its own on node1 and
    node2 (which asks for this fixture so), and checked after it: the job id, RUN_DIR and its output's folder."""
    tmp = tmp_path_factory.mktemp("time_limit")
    job, run = _sbatch(cluster, tmp, 2, "--time=10", "--nodelist=node3,node4", TIME_LIMIT="1s")
    return job, run, tmp


@pytest.mark.usefixtures("time_limit_job")
def test_a_node_killed_under_the_job_requeues_it_and_scancel_stops_it_with_a_save(cluster, tmp_path):
    """node2 dies whole once the run has a committed checkpoint: Slurm finds the node gone, requeues the job, and
    with node2 back (a slurmd started again) the next allocation continues from that checkpoint. scancel then
    stops it: every rank gets SIGTERM, the run saves the step it stopped after, and the job ends CANCELLED."""
    node1, node2 = cluster.cluster.nodes[1:3]
    job, run = _sbatch(cluster, tmp_path, 100_000, "--nodelist=node1,node2")
    saved = _until(lambda: _events(run, "checkpoint_saved"), 600, "no checkpoint", tmp_path)[0]["step"]
    node2.kill()
    _until(lambda: _job(cluster, job).get("Restarts") == "1", 120, "Slurm did not requeue the job", tmp_path)
    cluster.restart(node2)
    starts = _until(lambda: (s := _events(run, "start"))[1:] and s, 600, "no second allocation", tmp_path)
    assert [(s["step"], s["resumed"]) for s in starts] == [(0, False), (saved, True)]
    assert [(e["node"], e["ranks"]) for e in _events(run, "peer_lost")] == [("node2", [1])]
    # Training again (a step logged by this allocation), then cancelled as a user cancels a job.
    logged = len(read_jsonl(run / "metrics.jsonl"))
    _until(lambda: len(read_jsonl(run / "metrics.jsonl")) > logged, 300, "no step after the resume", tmp_path)
    cluster.run(["scancel", job])
    since = starts[1][
        "time"
    ]  # what the second allocation wrote (the first one, cut short by the kill, has no end)
    (end,) = _until(lambda: [e for e in _events(run, "end") if e["time"] > since], 120, "no end after scancel",
                    tmp_path)  # fmt: skip
    (stop,) = [e for e in _events(run, "preempted") if e["time"] > since]
    assert stop["step"] > saved and stop["signal"] == "SIGTERM"
    assert stop["step"] == _events(run, "checkpoint_saved")[-1]["step"] == end["step"]
    state = _until(lambda: (j := _job(cluster, job))["JobState"] in ("CANCELLED", "COMPLETED", "FAILED") and j,
                   60, "the job did not end", tmp_path)  # fmt: skip
    assert state["JobState"] == "CANCELLED"
    assert not node1.processes("scaletrain") and not node2.processes("scaletrain")


def test_run_time_limit_ends_the_allocation_and_the_requeued_job_continues_the_run(cluster, time_limit_job):
    """TIME_LIMIT=1s: every allocation trains one step (every start makes at least one), saves it and exits 75 to
    the script, which requeues the job; the next allocation continues from that step and finishes the run."""
    job, run, tmp_path = time_limit_job
    _until(lambda: _job(cluster, job).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), 600,
           "the job did not end", tmp_path)  # fmt: skip
    state = _job(cluster, job)
    assert (state["JobState"], state["Restarts"]) == ("COMPLETED", "1"), state
    stops, saves, starts = _events(run, "time_limit"), _events(run, "checkpoint_saved"), _events(run, "start")
    assert [e["step"] for e in stops] == [1] and 1 in [e["step"] for e in saves]
    assert [(s["step"], s["resumed"]) for s in starts] == [(0, False), (1, True)]  # the same run, from step 1
    assert all(sorted(s["nodes"]) == ["node3", "node4"] for s in starts)  # both allocations span both nodes
    (end,) = [e for e in _events(run, "end") if e["step"] == 2]
    assert end["stopped"] is None
    out = next(tmp_path.glob("slurm-*.out")).read_text()
    assert f"requeueing job {job} (stopped by run.time_limit" in out
