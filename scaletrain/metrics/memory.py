"""Measuring memory: the peak of this process's device, in MiB, for the `mem_peak_mib` metric; and the activation
bytes a forward leaves for its backward (saved_activation_bytes: every tensor storage an op made during the forward
that is still alive after it, saved by autograd, kept by a checkpoint or its selective cache, or returned; parameters,
buffers and views of them are not counted), which the tests and benchmarks/memory.py compare the planner's
activation formula with. The techniques that save memory (recompute, offload) are applied with the other
parallelisms in scaletrain/parallel/."""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


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


class _Track(TorchDispatchMode):
    """Records a weak reference to each storage an op outputs, unless an op read it before it was made here."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, tuple[StorageWeakRef, int]] = {}
        self.before: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                key = t.untyped_storage()._cdata
                if key not in self.made:
                    self.before.add(key)
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                st = t.untyped_storage()
                if st._cdata not in self.before and st._cdata not in self.made:
                    self.made[st._cdata] = (StorageWeakRef(st), st.nbytes())
        return out


def saved_activation_bytes(forward: Callable[[], torch.Tensor]) -> tuple[int, torch.Tensor]:
    """Run `forward` (e.g. model and loss) and return (bytes of the storages it made that are still alive, its
    result). Call backward on the result afterwards to free them."""
    track = _Track()
    with track:
        out = forward()
    alive = sum(n for ref, n in track.made.values() if not ref.expired())
    return alive, out
