"""Chaos tests: inject each failure into real CLI runs and check the outcome, not only that the job ran."""

import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from scaletrain.checkpoint.run_model import load_run_model
from tests.helpers import ROOT, events, free_port, per_step, read_jsonl, train_args, train_cli

BASE = dict(training__eval_interval=0, metrics__log_interval=1)
# The deterministic 2-rank run that the killed-worker tests (--nproc and two torchrun agents) must end equal to.
RESTART = dict(
    BASE, steps=12, training__deterministic=True, checkpoint__interval=3, checkpoint__snapshot_interval=2
)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """RESTART run once without a fault: both tests compare with it (the suite runs a file in one worker)."""
    ref = tmp_path_factory.mktemp("uninterrupted") / "ref"
    train_cli(ref, nproc=2, **RESTART)
    return ref


def _inject(*tables):
    return "--resilience.inject=[" + ", ".join(tables) + "]"


def test_killed_worker_is_restarted_and_the_final_weights_equal_the_uninterrupted_run(
    tmp_path, uninterrupted
):
    ref, run = uninterrupted, tmp_path / "run"
    train_cli(run, "--max-restarts", "2", _inject('{kind="kill", rank=1, step=7}'), nproc=2, **RESTART)
    # One failure, one restart, blamed on the killed rank (not on its peer, which lost its connection to it).
    [failure] = events(run, "failure")
    assert (failure["cause"], failure["rank"]) == ("killed", 1), failure
    assert len(events(run, "restart")) == 1 and events(run)[-1]["kind"] == "end"
    loaded = events(run, "checkpoint_loaded")
    assert loaded[0]["source"] == "memory" and loaded[0]["step"] == 6  # newer than the storage checkpoint (3)
    assert per_step(run, "loss") == per_step(ref, "loss")
    a, b = load_run_model(ref)[0].state_dict(), load_run_model(run)[0].state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_slowed_rank_is_named_in_lock_step_data_parallel(tmp_path):
    # DDP's gradient all-reduce makes both ranks' wall-clock step times equal; busy time still tells them apart.
    run = tmp_path / "run"
    train_cli(
        run,
        _inject('{kind="slow", rank=1, factor=4, step=4}'),
        nproc=2,
        steps=9,
        **BASE,
        resilience__straggler_factor=2,
        resilience__straggler_interval=3,
    )
    named = events(run, "straggler")
    assert [e["step"] for e in named] == [6, 9] and all(e["rank"] == 1 and e["ratio"] > 2 for e in named), (
        named
    )
    # Named with its node (one here: no link to time), from the table the start event records.
    assert {(e["cause"], e["node"]) for e in named} == {("compute", socket.gethostname())}, named


def test_nan_is_skipped_and_a_failing_save_loses_nothing(tmp_path):
    """A NaN step is skipped; ENOSPC raised inside DCP's storage writer (async save, the default) reaches us as DCP's
    CheckpointException (a BaseException): the run reports checkpoint_failed, trains on, and the checkpoints before
    and after it are committed. (Both save modes, step by step: tests/unit/test_checkpoint.py.)"""
    run = tmp_path / "run"
    train_cli(
        run,
        _inject('{kind="nan", step=4}', '{kind="write_error", step=6}'),
        steps=10,
        **BASE,
        checkpoint__interval=3,
    )
    (skipped,) = events(run, "skipped_step")
    assert skipped["step"] == 4 and skipped["skipped_total"] == 1
    (failed,) = events(run, "checkpoint_failed")
    assert failed["step"] == 6 and "CheckpointException" in failed["error"] and "No space" in failed["error"]
    assert sorted(e["step"] for e in events(run, "checkpoint_saved")) == [3, 9, 10]
    commits = sorted(p.parent.name for p in (run / "checkpoints").glob("step-*/commit.json"))
    assert commits == ["step-00000003", "step-00000009", "step-00000010"]
    assert per_step(run, "loss")[4] is None  # the NaN loss is recorded (as null), the update was not applied
    assert events(run)[-1]["kind"] == "end" and events(run, "end")[0]["steps"] == 10


def test_loss_spike_rolls_back_and_skips_the_bad_batches(tmp_path):
    run = tmp_path / "run"
    train_cli(
        run,
        _inject('{kind="spike", step=15}'),
        steps=20,
        **BASE,
        checkpoint__snapshot_interval=4,
        resilience__spike_zscore=4,
        resilience__spike_window=8,
    )
    (spike,) = events(run, "loss_spike")
    (rollback,) = events(run, "rollback")
    assert spike["step"] == 15 and rollback["to_step"] == 12 and rollback["skipped_batches"] == 3
    losses = [m["loss"] for m in read_jsonl(run / "metrics.jsonl") if m["step"] > 12]
    assert max(losses) < spike["loss"] / 1.5  # the spiking batch was never trained on again
    assert events(run)[-1]["kind"] == "end" and events(run)[-1]["step"] == 20


