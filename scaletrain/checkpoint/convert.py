"""`scaletrain convert`: a run's newest checkpoint to a Hugging Face Llama (or, for an MoE, Mixtral) directory or
(`--quantize`) to a real int8/int4 quantised model, and an HF directory of any family to a config that starts
training from its weights (`model.init_from = "hf:DIR"`)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import tomli_w
import torch

from scaletrain.checkpoint.hf.core import (
    architecture,
    args_from_hf_config,
    hf_dir_problems,
    quiet_torchao,
    verify_with_transformers,
    write_hf,
)
from scaletrain.checkpoint.hf.families import adapter_for_config
from scaletrain.checkpoint.hf.files import EXPORT_DTYPES, SHARD_BYTES, read_hf_config, umask_permissions
from scaletrain.checkpoint.hf.mixtral import config_sections
from scaletrain.checkpoint.run_model import load_run_model, open_run_checkpoint, run_config
from scaletrain.config.io import to_dict
from scaletrain.data import build_loader, load_tokenizer
from scaletrain.errors import ConfigError, UserError, unwritable
from scaletrain.models import ModelArgs, Transformer, build_meta_model, resolve_model_args
from scaletrain.precision.qat import (
    WEIGHTS_FILE,
    apply_qat,
    convert_qat,
    load_quantized_state,
    mean_loss,
    qat_problems,
    save_quantized,
)
from scaletrain.run.directory import CONFIG

log = logging.getLogger("scaletrain")


def claim_out_dir(out: Path) -> bool:
    """Make OUT_DIR for an export, before any work: UserError when it is a file, holds anything already (nothing
    is overwritten) or cannot be created or written. True when it was created here (remove it if the export
    fails: a half-written export would block the next attempt)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file, not a directory; choose a new OUT_DIR (nothing is overwritten)")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"{out} exists and is not empty; choose a new OUT_DIR (nothing is overwritten)")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"cannot create {out} ({unwritable(out, e)}); choose an OUT_DIR in a writable place"
        ) from None
    if not os.access(out, os.W_OK):
        raise UserError(f"{out} is not writable; choose an OUT_DIR in a writable place")
    return created


@contextlib.contextmanager
def _into(out: Path, created: bool) -> Iterator[None]:
    """Remove `out` (made by claim_out_dir) when the export in the block fails, or is interrupted: a half-written
    export would block the next attempt. The files of a finished one get the umask's permissions."""
    try:
        yield
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    umask_permissions(out)


def to_hf(src: Path, out: Path, dtype: str = "fp32", max_shard_bytes: int = SHARD_BYTES) -> str:
    """A run's newest intact checkpoint (or the checkpoint directory `src`) as a Hugging Face directory `out`:
    config.json, the weights in `dtype` (fp32 or bf16) as model.safetensors or, above `max_shard_bytes`, several
    files and their index, and, for a run with a tokenizer.json, that file and a tokenizer_config.json. The
    checkpoint is read a tensor at a time (the host holds about the largest tensor, not the model). Checked
    against transformers' own forward when it is installed and the model fits this host twice in fp32."""
    if dtype not in EXPORT_DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose {' or '.join(EXPORT_DTYPES)}")
    out = out.expanduser().absolute()
    created = claim_out_dir(out)
    with _into(out, created):
        ckpt = open_run_checkpoint(src)
        cfg, tokenizer = ckpt.cfg, ckpt.tokenizer
        tok_file = Path(cfg.data.tokenizer) if cfg.data.tokenizer != "byte" else None
        eod_token = getattr(tokenizer, "eod_token", None)
        shapes = ckpt.shapes()
        write_hf(
            out, ckpt.args, shapes, ckpt.read, tok_file, tokenizer.eod_id, eod_token, dtype, max_shard_bytes
        )
    files = len(list(out.glob("*.safetensors")))
    checked = _check_export(src, out, ckpt.args, sum(math.prod(s) for s in shapes.values()), dtype)
    return f"exported {ckpt.path} to {out}; {files} safetensors file(s) in {dtype}; {checked}"


def _check_export(src: Path, out: Path, args: ModelArgs, n_params: int, dtype: str) -> str:
    """transformers' logits against ours, or why they were not compared. Both models are held in fp32."""
    if importlib.util.find_spec("transformers") is None:
        return "not checked against transformers (not installed)"
    need, available = 2 * 4 * n_params, available_memory()
    if need > available:
        return (
            f"not checked against transformers: the check holds the model twice in fp32 ({need / 2**30:.1f} GiB), "
            f"more than the {available / 2**30:.1f} GiB available here"
        )
    model = load_run_model(src)[0].eval()
    if dtype != "fp32":
        with torch.no_grad():  # what the export holds: our weights rounded to its dtype
            for p in model.parameters():
                p.copy_(p.to(EXPORT_DTYPES[dtype]))
    diff = verify_with_transformers(model, out)
    return f"transformers.{architecture(args)} logits match (max abs diff {diff:.1e})"


