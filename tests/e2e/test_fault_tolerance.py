"""fault_tolerance on torchft (issue 26): replica groups that keep training when one of them loses a rank, and the
lost group heals from a live peer and rejoins. CPU, gloo; skipped where torchft (the ft extra) is not installed."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from scaletrain.resilience.fault_tolerance import torchft_installed
from tests.helpers import DEBUG, ROOT, events, per_step, read_jsonl, train_args, train_cli

pytestmark = pytest.mark.skipif(
    not torchft_installed(), reason="torchft not installed: pip install 'scaletrain[ft]'"
)

STEPS = 14
BASE = dict(
    steps=STEPS,
    training__eval_interval=0,
    training__deterministic=True,
    metrics__log_interval=1,
    fault_tolerance__enabled=True,
)
LAYOUTS = {  # (nproc, the rank killed: group 1's last, overrides)
    "2x1": (2, 1, {}),
    "2x2-fsdp": (4, 3, {"parallel__data_parallel": "fsdp", "training__micro_batch": 2}),
}


# The reference: train.build's single-process job stepped by hand on the same global batches, except that a step
# group 0 committed alone (replicas 1) trains on group 0's slice only (the first half of the global batch), as the
# fault-tolerant run did: the gradient averaged over the groups present.
REFERENCE = """
import json, sys
from scaletrain.train import build
from scaletrain.validate import load_config
overrides, replicas = json.loads(sys.argv[1]), json.loads(sys.argv[2])
job = build(load_config(sys.argv[3], overrides, world_size=1, check_run_dir=False))
out = {}
for step in range(1, len(replicas) + 1):
    x, y = job.loader.next_batch()
    n = x.shape[0] * replicas[str(step)] // 2
    loss = job.runner.forward_backward(x[:n], y[:n])
    norm = job.runner.clip()
    job.optimizers.step()
    out[step] = (loss.item(), norm.item())
print(json.dumps(out))
"""


def _reference(run, args: dict, replicas: dict[int, int]) -> dict[int, tuple[float, float]]:
    plain = {k: v for k, v in args.items() if not k.startswith("fault_tolerance")}
    overrides = train_args(run, **plain)[3:]  # after "train --config DEBUG"
    out = subprocess.run([sys.executable, "-c", REFERENCE, json.dumps(overrides), json.dumps(replicas), DEBUG],
                         cwd=ROOT, capture_output=True, text=True, check=True)  # fmt: skip
    return {int(k): tuple(v) for k, v in json.loads(out.stdout.splitlines()[-1]).items()}


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_groups_survive_a_kill_heal_and_end_bit_identical(tmp_path, layout):
    """G = 2 groups of 1 rank, and of 2 ranks under fsdp; group 1's last rank killed at step 8. Group 0 is never
    restarted (one pid for the whole run), group 1 restarts under its own agent, heals from group 0 and rejoins;
    at the end each rank of group 1 holds the same bytes as its counterpart in group 0.

    The losses and grad norms match REFERENCE: each committed step's gradient is the average over the groups
    present, so a step with both is the single-process step on the whole global batch, and a step group 0 committed
    alone (while group 1 restarted) is the single-process step on group 0's slice of it."""
    run = tmp_path / "run"
    nproc, killed, extra = LAYOUTS[layout]
    args = {**BASE, **extra}
    kill = f'--resilience.inject=[{{kind="kill", rank={killed}, step=8}}]'
    train_cli(run, "--max-restarts", "1", kill, nproc=nproc, **args)
    [lost] = events(run, "replica_lost")
    assert (lost["group"], lost["step"], lost["cause"]) == (1, 8, "killed"), lost
    # Every rank of group 0: one process throughout; every rank of group 1: restarted once (its agent's restart).
    started = events(run, "replica_started")
    for group, starts in ((0, 1), (1, 2)):
        pids = {
            r: {e["pid"] for e in started if (e["group"], e["group_rank"]) == (group, r)}
            for r in range(nproc // 2)
        }
        assert all(len(p) == starts for p in pids.values()), started
    # At the latest before the last step, which waits for every group.
    [joined] = [e for e in events(run, "replica_joined") if e["cause"] == "restarted"]
    assert joined["group"] == 1 and joined["heal_s"] > 0 and 7 <= joined["step"] < STEPS, joined
    done = [e for e in events(run, "replica_done") if e["step"] == STEPS]  # (group 1's survivor: at 7)
    digests = {(e["group"], e["group_rank"]): e["params_sha256"] for e in done}
    assert len(done) == nproc and all(digests[1, r] == digests[0, r] for r in range(nproc // 2)), done
    # Every step committed exactly once in group 0's record (one process throughout: no step is recomputed, so a
    # step recorded twice is a step that did not commit logged as one); `replicas` says which groups took part.
    recorded = [m["step"] for m in read_jsonl(run / "metrics.jsonl")]
    assert recorded == list(range(1, STEPS + 1)), recorded
    replicas = per_step(run, "replicas")
    assert all(replicas[s] == 2 for s in range(1, 8)) and replicas[STEPS] == 2, replicas
    got, want = per_step(run, ("loss", "grad_norm")), _reference(tmp_path / "ref", args, replicas)
    for s in range(1, STEPS + 1):
        assert _close(got[s][0], want[s][0]) and _close(got[s][1], want[s][1]), (s, got[s], want[s], replicas)
