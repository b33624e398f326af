import pickle

import pytest
import torch

from scaletrain.checkpoint import CheckpointManager
from scaletrain.checkpoint.integrity import verify
from scaletrain.checkpoint.interval import interval_steps, young_daly_interval_s
from scaletrain.checkpoint.safe_load import UnsafeCheckpointError, read_metadata
from scaletrain.config import CheckpointConfig, FaultConfig, OptimizerConfig
from scaletrain.errors import UserError
from tests.fixtures import checkpoint_manager, make_state


@pytest.mark.parametrize("async_save", [False, True])
def test_save_then_load_restores_everything(tmp_path, async_save):
    state, model, opt, sched, loader, train = make_state()
    train.step, train.tokens, loader.next_sample = 7, 700, 56
    mgr = CheckpointManager(
        CheckpointConfig(async_save=async_save), str(tmp_path / "ck"), state, rank=0, world_size=1
    )
    mgr.save(7)
    mgr.wait()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = opt.state_dict()["state"][0]["exp_avg"].clone()
    state2, model2, opt2, sched2, loader2, train2 = make_state(seed=1)
    mgr2 = CheckpointManager(CheckpointConfig(), str(tmp_path / "ck"), state2, rank=0, world_size=1)
    assert mgr2.load_latest() == 7
    for k, v in model2.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], want_opt)
    assert (train2.step, train2.tokens, loader2.next_sample) == (7, 700, 56)
    assert sched2.last_epoch == sched.last_epoch and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


@pytest.mark.parametrize("form", ["relative", "file://", "memory://"])
def test_every_form_of_checkpoint_location_resumes(tmp_path, monkeypatch, form):
    """Issue 21 (1): commit.json named its files by cutting fsspec's absolute, protocol-less listing at the length
    of the folder as typed, so a relative folder or a URL committed names no file and never resumed."""
    monkeypatch.chdir(tmp_path)
    root = {
        "relative": "runs/x/ck",
        "file://": f"file://{tmp_path}/ck",
        "memory://": f"memory://t{id(form)}/ck",
    }
    state, model, *_, train = make_state()
    train.step = 3
    mgr = CheckpointManager(CheckpointConfig(async_save=False), root[form], state, rank=0, world_size=1)
    mgr.save(3)
    assert verify(mgr.fs, mgr.path(3)) is None
    state2, model2, *_, train2 = make_state(seed=1)
    mgr2 = CheckpointManager(CheckpointConfig(), root[form], state2, rank=0, world_size=1)
    assert mgr2.load_latest() == 3 and train2.step == 3
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_corrupted_and_half_written_checkpoints_fall_back(tmp_path):
    state, *_, train = make_state()
    events = []
    mgr = CheckpointManager(
        CheckpointConfig(async_save=False),
        str(tmp_path),
        state,
        rank=0,
        world_size=1,
        event=lambda kind, **kw: events.append((kind, kw)),
    )
    for step in (1, 2, 3):
        train.step = step
        mgr.save(step)
    (tmp_path / "step-00000003" / "commit.json").unlink()  # a save that never committed
    shard = next((tmp_path / "step-00000002").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))  # bit rot
    assert "no commit marker" in verify(mgr.fs, mgr.path(3))
    assert "checksum" in verify(mgr.fs, mgr.path(2))
    train.step = 0
    assert mgr.load_latest() == 1 and train.step == 1
    rejected = [kw["step"] for kind, kw in events if kind == "checkpoint_rejected"]
    assert rejected == [3, 2]


def test_retention_keeps_last_k_and_every_mth(tmp_path):
    state, *_ = make_state()
    mgr = CheckpointManager(
        CheckpointConfig(async_save=False, keep_last=2, keep_every=4),
        str(tmp_path),
        state,
        rank=0,
        world_size=1,
    )
    for step in range(1, 10):
        mgr.save(step)
    assert mgr.committed_steps() == [4, 8, 9] or mgr.committed_steps() == [4, 8, 9]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000008", "step-00000009"]


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_crafted_metadata_is_refused(tmp_path):
    state, *_ = make_state()
    mgr = CheckpointManager(CheckpointConfig(async_save=False), str(tmp_path), state, rank=0, world_size=1)
    mgr.save(1)
    meta = tmp_path / "step-00000001" / ".metadata"
    read_metadata(str(meta.parent))  # the genuine one loads
    meta.write_bytes(pickle.dumps(Evil()))
    with pytest.raises(UnsafeCheckpointError, match="builtins.print"):
        read_metadata(str(meta.parent))


def test_young_daly_interval():
    assert young_daly_interval_s(2.0, 3600.0) == pytest.approx(120.0)
    assert interval_steps(2.0, 3600.0, step_time_s=0.5) == 240


def test_resuming_with_a_longer_run_follows_the_new_schedule(tmp_path):
    """The checkpoint restores moments and step counts; the learning rate comes from the schedule now running."""
    state, *_ = make_state()
    CheckpointManager(CheckpointConfig(async_save=False), str(tmp_path), state, rank=0, world_size=1).save(1)
    state2, model2, opt2, longer, *_ = make_state(seed=1, total_steps=1000)
    CheckpointManager(CheckpointConfig(), str(tmp_path), state2, rank=0, world_size=1).load_latest()
    assert longer.last_epoch == 1
    want = OptimizerConfig().lr * 2 / 5  # warmup step index 1 of 5
    assert [g["lr"] for g in opt2.param_groups] == [pytest.approx(want)] * 2


