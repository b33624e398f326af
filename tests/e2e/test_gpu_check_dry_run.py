"""The GPU check's CPU dry run (benchmarks/gpu_check.sh with DEVICE=cpu PRESET=debug) on the pinned torch: the same
plumbing the lent GPU machine runs — every phase recorded with a status, the throughput pair measured, and the
checkpoint phase killing a run after a committed async save and resuming it from that step. `make compat` runs the
same dry run on another torch release (docs/performance.md, GPU check)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import ROOT

PHASES = ["env", "pytest_gpu", "throughput", "compiled", "checkpoint", "planner", "fp8"]


def test_the_dry_run_records_every_phase_and_resumes_from_the_killed_runs_checkpoint(tmp_path):
    env = {
        **os.environ,
        "DEVICE": "cpu",
        "PRESET": "debug",
        "OUT": str(tmp_path / "out"),
        "PY": sys.executable,
    }
    env.pop("PHASES", None)
    run = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    phases = summary["phases"]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert list(phases) and sorted(phases) == sorted(PHASES)
    assert {p["status"] for p in phases.values()} <= {"passed", "skipped"}
    assert all(p["reason"] for p in phases.values() if p["status"] == "skipped"), phases
    assert phases["env"]["status"] == "passed" and phases["env"]["missing"] == []
    assert phases["pytest_gpu"]["status"] == "skipped" and "no CUDA device" in phases["pytest_gpu"]["reason"]
    tput = phases["throughput"]
    assert (
        tput["status"] == "passed"
        and tput["tokens_per_s"]["scaletrain"] > 0
        and tput["tokens_per_s"]["bare"] > 0
    )
    ckpt = phases["checkpoint"]
    assert ckpt["status"] == "passed", ckpt
    assert ckpt["resumed_from"] == ckpt["killed_after_step"] == max(ckpt["saved_steps"])
    assert ckpt["last_step"] == ckpt["steps"] and ckpt["starts"][-1][1] is True
    assert "torchao" in phases["fp8"]["reason"] or "capability" in phases["fp8"]["reason"]
    assert summary["multi_gpu_unrun"]
    table = run.stdout[run.stdout.rindex("phase ") :]
    assert all(name in table for name in PHASES) and (tmp_path / "out" / "gpu_check.log").stat().st_size > 0
