"""Save under one parallel layout, resume under another: the losses continue as in the uninterrupted
single-process run (a constant LR after warmup, so that the schedule does not depend on each
run's length). One chain covers a world-size change (1 -> 4 -> 2 -> 1), tensor parallel, a pipeline change
and ZeRO-1 optimizer shards."""

import pytest

from tests.helpers import DEBUG, QUICK, read_jsonl, run_cli

BASE = ["--config", DEBUG, *QUICK, "--training.eval_interval", "0", "--metrics.log_interval", "1",
        "--checkpoint.interval", "0", "--optimizer.schedule", "constant", "--training.steps"]
CHAIN = [
    (1, []),
    (4, ["--parallel.data_parallel", "fsdp", "--parallel.tp", "2", "--parallel.dp_shard", "2"]),
    (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "1f1b"]),
    (2, ["--parallel.data_parallel", "zero1"]),
    (1, []),
]


def _losses(run):
    out = {}
    for m in read_jsonl(run / "metrics.jsonl"):
        out[m["step"]] = m["loss"]
    return out


def test_resume_across_layouts_continues_the_reference_losses(tmp_path):
    ref = tmp_path / "ref"
    run_cli("train", "--run.dir", str(ref), *BASE, str(2 * len(CHAIN)))
    want = _losses(ref)
    run = tmp_path / "chain"
    for i, (nproc, layout) in enumerate(CHAIN):
        run_cli("train", "--nproc", str(nproc), "--run.dir", str(run), *BASE, str(2 * (i + 1)), *layout)
    got = _losses(run)
    assert sorted(got) == sorted(want)
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=1e-5), f"step {step}"
    loaded = [e["step"] for e in read_jsonl(run / "events.jsonl") if e["kind"] == "checkpoint_loaded"]
    assert loaded == [2, 4, 6, 8]
