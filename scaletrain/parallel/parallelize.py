"""Apply every configured parallelism and memory technique to a built model, in one fixed order, and say what ran.

Order (as in torchtitan): pipeline split -> tensor/sequence parallel -> context parallel -> recompute -> compile ->
activation offload -> data parallel. The pipeline goes first so that each stage is then parallelised on its own.
Tensor parallel comes before FSDP because FSDP shards the DTensors that TP made along the data-parallel dim (a 2-D
layout); the reverse is not supported. Context parallel only swaps the attention kernel, so it can sit anywhere
before the wrapping. Recompute wraps each block's forward after TP/CP have installed their hooks and kernels, so a
recomputed block repeats exactly what the forward ran (TP's redistributions and ring attention included). Compile
comes after recompute so that each compiled block contains its checkpoint (torch.compile traces it as one region)
and before FSDP, whose hooks stay outside the graphs. Activation offload wraps the whole stage's forward, outside
the compiled blocks (torch.compile cannot trace saved-tensor hooks). FSDP comes last and wraps the recomputed,
compiled blocks themselves: its per-block units are unchanged, its unshard runs before a block's forward and its
recompute alike, and the blocks keep their parameter names.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from scaletrain.config import MemoryConfig, ParallelConfig
from scaletrain.memory import apply_activation_offload, apply_recompute, fsdp_offload_policy
from scaletrain.parallel.compile import apply_compile
from scaletrain.parallel.mesh import ParallelDims

log = logging.getLogger("scaletrain")


@dataclass
class ParallelModel:
    parts: list[nn.Module]  # the modules that hold this rank's parameters: the model, or its pipeline stages
    pipeline: object = None  # PipelineParts when pp > 1
    loss_parallel: bool = False


def fsdp_applies(dims: ParallelDims, mode: str) -> bool:
    """Whether the layout wraps the model in FSDP2: hsdp always, fsdp and zero2 over more than one dp_shard x cp
    rank (on one rank there is nothing to shard)."""
    return mode == "hsdp" or (mode in ("fsdp", "zero2") and dims.size("dp_shard_cp") > 1)


def apply_data_parallel(
    model: nn.Module, dims: ParallelDims, pcfg: ParallelConfig, mem: MemoryConfig | None = None
) -> nn.Module:
    """Gradients are averaged over data-parallel AND context-parallel ranks: each cp rank holds part of every
    sequence, so its gradient is a partial sum of the same samples' gradient (hence the dp_cp / dp_shard_cp meshes)."""
    from scaletrain.parallel.data_parallel import apply_ddp, apply_fsdp

    mode = pcfg.data_parallel
    if mode in ("ddp", "zero1"):
        if dims.size("dp_cp") > 1:
            return apply_ddp(model, dims.submesh("dp_cp"), bucket_mb=pcfg.ddp_bucket_mb)
        return model
    if not fsdp_applies(dims, mode):
        return model
    mesh = dims.hsdp_mesh() if mode == "hsdp" else dims.submesh("dp_shard_cp")
    from scaletrain.parallel.pipeline import reshards_after_forward

    reshard = reshards_after_forward(mode, dims.pp, pcfg.pp_schedule)
    return apply_fsdp(model, mesh, reshard_after_forward=reshard, offload_policy=fsdp_offload_policy(mem))


def apply_memory(m: nn.Module, mem: MemoryConfig | None, *, compile: bool, device: torch.device) -> nn.Module:
    """Recompute, compile and activation offload, in that order (see the module docstring for why)."""
    if mem is not None and mem.recompute != "none":
        m = apply_recompute(m, mem.recompute, mem.recompute_every)
    if compile:
        m = apply_compile(m)
    if mem is not None and mem.activation_offload:
        m = apply_activation_offload(m, device)
    return m


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    pcfg: ParallelConfig,
    *,
    device: torch.device,
    n_microbatches: int,
    memory: MemoryConfig | None = None,
    compile: bool = False,
) -> ParallelModel:
    """`memory` (recompute, offload) and `compile` (training.compile) default to off."""
    loss_parallel = dims.tp_enabled and not dims.pp_enabled  # a pipeline's loss runs inside the schedule

    def per_stage(m: nn.Module) -> nn.Module:
        if dims.tp_enabled:
            from scaletrain.parallel.tensor_parallel import apply_tp

            m = apply_tp(
                m, dims.submesh("tp"), sequence_parallel=pcfg.sequence_parallel, loss_parallel=loss_parallel
            )
        if dims.cp_enabled:
            from scaletrain.parallel.context_parallel import apply_cp

            m = apply_cp(m, dims.submesh("cp"), load_balance=pcfg.cp_load_balance)
        m = apply_memory(m, memory, compile=compile, device=device)
        return apply_data_parallel(m, dims, pcfg, memory)

    if dims.pp_enabled:
        from scaletrain.parallel.pipeline import apply_pp

        pp = apply_pp(
            model,
            dims.submesh("pp"),
            schedule=pcfg.pp_schedule,
            n_microbatches=n_microbatches,
            virtual_stages=pcfg.pp_virtual_stages,
            device=device,
            parallelize_fn=per_stage,
        )
        return ParallelModel(list(pp.modules), pp, loss_parallel)
    return ParallelModel([per_stage(model)], None, loss_parallel)
