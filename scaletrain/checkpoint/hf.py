"""Hugging Face Llama interchange: export our weights as config.json + safetensors (loadable by
`transformers.LlamaForCausalLM`), and import HF safetensors into our model. Our attention uses HF's rotate-half RoPE
layout, so the weights map one to one; only the names differ. Import reads safetensors only (never pickles).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from scaletrain.errors import UserError
from scaletrain.models.llama import ModelArgs, Transformer

_LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def to_hf_name(name: str) -> str:
    if name == "tok_embeddings.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    _, i, rest = name.split(".", 2)
    module, leaf = rest.rsplit(".", 1)
    return f"model.layers.{i}.{_LAYER_NAMES[module]}.{leaf}"


def from_hf_name(name: str) -> str:
    reverse = {v: k for k, v in _LAYER_NAMES.items()}
    if name == "model.embed_tokens.weight":
        return "tok_embeddings.weight"
    if name == "model.norm.weight":
        return "norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = name.split(".", 3)
    module, leaf = rest.rsplit(".", 1)
    if module not in reverse:
        raise UserError(f"unexpected tensor '{name}' in the Hugging Face checkpoint (not a Llama weight)")
    return f"layers.{i}.{reverse[module]}.{leaf}"


def hf_config(args: ModelArgs, eod_id: int | None = None) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if args.rope_scaling == "llama3":
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": args.rope_scaling_factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": args.rope_original_max_len,
        }
    if eod_id is not None:
        cfg["eos_token_id"] = eod_id
    return cfg


def args_from_hf_config(cfg: dict) -> dict:
    """model.* config fields from an HF Llama config.json."""
    if cfg.get("model_type") != "llama":
        raise UserError(
            f"config.json has model_type '{cfg.get('model_type')}'; only Llama checkpoints import"
        )
    out = {
        "dim": cfg["hidden_size"],
        "n_layers": cfg["num_hidden_layers"],
        "n_heads": cfg["num_attention_heads"],
        "n_kv_heads": cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        "ffn_hidden": cfg["intermediate_size"],
        "vocab_size": cfg["vocab_size"],
        "norm_eps": cfg["rms_norm_eps"],
        "rope_theta": float(cfg.get("rope_theta", 10000.0)),
        "tie_embeddings": cfg.get("tie_word_embeddings", False),
        "rope_scaling": "none",
    }
    scaling = cfg.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        out.update(
            rope_scaling="llama3",
            rope_scaling_factor=float(scaling["factor"]),
            rope_original_max_len=int(scaling["original_max_position_embeddings"]),
        )
    elif scaling:
        raise UserError(f"rope_scaling {scaling} is not supported; only llama3 scaling imports")
    return out


def export_hf(
    model: Transformer, out: Path, tokenizer_file: Path | None = None, eod_id: int | None = None
) -> None:
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} exists and is not empty; choose a new output directory")
    out.mkdir(parents=True, exist_ok=True)
    sd = {
        to_hf_name(k): v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()
    }
    if model.args.tie_embeddings:
        sd.pop("lm_head.weight", None)  # HF re-ties it from the embedding
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(model.args, eod_id), indent=2))
    if tokenizer_file is not None:
        shutil.copy(tokenizer_file, out / "tokenizer.json")


def read_hf_dir(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and the safetensors weights of an HF Llama directory. Pickle files are refused."""
    if not (path / "config.json").is_file():
        raise UserError(f"{path} has no config.json; give a Hugging Face Llama model directory")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = (
            f" ({', '.join(pickled)} are pickle files, which are never loaded: convert them to safetensors)"
            if pickled
            else ""
        )
        raise UserError(f"{path} has no .safetensors weights{hint}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return json.loads((path / "config.json").read_text()), weights


def load_hf_weights(model: Transformer, path: Path) -> None:
    """Copy HF weights into an (already materialised) model, checking names and shapes."""
    _, weights = read_hf_dir(path)
    ours = {from_hf_name(k): v for k, v in weights.items() if "rotary_emb" not in k}
    if model.args.tie_embeddings:
        ours.setdefault("output.weight", ours.get("tok_embeddings.weight"))
    sd = model.state_dict()
    missing = sorted(set(sd) - set(ours))
    if missing:
        raise UserError(f"the Hugging Face checkpoint lacks {len(missing)} weight(s), e.g. {missing[:3]}")
    for k, v in sd.items():
        if tuple(ours[k].shape) != tuple(v.shape):
            raise UserError(
                f"{k}: shape {tuple(ours[k].shape)} in the checkpoint, {tuple(v.shape)} in the model "
                "(does the config match config.json?)"
            )
    with torch.no_grad():
        for k, v in sd.items():
            v.copy_(ours[k].to(v.dtype))


def verify_with_transformers(model: Transformer, out: Path, atol: float = 1e-5) -> float | None:
    """Load the export with transformers and compare logits; None when transformers is not installed."""
    try:
        import transformers
    except ImportError:
        return None
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    x = torch.randint(
        0,
        model.args.vocab_size,
        (2, min(32, model.args.max_seq_len)),
        generator=torch.Generator().manual_seed(0),
    )
    with torch.no_grad():
        diff = (hf(x).logits - model.float()(x)).abs().max().item()
    if diff > atol:
        raise UserError(f"exported model's logits differ from ours by {diff:.2e} (> {atol}); export is wrong")
    return diff
