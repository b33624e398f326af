"""optimizer.qk_clip through the real CLI, as a user types it (the debug config, 2 ranks under fsdp): every logged
step records max_attn_logit and qk_clipped_heads in metrics.jsonl, a τ below every logit clips every head of the
model at step 1 and brings the next step's logits to about τ; a layout QK-clip cannot measure is refused before any worker starts. (The clip's values
in each layout: tests/distributed/test_qk_clip.py.)"""

from __future__ import annotations

from tests.helpers import per_step, train_cli

HEADS = 4 * 4  # the debug preset: 4 layers of 4 query heads


def test_qk_clip_metrics_are_logged_every_step_on_two_ranks(tmp_path):
    run = tmp_path / "run"
    train_cli(run, "--optimizer.qk_clip", "1e-4", steps=3, nproc=2, parallel__data_parallel="fsdp",
              metrics__log_interval=1, training__eval_interval=0, checkpoint__interval=0)  # fmt: skip
    logits, clipped = per_step(run, "max_attn_logit"), per_step(run, "qk_clipped_heads")
    assert sorted(logits) == sorted(clipped) == [1, 2, 3]
    # Step 1's logits all exceed τ: every head is clipped, to τ. Step 2 runs on the clipped weights: its logits (a
    # new batch) are near τ, far below step 1's. Heads are clipped exactly on the steps whose maximum exceeds τ.
    assert logits[1] > 1e-4 and clipped[1] == HEADS, (logits, clipped)
    assert logits[2] < 10 * 1e-4, logits
    assert all((clipped[s] > 0) == (logits[s] > 1e-4) and clipped[s] <= HEADS for s in logits), (
        logits,
        clipped,
    )


def test_qk_clip_under_context_parallel_is_refused_before_start(tmp_path):
    out = train_cli(tmp_path / "run", "--optimizer.qk_clip", "100", "--parallel.cp", "2", steps=1, nproc=2,
                    check=False)  # fmt: skip
    assert out.returncode != 0
    assert "optimizer.qk_clip with parallel.cp > 1 is refused" in out.stdout + out.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
