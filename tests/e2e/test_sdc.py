"""Silent data corruption (issue 25 part 2): a bit flipped in one rank's parameters after an update is found within
resilience.sdc_interval steps under every data-parallel mode, named (rank, step, parameter), rolled back and replayed to
the parameters of the run without the fault; a clean run checked at every step raises no alarm; sdc_exclude marks
the host and the launcher then starts nothing on it. hsdp runs with training.deterministic off (validate accepts
it): its replay still names the rank, as CPU kernels give the same bits either way (on GPUs see
docs/resilience.md)."""

from __future__ import annotations

import socket

import pytest
import torch

from scaletrain.checkpoint.run_model import load_run_model
from scaletrain.resilience.sdc import excluded_hosts
from tests.helpers import events, losses, train_cli

STEPS = 7
INTERVAL = 3
BASE = dict(
    steps=STEPS,
    training__eval_interval=0,
    training__deterministic=True,
    metrics__log_interval=1,
    checkpoint__snapshot_interval=INTERVAL,
)
# nproc, the step of the flip, overrides. Rank 1 holds: ddp the whole model (rank 0 its replica), hsdp 2x2 the shard
# rank 3 also holds: a flip at any step shows at the next check, as the replicas then differ. fsdp and zero2: its
# shard alone, no replica; zero1: a copy that rank 0's next update overwrites (the replicas agree again). There the
# flip is seen at rest, before the next update, between checks (after step 4 or 5, read at the check of step 6;
# zero1 and zero2 after step 4: the change is carried over step 5's update). A flip right after a check step's update
# is found at once: tests/unit/test_sdc.py.
HSDP = {"parallel__data_parallel": "hsdp", "parallel__dp_replicate": 2, "training__micro_batch": 2}
MODES = {
    "ddp": (2, 5, {"parallel__data_parallel": "ddp"}),
    "zero1": (2, 4, {"parallel__data_parallel": "zero1"}),
    "fsdp": (2, 5, {"parallel__data_parallel": "fsdp"}),
    "zero2": (2, 4, {"parallel__data_parallel": "zero2"}),
    # training.deterministic off: the replay that names the rank needs no deterministic kernels on CPU
    "hsdp": (4, 5, {**HSDP, "training__deterministic": False}),
}
AT_REST = ("fsdp", "zero2", "zero1")


def _params(run) -> dict[str, torch.Tensor]:
    model = load_run_model(run)[0]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_flipped_bit_is_found_named_and_rolled_back_to_the_clean_run(tmp_path, mode):
    nproc, flip, layout = MODES[mode]
    base = {**BASE, **layout}
    # The clean run, checked at every step (sdc_interval 1): no false alarm over its steps.
    clean = tmp_path / "clean"
    train_cli(clean, nproc=nproc, resilience__sdc_interval=1, **base)
    assert events(clean, "sdc_detected") == [] and events(clean, "rollback") == []

    faulty = tmp_path / "faulty"
    train_cli(faulty, "--resilience.inject", f'[{{kind="bitflip", rank=1, step={flip}}}]', nproc=nproc, resilience__sdc_interval=INTERVAL,
              resilience__sdc_exclude=mode == "ddp", **base)  # fmt: skip
    (fired,) = events(faulty, "fault_injected")
    (found,) = events(faulty, "sdc_detected")
    # ddp, hsdp: found at the next check (step 6): rank 1's fingerprint differs from its replica's, neither
    # is a majority; the rollback's replay of steps 4-6 names rank 1, whose logits differ from the original's (it
    # had computed with the flipped weight). fsdp, zero2, zero1: at rest, rank 1's copy changed after an update.
    assert flip <= found["step"] < flip + INTERVAL, found
    assert found["rank"] == 1 and found["ranks"] == [1] and found["attributed"], found
    assert found["how"] == {"1": "at_rest" if mode in AT_REST else "replay"}, found
    assert found["params"] == {"1": [fired["param"]]}, (found, fired)
    (back,) = events(faulty, "rollback")
    assert back["reason"] == "sdc" and back["to_step"] == INTERVAL and back["skipped_batches"] == 0, back
    # Rolled back and replayed on the same data: the run ends as the clean one, bit for bit.
    assert losses(faulty) == losses(clean)
    a, b = _params(clean), _params(faulty)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if mode == "ddp":  # resilience.sdc_exclude: the host is marked, and no start of the run uses it again
        host = socket.gethostname()
        assert excluded_hosts(faulty) == {host: found["step"]}
        more = {**base, "steps": STEPS + 2, "run__accept_changes": "training.steps"}  # the run, continued
        again = train_cli(faulty, nproc=2, check=False, **more)
        assert again.returncode == 1 and f"host {host} is excluded from this run" in again.stderr, (
            again.stderr
        )


SPIKES = dict(
    steps=20,
    nproc=2,
    training__eval_interval=0,
    training__deterministic=True,
    metrics__log_interval=1,
    parallel__data_parallel="fsdp",
    checkpoint__snapshot_interval=4,
    resilience__sdc_interval=4,
    resilience__spike_zscore=4,
    resilience__spike_window=8,
)


def test_a_spike_is_replayed_on_each_ranks_buddy_data_skipped_device_named(tmp_path):
    """A loss spike with sdc on, under fsdp x2: the step's forward is replayed on each rank and its buddy (same
    batches, same weights). Garbage targets (the data): every replay reproduces the logits, the batches since the
    snapshot are skipped. One activation of rank 1's forward computed 2^16 times too large, once (the device): rank 1
    is named, the run rolls back without skipping data and ends with the clean run's losses and parameters."""
    data = tmp_path / "data"
    train_cli(data, "--resilience.inject", '[{kind="spike", step=15}]', **SPIKES)
    (spike,) = events(data, "loss_spike")
    assert events(data, "spike_cause") == [
        {
            **events(data, "spike_cause")[0],
            "step": 15,
            "spike": "loss_spike",
            "cause": "data",
            "replayed": True,
        }
    ]
    assert events(data, "sdc_detected") == [] and events(data, "rollback")[0]["skipped_batches"] == 3

    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    train_cli(clean, **SPIKES)
    train_cli(faulty, "--resilience.inject", '[{kind="compute_error", rank=1, step=15}]', **SPIKES)
    assert events(clean, "sdc_detected") == [] and events(clean, "rollback") == []
    (cause,) = events(faulty, "spike_cause")
    assert cause["step"] == 15 and cause["cause"] == "device" and cause["replayed"], cause
    (found,) = events(faulty, "sdc_detected")
    assert (
        found["ranks"] == [1] and found["how"] == {"1": "replay"} and found["params"] == {"1": ["logits"]}
    ), found
    (back,) = events(faulty, "rollback")
    assert back["reason"] == "sdc" and back["to_step"] == 12 and back["skipped_batches"] == 0, back
    assert losses(faulty) == losses(clean)
    a, b = _params(clean), _params(faulty)
    assert all(torch.equal(a[k], b[k]) for k in a)