@pytest.mark.parametrize("async_save", [False, True])
def test_a_write_failure_inside_dcp_is_reported_and_the_previous_checkpoint_stays(tmp_path, async_save):
    """The storage writer DCP uses raises ENOSPC in write_data, so DCP raises its own CheckpointException (a
    BaseException, not an OSError): reported as checkpoint_failed, training goes on, step 1 stays loadable."""
    state, *_ = make_state()
    events = []
    mgr = checkpoint_manager(
        tmp_path, state, events, FaultConfig(kind="write_error", step=2), async_save=async_save
    )
    assert mgr.try_save(1) is not None
    mgr.wait()
    started = mgr.try_save(2)  # sync: fails at once (None); async: starts, and fails in the background
    assert (started is not None) == async_save
    assert mgr.wait() is not async_save  # the background failure surfaces when the save is finished
    failed = [kw for kind, kw in events if kind == "checkpoint_failed"]
    assert [f["step"] for f in failed] == [2]
    assert "No space left on device" in failed[0]["error"] and "CheckpointException" in failed[0]["error"]
    assert mgr.committed_steps() == [1] and verify(mgr.fs, mgr.path(1)) is None
    assert [kw["step"] for kind, kw in events if kind == "checkpoint_saved"] == [1]
    assert mgr.try_save(3) is not None and mgr.wait()  # the next save works again
    assert mgr.committed_steps() == [1, 3]


def test_the_async_commit_runs_off_the_training_thread(tmp_path):
    """Checksumming every file and writing the marker is storage work: it runs in the commit thread, and the
    training thread only learns that it finished (poll() is a local check)."""
    state, *_ = make_state()
    events = []
    mgr = checkpoint_manager(tmp_path, state, events, async_save=True, interval=2)
    mgr.load_latest()
    assert mgr.maybe_save(1) == 0.0 and mgr.pending is None
    mgr.maybe_save(2)
    assert mgr.pending is not None
    mgr.pending[1].result(timeout=60)
    mgr.poll()
    assert mgr.committed_steps() == [2]
    assert mgr.commit_thread.startswith("ckpt-commit")
    saved = [kw for kind, kw in events if kind == "checkpoint_saved"]
    assert len(saved) == 1 and saved[0]["background_commit_s"] > 0 and saved[0]["blocking_s"] > 0


def test_the_final_save_failing_is_an_error_and_keeps_the_previous_checkpoint(tmp_path):
    state, *_ = make_state()
    events = []
    mgr = checkpoint_manager(
        tmp_path, state, events, FaultConfig(kind="write_error", step=4), async_save=False
    )
    mgr.try_save(2)
    with pytest.raises(UserError, match="final checkpoint of step 4 failed"):
        mgr.close(4)
    assert mgr.committed_steps() == [2]


def test_a_disabled_manager_saves_nothing_and_loads_nothing(tmp_path):
    state, *_ = make_state()
    events = []
    mgr = checkpoint_manager(tmp_path, state, events, enabled=False, interval=1)
    assert mgr.load_latest() is None
    assert mgr.maybe_save(1) == 0.0
    mgr.close(1)
    assert not (tmp_path / "ck").exists() and events == []


def test_a_commit_marker_without_its_file_list_is_a_reason_not_a_crash(tmp_path):
    import fsspec

    (tmp_path / "step-00000001").mkdir()
    (tmp_path / "step-00000001" / "commit.json").write_text('{"step": 1}')
    assert "lists no files" in verify(fsspec.filesystem("file"), str(tmp_path / "step-00000001"))


def test_async_saves_go_on_where_torchs_stager_stages_only_once(tmp_path, monkeypatch):
    """torch 2.11's DefaultStager closes its copier after each stage, so the second async save of a run died in
    DCP's stager with `KeyError: <class 'type'>` (pytorch/pytorch#183413). Reproduced here on the pinned torch by
    closing after each stage as 2.11 does: the manager then stages each save with a fresh stager."""
    from torch.distributed.checkpoint.staging import DefaultStager

    from scaletrain.checkpoint import manager

    stage = DefaultStager._stage

    def stage_once(self, state_dict, **kwargs):
        out = stage(self, state_dict, **kwargs)
        self._state_dict_stager.close()  # what torch 2.11 does at the end of every stage
        return out

    monkeypatch.setattr(DefaultStager, "_stage", stage_once)
    manager.stager_reusable.cache_clear()
    try:
        assert not manager.stager_reusable()
        state, *_ = make_state()
        mgr = CheckpointManager(
            CheckpointConfig(async_save=True), str(tmp_path / "ck"), state, rank=0, world_size=1
        )
        for step in (1, 2, 3):
            mgr.save(step)
            mgr.before_update()
            assert mgr.wait()
        assert mgr.committed_steps() == [1, 2, 3]
        mgr.shutdown()
    finally:
        manager.stager_reusable.cache_clear()
