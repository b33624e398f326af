"""The truncated normal every weight matrix starts from, N(0, std) cut at ±3 std: the numbers of torch's
`nn.init.trunc_normal_`, bit for bit, drawn with fewer temporaries.

Why not call torch's: from torch 2.12 it is a rejection sampler that holds the tensor, a whole candidate tensor,
`torch.where`'s result and three boolean masks at once — 4.4x the tensor, measured on CPU — and a sharded
initialisation draws each parameter whole (parallel/materialize.py), so that multiple is the peak of a rank's
start for the largest matrix (a 70B model's output table: 4 GB drawn, 18 GB held). Here the same draws are made in
the same order (the tensor's `normal_`, then one whole candidate `normal_` per round while any element lies outside
the bounds), but only the rejected positions are kept as an index and replaced in place: the tensor, one candidate
and an index of the ~0.3% rejected elements. `uses_torch_sampler` says whether this torch draws these numbers (a
check on a fixed private generator, once); where it does not (torch 2.11's inverse-CDF sampler, in place anyway),
torch's own is called, so the values are always the installed torch's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

# The most copies of a parameter a draw holds at once: the tensor and a candidate, plus the rejected positions'
# index (8 bytes for ~0.27% of the elements) and the allocator's slack around the chunks' masks: measured 2.00-2.24
# for a 206 MB table on CPU (tests/unit/test_init.py holds it to this bound). torch's own: 4.25.
WHOLE_PARAM_COPIES = 2.25

_CHUNK = 1 << 20  # elements per boolean mask while looking for rejected positions: 1 MiB of bools


def trunc_normal(std: float) -> Callable[[torch.Tensor], None]:
    """The in-place init of a weight matrix: N(0, std) truncated at ±3 std."""
    return partial(trunc_normal_, std=std)


@torch.no_grad()
def trunc_normal_(tensor: torch.Tensor, std: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """`nn.init.trunc_normal_(tensor, std=std, a=-3 * std, b=3 * std)`'s numbers, holding two copies, not 4.4."""
    if tensor.is_meta:
        return tensor
    if not (uses_torch_sampler() and tensor.is_contiguous()):
        return nn.init.trunc_normal_(tensor, std=std, a=-3 * std, b=3 * std, generator=generator)
    _lean(tensor, std, generator)
    return tensor


def _outside(flat: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """Positions of `flat` outside [lo, hi], found a chunk at a time so no whole-size mask is held."""
    found = [
        start + ((part < lo) | (part > hi)).nonzero().view(-1)
        for start, part in zip(range(0, flat.numel(), _CHUNK), flat.split(_CHUNK), strict=True)
    ]
    return torch.cat(found) if found else flat.new_empty(0, dtype=torch.long)


@functools.cache
def uses_torch_sampler() -> bool:
    """Whether `trunc_normal_` here draws what this torch's `nn.init.trunc_normal_` draws: both run on a private
    generator over a tensor large enough to reject some elements (~0.3% of 65536), and are compared bit for bit."""
    ours, theirs = torch.empty(1 << 16), torch.empty(1 << 16)
    _lean(ours, 0.02, torch.Generator().manual_seed(1234))
    nn.init.trunc_normal_(theirs, std=0.02, a=-0.06, b=0.06, generator=torch.Generator().manual_seed(1234))
    return torch.equal(ours, theirs)


def _lean(tensor: torch.Tensor, std: float, generator: torch.Generator | None) -> None:
    # torch compares against the bounds cast to the tensor's dtype; so do we.
    lo = tensor.new_tensor(-3 * std, device="cpu").item()
    hi = tensor.new_tensor(3 * std, device="cpu").item()
    flat = tensor.view(-1).normal_(0.0, std, generator=generator)
    rejected = _outside(flat, lo, hi)
    while rejected.numel():
        # One whole candidate per round, drawn as torch draws it (so the generator moves as torch's does), of which
        # only the rejected positions are kept: the candidate is freed at once.
        values = torch.empty_like(flat).normal_(0.0, std, generator=generator)[rejected]
        flat[rejected] = values
        rejected = rejected[(values < lo) | (values > hi)]
