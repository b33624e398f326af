"""Save under one parallel layout, resume under another: the losses continue as in the uninterrupted
single-process run (a constant LR after warmup, so that the schedule does not depend on each
run's length). One chain covers world-size changes (1 -> 4 -> 2 -> 4 -> 2 -> 1: the elastic 4 -> 2 -> 4 keeps the
data order and the losses), tensor and sequence parallel, pipeline changes, context parallel and every data-parallel
mode's optimizer shards."""

import pytest

from tests.helpers import losses, read_jsonl, train_cli

BASE = dict(
    training__eval_interval=0,
    metrics__log_interval=1,
    checkpoint__interval=0,
    optimizer__schedule="constant",
    training__micro_batch=2,
)
FSDP = ["--parallel.data_parallel", "fsdp"]
# Each link loads the previous link's checkpoint and saves its own: a save/load round trip in every layout.
CHAIN = [
    (1, []),
    (4, [*FSDP, "--parallel.tp", "2", "--parallel.dp_shard", "2"]),
    (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "1f1b"]),
    (2, ["--parallel.data_parallel", "zero1"]),
    (4, ["--parallel.data_parallel", "hsdp", "--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"]),
    (2, ["--parallel.cp", "2"]),
    (2, ["--parallel.data_parallel", "zero2", "--parallel.tp", "2", "--parallel.sequence_parallel", "true"]),
    (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "interleaved_1f1b"]),
    (1, []),
]


def test_resume_across_layouts_continues_the_reference_losses(tmp_path):
    ref = tmp_path / "ref"
    train_cli(ref, steps=2 * len(CHAIN), **BASE)
    want = losses(ref)
    run = tmp_path / "chain"
    for i, (nproc, layout) in enumerate(CHAIN):
        # Each link runs two more steps of a constant schedule: a length change the resume must be told to accept.
        longer = dict(steps=2 * (i + 1), run__accept_changes="training.steps")
        train_cli(run, *layout, nproc=nproc, **BASE, **longer)
    got = losses(run)
    assert sorted(got) == sorted(want)
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=1e-5), f"step {step}"
    loaded = [e["step"] for e in read_jsonl(run / "events.jsonl") if e["kind"] == "checkpoint_loaded"]
    assert loaded == [2 * i for i in range(1, len(CHAIN))]
    # Where each link ran: its world size, as each start recorded it.
    starts = [e["world_size"] for e in read_jsonl(run / "events.jsonl") if e["kind"] == "start"]
    assert starts == [nproc for nproc, _ in CHAIN]
