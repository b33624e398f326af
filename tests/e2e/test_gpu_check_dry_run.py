"""The GPU check's CPU dry run (benchmarks/gpu_check.sh with DEVICE=cpu PRESET=debug) on the pinned torch: the same
plumbing the lent GPU machine runs — every phase recorded with a status, the throughput pair measured, and the
checkpoint phase killing a run after a committed async save and resuming it from that step. `make compat` runs the
same dry run on another torch release (docs/performance.md, GPU check).

The dry run runs as the GPU machine runs it: an interpreter outside this project's venv that has torch and the
image's packages but not scaletrain, tomli-w nor torchao, tomli-w from a wheel brought along, PIP_NO_INDEX=1, and
(as root) no network at all but loopback."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers import ROOT

PHASES = ["env", "pytest_gpu", "throughput", "compiled", "checkpoint", "planner", "fp8"]
# What the GPU machine's image has besides torch: one list, the Makefile's (its `compat` target installs the same).
IMAGE = re.search(r"^COMPAT_PACKAGES := (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1).split()


def _closure(names: list[str]) -> list[metadata.Distribution]:
    """The installed distributions `names` need, their requirements followed (extras and other platforms' left out)."""
    found: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        try:
            found[name] = dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional dependency this machine lacks: the image may lack it too
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(found.values())


def image_python(tmp: Path) -> str:
    """A fresh venv without pip whose only packages are torch and the image's (symlinked from this venv)."""
    venv, site = tmp / "image", tmp / "image-site"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site.mkdir()
    for dist in _closure(["torch", *IMAGE]):
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}:
            if not (site / top).exists() and Path(dist.locate_file(top)).exists():
                (site / top).symlink_to(dist.locate_file(top))
    (next((venv / "lib").glob("python3*/site-packages")) / "image.pth").write_text(f"{site}\n")
    assert (
        not (site / "scaletrain").exists()
        and not (site / "tomli_w").exists()
        and not (site / "torchao").exists()
    )
    return str(venv / "bin" / "python")


def tomli_w_wheel(folder: Path) -> Path:
    """`make gpu-wheels`' tomli-w wheel, made from this venv's copy (the test takes nothing from a network)."""
    dist = metadata.distribution("tomli-w")
    folder.mkdir()
    wheel = folder / f"tomli_w-{dist.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for f in dist.files or []:
            if f.parts[0] != ".." and "__pycache__" not in f.parts:
                z.write(dist.locate_file(f), str(f))
    return wheel


def test_the_dry_run_records_every_phase_and_resumes_from_the_killed_runs_checkpoint(tmp_path):
    env = {
        **os.environ,
        "DEVICE": "cpu",
        "PRESET": "debug",
        "OUT": str(tmp_path / "out"),
        "PY": image_python(tmp_path),
        "WHEELS": str(tomli_w_wheel(tmp_path / "wheels").parent),
        "PIP_NO_INDEX": "1",
    }
    env.pop("PHASES", None)
    env.pop("VIRTUAL_ENV", None)
    command = ["bash", "benchmarks/gpu_check.sh"]
    if os.geteuid() == 0 and shutil.which("unshare") and shutil.which("ip"):
        # No network but loopback, as on the GPU machine (root here: tests/preflight.py installs unshare and ip).
        command = ["unshare", "--net", "sh", "-c", "ip link set lo up && exec bash benchmarks/gpu_check.sh"]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
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
