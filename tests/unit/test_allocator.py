"""pin_mmap_threshold (issue 35): after it, a freed tensor leaves the resident set at once, as the memory check
assumes. Without it glibc raises its mmap threshold when a large block is freed, and a later tensor of a layer's
size comes from the heap and stays resident after it is freed. Measured by the kernel (VmRSS), in a fresh
interpreter (the setting is process-wide); also through setup_process, where every CPU run sets it."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import sys, torch
from scaletrain.hardware import pin_mmap_threshold
from scaletrain.parallel.mesh import DistEnv, setup_process
if sys.argv[1] == "pin":
    assert pin_mmap_threshold()
if sys.argv[1] == "setup":  # what every CPU process of a run calls first (job.build)
    setup_process(DistEnv(0, 1, 0, 1, torch.device("cpu")), threads=1, deterministic=False)
def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1024
big = torch.ones(24 * 2**18)  # 24 MiB: mmapped; freeing it raises glibc's threshold to 24 MiB (cap: 32)
del big
before = rss_mib()
layer = torch.ones(16 * 2**18)  # 16 MiB, one layer's weights or gradients
del layer
print(rss_mib() - before)
"""


def _kept_mib(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc only")
def test_a_freed_tensor_leaves_the_resident_set():
    assert _kept_mib("pin") < 2, "pinned: the 16 MiB tensor is unmapped when freed"
    assert _kept_mib("setup") < 2, "a run's setup_process pins it"
    # The measure sees the difference: unpinned, glibc keeps the freed 16 MiB in its heap, resident.
    assert _kept_mib("default") > 12
