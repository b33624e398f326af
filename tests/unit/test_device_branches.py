"""The CUDA branches of the code, decided without a GPU: the process group's backends, the control
group's backend, TF32, the async save's staging flags, the peak-memory source, bf16 autocast's device and the
straggler clock. tests/gpu/test_cuda.py runs the same paths on a GPU; these keep each decision tested on every
machine (nothing here allocates on, or needs, a CUDA device)."""

from __future__ import annotations

import contextlib
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import scaletrain.parallel.mesh as mesh_module
from scaletrain.checkpoint.manager import staging_options
from scaletrain.config import ResilienceConfig
from scaletrain.metrics.memory import peak_memory_mib
from scaletrain.parallel.mesh import DistEnv, ParallelDims, init_distributed, setup_process
from scaletrain.parallel.step import autocast
from scaletrain.resilience.busy import EventClock, ProcessClock
from scaletrain.resilience.guard import Guard
from tests.fixtures import kept_process_settings

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


class _Stop(Exception):
    """Raised by a stand-in once it has recorded what it was asked for."""


def _env(device: torch.device) -> DistEnv:
    return DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=device)


@pytest.fixture
def joins(monkeypatch) -> dict:
    """init_distributed as rank 1 of 2, with the process group's start recorded instead of made."""
    for key, value in dict(WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    calls: dict = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.update(kw))
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.update(set_device=index))
    return calls


@pytest.mark.parametrize(
    "pref, visible, backend, device",
    [
        ("cuda", True, "cuda:nccl,cpu:gloo", "cuda:1"),
        ("auto", True, "cuda:nccl,cpu:gloo", "cuda:1"),
        ("auto", False, "gloo", "cpu"),
        ("cpu", True, "gloo", "cpu"),
    ],
)
def test_init_distributed_pairs_nccl_with_gloo_for_cuda_only(
    joins, monkeypatch, pref, visible, backend, device
):
    """On GPUs the default group gets gloo for CPU tensors beside NCCL (which carries only CUDA tensors), and is
    bound to this rank's device; on CPU it is gloo alone."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible)
    env = init_distributed(pref)
    assert env.device == torch.device(device) and (env.rank, env.world_size) == (1, 2)
    assert joins["backend"] == backend
    assert joins["device_id"] == (env.device if env.device.type == "cuda" else None)
    assert joins.get("set_device") == (1 if env.device.type == "cuda" else None)


def test_the_control_group_is_gloo_whatever_the_mesh_device(monkeypatch):
    """build_mesh makes the CPU control group with an explicit gloo backend before the (CUDA) device mesh: the
    control plane's CPU tensors never travel on NCCL."""
    made: list = []
    monkeypatch.setattr(dist, "new_group", lambda **kw: made.append(("new_group", kw)) or "control")

    def device_mesh(device_type, shape, mesh_dim_names):
        made.append(("mesh", device_type))
        raise _Stop

    monkeypatch.setattr(mesh_module, "init_device_mesh", device_mesh)
    dims = ParallelDims(dp_shard=2)
    with pytest.raises(_Stop):
        dims.build_mesh("cuda")
    assert made == [("new_group", {"backend": "gloo"}), ("mesh", "cuda")]
    assert dims.control == "control"


@pytest.mark.parametrize("device, tf32_after", [("cuda", False), ("cpu", True)])
def test_setup_process_turns_tf32_off_for_cuda_only(device, tf32_after):
    """fp32 means fp32 on GPUs: TF32 matmuls would compute with a 10-bit mantissa. On CPU the flags are left as
    they were (they do nothing there)."""
    with kept_process_settings():
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        setup_process(_env(torch.device(device)), threads=1, deterministic=False)
        after = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    assert after == (tf32_after, tf32_after)


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_async_save_pins_and_copies_non_blocking_only_for_a_cuda_run(monkeypatch, device_type):
    """Pinned host buffers and non-blocking device-to-host copies for a CUDA run; a CPU run pins nothing even on a
    GPU host (it must not open a CUDA context at its first save)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    options = staging_options(device_type)
    cuda = device_type == "cuda"
    assert (options.use_pinned_memory, options.use_non_blocking_copy) == (cuda, cuda)
    assert options.use_async_staging and not options.use_shared_memory


def test_peak_memory_on_cuda_reads_the_allocator_peak(monkeypatch):
    """On CUDA the metric is the allocator's peak of tensors on the run's device (not the process RSS)."""
    asked = []
    monkeypatch.setattr(
        torch.cuda, "max_memory_allocated", lambda device=None: asked.append(device) or 3 << 20
    )
    assert peak_memory_mib(CUDA) == 3.0 and asked == [CUDA]


def test_bf16_autocasts_on_the_runs_device_and_fp32_does_not():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available ... Disabling autocast" on a CPU machine
        on_cuda = autocast("bf16", CUDA)
    assert isinstance(on_cuda, torch.autocast) and on_cuda.device == "cuda"
    assert on_cuda.fast_dtype == torch.bfloat16 and autocast("bf16", CPU).device == "cpu"
    assert isinstance(autocast("fp32", CUDA), contextlib.nullcontext)


@pytest.mark.parametrize(
    "device, kind, host", [("cuda", EventClock, time.perf_counter), ("cpu", ProcessClock, time.process_time)]
)
def test_straggler_busy_time_is_device_time_on_cuda_and_cpu_time_on_cpu(tmp_path, device, kind, host):
    """On CPU a gloo wait uses no CPU time, so CPU time is a rank's own work; on a GPU the host waits either way, so
    the busy time is CUDA events' device time (the host clock only times fault injection's slowdowns)."""
    env = _env(torch.device(device))
    guard = Guard(ResilienceConfig(), tmp_path, env, None, lambda *a, **k: None, lambda x: x)
    assert isinstance(guard.clock, kind) and guard.busy_clock is host
    guard.close()
