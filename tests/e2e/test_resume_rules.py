"""A start in an existing run directory continues that run or is refused before anything is written."""

from tests.helpers import events, train_cli

ARGS = dict(training__eval_interval=0, steps=4)


def test_a_resume_that_changes_the_run_is_refused_and_config_history_is_kept(tmp_path):
    run = tmp_path / "run"
    train_cli(run, **ARGS)
    saved = (run / "config.toml").read_bytes()

    refused = train_cli(run, **ARGS, training__seed=7, model__n_layers=1, check=False)
    assert refused.returncode == 2, refused.stderr
    assert (
        "training.seed was 1234 in the saved run, now 7" in refused.stderr
        and "model.n_layers" in refused.stderr
    )
    assert (run / "config.toml").read_bytes() == saved  # nothing overwritten before the check

    longer = {**ARGS, "steps": 6, "optimizer__lr": "1e-3"}
    refused = train_cli(run, **longer, check=False)
    assert refused.returncode == 2 and "--run.accept_changes training.steps" in refused.stderr

    train_cli(run, **longer, run__accept_changes="training.steps,optimizer.lr")
    starts = events(run, "start")
    assert [(s["step"], s["resumed"]) for s in starts] == [(0, False), (4, True)]
    assert events(run, "end")[-1]["steps"] == 6
    assert (run / "config.1.toml").read_bytes() == saved
    assert "lr = 0.001" in (run / "config.toml").read_text()


def test_runs_sharing_a_storage_root_resume_their_own_checkpoints_and_keep_the_others(tmp_path):
    """checkpoint.storage holds one folder per run (its run id): running again resumes from it (it used to be
    refused as having no checkpoint), and another run on the same root neither resumes from nor deletes it."""
    store = tmp_path / "store"
    a, b = tmp_path / "a", tmp_path / "b"
    common = {**ARGS, "checkpoint__storage": store, "checkpoint__keep_last": 1}
    train_cli(a, **common)
    train_cli(b, **{**common, "steps": 2})
    id_a, id_b = ((d / "run_id").read_text().strip() for d in (a, b))
    assert sorted(p.name for p in (store / id_a).iterdir()) == ["step-00000004"]
    assert sorted(p.name for p in (store / id_b).iterdir()) == ["step-00000002"]
    assert [s["resumed"] for s in events(b, "start")] == [False]  # b did not pick up a's step 4

    train_cli(a, **{**common, "steps": 6}, run__accept_changes="training.steps")
    assert [(s["step"], s["resumed"]) for s in events(a, "start")] == [(0, False), (4, True)]
    assert sorted(p.name for p in (store / id_a).iterdir()) == ["step-00000006"]
    assert sorted(p.name for p in (store / id_b).iterdir()) == ["step-00000002"]
