"""fp16 through the real CLI: the start-up line names the mechanism, the loss scaler's overflows (forced by a huge
initial scale) are skipped without the guard counting them, metrics.jsonl records the scale and the skipped count,
and the checkpoint holds the scaler's state."""

from __future__ import annotations

import torch.distributed.checkpoint as dcp

from scaletrain.precision import LossScaler
from scaletrain.precision.policy import cpu_flags
from tests.helpers import events, read_jsonl, train_cli

# The debug config at a quarter of its width: fp16 autocast on a CPU without fp16 units costs ~2 s per debug step.
SMALL = ["--model.dim", "32", "--model.n_layers", "1", "--model.n_heads", "2", "--model.n_kv_heads", "1",
         "--model.ffn_hidden", "64", "--data.seq_len", "32"]  # fmt: skip


def test_fp16_run_skips_overflows_records_the_scale_and_checkpoints_it(tmp_path):
    run = tmp_path / "run"
    proc = train_cli(
        run, *SMALL, steps=6, training__eval_interval=0, metrics__log_interval=1, precision__compute="fp16",
        # 2^18: the first steps overflow for sure; a guard that saw them would roll back at the first one.
        precision__loss_scale_init=262144, resilience__nan_rollback_after=1,
    )  # fmt: skip
    assert "precision fp16 via torch.autocast(cpu, fp16), dynamic loss scale from 262144" in proc.stderr
    if not cpu_flags() & {"amx_bf16", "avx512_bf16"}:
        assert "no amx_bf16 or avx512_bf16" in proc.stderr and "use --precision.compute fp32" in proc.stderr
    metrics = read_jsonl(run / "metrics.jsonl")
    scales = [m["loss_scale"] for m in metrics]
    skipped = [m["overflow_skipped"] for m in metrics]
    # Exactly the steps whose gradient norm is non-finite (null) are counted, each halving the scale; a clean
    # step keeps it (growth only after 2000).
    overflowed = [m["grad_norm"] is None for m in metrics]
    assert overflowed == [b - a == 1 for a, b in zip([0, *skipped], skipped)]
    assert overflowed[0] and not all(overflowed)
    assert all(s == 2.0**18 / 2**k for s, k in zip(scales, skipped, strict=True))
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert not events(run, "skipped_step") and not events(run, "rollback")
    (ckpt,) = sorted((run / "checkpoints").glob("step-*"))
    restored = LossScaler()
    dcp.load({"scaler": restored}, checkpoint_id=str(ckpt))
    assert (restored.scale, restored.skipped) == (scales[-1], skipped[-1])
