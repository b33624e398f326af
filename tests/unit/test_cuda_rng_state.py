"""The CUDA RNG state is checkpointed (per rank, on CUDA runs only) and old checkpoints without it still load; more
local CUDA workers than GPUs are refused before launch (issue 24 item 4). On CPU, with torch.cuda's RNG calls and
the GPU count faked; tests/gpu/test_cuda.py round-trips the real generator."""

from __future__ import annotations

import pytest
import torch

import scaletrain.cli as cli
import scaletrain.validate as validate_module
from scaletrain.checkpoint import TrainState
from tests.fixtures import checkpoint_manager, make_state

CUDA = torch.device("cuda", 0)


@pytest.fixture
def fake_cuda_rng(monkeypatch):
    """torch.cuda's generator state per device index, as a plain dict (16 bytes each, as Philox's seed + offset)."""
    states = {0: torch.arange(16, dtype=torch.uint8)}

    def get_rng_state(device="cuda"):
        return states[torch.device(device).index or 0].clone()

    def set_rng_state(state, device="cuda"):
        states[torch.device(device).index or 0] = state.clone()

    monkeypatch.setattr(torch.cuda, "get_rng_state", get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    return states


def test_the_cuda_rng_state_round_trips_through_the_train_state(fake_cuda_rng):
    train = TrainState(device=CUDA)
    saved = train.state_dict()
    assert torch.equal(saved["cuda_rng"][0], torch.arange(16, dtype=torch.uint8))
    fake_cuda_rng[0] = torch.zeros(16, dtype=torch.uint8)  # the generator drew on
    cpu_before = torch.get_rng_state()
    TrainState(device=CUDA).load_state_dict(saved)
    assert torch.equal(fake_cuda_rng[0], torch.arange(16, dtype=torch.uint8))
    assert torch.equal(torch.get_rng_state(), cpu_before)  # the CPU row was this process's own


def test_a_cpu_run_saves_no_cuda_rng_and_a_checkpoint_without_one_loads_on_cuda(fake_cuda_rng):
    old = TrainState().state_dict()
    assert set(old) == {"step", "tokens", "rng"}  # CPU: keys as before (golden checkpoints unchanged)
    fake_cuda_rng[0] = torch.zeros(16, dtype=torch.uint8)
    TrainState(device=CUDA).load_state_dict({**old, "step": torch.tensor(7)})
    assert torch.equal(fake_cuda_rng[0], torch.zeros(16, dtype=torch.uint8))  # left as it was


def test_the_cuda_rng_state_round_trips_through_a_dcp_checkpoint(tmp_path, fake_cuda_rng):
    state, *_ = make_state()
    state["train"] = TrainState(device=CUDA)
    mgr = checkpoint_manager(tmp_path, state, [], interval=1)
    mgr.save(1, blocking=True)
    fake_cuda_rng[0] = torch.zeros(16, dtype=torch.uint8)
    assert mgr.load_latest() == 1
    assert torch.equal(fake_cuda_rng[0], torch.arange(16, dtype=torch.uint8))
    mgr.shutdown()


def test_nproc_above_the_gpu_count_is_refused_before_launch(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "gpu_count", lambda: 1)
    monkeypatch.setattr(validate_module, "cuda_available", lambda: True)
    monkeypatch.setattr(validate_module, "fits_in_memory_problems", lambda *a: [])  # no device to ask
    monkeypatch.setattr(cli, "uses_cuda", lambda device: device in ("cuda", "auto"))
    launched = []
    monkeypatch.setattr(cli, "launch_local", lambda *a, **k: launched.append(a) or 0)
    argv = ["train", "--config", "configs/debug.toml", "--nproc", "2", "--training.device", "cuda"]
    code = cli.main([*argv, "--run.dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code != 0 and not launched
    assert "--nproc 2" in err and "the 1 GPU(s)" in err
