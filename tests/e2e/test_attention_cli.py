"""Document masking and the sliding window through the real CLI: a short run on packed short documents."""

from __future__ import annotations

import json
import math

from tests.helpers import losses, train_cli

STEPS = dict(steps=3, metrics__log_interval=1, training__deterministic=True)


def short_docs_config(tmp_path) -> str:
    """The debug model on documents of 20-120 bytes, so that every 64-token window packs several."""
    docs = tmp_path / "docs.jsonl"
    with docs.open("w") as f:
        for i in range(3000):
            f.write(
                json.dumps({"text": f"document {i}: " + "abcdefgh"[i % 8] * (10 + (i * 37) % 100)}) + "\n"
            )
    cfg = tmp_path / "short.toml"
    cfg.write_text(
        f'[model]\npreset = "debug"\nwindow = 16\nwindow_every = 2\n\n'
        f'[data]\nseq_len = 64\ncache_dir = "{tmp_path / "cache"}"\n\n[[data.sources]]\npath = "{docs}"\n\n'
        "[training]\nglobal_batch = 8\nmicro_batch = 4\neval_interval = 3\neval_sequences = 8\n"
    )
    return str(cfg)


def test_document_mask_trains_end_to_end_and_changes_the_loss(tmp_path):
    cfg = short_docs_config(tmp_path)
    plain = tmp_path / "plain"
    train_cli(plain, config=cfg, **STEPS)
    masked = tmp_path / "masked"
    proc = train_cli(masked, config=cfg, **STEPS, data__document_mask=True)
    assert "bool mask): SDPA" in proc.stdout + proc.stderr
    got, ref = losses(masked), losses(plain)
    assert sorted(got) == [1, 2, 3] and all(math.isfinite(v) for v in got.values())
    # Same weights, same batch: only the mask differs, and the windows hold several documents each.
    assert abs(got[1] - ref[1]) > 1e-4, (got, ref)
