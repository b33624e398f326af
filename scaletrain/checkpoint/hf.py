"""Hugging Face Llama and Mixtral interchange: export our weights as config.json + safetensors (loadable by
`transformers.LlamaForCausalLM`, or `MixtralForCausalLM` for an MoE model: checkpoint/hf_moe.py), and import HF
safetensors into our model. Our attention uses HF's rotate-half RoPE layout, so the weights map one to one; only
the names differ. Import reads safetensors only (never pickles).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from scaletrain.checkpoint import hf_moe
from scaletrain.errors import ConfigError, UserError
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


_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = re.compile(r"model\.layers\.(?P<i>\d+)\.(?P<module>.+)\.(?P<leaf>\w+)")
# The config.json fields an import cannot do without.
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
_FEW = 3  # tensor names shown in a message; the rest are counted


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
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER.fullmatch(name)
    if m is None or m["module"] not in reverse:
        raise UserError(f"unexpected tensor '{name}' in the Hugging Face checkpoint (not a Llama weight)")
    return f"layers.{m['i']}.{reverse[m['module']]}.{m['leaf']}"


def architecture(args: ModelArgs) -> str:
    """The transformers class an export of this model loads into."""
    return hf_moe.ARCHITECTURE if args.n_experts > 0 else "LlamaForCausalLM"


def hf_config(args: ModelArgs, eod_id: int | None = None) -> dict:
    cfg = {
        "architectures": [architecture(args)],
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
        cfg["eos_token_id"] = cfg["bos_token_id"] = eod_id  # see tokenizer_config
    if args.n_experts > 0:
        del cfg["mlp_bias"], cfg["attention_bias"]  # not Mixtral fields (it has no biases)
        cfg |= hf_moe.config_json(args)
    return cfg


def args_from_hf_config(cfg: dict) -> dict:
    """ModelArgs fields from an HF Llama or Mixtral config.json (for Llama they are all model.* config fields; for
    Mixtral hf_moe.config_sections splits off the [moe] ones); ConfigError naming every field our model would
    compute differently (biases, another activation or head size, a RoPE it does not implement)."""
    fields, problems = _read_hf_config(cfg)
    if problems:
        raise ConfigError(problems)
    return fields


def _read_hf_config(cfg: dict) -> tuple[dict, list[str]]:
    """(model.* fields, problems) of a config.json."""
    kind = cfg.get("model_type")
    if kind not in ("llama", "mixtral"):
        return {}, [f"config.json has model_type '{kind}'; only Llama and Mixtral checkpoints import"]
    missing = [k for k in _REQUIRED if k not in cfg]
    if missing:
        return {}, [f"config.json lacks {', '.join(missing)}; is it a complete {kind.title()} config?"]
    problems = [
        f"config.json: {flag} is true, but our Llama has no biases, so they would be dropped; only bias-free "
        "Llama checkpoints import"
        for flag in ("attention_bias", "mlp_bias")
        if cfg.get(flag)
    ]
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(
            f"config.json: hidden_act {cfg['hidden_act']!r} is not supported; our MLP is SwiGLU (hidden_act 'silu')"
        )
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    if cfg.get("head_dim") not in (None, head_dim):
        problems.append(
            f"config.json: head_dim {cfg['head_dim']} is not hidden_size / num_attention_heads = {head_dim}, "
            "which our model always uses"
        )
    rope, rope_problems = _rope_from_hf(cfg, hf_moe.DEFAULT_ROPE_THETA if hf_moe.is_mixtral(cfg) else 10000.0)
    fields = {
        "dim": cfg["hidden_size"],
        "n_layers": cfg["num_hidden_layers"],
        "n_heads": cfg["num_attention_heads"],
        "n_kv_heads": cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        "ffn_hidden": cfg["intermediate_size"],
        "vocab_size": cfg["vocab_size"],
        "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),  # LlamaConfig's default
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        **rope,
    }
    if hf_moe.is_mixtral(cfg):
        moe, moe_problems = hf_moe.read_config(cfg)
        fields |= moe
        problems += moe_problems
    return fields, problems + rope_problems


def _rope_from_hf(cfg: dict, default_theta: float) -> tuple[dict, list[str]]:
    """(model.rope_* fields, problems). transformers >= 5 writes rope_parameters (rope_theta inside it); earlier
    versions, and our export, write rope_theta and rope_scaling. Accepted is what our model computes identically:
    plain RoPE, and Llama 3.1's scaling with its low_freq_factor 1 and high_freq_factor 4 (models/llama.py)."""
    key = "rope_parameters" if "rope_parameters" in cfg else "rope_scaling"
    rope = dict(cfg.get(key) or {})
    theta = rope.get("rope_theta", cfg.get("rope_theta", default_theta))
    fields = {"rope_theta": float(theta), "rope_scaling": "none"}
    kind = rope.get("rope_type", rope.get("type", "default"))
    supported = (
        "our model computes RoPE unscaled (rope_type 'default') or with Llama 3.1's scaling (rope_type 'llama3', "
        "low_freq_factor 1.0, high_freq_factor 4.0), so these weights would run with other frequencies"
    )
    if kind == "default":
        return fields, []
    if kind != "llama3":
        return fields, [f"config.json: {key}.rope_type {kind!r} is not supported; {supported}"]
    problems = [
        f"config.json: {key}.{name} {rope[name]} is not {ours}; {supported}"
        for name, ours in (("low_freq_factor", 1.0), ("high_freq_factor", 4.0))
        if float(rope.get(name, ours)) != ours
    ]
    missing = [k for k in ("factor", "original_max_position_embeddings") if k not in rope]
    if missing:
        problems.append(f"config.json: {key} (rope_type 'llama3') lacks {', '.join(missing)}")
        return fields, problems
    fields.update(
        rope_scaling="llama3",
        rope_scaling_factor=float(rope["factor"]),
        rope_original_max_len=int(rope["original_max_position_embeddings"]),
    )
    return fields, problems


