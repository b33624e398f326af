"""The llama family's state-dict adapter (checkpoint/hf/families.py): a Llama (llama.py's names and config.json
fields), or with MoE blocks a Mixtral (mixtral.py's experts)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from scaletrain.checkpoint.hf import llama, mixtral
from scaletrain.checkpoint.hf.files import Source

if TYPE_CHECKING:
    from scaletrain.models.llama import ModelArgs

NAME = "Llama"
MODEL_TYPES = ("llama", "mixtral")


def architecture(args: ModelArgs) -> str:
    return mixtral.ARCHITECTURE if args.n_experts > 0 else llama.ARCHITECTURE


def export_config(args: ModelArgs, eod_id: int | None = None) -> dict:
    cfg = llama.config_json(args, eod_id)
    if args.n_experts > 0:
        del cfg["mlp_bias"], cfg["attention_bias"]  # not Mixtral fields (it has no biases)
        cfg |= mixtral.config_json(args)
    return cfg


def import_config(cfg: dict) -> tuple[dict, list[str]]:
    fields, problems = llama.read_config(cfg)
    if not fields:
        return fields, problems
    rope, rope_problems = llama.read_rope(
        cfg, mixtral.DEFAULT_ROPE_THETA if mixtral.is_mixtral(cfg) else 10000.0
    )
    fields |= rope | {"family": "llama"}
    if mixtral.is_mixtral(cfg):
        moe, moe_problems = mixtral.read_config(cfg)
        fields |= moe
        problems += moe_problems
    return fields, problems + rope_problems


def export_problems(args: ModelArgs, buffers: dict[str, torch.Tensor]) -> list[str]:
    problems = (
        [f"model.qk_norm is true; {llama.ARCHITECTURE} has no QK-norm (family qwen3 has)"]
        if args.qk_norm
        else []
    )
    if args.rope_scaling == "yarn":
        problems.append(
            "model.rope_scaling is 'yarn'; this export writes plain or Llama 3.1 RoPE (gpt_oss has YaRN)"
        )
    if args.n_experts > 0:
        problems += mixtral.export_problems(args, buffers)
    return problems


def export_tensors(
    args: ModelArgs, name: str, value: torch.Tensor, read: object = None
) -> dict[str, torch.Tensor]:
    if args.tie_embeddings and name == "output.weight":
        return {}  # HF re-ties lm_head to the embedding
    moe = mixtral.to_hf_tensors(name, value)
    return moe if moe is not None else {llama.to_hf_name(name): value}


def import_names(args: ModelArgs, names: set[str]) -> set[str]:
    expected = llama.tensor_names(args.n_layers, moe=args.n_experts > 0)
    for i in range(args.n_layers if args.n_experts else 0):
        expected |= mixtral.layer_names(i, args.n_experts, mixtral.is_fused(names, i))
    return expected


def import_source(args: ModelArgs, name: str, names: set[str]) -> Source:
    moe = mixtral.import_source(name, names, args.n_experts) if args.n_experts else None
    if moe is not None:
        return Source(*moe)
    if name == "output.weight" and args.tie_embeddings:
        # Tied: the embedding is the one weight; a saved copy of it as lm_head is not read.
        return Source(["model.embed_tokens.weight"])
    return Source([llama.to_hf_name(name)])
