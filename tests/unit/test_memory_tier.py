import json
import logging
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from scaletrain.checkpoint import ModelState, memory_tier
from scaletrain.checkpoint.memory_tier import (
    COMPLETE,
    META,
    TENSORS,
    MemoryTier,
    flatten_state,
    job_key,
    make_layout_key,
    replica_offset,
    unflatten_state,
)
from tests.fixtures import flip_bit, tiny
from tests.fixtures import make_state as checkpoint_state

LAYOUT = make_layout_key(1, "single process")


def make_state(seed: int = 0):
    """A tiny model after one AdamW step (so the moments exist), in the dict of Statefuls the trainer hands over:
    the checkpoint tests' state."""
    state, model, _, _, loader, train = checkpoint_state(seed)
    return state, model, state["optimizer"], loader, train


def tier(tmp_path, **kw) -> MemoryTier:
    return MemoryTier(job_key(tmp_path / "run"), kw.pop("layout_key", LAYOUT), root=tmp_path / "shm", **kw)


@pytest.fixture
def shm(tmp_path) -> Path:
    """A root in real shared memory, where the tier keeps its snapshots in production; removed afterwards."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    root = base / f"scaletrain-test-{uuid.uuid4().hex[:12]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_flatten_unflatten_round_trip():
    sd = {
        "model": {"a.weight": torch.randn(3, 2), "nested": {"b": torch.arange(4), "empty": {}}},
        "optimizer": {
            "param_groups.a.weight.lr": 1e-3,
            "param_groups.a.weight.betas": (0.9, 0.95),
            "param_groups.a.weight.foreach": None,
            "amsgrad": False,
            "name": "adamw",
            "ids": [1, 2],
        },
        "train": {"step": torch.tensor(7)},
    }
    tensors, leaves = flatten_state(sd)
    assert set(tensors) == {"model/a.weight", "model/nested/b", "train/step"}
    json.dumps(leaves)  # the non-tensor leaves are plain JSON
    back = unflatten_state(tensors, json.loads(json.dumps(leaves)))
    assert back.keys() == sd.keys() and back["optimizer"] == sd["optimizer"]
    assert isinstance(back["optimizer"]["param_groups.a.weight.betas"], tuple)
    assert back["model"]["nested"]["empty"] == {}
    assert torch.equal(back["model"]["a.weight"], sd["model"]["a.weight"])
    assert torch.equal(back["model"]["nested"]["b"], sd["model"]["nested"]["b"])
    with pytest.raises(ValueError, match="only str keys"):
        flatten_state({"a/b": torch.zeros(1)})
    with pytest.raises(ValueError, match="cannot be snapshotted"):
        flatten_state({"a": object()})


def _mutate(model, optimizers, train, loader):
    """Move every piece of state away from the snapshot."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    opt = optimizers.optimizers[0]
    for s in opt.state.values():
        s["exp_avg"].zero_()
    opt.param_groups[0]["betas"] = (0.1, 0.2)
    optimizers.schedulers[0].last_epoch = 50
    train.step, train.tokens, loader.next_sample = 99, 9900, 999


def test_snapshot_then_restore_into_a_fresh_state_is_identical(tmp_path):
    state, model, optimizers, loader, train = make_state()
    train.step, train.tokens, loader.next_sample = 7, 700, 56
    mt = tier(tmp_path)
    assert mt.snapshot(7, state)
    opt = optimizers.optimizers[0]
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())}
    want_rng = torch.get_rng_state()
    assert mt.bytes_used() > sum(v.nbytes for v in want.values())

    # A restarted worker: new objects with other values, the same shared-memory root.
    state2, model2, optimizers2, loader2, train2 = make_state(seed=1)
    _mutate(model2, optimizers2, train2, loader2)
    torch.manual_seed(123)
    mt2 = tier(tmp_path)
    assert mt2.latest_complete_step() == 7
    mt2.restore(7, state2)
    opt2 = optimizers2.optimizers[0]
    for k, v in model2.state_dict().items():
        assert torch.equal(v, want[k]), k
    for i, s in enumerate(opt2.state.values()):
        for k, v in s.items():
            assert torch.equal(v, want_opt[i][k]), (i, k)
    assert opt2.param_groups[0]["betas"] == (0.9, 0.95)
    assert (train2.step, train2.tokens, loader2.next_sample) == (7, 700, 56)
    assert optimizers2.schedulers[0].last_epoch == optimizers.schedulers[0].last_epoch
    assert optimizers2.lr == optimizers.lr
    assert torch.equal(torch.get_rng_state(), want_rng)
    assert mt2.last_restore_s > 0 and not mt2.restored_from_peer


def test_only_the_newest_snapshot_is_kept(tmp_path):
    state, *_, train = make_state()
    mt = tier(tmp_path)
    for step in (2, 4, 6):
        train.step = step
        assert mt.snapshot(step, state)
    assert [d.name for d in mt.own.iterdir()] == ["step-00000006"]
    assert mt.latest_complete_step() == 6


