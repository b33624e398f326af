"""training.batch_ramp through the real CLI: the global batch grows 2, 4, 6 then 8 sequences (ramp "2:3"), each
step's tokens are recorded as such (and read by the loader), and a run stopped mid-ramp and resumed equals the
uninterrupted one bit for bit on the same rank, and resumed on 2 ranks (ddp) within the layout tolerance: losses, grad
norms and final parameters. (Every ramped layout from step 1 on 4 ranks: tests/distributed/test_batch_ramp.py.)"""

import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from scaletrain.compare.parity import final_params, param_diff
from tests.helpers import events, per_step, train_cli

SEQ_LEN = 64  # configs/debug.toml
# micro_batch 1: the ramp's first step (2 sequences) is one micro-batch on each of 2 ranks.
ARGS = dict(steps=6, training__batch_ramp="2:3", training__micro_batch=1, training__deterministic=True,
            training__eval_interval=0, metrics__log_interval=1, checkpoint__interval=0)  # fmt: skip
BATCHES = [2, 4, 6, 8, 8, 8]  # the ramp's rungs, then training.global_batch 8
KEYS = ("loss", "grad_norm", "lr", "tokens")


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    run = tmp_path_factory.mktemp("ramp") / "ref"
    train_cli(run, **ARGS)
    return run


def _close(got: dict, want: dict, rtol: float) -> None:
    assert sorted(got) == sorted(want)
    for step, (loss, gnorm, lr, tokens) in want.items():
        g = got[step]
        assert g[0] == pytest.approx(loss, rel=rtol) and g[1] == pytest.approx(gnorm, rel=rtol), (
            f"step {step}"
        )
        assert (g[2], g[3]) == (lr, tokens), f"step {step}"


def test_tokens_follow_the_ramp_and_the_lr_counts_them(ref):
    rec = per_step(ref, KEYS)
    tokens = [rec[s][3] for s in sorted(rec)]
    assert tokens == [SEQ_LEN * sum(BATCHES[:s]) for s in range(1, 7)]
    # warmup_steps 2 (debug.toml) are 16 sequences: steps 1-4 consume 0, 2, 6, 12 before their update, so the lr
    # rises as (consumed / 8 + 1) / 2 of the peak, capped at it, and the decay ends on the floor at the last step.
    lrs = [rec[s][2] for s in sorted(rec)]
    assert lrs[:4] == pytest.approx([3e-3 * f for f in (0.5, 0.625, 0.875, 1.0)])
    assert lrs[-1] == pytest.approx(3e-4) and max(lrs) <= 3e-3
    (start,) = events(ref, "start")
    assert start["batch_ramp"] == "2:3"


def test_a_run_stopped_mid_ramp_resumes_bit_for_bit_on_the_same_or_another_number_of_ranks(ref, tmp_path):
    run = tmp_path / "run"
    assert train_cli(run, **ARGS, run__stop_at_step=2, check=False).returncode == 75
    # What the loader actually read by then: steps 1 and 2 took 2 + 4 sequences of the global stream.
    saved = {"data": {"next_sample": torch.tensor(0)}, "train": {"tokens": torch.tensor(0)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: no process group, so it loads in this one process (as meant)
        dcp.load(saved, checkpoint_id=str(run / "checkpoints" / "step-00000002"))
    assert (int(saved["data"]["next_sample"]), int(saved["train"]["tokens"])) == (6, 6 * SEQ_LEN)
    elastic = tmp_path / "elastic"
    shutil.copytree(run, elastic)
    train_cli(run, **ARGS)
    assert [e["step"] for e in events(run, "checkpoint_loaded")] == [2]
    assert per_step(run, KEYS) == per_step(ref, KEYS)  # bit for bit
    want = final_params(ref)
    got = final_params(run)
    assert all(got[k].equal(v) for k, v in want.items())

    # The same checkpoint resumed on 2 ranks: steps 3-6 take the same samples (the rungs do not depend on the
    # ranks), so the run continues the reference within the layout tolerance.
    train_cli(elastic, **ARGS, nproc=2)
    assert [e["world_size"] for e in events(elastic, "start")] == [1, 2]
    _close(per_step(elastic, KEYS), per_step(ref, KEYS), rtol=1e-5)
    diff, name = param_diff(want, final_params(elastic))
    assert diff <= 2e-5, name
