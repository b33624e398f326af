"""Hugging Face interchange, the shared core over one state-dict adapter per model family (families.py names them:
llama.py with mixtral.py, qwen3.py, gpt_oss.py): every problem an import would have, the export (config.json +
safetensors, loadable by transformers as that family) and the whole-model import. The files on disk are
files.py's; the per-rank import of a parallelised model is sharded.py's."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from scaletrain.checkpoint.hf.families import adapter, read_hf_config_fields, tensor_problems
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
from scaletrain.errors import ConfigError, UserError
from scaletrain.models.llama import ModelArgs, Transformer


def architecture(args: ModelArgs) -> str:
    """The transformers class an export of this model loads into."""
    return adapter(args.family).architecture(args)


def hf_config(args: ModelArgs, eod_id: int | None = None) -> dict:
    return adapter(args.family).export_config(args, eod_id)


def args_from_hf_config(cfg: dict) -> dict:
    """ModelArgs fields from an HF config.json of any family (families.py; for a dense model they are all model.* fields; for
    Mixtral mixtral.config_sections splits off the [moe] ones); ConfigError naming every field our model would
    compute differently (biases, another activation or head size, a RoPE it does not implement)."""
    fields, problems = read_hf_config_fields(cfg)
    if problems:
        raise ConfigError(problems)
    return fields


def hf_dir_problems(path: Path) -> list[str]:
    """Every reason an HF directory would not import as the model it holds, from config.json and the tensor names
    (no weights are read): for `scaletrain convert --from hf` and for checking model.init_from early."""
    try:
        weight_files(path)
    except UserError as e:
        return [str(e)]
    cfg = json.loads((path / "config.json").read_text())
    fields, problems = read_hf_config_fields(cfg)
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
    written one at a time, so the host holds about the largest tensor (three for a GPT-OSS gate_up_proj: its
    halves and the result), never the model. With `tokenizer_file`, it is copied and a tokenizer_config.json
    names `eod_token`; files get the umask's permissions."""
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
        for name, value in _to_hf(
            args, k, read(k).to(torch_dtype), lambda o: read(o).to(torch_dtype)
        ).items():
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


def _to_hf(
    args: ModelArgs, name: str, value: torch.Tensor, read: Callable[[str], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The HF tensors of one of ours (an MoE's stacked experts are one per expert); none for a tied output."""
    return adapter(args.family).export_tensors(args, name, value, read=read)


def _hf_tensors(
    args: ModelArgs, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype
) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor an export writes, in the order it writes them (mapped on the meta device:
    nothing is read)."""

    def meta(k: str) -> torch.Tensor:
        return torch.empty(shapes[k], dtype=dtype, device="meta")

    return [
        (name, tuple(v.shape))
        for k, shape in shapes.items()
        for name, v in _to_hf(args, k, meta(k), meta).items()
    ]


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
        return [f"model.init_from '{init_from}' is not understood; write hf:DIR for a Hugging Face directory"]
    if not (hf / "config.json").is_file() or not any(hf.glob("*.safetensors")):
        return [
            f"model.init_from: '{hf}' needs config.json and .safetensors weights (pickle files are never loaded)"
        ]
    return hf_dir_problems(hf)
