import json
import logging

import pytest
import torch

from scaletrain.checkpoint.memory_tier import (
    COMPLETE,
    META,
    MemoryTier,
    flatten_state,
    job_key,
    make_layout_key,
    unflatten_state,
)
from tests.unit.test_checkpoint import make_state

LAYOUT = make_layout_key(1, "single process")


def tier(tmp_path, **kw) -> MemoryTier:
    return MemoryTier(job_key(tmp_path / "run"), kw.pop("layout_key", LAYOUT), root=tmp_path / "shm", **kw)


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


def _mutate(model, opt, train, loader):
    """Move every piece of state away from the snapshot."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    for s in opt.state.values():
        s["exp_avg"].zero_()
    opt.param_groups[0]["betas"] = (0.1, 0.2)
    train.step, train.tokens, loader.next_sample = 99, 9900, 999


def test_snapshot_then_restore_into_a_fresh_state_is_identical(tmp_path):
    state, model, opt, sched, loader, train = make_state()
    train.step, train.tokens, loader.next_sample = 7, 700, 56
    mt = tier(tmp_path)
    assert mt.snapshot(7, state)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())}
    want_rng = torch.get_rng_state()
    assert mt.bytes_used() > sum(v.nbytes for v in want.values())

    # A restarted worker: new objects with other values, the same shared-memory root.
    state2, model2, opt2, sched2, loader2, train2 = make_state(seed=1)
    _mutate(model2, opt2, train2, loader2)
    torch.manual_seed(123)
    mt2 = tier(tmp_path)
    assert mt2.latest_complete_step() == 7
    mt2.restore(7, state2)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, want[k]), k
    for i, s in enumerate(opt2.state.values()):
        for k, v in s.items():
            assert torch.equal(v, want_opt[i][k]), (i, k)
    assert opt2.param_groups[0]["betas"] == (0.9, 0.95)
    assert (train2.step, train2.tokens, loader2.next_sample) == (7, 700, 56)
    assert sched2.last_epoch == sched.last_epoch and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert torch.equal(torch.get_rng_state(), want_rng)


def test_only_the_newest_snapshot_is_kept(tmp_path):
    state, *_, train = make_state()
    mt = tier(tmp_path)
    for step in (2, 4, 6):
        train.step = step
        assert mt.snapshot(step, state)
    assert [d.name for d in mt.own.iterdir()] == ["step-00000006"]
    assert mt.latest_complete_step() == 6


def test_incomplete_snapshot_is_ignored(tmp_path):
    state, *_, train = make_state()
    mt = tier(tmp_path)
    train.step = 3
    mt.snapshot(3, state)
    # A snapshot interrupted before its marker: copy step 3 as step 5, then drop the marker.
    src, dst = mt.own / "step-00000003", mt.own / "step-00000005"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    meta = json.loads((dst / META).read_text())
    (dst / META).write_text(json.dumps({**meta, "step": 5}))
    assert mt.latest_complete_step() == 5  # the copy itself is valid...
    (dst / COMPLETE).unlink()
    assert mt.latest_complete_step() == 3  # ...until it lacks its marker
    (src / "tensors.safetensors").write_bytes(b"truncated")
    assert mt.latest_complete_step() is None  # and a truncated one does not count either


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
    from scaletrain.checkpoint import ModelState
    from tests.unit.test_model import tiny

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