def _expected_names(n_layers: int, n_experts: int = 0, names: set[str] = frozenset()) -> set[str]:
    """A Llama's tensor names, or with n_experts a Mixtral's (each layer's experts in the layout `names` has)."""
    per_layer = [f"{m}.weight" for m in _LAYER_NAMES.values() if not (n_experts and m.startswith("mlp."))]
    expected = set(_GLOBAL_NAMES) | {f"model.layers.{i}.{n}" for i in range(n_layers) for n in per_layer}
    for i in range(n_layers if n_experts else 0):
        expected |= hf_moe.layer_names(i, n_experts, hf_moe.is_fused(names, i))
    return expected


def _few(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:_FEW])
    return shown + (f" ({len(names)} in all)" if len(names) > _FEW else "")


def tensor_problems(names: list[str], n_layers: int, layers_from: str, n_experts: int = 0) -> list[str]:
    """What in a checkpoint's tensor names our model has no place for: biases, layers at or beyond `n_layers`
    (`layers_from` names where that count comes from), experts at or beyond `n_experts` (0: a Llama), anything
    else unexpected. Dropping them would load a different model than the one saved."""
    expected = _expected_names(n_layers, n_experts, set(names))
    extra = [n for n in names if n not in expected and "rotary_emb" not in n]  # old HF saved RoPE's inv_freq
    biases = [n for n in extra if n.endswith(".bias")]
    beyond = [n for n in extra if n not in biases and (m := _LAYER.fullmatch(n)) and int(m["i"]) >= n_layers]
    experts = hf_moe.experts_beyond([n for n in extra if n not in beyond], n_experts) if n_experts else []
    other = [n for n in extra if n not in biases and n not in beyond and n not in experts]
    problems = []
    if biases:
        problems.append(
            f"{len(biases)} bias tensor(s) in the weights, e.g. {_few(biases)}; our Llama has no biases"
        )
    if beyond:
        layers = sorted({int(_LAYER.fullmatch(n)["i"]) for n in beyond})
        problems.append(
            f"tensor(s) of layer {', '.join(map(str, layers))}, beyond {layers_from} {n_layers}: {_few(beyond)}; "
            "they would be dropped"
        )
    if experts:
        problems.append(
            f"tensor(s) of experts beyond the model's {n_experts} experts: {_few(experts)}; they would be dropped"
        )
    if other:
        problems.append(
            f"unexpected tensor(s) {_few([repr(n) for n in other])}: not weights of a "
            f"{'Mixtral' if n_experts else 'Llama'} causal LM"
        )
    return problems


def hf_dir_problems(path: Path) -> list[str]:
    """Every reason an HF directory would not import as the model it holds, from config.json and the tensor names
    (no weights are read): for `scaletrain convert --from hf` and for checking model.init_from early."""
    try:
        _weight_files(path)
    except UserError as e:
        return [str(e)]
    cfg = json.loads((path / "config.json").read_text())
    fields, problems = _read_hf_config(cfg)
    if "n_layers" in fields:
        names = _tensor_names(path)
        n_layers, n_experts = fields["n_layers"], fields.get("n_experts", 0)
        problems += tensor_problems(names, n_layers, "config.json's num_hidden_layers", n_experts)
        expected = _expected_names(n_layers, n_experts, set(names))
        missing = sorted(expected - set(names) - ({"lm_head.weight"} if fields["tie_embeddings"] else set()))
        if missing:
            problems.append(f"the weights lack {_few(missing)}, which config.json says the model has")
    return [f"{path}: {p}" for p in problems]


