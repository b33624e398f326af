"""Measure the activation memory a forward leaves for its backward: the bytes of every tensor storage an op made
during the forward that is still alive after it (saved by autograd, kept by a checkpoint or its selective cache,
or returned). Parameters, buffers and views of them are not counted. CPU or GPU; single process."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


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
