"""fp8 training through torchao's float8 (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"): the
transformer blocks' Linear layers become `Float8Linear` (dynamic tensorwise or rowwise scaling, e4m3 in forward and
backward) before any parallelism is applied; the rest runs in bf16. Refused before launch off fp8 hardware."""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from scaletrain.precision._torchao import import_quietly, torchao_problem

log = logging.getLogger("scaletrain")

MIN_CAPABILITY = (8, 9)  # Ada (8.9) and Hopper (9.0) onwards have fp8 tensor cores


def fp8_problems(device_type: str, tp: int = 1, capability: tuple[int, int] | None = None) -> list[str]:
    """Why fp8 cannot run here, each with what to use instead; [] when it can. `capability`: the GPU's (major,
    minor), read from device 0 when not given."""
    if device_type != "cuda":
        return [
            f"precision.compute 'fp8' needs a CUDA GPU with compute capability >= 8.9 (fp8 tensor cores: Ada, "
            f"Hopper or newer); this run is on {device_type}, which has no fp8 matrix units (torch runs torchao's "
            "float8 matmuls there as casts around plain kernels: 3.7x slower than fp32 on the debug model); use "
            "fp32, or bf16 where the hardware has bf16 units"
        ]
    cap = capability if capability is not None else torch.cuda.get_device_capability()
    problems = []
    if tuple(cap) < MIN_CAPABILITY:
        problems.append(
            f"precision.compute 'fp8' needs compute capability >= 8.9 (fp8 tensor cores); this GPU has "
            f"{cap[0]}.{cap[1]}; use bf16"
        )
    if tp > 1:
        problems.append(
            "precision.compute 'fp8' with parallel.tp > 1 is not supported: torchao's float8 tensor-parallel "
            "styles are not part of the TP plan; set parallel.tp = 1 or use bf16"
        )
    if (missing := torchao_problem("fp8 training")) is not None:
        problems.append(missing)
    return problems


def _torchao_float8():  # noqa: ANN202 (two torchao objects)
    """torchao's float8 config and converter; the float8 training path is Python over torch._scaled_mm."""
    float8 = import_quietly("torchao.float8", "fp8 training")
    return float8.Float8LinearConfig, float8.convert_to_float8_training


def fp8_filter(module: nn.Module, fqn: str) -> bool:
    """Which layers train in float8: every Linear of the blocks whose sizes the fp8 matmul takes (multiples of 16,
    torch._scaled_mm's rule). The output projection stays bf16: its logits feed the loss directly (torchtitan
    keeps it out for the same reason)."""
    if not isinstance(module, nn.Linear) or fqn.split(".")[-1] == "output":
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_fp8(model: nn.Module, recipe: str, fsdp_all_gather: bool = False) -> nn.Module:
    """Swap the layers `fp8_filter` picks for torchao's Float8Linear, in place. `fsdp_all_gather` (tensorwise only):
    FSDP2 then all-gathers the weights already cast to float8, half the bytes of bf16."""
    Float8LinearConfig, convert_to_float8_training = _torchao_float8()
    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=fp8_filter)
    n = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    log.info(
        "applied torchao float8 (%s scaling%s) to %d Linear layers",
        recipe,
        ", fp8 all-gather" * fsdp_all_gather,
        n,
    )
    return model
