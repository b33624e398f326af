"""data.when_dry = "stop" through the real CLI: a run whose source runs dry ends cleanly at the last whole step (exit
0, the source_dry event naming the source and the step, a committed checkpoint of that step); the same command again
says there is nothing left to read and changes nothing; with when_dry changed to "repeat" the run loads that
checkpoint and ends where a run that repeated from the start does, so nothing was lost or trained twice."""

from __future__ import annotations

from pathlib import Path

from scaletrain.checkpoint.run_model import read_data_position
from scaletrain.cli import main
from scaletrain.data.streaming import build_streaming_loader
from scaletrain.data.tokenizer import ByteTokenizer
from tests.helpers import events, losses, train_args, train_cli
from tests.unit.test_data_streaming import write_corpus

STEPS = 6


def _config(tmp: Path, corpus: Path) -> str:
    path = tmp / "dry.toml"
    path.write_text(f"""[model]
preset = "debug"
[data]
seq_len = 16
streaming = true
val_fraction = 0
when_dry = "stop"
cache_dir = "{tmp / "cache"}"
[[data.sources]]
path = "{corpus}"
name = "web"
[training]
steps = {STEPS}
global_batch = 4
micro_batch = 4
eval_interval = 0
deterministic = true
[metrics]
log_interval = 1
[checkpoint]
interval = 0
""")
    return str(path)


def test_a_dry_source_ends_the_run_cleanly_and_a_repeat_continues_it(tmp_path: Path, capsys):
    [corpus] = write_corpus(tmp_path, "a", shards=2, docs=8)  # ~240 tokens: 3 steps of 4 x 16 (and one more)
    config = _config(tmp_path, corpus)
    run = tmp_path / "run"
    proc = train_cli(run, config=config, check=False)
    # Ended as configured: 0, not 75, which a requeue script would start again only to stop again.
    assert proc.returncode == 0, proc.stderr
    [dry] = events(run, "source_dry")
    assert (dry["step"], dry["source"], dry["path"], dry["epoch"]) == (3, "web", str(corpus), 1), dry
    assert "web (" in proc.stderr and "read to its end" in proc.stderr and "ends at step 3" in proc.stderr
    end = events(run, "end")[-1]
    assert end["step"] == 3 and end["stopped"] is None and end["source_dry"]["source"] == "web"
    assert sorted(losses(run)) == [1, 2, 3]  # the dry step 4 was not trained, not even in part
    _, state, ckpt = read_data_position(run)  # the newest intact checkpoint: step 3's, committed
    assert Path(ckpt).name == "step-00000003"
    assert state["next_sample"] == state["s0_samples"] == 3 * 4  # the position after step 3, none of step 4

    # Typed again: nothing left to read, nothing changed (the CLI in this process: it stops before any training).
    before = (run / "events.jsonl").read_text()
    assert main(train_args(run, config=config)) == 0
    out = capsys.readouterr().out
    assert "nothing left to read" in out and "--data.when_dry repeat" in out, out
    assert (run / "events.jsonl").read_text() == before

    # Read again in a new order: the checkpoint of step 3 loads and the run goes on where a run that repeated from
    # the start is after step 6, every source at the same place: the samples of step 4 (left unread by the dry
    # start) were trained once, none skipped. The position of the repeating run comes from its loader alone.
    train_cli(run, config=config, data__when_dry="repeat", run__accept_changes="data.when_dry")
    assert [e["step"] for e in events(run, "start")] == [0, 3]
    assert sorted(losses(run)) == list(range(1, STEPS + 1))
    cfg, resumed, _ = read_data_position(run)
    cfg.data.when_dry = "repeat"
    repeat = build_streaming_loader(cfg.data, ByteTokenizer(), 4, 0, 1, cfg.training.seed, STEPS * 4 * 16)
    for _ in range(STEPS):
        repeat.next_batch()
    assert resumed == repeat.state_dict() and resumed["s0_epoch"] == 1  # into the second epoch
