"""The ground-floor hardware module: one CUDA rule asked in one place, one GPU table read by both the MFU at run time
and the planner, one name matcher, one /proc/cpuinfo reader and one best-of-N timer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from scaletrain.hardware import (
    GPU_TABLE,
    PLANNED_GPUS,
    best_time,
    cpu_flags,
    cpuinfo_field,
    match_gpu,
    uses_cuda,
)
from scaletrain.metrics.mfu import device_peak_flops
from scaletrain.planning.estimators.hardware import GPUS, gpu_kind, load_profile, local_gpu_profile
from scaletrain.precision.policy import mfu_precision

PACKAGE = Path(__file__).resolve().parents[2] / "scaletrain"
# The names torch.cuda.get_device_name() reports for the GPUs the planner knows.
REPORTED = {
    "h100": "NVIDIA H100 80GB HBM3",
    "h200": "NVIDIA H200",
    "a100": "NVIDIA A100-SXM4-80GB",
    "b200": "NVIDIA B200",
}


def test_every_planned_gpu_has_a_reported_name_here():
    assert set(REPORTED) == set(GPUS) == set(PLANNED_GPUS)


# Every GPU the planner plans: its own kinds, by the names torch reports, and those it plans as a near kind.
PLANNED_NAMES = [*REPORTED.values(), *(f"NVIDIA {g.match}" for g in GPU_TABLE if g.plans_as)]


@pytest.mark.parametrize("name", PLANNED_NAMES)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "fp8"])
def test_mfu_at_run_time_and_the_planner_use_the_same_peak(name, precision, tmp_path, monkeypatch):
    """For every known device and training precision: the peak the run divides by (device_peak_flops on that
    device, at the precision MFU is reported against) is the peak of the profile the planner plans that device
    with (`plan`/`train --dry-run`/`parallel.auto` on it; `--device KIND` for the kinds themselves)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    against = mfu_precision(precision, "cuda")
    run_peak, source = device_peak_flops(torch.device("cuda", 0), against, 0.0, tmp_path)
    assert source.startswith("table: ")
    assert local_gpu_profile(name, tmp_path).peak_flops[against] == run_peak
    if match_gpu(name).kind:
        assert load_profile(gpu_kind(name)).peak_flops[against] == run_peak


def test_a_gpu_planned_as_a_near_kind_keeps_its_memory_and_links():
    pcie, sxm = local_gpu_profile("NVIDIA H100 PCIe"), GPUS["h100"]
    assert gpu_kind("NVIDIA H100 PCIe") == "h100" and pcie.name.startswith("NVIDIA H100 PCIe")
    assert (pcie.memory_bytes, pcie.intra_bw, pcie.inter_bw) == (sxm.memory_bytes, sxm.intra_bw, sxm.inter_bw)
    # Its own peak at the SXM's measured share of it (MAMF 794.5 of 989.4 TFLOP/s).
    assert pcie.matmul["bf16"][1] == pytest.approx(756e12 * 794.5 / 989.4)


def test_every_planned_gpu_plans_with_its_table_peaks():
    """The planner's profile holds the table's peak at every precision the table has (fp16 as bf16)."""
    for kind, spec in PLANNED_GPUS.items():
        peaks = GPUS[kind].peak_flops
        assert peaks == {p: spec.peak_flops(p) for p in peaks}
        assert set(peaks) == {*spec.peak_tflops, "fp16"}


def test_cuda_is_asked_in_one_module_only():
    """torch.cuda.is_available() and torch.cuda.device_count() are called in scaletrain/hardware.py and nowhere else
    in the package: every other module asks uses_cuda / cuda_available / gpu_count, so the rule cannot drift again."""
    pattern = re.compile(r"cuda\.(is_available|device_count)\s*\(")
    asking = sorted(
        str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if pattern.search(p.read_text())
    )
    assert asking == ["hardware.py"]


def test_the_cuda_rule(monkeypatch):
    for visible in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda visible=visible: visible)
        assert uses_cuda("cuda") is True  # validation refuses it when none is visible
        assert uses_cuda("auto") is visible
        assert uses_cuda("cpu") is False


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA L40S", "L40S"),
        ("Some Future Accelerator", None),
    ],
)
def test_one_name_matcher(name, match):
    spec = match_gpu(name)
    assert (spec.match if spec else None) == match


def test_a_gpu_the_planner_has_no_profile_for_is_refused_with_the_known_ones():
    from scaletrain.errors import ConfigError

    for name in ("NVIDIA L4", "Tesla V100-SXM2-16GB"):
        with pytest.raises(ConfigError, match="no datasheet profile.*H100, H200, A100, B200"):
            gpu_kind(name)


def test_table_keys_are_unique_and_a_later_key_is_never_shadowed_by_an_earlier_one():
    """First match wins, so an entry whose key contains an earlier key would never be matched."""
    keys = [g.match.lower() for g in GPU_TABLE]
    assert len(keys) == len(set(keys))
    for i, later in enumerate(keys):
        assert not any(earlier in later for earlier in keys[:i]), later


def test_one_cpuinfo_reader(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU @ 2GHz\nflags\t\t: fpu avx2 amx_bf16\n")
    assert cpuinfo_field("model name", str(info)) == "Test CPU @ 2GHz"
    assert cpu_flags(str(info)) == {"fpu", "avx2", "amx_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == set()


def test_best_time_warms_up_then_takes_the_fastest_of_at_least_least_calls():
    calls, before = [], []
    took = best_time(lambda: calls.append(1), budget_s=0.0, least=4, before=lambda: before.append(1))
    assert len(calls) == 5 and len(before) == 4  # one warm-up outside the timing
    assert 0.0 <= took < 0.1
