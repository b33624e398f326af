"""Why a path cannot be written, in words; a child process whose peak memory is its own. (The CPUs this process
may use are a device fact: scaletrain/hardware.py's usable_cpus.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def unwritable(path: Path, error: OSError) -> str:
    """Why `path` could not be created or written, in words: a parent that is a regular file is named (the OS says
    only "File exists" or "Not a directory")."""
    for parent in [path, *path.parents]:
        if parent.exists():
            if not parent.is_dir() and parent != path:
                return f"{parent} is a file, not a directory"
            break
    return error.strerror or str(error)


def run_from_small_parent(cmd: list[str], env: dict, **kw) -> subprocess.CompletedProcess:
    """Run `cmd` as the grandchild of a bare interpreter. Linux folds the parent's peak RSS into a child's
    ru_maxrss across fork and exec, so a run started straight from a process that holds torch would report at least
    that process's memory; a bare interpreter in between (its own peak ~10 MiB) leaves the run's figure its own."""
    hop = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"
    return subprocess.run([sys.executable, "-S", "-c", hop, *cmd], env=env, **kw)
