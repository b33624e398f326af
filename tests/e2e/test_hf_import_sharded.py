"""`model.init_from = "hf:DIR"` through the real CLI on 2 ranks under fsdp (issue 23 item 3): a multi-file export
(100KB files with their index) imported by `train --nproc 2`, each rank reading its shards (load_hf_sharded); after
one step at a negligible learning rate the run's weights give transformers' logits."""

from __future__ import annotations

import pytest
import torch

from scaletrain.checkpoint.run_model import load_run_model
from tests.helpers import run_cli, train_cli


def test_init_from_a_multi_file_hf_checkpoint_under_fsdp_on_two_ranks(tmp_path):
    transformers = pytest.importorskip("transformers")
    run, out, cfg = tmp_path / "run", tmp_path / "hf", tmp_path / "from_hf.toml"
    train_cli(run, steps=2, training__eval_interval=0)
    run_cli("convert", "--to", "hf", str(run), str(out), "--max-shard-size", "100KB")
    assert len(list(out.glob("*.safetensors"))) > 3 and (out / "model.safetensors.index.json").is_file()
    run_cli("convert", "--from", "hf", str(out), "--out", str(cfg))
    train_cli(tmp_path / "run2", config=str(cfg), steps=1, nproc=2, optimizer__lr="1e-12", training__eval_interval=0,
              data__seq_len=64, training__global_batch=8, training__micro_batch=4,
              parallel__data_parallel="fsdp")  # fmt: skip
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
    imported = load_run_model(tmp_path / "run2")[0].eval()
    x = torch.randint(0, imported.args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(x).logits - imported(x)).abs().max() <= 1e-5