def umask_permissions(out: Path) -> None:
    """Give every file in `out` the mode a plain open() gives (0644 under the usual umask 022): safetensors writes
    0600, which another user, or a serving container under another uid, cannot read."""
    mask = os.umask(0)
    os.umask(mask)
    for f in out.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~mask)


def tokenizer_config(eod_token: str, max_len: int) -> dict:
    """tokenizer_config.json beside a copied tokenizer.json, so that transformers.AutoTokenizer knows its special
    tokens (without it eos_token is None). Our end-of-document token is both: packing puts it between documents,
    so it ends one and opens the next (GPT-2's convention for <|endoftext|>)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eod_token,
        "bos_token": eod_token,
        "model_max_length": max_len,
        "add_bos_token": False,  # documents are not prefixed at training: encode() adds no special tokens
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }


# HF's save_pretrained default (max_shard_size "5GB"): safetensors files of at most this many bytes each.
SHARD_BYTES = 5 * 10**9
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16"}


def export_hf(
    model: Transformer,
    out: Path,
    tokenizer_file: Path | None = None,
    eod_id: int | None = None,
    eod_token: str | None = None,
    dtype: str = "fp32",
    max_shard_bytes: int = SHARD_BYTES,
) -> None:
    """A model in memory exported as `write_hf` does (see there)."""
    state = model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    write_hf(
        out, model.args, shapes, lambda k: state[k].detach().cpu(), tokenizer_file, eod_id, eod_token, dtype,
        max_shard_bytes,
    )  # fmt: skip


def write_hf(
    out: Path,
    args: ModelArgs,
    shapes: dict[str, tuple[int, ...]],
    read: Callable[[str], torch.Tensor],
    tokenizer_file: Path | None = None,
    eod_id: int | None = None,
    eod_token: str | None = None,
    dtype: str = "fp32",
    max_shard_bytes: int = SHARD_BYTES,
) -> None:
    """config.json and the weights in `out` (created; if it exists it must be an empty directory): one
    model.safetensors, or, above `max_shard_bytes`, model-0000i-of-0000n.safetensors files and
    model.safetensors.index.json, as transformers' save_pretrained writes them. `shapes` are our tensors (names in
    state-dict order) and `read(name)` gives one on CPU: tensors are read, cast to `dtype` (fp32 or bf16) and
    written one at a time, so the host holds about the largest tensor, never the model. With `tokenizer_file`, it
    is copied and a tokenizer_config.json names `eod_token`; files get the umask's permissions."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file, not a directory; choose a new output directory")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} exists and is not empty; choose a new output directory")
    if dtype not in EXPORT_DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose {' or '.join(EXPORT_DTYPES)}")
    if args.n_experts > 0:
        biases = {k: read(k) for k in shapes if k.endswith("router.expert_bias")}  # small: one per layer
        problems = hf_moe.export_problems(args, biases)
        if problems:
            raise ConfigError([f"cannot export as {hf_moe.ARCHITECTURE}: {p}" for p in problems])
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = EXPORT_DTYPES[dtype]
    files = _plan_shards(_hf_tensors(args, shapes, torch_dtype), torch_dtype.itemsize, max_shard_bytes)
    writers = (_SafetensorsWriter(out / name, entries, torch_dtype) for name, entries in files.items())
    writer = next(writers)
    for k in shapes:
        for name, value in _to_hf(args, k, read(k).to(torch_dtype)).items():
            while writer.done():
                writer.close()
                writer = next(writers)
            writer.write(name, value)
    writer.close()
    if len(files) > 1:
        weight_map = {name: file for file, entries in files.items() for name, _ in entries}
        total = sum(
            math.prod(shape) * torch_dtype.itemsize for entries in files.values() for _, shape in entries
        )
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    cfg = hf_config(args, eod_id) | {"torch_dtype": str(torch_dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if tokenizer_file is not None:
        # The contents only (copyfile): not the mode of a source that may be read-only or private.
        shutil.copyfile(tokenizer_file, out / "tokenizer.json")
        if eod_token is not None:
            tok_cfg = tokenizer_config(eod_token, args.max_seq_len)
            (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    umask_permissions(out)


def _to_hf(args: ModelArgs, name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """The HF tensors of one of ours (an MoE's stacked experts are one per expert); none for a tied output."""
    if args.tie_embeddings and name == "output.weight":
        return {}  # HF re-ties lm_head to the embedding
    moe = hf_moe.to_hf_tensors(name, value)
    return moe if moe is not None else {to_hf_name(name): value}


def _hf_tensors(
    args: ModelArgs, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype
) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor an export writes, in the order it writes them (mapped on the meta device:
    nothing is read)."""
    return [
        (name, tuple(v.shape))
        for k, shape in shapes.items()
        for name, v in _to_hf(args, k, torch.empty(shape, dtype=dtype, device="meta")).items()
    ]


def _plan_shards(
    tensors: list[tuple[str, tuple[int, ...]]], itemsize: int, max_bytes: int
) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """File name -> the tensors it holds, in order; a file is closed before it would pass `max_bytes` (a tensor
    larger than that gets a file of its own, as in transformers)."""
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * itemsize
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    n = len(groups)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}


class _SafetensorsWriter:
    """One safetensors file written a tensor at a time: the header (every name, dtype, shape and offset) is known
    from the plan, so each tensor's bytes go straight to the file after it and nothing is held
    (https://github.com/huggingface/safetensors#format: a u64 header length, the JSON header padded to 8 bytes,
    then the data, C order, little-endian)."""

    def __init__(self, path: Path, entries: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype):
        self.entries, self.dtype, self.written = entries, dtype, 0
        header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape in entries:
            end = offset + math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, end]}
            offset = end
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.f = open(path, "wb")  # noqa: SIM115  # closed by close(), after the last of its tensors
        self.f.write(struct.pack("<Q", len(raw)) + raw)

    def done(self) -> bool:
        return self.written == len(self.entries)

    def write(self, name: str, value: torch.Tensor) -> None:
        expected, shape = self.entries[self.written]
        assert (name, tuple(value.shape), value.dtype) == (expected, shape, self.dtype), (name, expected)
        if value.numel():
            # Bytes in place (a uint8 view through numpy), little-endian as torch stores them on every host we run.
            self.f.write(value.contiguous().view(torch.uint8).reshape(-1).numpy().data)
        self.written += 1

    def close(self) -> None:
        assert self.done(), f"{self.f.name}: {self.written} of {len(self.entries)} tensors written"
        self.f.close()


INDEX_FILE = "model.safetensors.index.json"
"""Hugging Face's map of a multi-file checkpoint: {"metadata": {...}, "weight_map": {tensor name: file name}}."""


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of an HF directory (those its index names, when it has one); UserError when
    config.json or the weights are missing (pickle files are never loaded)."""
    if not (path / "config.json").is_file():
        raise UserError(f"{path} has no config.json; give a Hugging Face Llama model directory")
    if (path / INDEX_FILE).is_file():
        return sorted({path / f for f in _index_map(path).values()})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = (
            f" ({', '.join(pickled)} are pickle files, which are never loaded: convert them to safetensors)"
            if pickled
            else ""
        )
        raise UserError(f"{path} has no .safetensors weights{hint}")
    return files


def _index_map(path: Path) -> dict[str, str]:
    """The weight_map of `path`'s index, each file checked to be a plain name of a file in `path`."""
    index = path / INDEX_FILE
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{index} is not a safetensors index (no weight_map: {e})") from None
    for name, file in weight_map.items():
        if Path(file).name != file or not file.endswith(".safetensors"):
            raise UserError(f"{index} maps {name!r} to {file!r}, not a .safetensors file beside the index")
        if not (path / file).is_file():
            raise UserError(f"{index} maps {name!r} to {file}, which is not in {path}")
    return weight_map


def hf_tensor_files(path: Path) -> dict[str, Path]:
    """Which safetensors file holds each tensor of an HF directory: the index's weight_map for a multi-file
    checkpoint, each file's header otherwise (no tensor data is read). Every tensor is checked to be in the
    file that names it; UserError when the index and the files disagree or two files hold the same tensor.
    One reader of the layout for every import (whole, per-rank slices) and for `hf_dir_problems`."""
    indexed = _index_map(path) if (path / INDEX_FILE).is_file() else None
    where: dict[str, Path] = {}
    for f in _weight_files(path):
        with safe_open(str(f), framework="pt") as st:  # reads the header only
            for name in st.keys():  # noqa: SIM118  # safe_open has keys(), not __iter__
                if indexed is not None and indexed.get(name, f.name) != f.name:
                    continue  # the index says another file holds it (a stale duplicate here is not read)
                if name in where:
                    raise UserError(
                        f"{path}: tensor {name!r} is in both {where[name].name} and {f.name}; "
                        f"keep one (or write a {INDEX_FILE} saying which)"
                    )
                where[name] = f
    missing = sorted(set(indexed or {}) - set(where))
    if missing:
        raise UserError(f"{path / INDEX_FILE} names tensor(s) its files lack: {_few(missing)}")
    return where


def _tensor_names(path: Path) -> list[str]:
    return list(hf_tensor_files(path))


def read_hf_config(path: Path) -> dict:
    """config.json of an HF Llama directory that also has safetensors weights (UserError otherwise)."""
    _weight_files(path)
    return json.loads((path / "config.json").read_text())


def read_hf_dir(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and the safetensors weights of an HF Llama directory. Pickle files are refused."""
    weights: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, f in hf_tensor_files(path).items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt") as st:
            weights |= {name: st.get_tensor(name) for name in names}
    return json.loads((path / "config.json").read_text()), weights


def _args_problems(args: ModelArgs, hf: dict) -> list[str]:
    """model.* fields that differ from what config.json says the weights were trained with: same shapes, other
    numbers (e.g. the 8B preset's Llama 3.1 RoPE scaling on Llama 3 weights, which have none)."""
    keys = ["rope_theta", "rope_scaling", "norm_eps", "tie_embeddings"]
    if hf.get("rope_scaling") == "llama3":
        keys += ["rope_scaling_factor", "rope_original_max_len"]
    # An MoE's routing and window (capacity and the balance loss are training choices, left to the config).
    hf = {"n_experts": 0, **hf}
    keys += ["n_experts", "window", "window_every"]
    if hf["n_experts"]:
        keys += ["top_k", "moe_hidden", "shared_experts", "router", "norm_topk", "moe_every", "first_dense"]
    names = {k: f"moe.{hf_moe.MOE_FIELDS[k]}" if k in hf_moe.MOE_FIELDS else f"model.{k}" for k in keys}
    return [
        f"{names[k]} is {getattr(args, k)!r} but config.json has {hf[k]!r}; set {names[k]} = {hf[k]!r} (as "
        "`scaletrain convert --from hf` writes it)"
        for k in keys
        if k in hf and getattr(args, k) != hf[k]
    ]


def import_problems(args: ModelArgs, cfg: dict, names: list[str]) -> list[str]:
    """Why an HF checkpoint (its config.json and tensor names) would not load into a model of `args` as saved:
    config.json's own problems, model.* fields that differ from it, tensors the model has no place for."""
    fields, problems = _read_hf_config(cfg)
    problems += _args_problems(args, fields)
    return problems + tensor_problems(names, args.n_layers, "model.n_layers", args.n_experts)


def load_hf_weights(model: Transformer, path: Path) -> None:
    """Copy HF weights into an (already materialised) model, checking config.json, names and shapes: ConfigError
    naming every field and tensor that would not load as saved."""
    cfg, weights = read_hf_dir(path)
    problems = import_problems(model.args, cfg, list(weights))
    if problems:
        raise ConfigError([f"{path}: {p}" for p in problems])
    n_layers, n_experts = model.args.n_layers, model.args.n_experts
    moe = hf_moe.from_hf_tensors(weights, n_layers, n_experts) if n_experts else {}
    ours = moe | {from_hf_name(k): v for k, v in weights.items() if "rotary_emb" not in k}
    if model.args.tie_embeddings:
        # Tied: the embedding is the one weight; a saved copy of it as lm_head must not overwrite it.
        ours["output.weight"] = ours.get("tok_embeddings.weight")
    sd = model.state_dict()
    missing = sorted(k for k in sd if ours.get(k) is None)
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


@contextlib.contextmanager
def quiet_torchao() -> Iterator[None]:
    """For a block that may import torchao: on a CPU build of torch it logs that its CUDA kernels (mxfp8, cutlass)
    do not load, and torch's pytree logs a deprecation for each Enum it registers; neither concerns a user of its
    CPU paths. Only those two loggers are held at ERROR, only during the block."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


@contextlib.contextmanager
def _quiet_load() -> Iterator[None]:
    """transformers' from_pretrained, without what does not concern the export it loads: torchao's load messages
    (transformers imports it for its quantizers when it is installed) and a "Loading weights" progress bar."""
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with quiet_torchao():
            yield
    finally:
        if bar:
            hf_logging.enable_progress_bar()


def verify_with_transformers(model: Transformer, out: Path, atol: float = 1e-5) -> float | None:
    """Load the export with transformers and compare logits; None when transformers is not installed."""
    try:
        import transformers
    except ImportError:
        return None
    with _quiet_load():
        # A lazy import, inside: it brings the modeling code and the quantizers (torchao).
        cls = getattr(transformers, architecture(model.args))
        hf = cls.from_pretrained(str(out), torch_dtype=torch.float32).eval()
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
