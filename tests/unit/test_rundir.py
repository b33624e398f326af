"""The run directory's owner (scaletrain.run.directory): where a command without --run.dir goes, what a start finds there,
the JSONL records read and appended past a torn line, and paths stored resolved (issue 21: 3, 10, 11, 13)."""

from scaletrain.config.io import resolve_paths, to_dict
from scaletrain.metrics.writer import append_event
from scaletrain.run.directory import RunDir, continue_command, default_run_dir, read_jsonl
from scaletrain.validate import load_config


def test_a_command_without_run_dir_continues_its_run_and_two_new_runs_never_share_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = to_dict(load_config(None, ["--run.name", "exp", "--training.steps", "8"]))
    first = default_run_dir("exp", cfg)
    second = default_run_dir("exp", cfg)  # the same second, nothing written yet: two runs, two directories
    assert first.path != second.path and first.path.parent == tmp_path / "runs"
    first.open({**cfg, "run": {**cfg["run"], "dir": str(first.path)}})
    # The same config (a stop step or another layout is the same run) finds the run it started ...
    again = to_dict(
        load_config(None, ["--run.name", "exp", "--training.steps", "8", "--run.stop_at_step", "4"])
    )
    assert default_run_dir("exp", again) == first
    # ... another model does not.
    other = to_dict(
        load_config(None, ["--run.name", "exp", "--training.steps", "8", "--model.n_layers", "3"])
    )
    assert default_run_dir("exp", other).path not in (first.path, second.path)


def test_a_start_that_never_trained_is_not_a_run(tmp_path):
    """Issue 21 (10): config.toml and run_id written, then the start failed: the corrected command is no resume."""
    run = RunDir.at(tmp_path / "r")
    run.open(to_dict(load_config(None, ["--optimizer.lr", "1e-3"])))
    assert not run.started()
    cfg = load_config(
        None, ["--optimizer.lr", "2e-3", "--run.dir", str(run.path)]
    )  # would be a changed resume
    assert cfg.optimizer.lr == 2e-3
    append_event(run.path, "start", 0)
    assert run.started() and run.finished(10) is None
    append_event(run.path, "end", 10, stopped=None)
    assert run.finished(10) == 10 and run.finished(20) is None


def test_a_torn_last_line_swallows_no_record(tmp_path):
    """Issue 21 (13): a kill mid-write leaves `{"ti` without a newline; the next record must not join it."""
    run = RunDir.at(tmp_path)
    append_event(tmp_path, "start", 0)
    with open(run.events, "a") as f:
        f.write('{"time": 1, "kind": "ev')
    append_event(tmp_path, "start", 5)  # closes the torn line first
    skipped = []
    records = read_jsonl(run.events, skipped)
    assert [r["step"] for r in records] == [0, 5] and skipped == [2]


def test_paths_are_stored_resolved_and_the_continue_command_names_the_run(tmp_path, monkeypatch):
    """Issue 21 (11): relative paths in config.toml broke generate/convert from another directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("some text " * 400)
    cfg = load_config(
        None,
        ["--run.dir", "runs/x", "--data.sources", '[{path="data/*.txt"}]', "--checkpoint.storage", "ck",
         "--data.cache_dir", "cache", "--training.eval_interval", "0"],
        check_run_dir=False,
    )  # fmt: skip
    assert cfg.run.dir == str(tmp_path / "runs/x") and cfg.data.sources[0].path == str(
        tmp_path / "data/*.txt"
    )
    assert cfg.checkpoint.storage == str(tmp_path / "ck") and cfg.data.cache_dir == str(tmp_path / "cache")
    cfg.model.init_from = "hf:hf_dir"
    resolve_paths(cfg)
    assert cfg.model.init_from == f"hf:{tmp_path / 'hf_dir'}"
    url = load_config(None, ["--checkpoint.storage", "s3://bucket/runs"], check_run_dir=False)
    assert url.checkpoint.storage == "s3://bucket/runs"
    typed = ["train", "--config", "configs/debug.toml", "--run.stop_at_step", "3", "--training.steps=9"]
    line = continue_command(typed, tmp_path / "runs" / "exp-1")
    assert line == "scaletrain train --config configs/debug.toml --training.steps=9 --run.dir runs/exp-1"