def available_memory() -> int:
    """Bytes this host can give without swapping (MemAvailable; free pages where there is no /proc/meminfo)."""
    with contextlib.suppress(OSError, StopIteration, ValueError):
        with open("/proc/meminfo") as f:
            line = next(x for x in f if x.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """--max-shard-size: '5GB' (as transformers' max_shard_size), '500MB', '2GiB' or a byte count."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m[2].upper() if m else ""
    if m is None or unit not in _SIZE_UNITS or float(m[1]) <= 0:
        raise UserError(f"--max-shard-size {text!r}: give a positive size such as 5GB, 500MB or 2GiB")
    return int(float(m[1]) * _SIZE_UNITS[unit])


def from_hf(hf_dir: Path, out_toml: Path) -> str:
    # Absolute: the config names hf_dir (model.init_from, data.tokenizer) for a training started from anywhere.
    hf_dir = hf_dir.expanduser().absolute()
    if out_toml.exists():
        raise UserError(f"{out_toml} exists; choose another --out (nothing is overwritten)")
    cfg_json = read_hf_config(hf_dir)
    # Refused before anything is written: a config that trains from weights our model would load differently.
    problems = hf_dir_problems(hf_dir)
    if problems:
        raise ConfigError(problems)
    fields, moe = config_sections(args_from_hf_config(cfg_json))
    model = {"preset": "debug", **fields, "init_from": f"hf:{hf_dir}"}
    data = {"tokenizer": str(hf_dir / "tokenizer.json")} if (hf_dir / "tokenizer.json").exists() else {}
    kind = adapter_for_config(cfg_json).architecture(ModelArgs(**args_from_hf_config(cfg_json)))
    kind = kind.removesuffix("ForCausalLM")
    header = (
        f"# Start training from the Hugging Face {kind} weights in {hf_dir}.\n"
        f"# The model{' and moe' if moe else ''} fields below come from its config.json and override the preset.\n"
    )
    if moe and cfg_json.get("router_jitter_noise"):
        header += (
            f"# Not reproduced: router_jitter_noise {cfg_json['router_jitter_noise']} (training-time noise on the "
            "router input; our router has none).\n"
        )
    sections = {"model": model, **({"moe": moe} if moe else {}), **({"data": data} if data else {})}
    try:
        with out_toml.open("x") as f:  # "x": never overwritten
            f.write(header + tomli_w.dumps(sections))
    except OSError as e:
        raise UserError(
            f"cannot write {out_toml} ({unwritable(out_toml, e)}); choose another --out"
        ) from None
    return f"wrote {out_toml}; train with: scaletrain train --config {out_toml}"


def to_quantized(src: Path, out: Path, scheme: str) -> str:
    """A run's newest checkpoint as the real quantised model (torchao's QAT convert step) in `out`:
    model.safetensors (see save_quantized), config.toml (the run's, precision.qat = scheme) and
    quantization.json: the float, fake-quant and converted models' mean loss on the run's validation split."""
    out = out.expanduser().absolute()
    created = claim_out_dir(out)
    with _into(out, created):
        return _quantize(src, out, scheme)


def _quantize(src: Path, out: Path, scheme: str) -> str:
    model, cfg, tokenizer, ckpt = load_run_model(src)
    if cfg.data.val_fraction == 0:
        raise UserError(
            f"the run in {src} holds out no validation data (data.val_fraction = 0) to compare on"
        )
    p = dataclasses.replace(cfg.precision, qat=scheme)
    problems = qat_problems(p, model.args, tp=1)
    if problems:
        raise ConfigError(problems)
    loader = build_loader(cfg.data, tokenizer, cfg.training.global_batch, 0, 1, cfg.training.seed, log.info)
    batches = list(loader.val_batches(cfg.training.eval_sequences, cfg.training.micro_batch))
    eod = tokenizer.eod_id if cfg.data.document_mask else None
    losses = {"float": mean_loss(model, batches, eod)}
    with quiet_torchao():  # precision.qat imports torchao here
        losses["fake_quant"] = mean_loss(apply_qat(model, p), batches, eod)
        losses["converted"] = mean_loss(convert_qat(model, p), batches, eod)
    report = dict(
        scheme=scheme, group_size=p.qat_group_size, trained_with_qat=cfg.precision.qat, checkpoint=str(ckpt),
        val_sequences=sum(len(x) for x, _ in batches), loss=losses,
        converted_vs_fake_quant_rel=abs(losses["converted"] - losses["fake_quant"]) / losses["fake_quant"],
    )  # fmt: skip
    save_quantized(model, out, {"scheme": scheme, "group_size": p.qat_group_size})
    (out / CONFIG).write_text(tomli_w.dumps(to_dict(dataclasses.replace(cfg, precision=p))))
    (out / "quantization.json").write_text(json.dumps(report, indent=2) + "\n")
    trained = report["trained_with_qat"]
    note = "" if trained == scheme else f" (post-training quantisation: the run trained with qat = {trained})"
    return (
        f"quantised {ckpt} as {scheme}{note} into {out}; validation loss over {report['val_sequences']} "
        f"sequences: float {losses['float']:.4f}, fake-quant {losses['fake_quant']:.4f}, "
        f"converted {losses['converted']:.4f}"
    )


def load_quantized(out: Path) -> Transformer:
    """The model `to_quantized` wrote, rebuilt on CPU: its architecture converted, then its tensors assigned."""
    cfg = run_config(out)
    with quiet_torchao():  # precision.qat imports torchao here
        state, meta = load_quantized_state(out / WEIGHTS_FILE)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    model = build_meta_model(
        resolve_model_args(cfg.model, tokenizer.vocab_size, cfg.data.seq_len, moe=cfg.moe)
    )
    model.to_empty(device="cpu")
    model.init_weights()  # the RoPE buffer; every parameter is replaced below
    convert_qat(
        model, dataclasses.replace(cfg.precision, qat=meta["scheme"], qat_group_size=meta["group_size"])
    )
    model.load_state_dict(state, assign=True)
    if model.args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight  # assign=True unties them
    return model.eval()
