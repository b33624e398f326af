"""Peak memory of this process's device, in MiB, for the `mem_peak_mib` metric."""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory_mib(device: torch.device) -> float:
    """Highest memory use so far: tensors allocated on a CUDA device, else the whole process's peak RSS."""
    if device.type == "cuda":
        # Allocated tensors only; the caching allocator may reserve more (torch.cuda.max_memory_reserved).
        return torch.cuda.max_memory_allocated(device) / 2**20
    # On CPU this is the process's peak resident set: tensors plus the Python interpreter, torch's libraries
    # and allocator slack, so it overstates what the model needs. It can never be reset during a run.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # getrusage(2): ru_maxrss is in KiB on Linux but in bytes on macOS.
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10
