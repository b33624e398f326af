"""The CPU memory check's limit and margin (issue 35): the host share is what the kernel says is available, and
an estimate within its stated error of that share is refused, with the reason."""

from __future__ import annotations

import os

from scaletrain.config import ParallelConfig, TrainingConfig
from scaletrain.hardware import CPU_OVERHEAD_BYTES, host_memory_bytes
from scaletrain.models import ModelArgs
from scaletrain.planning.estimators.memory import CPU_ESTIMATE_ERROR, memory_problem, per_rank_bytes

GiB = 2**30
ARGS = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=704, vocab_size=512, max_seq_len=64)
FSDP, T = ParallelConfig(data_parallel="fsdp"), TrainingConfig(micro_batch=1)


def test_host_share_is_what_the_kernel_has_available(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:    1048576 kB\n")
    assert host_memory_bytes(str(meminfo)) == GiB
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert host_memory_bytes(str(meminfo), worker=True) == physical
    assert host_memory_bytes(str(tmp_path / "missing")) == physical


def _problem(have: float) -> str | None:
    return memory_problem(ARGS, FSDP, T, 64, 2, device_bytes=int(have), where="host memory share",
                          overhead_bytes=CPU_OVERHEAD_BYTES, error=CPU_ESTIMATE_ERROR)  # fmt: skip


def test_an_estimate_within_its_error_of_the_limit_is_refused_saying_so():
    need = per_rank_bytes(ARGS, FSDP, T, 64, 2, overhead_bytes=CPU_OVERHEAD_BYTES)["total"]
    assert _problem(need * (1 + CPU_ESTIMATE_ERROR) * 1.01) is None
    msg = _problem(need * 1.05)  # fits, but not with its 10% to spare
    assert msg is not None and "within the estimate's stated error (10%" in msg
    assert "more than the" in (_problem(need * 0.9) or "")
