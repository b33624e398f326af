"""What this process may use of the machine it runs on: its CPUs (its affinity mask: Slurm's --cpus-per-task,
taskset, docker --cpuset-cpus; and its cgroup's CPU quota: docker --cpus, Kubernetes limits; not os.cpu_count(),
which counts every core of the machine), and why a path cannot be written."""

from __future__ import annotations

import math
import os
from pathlib import Path

_CGROUP = Path("/sys/fs/cgroup")


def _quota(cgroup_root: Path) -> float | None:
    """CPUs the cgroup's quota allows (quota / period), None without a quota: cgroup v2's cpu.max ("max 100000" or
    "200000 100000"), else cgroup v1's cpu.cfs_quota_us (-1: none) / cpu.cfs_period_us. Read at the mount root,
    which inside a container is the container's own cgroup."""
    try:
        quota, period = (cgroup_root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for v1 in (cgroup_root / "cpu", cgroup_root / "cpu,cpuacct"):
        try:
            quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
            period_us = int((v1 / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    return None


def usable_cpus(cgroup_root: Path = _CGROUP) -> int:
    """How many CPUs this process can run on: the CPUs of its affinity mask, capped by its cgroup's CPU quota
    (rounded up: 1.5 CPUs of quota keep 2 threads busy part of the time); at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        cpus = os.cpu_count() or 1
    quota = _quota(cgroup_root)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def unwritable(path: Path, error: OSError) -> str:
    """Why `path` could not be created or written, in words: a parent that is a regular file is named (the OS says
    only "File exists" or "Not a directory")."""
    for parent in [path, *path.parents]:
        if parent.exists():
            if not parent.is_dir() and parent != path:
                return f"{parent} is a file, not a directory"
            break
    return error.strerror or str(error)
