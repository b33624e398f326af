"""What `make test` needs beyond pip, checked before the first test starts: each system tool the tests call,
installed with apt where this machine allows it (root, Debian), else named in one line with the command that
installs it, and the run fails at once rather than after 20 minutes. Also prints how long the suite is expected
to take here. Run by the Makefile (`python -m tests.preflight`); CI's `.ci/run` adds nothing to it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# (command, Debian package, the tests that call it). One place: tests/unit/test_preflight.py fails when a test
# calls a system tool this table lacks, or when .ci/run does a step of its own.
NEEDS = (
    ("chromium", "chromium", "tests/e2e/test_report.py opens the report pages in a headless browser"),
    ("ip", "iproute2", "tests/cluster makes simulated nodes: network namespaces, veth, a bridge"),
    ("tc", "iproute2", "tests/cluster slows a node's link"),
    ("unshare", "util-linux", "tests/cluster gives each node its own hostname, /dev/shm and pids"),
    ("nsenter", "util-linux", "tests/cluster runs commands inside a simulated node"),
    ("mount", "mount", "tests/cluster gives each node a /dev/shm and /etc/hosts of its own"),
    ("slurmctld", "slurm-wlm", "tests/cluster/test_slurm.py runs a real Slurm on simulated nodes"),
    ("slurmd", "slurm-wlm", "tests/cluster/test_slurm.py runs a real Slurm on simulated nodes"),
    ("sbatch", "slurm-wlm", "tests/cluster/test_slurm.py submits the Slurm recipe"),
    ("munged", "munge", "tests/cluster/test_slurm.py: Slurm authenticates with munge"),
    ("taskset", "util-linux", "tests/e2e/test_tools_user_form.py pins a process to one CPU"),
)
ALIASES = {"chromium": ("chromium", "chromium-browser")}

ROOT = Path(__file__).resolve().parents[1]
LAST_RUN = ROOT / ".cache" / "tests" / "last-run.json"  # written by conftest when a full run ends
CI_MINUTES = 25  # the full suite on CI's machine (2 cores), measured; the scale when nothing ran here yet


def missing() -> list[tuple[str, str, str]]:
    return [n for n in NEEDS if not any(shutil.which(c) for c in ALIASES.get(n[0], (n[0],)))]


def install(packages: list[str]) -> bool:
    """apt-get install, where this is root on a Debian-like system; False where it cannot be tried."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return False
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    print(f"preflight: installing {' '.join(packages)} (apt-get, as root)", flush=True)
    subprocess.run(["apt-get", "update", "-qq"], env=env, check=False)
    done = subprocess.run(["apt-get", "install", "-y", "-qq", *packages], env=env, check=False)
    return done.returncode == 0


def namespaces_problem() -> str | None:
    """Why the cluster tests cannot make simulated nodes here (they need root and network namespaces), or None."""
    if os.geteuid() != 0:
        return "not root"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"unshare failed: {probe.stderr.strip()}"


def expected_duration() -> str:
    cores = os.cpu_count() or 1
    if LAST_RUN.exists():
        last = json.loads(LAST_RUN.read_text())
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(last["ended"]))
        return f"the last full run here took {last['seconds'] / 60:.0f} min ({when}, {last['tests']} tests)"
    return f"about {CI_MINUTES} min on CI's 2 cores (this machine has {cores}; nothing ran here yet)"


def main() -> int:
    lacking = missing()
    if lacking:
        packages = sorted({pkg for _, pkg, _ in lacking})
        if install(packages):
            lacking = missing()
    if lacking:
        packages = " ".join(sorted({pkg for _, pkg, _ in lacking}))
        why = "; ".join(f"{cmd}: {use}" for cmd, _, use in lacking)
        print(f"preflight: missing {why}. Install it: sudo apt-get install -y {packages}", file=sys.stderr)
        return 1
    if problem := namespaces_problem():
        print(f"preflight: tests/cluster will be skipped ({problem}): they need root and network namespaces")
    print(
        f"preflight: make test runs the full suite; expected: {expected_duration()}. make test-quick (unit tests + one CLI run): ~2 min"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
