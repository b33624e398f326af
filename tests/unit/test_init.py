"""models/init.py's truncated normal: torch's numbers bit for bit, in about half the memory of torch's sampler."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from scaletrain.models.init import WHOLE_PARAM_COPIES, trunc_normal_, uses_torch_sampler


@pytest.mark.parametrize(
    "shape,std", [((1000, 333), 0.02), ((7,), 0.5), ((50304, 64), 0.125), ((3, 4, 5), 1.0)]
)
def test_the_draws_are_torchs_and_leave_the_generator_where_torchs_do(shape, std):
    ours, theirs = torch.empty(shape), torch.empty(shape)
    torch.manual_seed(3)
    trunc_normal_(ours, std)
    after_ours = torch.rand(4)
    torch.manual_seed(3)
    nn.init.trunc_normal_(theirs, std=std, a=-3 * std, b=3 * std)
    after_theirs = torch.rand(4)
    assert torch.equal(ours, theirs)
    assert torch.equal(after_ours, after_theirs)
    assert ours.abs().max() <= 3 * std


PEAK = """
import torch
from scaletrain.models.init import trunc_normal_, uses_torch_sampler
uses_torch_sampler()
def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
t = torch.zeros(50304, 1024)  # a 206 MB output table
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
base = status("VmRSS")
trunc_normal_(t, 0.02) if {lean} else torch.nn.init.trunc_normal_(t, std=0.02, a=-0.06, b=0.06)
print(1 + (status("VmHWM") - base) / t.nbytes)
"""


def _copies(lean: bool) -> float:
    out = subprocess.run(
        [sys.executable, "-c", PEAK.format(lean=lean)], capture_output=True, text=True, check=True
    )
    return float(out.stdout)


def test_a_draw_holds_at_most_whole_param_copies_of_the_tensor():
    """The bound the planner and the memory check use (planner/memory.init_draw_bytes), measured as the growth of
    the resident set's high-water mark while one 206 MB table is drawn; torch's own sampler holds about twice it."""
    if not uses_torch_sampler():
        pytest.skip("this torch's trunc_normal_ is not a rejection sampler: ours calls it (in place)")
    assert _copies(lean=True) <= WHOLE_PARAM_COPIES
    assert _copies(lean=False) > WHOLE_PARAM_COPIES + 1
