"""When a run saves by default, and what is checked before step 1 (issue 21): a time bound between saves that every
shipped config gets, and an unwritable checkpoint.storage refused before training."""

from __future__ import annotations

import fsspec
import pytest

from scaletrain.config import CheckpointConfig
from scaletrain.errors import ConfigError
from scaletrain.validate import load_config
from tests.fixtures import checkpoint_manager, make_state
from tests.helpers import DEBUG, ROOT


def test_the_default_saves_at_least_every_interval_minutes(tmp_path):
    """checkpoint.interval = 0 (the default) used to mean: nothing before the end, so a crash at step 270 of 300 lost
    the run. By default a save now starts once 30 minutes passed since the last one (the clock is the manager's,
    replaced here), and only then: a run of a few minutes saves only at its end, as before."""
    assert CheckpointConfig().interval_minutes == 30
    state, *_ = make_state()
    events, now = [], [0.0]
    mgr = checkpoint_manager(tmp_path, state, events, async_save=False)
    mgr.clock = lambda: now[0]
    mgr.load_latest()
    saved = []
    for step in range(1, 9):
        mgr.maybe_save(step)
        saved = [kw["step"] for kind, kw in events if kind == "checkpoint_saved"]
        now[0] += 10 * 60  # each step takes 10 minutes
    # 30 minutes after the first step (the segment's clock starts there), then 30 after that save started.
    assert saved == [4, 7]
    assert mgr.committed_steps() == [4, 7]


def test_no_time_bound_with_interval_minutes_zero(tmp_path):
    state, *_ = make_state()
    events, now = [], [0.0]
    mgr = checkpoint_manager(tmp_path, state, events, async_save=False, interval_minutes=0, interval=5)
    mgr.clock = lambda: now[0]
    for step in range(1, 8):
        mgr.maybe_save(step)
        now[0] += 3600
    assert [kw["step"] for kind, kw in events if kind == "checkpoint_saved"] == [5]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_saves_periodically(path):
    """A shipped config that trains for more than a few minutes saves on a step interval as well; all are bounded
    in time by checkpoint.interval_minutes."""
    cfg = load_config(str(path), check_run_dir=False)
    c = cfg.checkpoint
    assert c.enabled and c.interval_minutes > 0
    if cfg.training.steps >= 100:  # default.toml (300 steps, minutes on a CPU), small.toml (5000 steps)
        assert c.interval == "auto" or 0 < c.interval <= cfg.training.steps // 3, (path.name, c.interval)


def test_interval_minutes_must_not_be_negative():
    with pytest.raises(ConfigError, match="checkpoint.interval_minutes must be >= 0"):
        load_config(DEBUG, ["--checkpoint.interval_minutes", "-1"], check_run_dir=False)


@pytest.mark.parametrize("form", ["below a file", "unknown URL scheme"])
def test_an_unwritable_checkpoint_storage_is_refused_before_training(tmp_path, form):
    (tmp_path / "file").write_text("")
    storage = {
        "below a file": str(tmp_path / "file" / "ckpt"),
        "unknown URL scheme": "nosuchfs://bucket/ckpt",
    }[form]
    with pytest.raises(ConfigError) as e:
        load_config(DEBUG, ["--run.dir", str(tmp_path / "run"), "--checkpoint.storage", storage])
    assert f"checkpoint.storage '{storage}'" in str(e.value) and "--checkpoint.storage" in str(e.value)


@pytest.mark.parametrize("form", ["missing directory", "memory URL"])
def test_a_writable_checkpoint_storage_passes_and_is_left_as_it_was(tmp_path, form):
    """The probe file is removed; a local root that does not exist yet is not created by the check."""
    storage = {"missing directory": str(tmp_path / "new" / "ckpt"), "memory URL": "memory://probe-test/ckpt"}[
        form
    ]
    load_config(DEBUG, ["--run.dir", str(tmp_path / "run"), "--checkpoint.storage", storage])
    if form == "missing directory":
        assert not (tmp_path / "new").exists()
    else:
        fs, root = fsspec.core.url_to_fs(storage)
        assert fs.ls(root) == []