def _two_snapshots(mt: MemoryTier, state: dict, train, stash: Path) -> tuple[Path, Path]:
    """Steps 3 and 5 both in the slot, as a crash between a snapshot and its retention leaves them."""
    train.step = 3
    assert mt.snapshot(3, state)
    shutil.copytree(mt.own / "step-00000003", stash)
    train.step = 5
    assert mt.snapshot(5, state)
    shutil.copytree(stash, mt.own / "step-00000003")
    return mt.own / "step-00000003", mt.own / "step-00000005"


def test_incomplete_snapshot_is_ignored(tmp_path):
    state, *_, train = make_state()
    mt = tier(tmp_path)
    older, newer = _two_snapshots(mt, state, train, tmp_path / "stash")
    assert mt.latest_complete_step() == 5
    (newer / COMPLETE).unlink()  # interrupted before its marker
    assert mt.latest_complete_step() == 3
    (older / TENSORS).write_bytes(b"truncated")
    assert mt.latest_complete_step() is None  # and a truncated one does not count either


def test_a_corrupted_snapshot_is_detected_removed_and_storage_is_used(shm, caplog, monkeypatch):
    monkeypatch.setattr(memory_tier, "_CRC_CHUNK", 4096)  # many chunks: the message names the damaged one
    state, *_, train = make_state()
    train.step = 3
    assert MemoryTier("job", LAYOUT, root=shm).snapshot(3, state)
    f = shm / "job" / "rank0" / "step-00000003" / TENSORS
    good = {k: v.clone() for k, v in load_file(f).items()}  # load_file maps the file: copy before the damage
    pos = flip_bit(f)
    bad = load_file(f)  # the damage is invisible to the format: the file still loads, with a wrong value
    assert any(not torch.equal(good[k], bad[k]) for k in good)

    restarted = MemoryTier("job", LAYOUT, root=shm)
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        assert (
            restarted.latest_complete_step() is None
        )  # one process holds no replica: the caller uses storage
    assert "rejected" in caplog.text and f"first at byte {pos // 4096 * 4096}" in caplog.text
    assert not f.parent.exists() and restarted.bytes_used() == 0


def test_corrupted_metadata_is_detected(shm):
    state, *_, train = make_state()
    mt = MemoryTier("job", LAYOUT, root=shm)
    assert mt.snapshot(3, state)
    meta_file = mt.own / "step-00000003" / META
    meta = json.loads(meta_file.read_text())
    lr = next(k for k in meta["leaves"] if k.endswith(".lr"))
    meta["leaves"][lr] *= 10  # still well-formed JSON, with the wrong learning rate
    meta_file.write_text(json.dumps(meta))
    assert MemoryTier("job", LAYOUT, root=shm).latest_complete_step() is None


def test_a_corrupted_newest_snapshot_falls_back_to_an_intact_older_one(shm):
    state, *_, train = make_state()
    mt = MemoryTier("job", LAYOUT, root=shm)
    older, newer = _two_snapshots(mt, state, train, shm / "stash")
    flip_bit(newer / TENSORS, at=0.9)
    state2, *_, train2 = make_state(seed=1)
    restarted = MemoryTier("job", LAYOUT, root=shm)
    assert restarted.latest_complete_step() == 3
    restarted.restore(3, state2)
    assert train2.step == 3 and not newer.exists()


def test_restore_never_loads_a_corrupted_snapshot(shm):
    state, *_ = make_state()
    assert MemoryTier("job", LAYOUT, root=shm).snapshot(3, state)
    flip_bit(shm / "job" / "rank0" / "step-00000003" / TENSORS)
    state2, model2, *_ = make_state(seed=1)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    with pytest.raises(FileNotFoundError, match="no intact copy"):
        MemoryTier("job", LAYOUT, root=shm).restore(3, state2)  # asked directly, without latest_complete_step
    assert all(torch.equal(v, before[k]) for k, v in model2.state_dict().items())


def test_a_restore_checks_the_checksums_once(shm, monkeypatch):
    state, *_ = make_state()
    assert MemoryTier("job", LAYOUT, root=shm).snapshot(3, state)
    calls = []
    verify = memory_tier._verify
    monkeypatch.setattr(memory_tier, "_verify", lambda d: calls.append(d) or verify(d))
    restarted = MemoryTier("job", LAYOUT, root=shm)
    assert restarted.latest_complete_step() == 3
    restarted.restore(3, state)
    assert len(calls) == 1  # choosing the step checked it; restoring it reuses that check
    flip_bit(restarted.own / "step-00000003" / TENSORS)  # ...until the file changes
    with pytest.raises(FileNotFoundError):
        restarted.restore(3, state)


def test_over_the_bound_is_skipped(tmp_path, caplog):
    state, model, *_ = make_state()
    mt = tier(tmp_path, max_bytes=1000)
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        assert not mt.snapshot(1, state)
    assert "skipped" in caplog.text and mt.bytes_used() == 0
    assert mt.latest_complete_step() is None


