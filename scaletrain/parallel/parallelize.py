"""Apply every configured parallelism to a built model, in one fixed order, and say what ran.

Order (as in torchtitan): pipeline split -> tensor/sequence parallel -> context parallel -> data parallel.
The pipeline goes first so that each stage is then parallelised on its own. Tensor parallel comes before FSDP
because FSDP shards the DTensors that TP made along the data-parallel dim (a 2-D layout); the reverse is not
supported. Context parallel only swaps the attention kernel, so it can sit anywhere before the wrapping.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from scaletrain.config import ParallelConfig
from scaletrain.parallel.mesh import ParallelDims

log = logging.getLogger("scaletrain")


@dataclass
class ParallelModel:
    parts: list[nn.Module]  # the modules that hold this rank's parameters: the model, or its pipeline stages
    pipeline: object = None  # PipelineParts when pp > 1
    loss_parallel: bool = False


def apply_data_parallel(model: nn.Module, dims: ParallelDims, pcfg: ParallelConfig) -> nn.Module:
    """Gradients are averaged over data-parallel AND context-parallel ranks: each cp rank holds part of every
    sequence, so its gradient is a partial sum of the same samples' gradient (hence the dp_cp / dp_shard_cp meshes)."""
    from scaletrain.parallel.data_parallel import apply_ddp, apply_fsdp

    mode = pcfg.data_parallel
    if mode in ("ddp", "zero1"):
        if dims.size("dp_cp") > 1:
            return apply_ddp(model, dims.submesh("dp_cp"), bucket_mb=pcfg.ddp_bucket_mb)
        return model
    if mode == "hsdp":
        mesh = dims.hsdp_mesh()
    elif dims.size("dp_shard_cp") > 1:
        mesh = dims.submesh("dp_shard_cp")
    else:
        return model
    from scaletrain.parallel.pipeline import reshards_after_forward

    reshard = reshards_after_forward(mode, dims.pp, pcfg.pp_schedule)
    return apply_fsdp(model, mesh, reshard_after_forward=reshard)


def parallelize(
    model: nn.Module, dims: ParallelDims, pcfg: ParallelConfig, *, device: torch.device, n_microbatches: int
) -> ParallelModel:
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
        return apply_data_parallel(m, dims, pcfg)

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
