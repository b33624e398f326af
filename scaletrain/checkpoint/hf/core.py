"""Hugging Face interchange, the shared core over one state-dict adapter per model family (families.py names them:
llama.py with mixtral.py, qwen3.py, gpt_oss.py): every problem an import would have, the export (config.json +
safetensors, loadable by transformers as that family) and the whole-model import. The files on disk are
files.py's; the per-rank import of a parallelised model is sharded.py's."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from scaletrain.checkpoint.hf import llama
from scaletrain.checkpoint.hf.families import adapter, adapter_for_config, importable_types
from scaletrain.checkpoint.hf.files import (
    EXPORT_DTYPES,
    INDEX_FILE,
    SHARD_BYTES,
    SafetensorsWriter,
    few,
    plan_shards,
    tensor_names,
    tokenizer_config,
    umask_permissions,
    weight_files,
)
from scaletrain.checkpoint.hf.mixtral import MOE_FIELDS as MOE_CONFIG_FIELDS
from scaletrain.errors import ConfigError, UserError
from scaletrain.models.llama import ModelArgs, Transformer


def architecture(args: ModelArgs) -> str:
    """The transformers class an export of this model loads into."""
    return adapter(args.family).architecture(args)


def hf_config(args: ModelArgs, eod_id: int | None = None) -> dict:
    return adapter(args.family).export_config(args, eod_id)


def args_from_hf_config(cfg: dict) -> dict:
    """ModelArgs fields from an HF Llama or Mixtral config.json (for Llama they are all model.* config fields; for
    Mixtral mixtral.config_sections splits off the [moe] ones); ConfigError naming every field our model would
    compute differently (biases, another activation or head size, a RoPE it does not implement)."""
    fields, problems = _read_hf_config(cfg)
    if problems:
        raise ConfigError(problems)
    return fields


def _read_hf_config(cfg: dict) -> tuple[dict, list[str]]:
    """(model.* fields, problems) of a config.json, by its family."""
    family = adapter_for_config(cfg)
    if family is None:
        return {}, [
            f"config.json has model_type '{cfg.get('model_type')}'; the model types that import are "
            f"{importable_types()}"
        ]
    return family.import_config(cfg)


def tensor_problems(names: list[str], args: ModelArgs, layers_from: str) -> list[str]:
    """What in a checkpoint's tensor names a model of `args` has no place for: biases, layers at or beyond its
    n_layers (`layers_from` names where that count comes from), experts at or beyond its n_experts, anything else
    unexpected. Dropping them would load a different model than the one saved."""
    family = adapter(args.family)
    expected = family.import_names(args, set(names))
    extra = [n for n in names if n not in expected and "rotary_emb" not in n]  # old HF saved RoPE's inv_freq
    biases = [n for n in extra if n.endswith(".bias")]
    beyond = [
        n
        for n in extra
        if n not in biases and (m := llama.LAYER.fullmatch(n)) and int(m["i"]) >= args.n_layers
    ]
    experts = [
        n
        for n in extra
        if n not in beyond and (m := _EXPERT.search(n)) and int(m["e"]) >= args.n_experts and args.n_experts
    ]
    other = [n for n in extra if n not in biases and n not in beyond and n not in experts]
    problems = []
    if biases:
        problems.append(
            f"{len(biases)} bias tensor(s) in the weights, e.g. {few(biases)}; our {family.NAME} has no biases"
        )
    if beyond:
        layers = sorted({int(llama.LAYER.fullmatch(n)["i"]) for n in beyond})
        problems.append(
            f"tensor(s) of layer {', '.join(map(str, layers))}, beyond {layers_from} {args.n_layers}: "
            f"{few(beyond)}; they would be dropped"
        )
    if experts:
        problems.append(
            f"tensor(s) of experts beyond the model's {args.n_experts} experts: {few(experts)}; they would be "
            "dropped"
        )
    if other:
        problems.append(
            f"unexpected tensor(s) {few([repr(n) for n in other])}: not weights of a "
            f"{family.architecture(args).removesuffix('ForCausalLM')} causal LM"
        )
    return problems


# An expert's own tensor in the Hub layout, whatever the family (experts.{e}.<name>).
_EXPERT = re.compile(r"\.experts\.(?P<e>\d+)\.")


def hf_dir_problems(path: Path) -> list[str]:
    """Every reason an HF directory would not import as the model it holds, from config.json and the tensor names
    (no weights are read): for `scaletrain convert --from hf` and for checking model.init_from early."""
    try:
        weight_files(path)
    except UserError as e:
        return [str(e)]
    cfg = json.loads((path / "config.json").read_text())
    fields, problems = _read_hf_config(cfg)
    if "n_layers" in fields:
        names = tensor_names(path)
        args = ModelArgs(**fields)
        problems += tensor_problems(names, args, "config.json's num_hidden_layers")
        expected = adapter(args.family).import_names(args, set(names))
        missing = sorted(expected - set(names) - ({"lm_head.weight"} if args.tie_embeddings else set()))
        if missing:
            problems.append(f"the weights lack {few(missing)}, which config.json says the model has")
    return [f"{path}: {p}" for p in problems]


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
    family = adapter(args.family)
    biases = {k: read(k) for k in shapes if k.endswith("router.expert_bias")}  # small: one per layer
    problems = family.export_problems(args, biases)
    if problems:
        raise ConfigError([f"cannot export as {family.architecture(args)}: {p}" for p in problems])
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = EXPORT_DTYPES[dtype]
    files = plan_shards(_hf_tensors(args, shapes, torch_dtype), torch_dtype.itemsize, max_shard_bytes)
    writers = (SafetensorsWriter(out / name, entries, torch_dtype) for name, entries in files.items())
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
    return adapter(args.family).export_tensors(args, name, value)


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


_SHAPE_FIELDS = {"dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size"}
_TRAINING_CHOICES = {"capacity_factor", "aux_loss_coef", "z_loss_coef"}


def _args_problems(args: ModelArgs, hf: dict) -> list[str]:
    """model.* fields that differ from what config.json says the weights were trained with: same shapes, other
    numbers (e.g. the 8B preset's Llama 3.1 RoPE scaling on Llama 3 weights, which have none)."""
    # Every field config.json states but the shape (the tensors' shapes check it) and the MoE's training choices
    # (capacity and the balance losses, left to the config); a dense config.json states n_experts 0.
    hf = {"n_experts": 0, **hf}
    keys = [k for k in hf if k not in _SHAPE_FIELDS | _TRAINING_CHOICES]
    names = {k: f"moe.{MOE_CONFIG_FIELDS[k]}" if k in MOE_CONFIG_FIELDS else f"model.{k}" for k in keys}
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
    return problems + tensor_problems(names, args, "model.n_layers")


def load_hf_weights(model: Transformer, path: Path) -> None:
    """Copy HF weights into an (already materialised, unsharded) model, checking config.json, names and shapes:
    ConfigError naming every field and tensor that would not load as saved. The per-rank import on one rank."""
    from scaletrain.checkpoint.hf.sharded import load_hf_sharded  # sharded.py builds on this module

    load_hf_sharded([model], path, model.args)


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


def init_from_problems(init_from: str) -> list[str]:
    """model.init_from: a Hugging Face directory that would import as the model it holds, checked before launch, not
    at the first rank's build."""
    if not init_from:
        return []
    hf = Path(init_from[3:])
    if not init_from.startswith("hf:"):
        return [
            f"model.init_from '{init_from}' is not understood; write hf:DIR for a Hugging Face Llama directory"
        ]
    if not (hf / "config.json").is_file() or not any(hf.glob("*.safetensors")):
        return [
            f"model.init_from: '{hf}' needs config.json and .safetensors weights (pickle files are never loaded)"
        ]
    return hf_dir_problems(hf)
