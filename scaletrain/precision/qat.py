"""Quantization-aware training (`precision.qat`; Liu et al. 2023, LLM-QAT) through torchao: fake int8 per-token
activations and int4/int8 grouped weights in the transformer blocks' Linear layers while training (prepare), the
real quantised model from the trained weights (convert), and its on-disk form (safetensors plus metadata)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from scaletrain.config import PrecisionConfig
from scaletrain.models.attention import document_ids
from scaletrain.models.llama import ModelArgs
from scaletrain.precision._torchao import import_quietly, torchao_problem
from scaletrain.precision.policy import Precision

log = logging.getLogger("scaletrain")

# The weight dtype of each scheme. Activations are always int8, dynamic (scales from each token's own range),
# asymmetric; weights symmetric per group of input channels: torchao's Int8DynamicActivationIntxWeightConfig, the
# "8da4w" scheme ExecuTorch runs on CPUs and phones.
WEIGHT_DTYPES = {"int8_int4": torch.int4, "int8_int8": torch.int8}
WEIGHTS_FILE = "model.safetensors"


def _torchao_quantization():  # noqa: ANN202 (a module)
    """torchao.quantization (call it before any other torchao import: it refuses a missing torchao with the fix);
    the fake-quant and int8 paths used here are plain PyTorch."""
    return import_quietly("torchao.quantization", "precision.qat")


def block_linear_inputs(args: ModelArgs) -> dict[str, int]:
    """The input size of each Linear in a transformer block, by name: what a weight group must divide."""
    return {
        "attention.wq/wk/wv": args.dim,
        "attention.wo": args.n_heads * args.head_dim,
        "feed_forward.w1/w3": args.dim,
        "feed_forward.w2": args.ffn_hidden,
    }


def qat_problems(p: PrecisionConfig, args: ModelArgs, *, tp: int) -> list[str]:
    """precision.qat against the model shape, the layout and precision.compute; [] when it is off or sound. bf16
    and fp16 compose (the quantisers run in the autocast dtype: one forward/backward checked)."""
    if p.qat == "none":
        return []
    if p.qat_group_size < 1:
        return [f"precision.qat_group_size must be >= 1, got {p.qat_group_size}"]
    problems = [missing] if (missing := torchao_problem("precision.qat")) is not None else []
    bad = {name: n for name, n in block_linear_inputs(args).items() if n % p.qat_group_size}
    if bad:
        sizes = sorted(set(block_linear_inputs(args).values()))
        ok = [g for g in (256, 128, 64, 32, 16, 8) if all(n % g == 0 for n in sizes)]
        problems.append(
            f"precision.qat_group_size {p.qat_group_size} does not divide the input size of "
            + ", ".join(f"{k} ({v})" for k, v in bad.items())
            + f": each weight group takes that many input channels; use one of {ok or [1]}"
        )
    if p.compute == "fp8":
        # fp8 swaps every nn.Linear for Float8Linear after QAT has swapped them (FakeQuantizedLinear is one):
        # the fake quantisation would silently be dropped.
        problems.append(
            "precision.qat cannot be combined with precision.compute fp8: both replace the blocks' Linear "
            "layers; use precision.compute fp32, bf16 or fp16 with QAT"
        )
    if tp > 1:
        # Measured with torch 2.13 / torchao 0.18: parallelize_module's Colwise/RowwiseParallel fail on a
        # FakeQuantizedLinear ("'IntxFakeQuantizer' object has no attribute 'weight'": they partition its
        # quantiser submodules as if they were Linears). Beyond that, a rowwise-split weight's groups and a
        # sharded activation's per-token range would span ranks, and torchao computes them with local tensor ops.
        problems.append(
            "precision.qat is not supported with parallel.tp > 1 (tensor parallel cannot shard torchao's "
            "fake-quantised Linear layers, and weight groups / per-token ranges would span ranks); use data, "
            "pipeline or context parallel, or set precision.qat = none"
        )
    return problems


def _base_config(scheme: str, group_size: int):  # noqa: ANN202 (a torchao config)
    tq = _torchao_quantization()
    from torchao.quantization.granularity import PerGroup

    return tq.Int8DynamicActivationIntxWeightConfig(
        weight_dtype=WEIGHT_DTYPES[scheme], weight_granularity=PerGroup(group_size)
    )


def _blocks(model: nn.Module) -> nn.Module:
    # Only the blocks: the embedding is a lookup (no activation to quantise) and the output head is kept in full
    # precision, as LLM-QAT and most int4 deployments do (its error goes straight into the logits).
    return model.layers


def apply_qat(model: nn.Module, p: PrecisionConfig | Precision) -> nn.Module:
    """torchao's QAT prepare step on the model's blocks (in place): each nn.Linear becomes a FakeQuantizedLinear,
    an nn.Linear subclass with the same `weight` parameter, so names, checkpoints and FSDP are unchanged. `p`: the
    precision section, or the run's resolved Precision (which carries its qat and qat_group_size)."""
    if p.qat == "none":
        return model
    tq = _torchao_quantization()
    from torchao.quantization.qat import QATConfig

    tq.quantize_(_blocks(model), QATConfig(_base_config(p.qat, p.qat_group_size), step="prepare"))
    log.info("qat: %s fake quantisation (group size %d) in every block Linear", p.qat, p.qat_group_size)
    return model