def test_hang_is_caught_by_the_watchdog_and_the_job_recovers(tmp_path):
    run = tmp_path / "run"
    train_cli(
        run,
        "--max-restarts",
        "1",
        _inject('{kind="hang", rank=1, step=5}'),
        nproc=2,
        steps=8,
        **BASE,
        checkpoint__interval=2,
        resilience__hang_timeout_s=3,
    )
    fired = [e for e in events(run, "fault_injected") if e["fault"].startswith("hang")][0]
    hangs = [e for e in events(run, "hang") if e["rank"] == 1]
    assert hangs and hangs[0]["time"] - fired["time"] < 3 + 2  # within the timeout (+ the watchdog's tick)
    stacks = (run / "hang-rank1.txt").read_text()
    assert "Thread" in stacks and "sleep" in stacks
    assert [e["cause"] for e in events(run, "failure")][0] == "hang"
    assert events(run)[-1]["kind"] == "end" and events(run)[-1]["step"] == 8


def test_corrupted_checkpoint_falls_back_to_the_previous_one_after_a_crash(tmp_path):
    run = tmp_path / "run"
    train_cli(
        run,
        "--max-restarts",
        "1",
        _inject('{kind="corrupt_checkpoint", step=6}', '{kind="kill", rank=0, step=8}'),
        steps=10,
        **BASE,
        checkpoint__interval=3,
        checkpoint__async_save=False,  # step 6 commits before the kill
    )
    (rejected,) = events(run, "checkpoint_rejected")
    assert rejected["step"] == 6 and "checksum" in rejected["reason"]
    assert [e["step"] for e in events(run, "checkpoint_loaded")] == [3]
    assert events(run)[-1]["kind"] == "end"


def test_auto_interval_is_measured_again_after_a_restart(tmp_path):
    # A restarted worker must choose its own interval: before, only the first run segment probed, so after a
    # restart no storage checkpoint was ever written again.
    run = tmp_path / "run"
    train_cli(
        run,
        "--max-restarts",
        "1",
        _inject('{kind="kill", rank=0, step=9}'),
        steps=16,
        **BASE,
        checkpoint__interval="auto",
        checkpoint__mtbf_hours="0.0001",
    )
    probes = events(run, "checkpoint_interval")
    [resumed] = [e["step"] for e in events(run, "start") if e["resumed"]]
    assert [p["step"] for p in probes] == [5, resumed + 5], probes
    assert all(p["cost"] == "whole save" and p["cost_s"] > 0 and p["interval_steps"] >= 1 for p in probes)
    every = probes[1]["interval_steps"]
    saved = {e["step"] for e in events(run, "checkpoint_saved")}
    assert {s for s in range(resumed + 6, 16) if s % every == 0} <= saved and resumed + 5 in saved
    assert events(run)[-1]["kind"] == "end"


def test_two_torchrun_agents_as_two_nodes_recover_from_a_killed_worker(tmp_path, uninterrupted):
    # Two agents joined by c10d rendezvous on localhost act as two nodes; node 1's worker is killed at step 6 and
    # torchrun's own restart brings both nodes back, resuming the deterministic run bit for bit.
    ref, run = uninterrupted, tmp_path / "run"
    port = free_port()
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    agents = []
    for node, is_host in enumerate((1, 0)):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            f"job{port}",
            "--rdzv-conf",
            f"is_host={is_host},join_timeout=120",
            "--local-addr",
            "127.0.0.1",
            "--max-restarts",
            "1",
            "--monitor-interval",
            "0.2",
            "-m",
            "scaletrain",
            *train_args(run, _inject('{kind="kill", rank=1, step=6}'), **RESTART),
        ]
        log = open(tmp_path / f"node{node}.log", "w")  # a file, not a pipe: nobody reads it while they run
        agents.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env))
        time.sleep(1 if node == 0 else 0)  # the host's store first
    try:
        codes = [a.wait(timeout=240) for a in agents]
    finally:
        for a in agents:
            a.kill()
    logs = "\n".join((tmp_path / f"node{n}.log").read_text()[-3000:] for n in range(2))
    assert codes == [0, 0], logs
    starts = events(run, "start")
    # One restart, resumed from the memory snapshot at step 4. (Rank 0 writes `start`; its node's agent restarts
    # it for the new rendezvous, not as a failure, so its own restart count can stay 0.)
    assert len(starts) == 2 and starts[1]["resumed"] and starts[1]["step"] == 4, starts
    assert per_step(run, "loss") == per_step(ref, "loss")
    a, b = load_run_model(ref)[0].state_dict(), load_run_model(run)[0].state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)
