"""Why a path cannot be written, in words. (The CPUs this process may use are a device fact: scaletrain/hardware.py's
usable_cpus.)"""

from __future__ import annotations

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