def fake_quantized_linears(model: nn.Module) -> int:
    _torchao_quantization()
    from torchao.quantization.qat import FakeQuantizedLinear

    return sum(isinstance(m, FakeQuantizedLinear) for m in model.modules())


def convert_qat(model: nn.Module, p: PrecisionConfig) -> nn.Module:
    """torchao's convert step (in place): the fake-quantised Linears (prepared first when the model is plain:
    that is post-training quantisation of the same scheme) become Linears with int8-stored weights, the int4 or
    int8 values with their per-group scales, and int8 dynamic activation quantisation at every call."""
    if fake_quantized_linears(model) == 0:
        apply_qat(model, p)
    tq = _torchao_quantization()
    from torchao.quantization.qat import QATConfig

    tq.quantize_(_blocks(model), QATConfig(_base_config(p.qat, p.qat_group_size), step="convert"))
    return model


@torch.no_grad()
def mean_loss(
    model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], eod_id: int | None
) -> float:
    """Mean token cross-entropy of `model` over `batches` on one process (the validation loss of train.py's
    evaluate, without a mesh); `eod_id` when the run masks attention at document ends."""
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    for x, y in batches:
        kwargs = {"document_ids": document_ids(x, eod_id)} if eod_id is not None else {}
        total += model(x, targets=y, **kwargs).item()
        n += y.numel()
    model.train(was_training)
    return total / n


def save_quantized(model: nn.Module, out: Path, meta: dict) -> Path:
    """The converted model's state dict as safetensors: torchao flattens each quantised weight into its plain
    tensors (`layers.0.attention._wq_qdata`, `_scale`, `_zero_point`) and describes it in the file's metadata;
    `meta` (the scheme) goes there too. No pickle: `load_quantized_state` rebuilds the tensors."""
    from safetensors.torch import save_file

    _torchao_quantization()
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    # Copies of the plain tensors: safetensors refuses shared storage (tied embeddings, views).
    state = {
        k: v if type(v) is not torch.Tensor else v.detach().clone() for k, v in model.state_dict().items()
    }
    tensors, metadata = flatten_tensor_state_dict(state)
    path = out / WEIGHTS_FILE
    save_file(tensors, str(path), metadata={**metadata, "scaletrain": json.dumps(meta)})
    return path


def load_quantized_state(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """What save_quantized wrote: the state dict with torchao's quantised tensors, and the scaletrain metadata."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    _torchao_quantization()
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    state, leftover = unflatten_tensor_state_dict(load_file(str(path)), metadata)
    assert not leftover, f"unread tensors in {path}: {sorted(leftover)}"
    return state, json.loads(metadata.get("scaletrain", "{}"))
