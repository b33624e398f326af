"""Offload to host memory: saved activations (torch.autograd.graph.save_on_cpu into pinned memory) and, through
FSDP2's CPUOffloadPolicy, parameters, gradients and optimizer state with the optimizer step on the CPU
(ZeRO-Offload, Ren et al. 2021). Only a CUDA device has a separate memory to offload from. memory_problems checks
memory.* (recompute's k too) before launch."""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy

from scaletrain.config import MemoryConfig

log = logging.getLogger(__name__)

SHARDING_MODES = ("fsdp", "zero2", "hsdp")


def offload_problems(
    mem: MemoryConfig, device_type: str, data_parallel: str, fsdp_applied: bool
) -> list[str]:
    """Why the offload switches cannot run on this device and layout (`fsdp_applied`: whether the layout wraps the
    model in FSDP at all, see parallelize.fsdp_applies)."""
    problems = []
    if device_type != "cuda":
        for name, what in (
            ("activation_offload", "saved activations"),
            ("optimizer_offload", "parameters, gradients and optimizer state"),
        ):
            if getattr(mem, name):
                problems.append(
                    f"memory.{name} needs a CUDA device: on {device_type} the {what} already live in host "
                    f"memory, so there is nothing to offload them to; set memory.{name} false"
                    + (" (memory.recompute cuts activation memory on any device)" if "activ" in name else "")
                )
        return problems
    if mem.optimizer_offload and data_parallel not in SHARDING_MODES:
        problems.append(
            "memory.optimizer_offload uses FSDP2's CPUOffloadPolicy, which needs parallel.data_parallel fsdp, "
            f"zero2 or hsdp (got {data_parallel}); change parallel.data_parallel or set memory.optimizer_offload "
            "false"
        )
    elif mem.optimizer_offload and not fsdp_applied:
        problems.append(
            "memory.optimizer_offload uses FSDP2's CPUOffloadPolicy, but this layout has one data-parallel rank, "
            "so FSDP is not applied (fsdp and zero2 shard over dp_shard x cp > 1); run more processes or set memory.optimizer_offload false"
        )
    return problems


def fsdp_offload_policy(mem: MemoryConfig | None) -> CPUOffloadPolicy | None:
    """FSDP2's offload policy when optimizer offload is on: pinned host memory for the sharded parameters, their
    gradients and so the optimizer state; the AdamW step then runs on the CPU."""
    return CPUOffloadPolicy(pin_memory=True) if mem is not None and mem.optimizer_offload else None


def apply_activation_offload(model: nn.Module, device: torch.device) -> nn.Module:
    """Move every tensor the forward of `model` saves for backward to pinned host memory, and back when backward
    needs it. The whole stage's forward is wrapped (not each block) so that compiled blocks stay free of the
    saved-tensor hooks, which torch.compile cannot trace; the copies are synchronous (no stream overlap)."""
    if device.type != "cuda":
        raise ValueError("activation offload needs a CUDA device: host memory is this device's memory")
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with torch.autograd.graph.save_on_cpu(pin_memory=True, device_type=device.type):
            return inner(*args, **kwargs)

    model.forward = forward
    log.info("applied activation offload: saved activations go to pinned host memory during forward")
    return model


def memory_problems(m: MemoryConfig, device: str, data_parallel: str, fsdp_applied: bool) -> list[str]:
    """memory.*: recompute's k, and offload only where there is a separate device memory and (for the optimizer)
    FSDP to carry it."""
    problems = []
    if m.recompute == "every_k" and m.recompute_every < 1:
        problems.append(
            f"memory.recompute_every must be >= 1 with recompute every_k, got {m.recompute_every}"
        )
    return problems + offload_problems(m, device, data_parallel, fsdp_applied)
