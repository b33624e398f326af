"""Sharded Hugging Face import (issue 23 item 3): multi-file checkpoints saved by transformers (a Llama and a
Mixtral, each split into many safetensors files with model.safetensors.index.json) loaded by load_hf_sharded into
models already parallelised under fsdp, tp, fsdp x tp, ddp, pp and ep, in one spawn of 4 gloo processes. Every
layout's gathered parameters equal load_hf_weights' on the whole model bit for bit; its sharded forward gives
transformers' logits; under fsdp over 4 ranks each rank reads about a quarter of the checkpoint, not all of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from scaletrain.checkpoint.hf.core import args_from_hf_config
from scaletrain.checkpoint.hf.sharded import load_hf_sharded, load_hf_weights
from scaletrain.config import ParallelConfig
from scaletrain.models import ModelArgs, build_model
from scaletrain.parallel.mesh import ParallelDims
from scaletrain.parallel.parallelize import parallelize
from tests.distributed.reference import CPU, gather_state
from tests.distributed.spawn import spawn

transformers = pytest.importorskip("transformers")

WORLD = 4
SEQ = 16
# Shapes that 4 ranks do not divide evenly: vocabulary 130, so FSDP's row chunks of the embedding are 33, 33, 33, 31.
HF_COMMON = dict(
    vocab_size=130,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
FSDP = dict(data_parallel="fsdp")
# name -> (checkpoint, ParallelConfig fields)
CASES = {
    "fsdp4": ("llama", FSDP),
    "ddp4": ("llama", dict(data_parallel="ddp")),
    "tp2_fsdp2": ("llama", dict(tp=2, **FSDP)),
    "tp2_sp_fsdp2": ("llama", dict(tp=2, sequence_parallel=True, **FSDP)),
    "pp2_fsdp2": ("llama", dict(pp=2, pp_schedule="1f1b", **FSDP)),
    "pp2_tp2": ("llama", dict(pp=2, tp=2, pp_schedule="1f1b")),
    "mixtral_fsdp4": ("mixtral", FSDP),
    "mixtral_ep2_fsdp4": ("mixtral", dict(ep=2, **FSDP)),
    "mixtral_fused_ep4_fsdp4": ("mixtral_fused", dict(ep=4, **FSDP)),
    "mixtral_tp2_ep2_fsdp2": ("mixtral", dict(tp=2, ep=2, **FSDP)),
}


def _save(model, path: Path, **kw) -> Path:
    # 100 KB files: a 4-layer model of ~0.5 MB becomes 6 to 9 files and an index, as a Hub checkpoint does.
    model.save_pretrained(str(path), max_shard_size="100KB", **kw)
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 3
    return path


def _checkpoints(root: Path) -> dict[str, Path]:
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=96, **HF_COMMON))
    mixtral_cfg = transformers.MixtralConfig(
        intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, **HF_COMMON
    )
    mixtral = transformers.MixtralForCausalLM(mixtral_cfg)
    with torch.no_grad():
        # A wide router makes each token's expert choice clear, so rounding cannot flip a near-tie between the two
        # implementations (as tests/unit/test_hf_mixtral.py).
        for layer in mixtral.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    return {
        "llama": _save(llama, root / "llama"),
        "mixtral": _save(mixtral, root / "mixtral"),
        "mixtral_fused": _save(mixtral, root / "mixtral_fused", save_original_format=False),
    }


def _args(path: Path) -> ModelArgs:
    return ModelArgs(**args_from_hf_config(json.loads((path / "config.json").read_text())), max_seq_len=SEQ)


def _tokens() -> torch.Tensor:
    return torch.randint(0, HF_COMMON["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(0))


def _case(path: Path, spec: dict, world_size: int, reference: dict, logits: torch.Tensor) -> dict:
    """Load `path` into a model built with other weights and parallelised as `spec`; what differs from the
    whole-model load, the sharded forward's largest logit difference from transformers', the bytes read."""
    args = _args(path)
    pcfg = ParallelConfig(**spec)
    dims = ParallelDims.from_config(pcfg, world_size)
    dims.build_mesh("cpu")
    pm = parallelize(build_model(args, 7, CPU), dims, pcfg, device=CPU, n_microbatches=2)
    read = load_hf_sharded(pm.parts, path, args)
    state = gather_state(pm, dims)
    diffs = sorted(k for k in reference if k not in state or not torch.equal(state[k], reference[k]))
    out = {
        "diffs": diffs,
        "read": read,
        "sharded": any(isinstance(p, DTensor) for p in pm.parts[0].parameters()),
    }
    if not dims.pp_enabled:  # a pipeline's forward runs inside its schedule; its weights are checked above
        with torch.no_grad():
            got = pm.parts[0](_tokens())
        got = got.full_tensor() if isinstance(got, DTensor) else got
        out["logits_diff"] = (got - logits).abs().max().item()
    return out


def _worker(rank: int, world_size: int, dirs: dict, logits: dict, out: str) -> None:
    results = {}
    references = {}
    for name, (ckpt, spec) in CASES.items():
        path = Path(dirs[ckpt])
        if ckpt not in references:
            whole = build_model(_args(path), 0, CPU)
            load_hf_weights(whole, path)
            references[ckpt] = {k: v.clone() for k, v in whole.state_dict().items()}
        results[name] = _case(path, spec, world_size, references[ckpt], torch.tensor(logits[ckpt]))
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf_sharded")
    dirs = _checkpoints(root)
    logits = {}
    for name, path in dirs.items():
        cls = transformers.MixtralForCausalLM if "mixtral" in name else transformers.LlamaForCausalLM
        with torch.no_grad():
            logits[name] = (
                cls.from_pretrained(str(path), dtype=torch.float32).eval()(_tokens()).logits.tolist()
            )
    spawn(_worker, WORLD, {k: str(v) for k, v in dirs.items()}, logits, str(root))
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(WORLD)]
    sizes = {name: sum(f.stat().st_size for f in path.glob("*.safetensors")) for name, path in dirs.items()}
    return {"ranks": ranks, "sizes": sizes}


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_import_equals_the_whole_model_load(results, name):
    for rank, r in enumerate(results["ranks"]):
        case = r[name]
        assert not case["diffs"], f"rank {rank}: {case['diffs'][:5]} differ from load_hf_weights"
        if "logits_diff" in case:
            # Tensor parallel reorders the sums of wo and w2 (row-split): equal to rounding, not bitwise.
            assert case["logits_diff"] <= 1e-5, f"rank {rank}: logits differ from transformers' by {case}"
        assert case["sharded"] == (name != "ddp4")


def test_fsdp_ranks_read_their_quarter_not_the_checkpoint(results):
    # Each FSDP rank holds about 1/4 of every tensor (the norms' rows too): it reads that, plus at most the
    # rounding of uneven chunks; a full read per rank would be 4x as much.
    size = results["sizes"]["llama"]
    reads = [r["fsdp4"]["read"] for r in results["ranks"]]
    assert all(read <= 0.27 * size for read in reads), (reads, size)
    assert sum(reads) <= 1.01 * size  # the whole checkpoint read once over all ranks (headers excluded)
    # Plain DDP replicas each read everything: the measure is not vacuous.
    assert all(r["ddp4"]["read"] >= 0.95 * size for r in results["ranks"])