def test_another_layout_is_never_used(tmp_path):
    state, *_ = make_state()
    tier(tmp_path).snapshot(1, state)
    assert tier(tmp_path).latest_complete_step() == 1
    other = tier(tmp_path, layout_key=make_layout_key(1, "tp2"))
    assert other.latest_complete_step() is None
    assert tier(tmp_path).latest_complete_step(make_layout_key(2, "single process")) is None


def test_tied_weights_and_cleanup(tmp_path):
    model = tiny(tie_embeddings=True)
    mt = tier(tmp_path)
    assert mt.snapshot(1, {"model": ModelState([model])})  # overlapping tensors are cloned for safetensors
    want = model.tok_embeddings.weight.clone()
    with torch.no_grad():
        model.tok_embeddings.weight.zero_()
    mt.restore(1, {"model": ModelState([model])})
    assert torch.equal(model.output.weight, want) and model.output.weight is model.tok_embeddings.weight
    mt.cleanup()
    assert not mt.job_dir.exists()


def test_job_key_is_per_run_not_per_path(tmp_path):
    # A crashed run's snapshots outlive it in shared memory; a new run created at the same path (after the old
    # directory was deleted) gets a new run id, so it never restores them.
    run = tmp_path / "run"
    assert job_key(run, "id-a") == job_key(str(run), "id-a")
    assert job_key(run, "id-a") != job_key(run, "id-b")
    assert job_key(run, "id-a") != job_key(tmp_path / "other", "id-a")


def test_snapshots_of_jobs_idle_past_the_ttl_are_removed_when_a_tier_opens(tmp_path):
    import os
    import time

    state = make_state()[0]
    crashed = MemoryTier("crashed", LAYOUT, root=tmp_path / "shm")
    crashed.snapshot(1, state)
    live = MemoryTier("live", LAYOUT, root=tmp_path / "shm")
    live.snapshot(1, state)
    # The crashed job last wrote two hours ago; the live one just now.
    old = time.time() - 2 * 3600
    for p in [crashed.job_dir, *crashed.job_dir.iterdir()]:
        os.utime(p, (old, old))

    MemoryTier("new", LAYOUT, root=tmp_path / "shm", ttl_s=3600)
    assert not crashed.job_dir.exists()
    assert live.latest_complete_step() == 1
    # The same job idle past the TTL is never removed by itself, and ttl 0 removes nothing.
    for p in [live.job_dir, *live.job_dir.iterdir()]:
        os.utime(p, (old, old))
    MemoryTier("live", LAYOUT, root=tmp_path / "shm", ttl_s=3600)
    MemoryTier("other", LAYOUT, root=tmp_path / "shm", ttl_s=0)
    assert live.latest_complete_step() == 1


def test_replica_offset_puts_every_replica_on_another_node():
    """torchrun numbers a node's ranks contiguously: with L workers a node the replica goes L ranks on (the ring,
    1, where there is one node or where no offset separates every rank from its replica)."""
    assert replica_offset(["a", "a", "b", "b"]) == 2
    assert replica_offset(["a"] * 4 + ["b"] * 4 + ["c"] * 4) == 4
    assert replica_offset(["a", "b", "a", "b"]) == 1
    assert replica_offset(["a", "a", "a"]) == replica_offset(["a"]) == 1
    assert replica_offset(["a", "a", "a", "b"]) == 1  # unequal nodes: no offset works (MemoryTier warns)


def test_a_start_over_beside_a_snapshot_of_another_layout_says_so(tmp_path, caplog):
    """A job re-formed with another world size (`--nnodes 1:2`) before storage held a checkpoint: the tier cannot
    reshard its snapshot, so the job starts at 0, and says why in a warning and an event."""
    from scaletrain.checkpoint import CheckpointManager
    from scaletrain.config import CheckpointConfig

    state, *_, train = make_state()
    train.step = 4
    assert tier(tmp_path, layout_key=make_layout_key(4, "dp_shard4 (fsdp)")).snapshot(4, state)
    same = tier(tmp_path, layout_key=make_layout_key(4, "dp_shard4 (fsdp)"))
    assert same.other_layout_step() is None
    shrunk = tier(tmp_path)
    assert shrunk.other_layout_step() == (4, make_layout_key(4, "dp_shard4 (fsdp)"))
    events = []
    mgr = CheckpointManager(CheckpointConfig(), str(tmp_path / "ck"), state, rank=0, world_size=1,
                            event=lambda kind, **kw: events.append((kind, kw)), memory=shrunk)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        assert mgr.load_latest() is None
    assert "cannot reshard" in caplog.text and "starts again from step 0" in caplog.text
    (kind, fields), *_ = [e for e in events if e[0] == "memory_snapshot_unusable"]
    assert fields["snapshot_step"] == 4 and fields["storage"] == "has no committed checkpoint"
