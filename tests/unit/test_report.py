"""The report's pure parts (scaletrain.report): reading a run back, config differences, event marks, and a run
with missing files drawn as "no data" instead of failing."""

import json
import re

import pytest

from scaletrain.cli import main
from scaletrain.errors import UserError
from scaletrain.report import config_diff, event_marks, read_run, write_report
from scaletrain.report.plots import PLOTS
from scaletrain.report.runs import MISSING, run_names, series, val_series


def _jsonl(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_config_diff_lists_only_the_keys_that_differ():
    a = {"optimizer": {"lr": 3e-3, "betas": [0.9, 0.95]}, "training": {"steps": 20}, "run": {"dir": "runs/a"}}
    b = {"optimizer": {"lr": 1e-3, "betas": [0.9, 0.95]}, "training": {"steps": 20}, "run": {"dir": "runs/b"}}
    c = {"optimizer": {"lr": 1e-3, "betas": [0.9, 0.99]}, "training": {}, "run": {"dir": "runs/c"}}
    assert config_diff([a, b]) == {"optimizer.lr": [3e-3, 1e-3]}  # run.dir always differs: the runs' names
    assert config_diff([a, b, c]) == {
        "optimizer.betas": [[0.9, 0.95], [0.9, 0.95], [0.9, 0.99]],
        "optimizer.lr": [3e-3, 1e-3, 1e-3],
        "training.steps": [20, 20, MISSING],
    }
    assert config_diff([a, a]) == {} and config_diff([a]) == {}


def test_event_marks_group_steps_by_kind_and_skip_events_without_a_step():
    evs = [
        {"kind": "job_start", "step": None},
        {"kind": "start", "step": 0},
        {"kind": "checkpoint_saved", "step": 10},
        {"kind": "rollback", "step": 14, "to_step": 10},
        {"kind": "checkpoint_saved", "step": 20},
        {"kind": "odd", "step": True},  # not a step number
        {"step": 3},  # no kind
    ]
    assert event_marks(evs) == {"start": [0], "checkpoint_saved": [10, 20], "rollback": [14]}


def test_a_run_reads_back_with_the_history_it_ended_with(tmp_path):
    (tmp_path / "config.toml").write_text("[optimizer]\nlr = 0.003\n")
    # Steps 3 and 4 ran again after a rollback: their last records count. A crash cut the last line.
    recs = [{"step": s, "loss": 5.0 - s, "val_loss": None} for s in (1, 2, 3, 4)]
    recs += [{"step": 3, "loss": 1.5}, {"step": 4, "loss": float("nan")}]
    _jsonl(tmp_path / "metrics.jsonl", recs, tail='{"step": 5, "lo')
    _jsonl(
        tmp_path / "events.jsonl",
        [
            {"time": 1.0, "kind": "start", "step": 0},
            {"time": 1.1, "kind": "eval", "step": 0, "val_loss": 6.0},
            {"time": 2.0, "kind": "eval", "step": 4, "val_loss": 2.5},
            {"time": 3.0, "kind": "end", "step": 4, "steps": 4, "final_loss": 1.0},
        ],
    )
    run = read_run(tmp_path)
    assert run.config == {"optimizer": {"lr": 0.003}}
    assert [m["step"] for m in run.metrics] == [1, 2, 3, 4]
    assert series(run, "loss") == ([1, 2, 3], [4.0, 3.0, 1.5])  # step 4's NaN (null) is left out
    assert val_series(run) == ([0, 4], [6.0, 2.5])  # from the eval events: the one before step 1 included
    assert run.summary == {"steps": 4, "final_loss": 1.0}
    assert run.goodput is not None and run.goodput["total_s"] == pytest.approx(2.0)
    assert run.unreadable == {"metrics.jsonl": [7]}  # issue 21 (13): said, not dropped silently


def test_the_report_says_which_lines_it_left_out(tmp_path, caplog):
    _jsonl(tmp_path / "events.jsonl", [{"time": 1.0, "kind": "start", "step": 0}], tail='{"time": 2')
    write_report([tmp_path])
    assert "events.jsonl: line(s) 2 are no JSON record" in caplog.text


def test_validation_falls_back_to_the_metrics_records(tmp_path):
    _jsonl(tmp_path / "metrics.jsonl", [{"step": 5, "loss": 2.0, "val_loss": 2.2}, {"step": 10, "loss": 1.9}])
    assert val_series(read_run(tmp_path)) == ([5], [2.2])


def test_run_names_tell_apart_runs_with_the_same_directory_name(tmp_path):
    assert run_names([tmp_path / "a" / "run", tmp_path / "b" / "run", tmp_path / "c"]) == [
        "a/run",
        "b/run",
        "c",
    ]


def test_a_run_with_only_an_events_file_gets_a_report_that_says_no_data(tmp_path):
    run = tmp_path / "crashed"
    run.mkdir()
    _jsonl(
        run / "events.jsonl", [{"time": 1.0, "kind": "start", "step": 0}, {"time": 2.0, "kind": "failure"}]
    )
    page = write_report([run])
    assert page == run / "report" / "index.html"
    text = page.read_text()
    assert len(re.findall(r'<img class="plot" id="plot-(\w+)"', text)) == len(PLOTS)
    no_data = {name for name, title, *_ in PLOTS if f"<figcaption>{title} — no data" in text}
    assert no_data == {name for name, *_ in PLOTS} - {"events", "goodput"}  # those two have the events' data
    assert "no end event" in text and "config.toml is missing" in text
    assert all((run / "report" / f"{name}.png").stat().st_size > 1000 for name, *_ in PLOTS)


def test_a_directory_that_is_not_a_run_is_refused_with_a_plain_message(tmp_path, capsys):
    with pytest.raises(UserError, match="is not a run directory"):
        read_run(tmp_path)
    assert main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "is not a run directory" in err and "--run.dir" in err and "Traceback" not in err
    assert main(["report", str(tmp_path / "nowhere")]) == 1
    assert "is not a directory" in capsys.readouterr().err
    assert not (tmp_path / "report").exists()  # nothing written


def test_an_unwritable_output_directory_is_a_plain_error(tmp_path):
    _jsonl(tmp_path / "metrics.jsonl", [{"step": 1, "loss": 2.0}])
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="could not write the report.*--out"):
        write_report([tmp_path], tmp_path / "file" / "report")
