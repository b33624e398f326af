"""Apply every configured parallelism and memory technique to a built model, in one fixed order, and say what ran.

Order (as in torchtitan): pipeline split -> QAT -> tensor/sequence parallel -> expert parallel -> context parallel
-> recompute -> compile -> activation offload -> data parallel. The pipeline goes first so that each stage is then
parallelised on its own. QAT swaps each block's nn.Linear for torchao's FakeQuantizedLinear (a subclass, same parameter names), so
everything after it wraps the swapped modules; TP's parallelize_module cannot shard them (validate refuses tp > 1
with QAT), FSDP shards their weights like any Linear's.
Tensor parallel comes before FSDP because FSDP shards the DTensors that TP made along the data-parallel dim (a 2-D
layout); the reverse is not supported. Context parallel only swaps the attention kernel, so it can sit anywhere
before the wrapping. Expert parallel comes after TP (it leaves the MoE blocks alone) and before FSDP for the
same reason as TP: FSDP then shards each rank's expert DTensors over the ranks holding the same experts (a 2-D
dp_mod_ep x ep layout); and before recompute and compile, so that a recomputed or compiled block repeats its
all-to-alls like any other op of its forward. Recompute wraps each block's forward after TP/CP have installed
their hooks and kernels, so a recomputed block repeats exactly what the forward ran (TP's redistributions and ring attention included). Compile
comes after recompute so that each compiled block contains its checkpoint (torch.compile traces it as one region)
and before FSDP, whose hooks stay outside the graphs. Activation offload wraps the whole stage's forward, outside
the compiled blocks (torch.compile cannot trace saved-tensor hooks). FSDP comes last and wraps the recomputed,
compiled blocks themselves: its per-block units are unchanged, its unshard runs before a block's forward and its
recompute alike, and the blocks keep their parameter names.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from scaletrain.config import MemoryConfig, ParallelConfig
from scaletrain.models.loss import token_mean
from scaletrain.parallel.comm import CommMeter, apply_comm_hook, count_fsdp
from scaletrain.parallel.compile import apply_compile
from scaletrain.parallel.layout import fsdp_applies
from scaletrain.parallel.materialize import is_meta, materialize
from scaletrain.parallel.mesh import ParallelDims
from scaletrain.parallel.offload import apply_activation_offload, fsdp_offload_policy
from scaletrain.parallel.recompute import apply_recompute
from scaletrain.precision.fp8 import apply_fp8
from scaletrain.precision.policy import Precision
from scaletrain.precision.qat import apply_qat

log = logging.getLogger("scaletrain")


@dataclass
class ParallelModel:
    parts: list[nn.Module]  # the modules that hold this rank's parameters: the model, or its pipeline stages
    pipeline: object = None  # PipelineParts when pp > 1
    loss_parallel: bool = False
    comm: CommMeter = field(default_factory=CommMeter)  # data-parallel bytes sent; PowerSGD's state


def apply_data_parallel(
    model: nn.Module,
    dims: ParallelDims,
    pcfg: ParallelConfig,
    mem: MemoryConfig | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    comm: CommMeter | None = None,
    *,
    device: torch.device,
) -> nn.Module:
    """Gradients are averaged over data-parallel AND context-parallel ranks: each cp rank holds part of every
    sequence, so its gradient is a partial sum of the same samples' gradient (hence the dp_cp / dp_shard_cp meshes).
    `comm` counts the bytes the data-parallel collectives send (and holds the DDP hook's state)."""
    from scaletrain.parallel.data_parallel import apply_ddp, apply_fsdp

    mode = pcfg.data_parallel
    if mode in ("ddp", "zero1"):
        if dims.size("dp_cp") > 1:
            ddp = apply_ddp(model, dims.submesh("dp_cp"), device=device, bucket_mb=pcfg.ddp_bucket_mb)
            apply_comm_hook(ddp, pcfg, comm or CommMeter(), dims.submesh("dp_cp").get_group())
            return ddp
        return model
    if not fsdp_applies(dims, mode):
        return model
    mesh = dims.hsdp_mesh() if mode == "hsdp" else dims.submesh("dp_shard_cp")
    from scaletrain.parallel.pipeline import reshards_after_forward

    # parallel.reshard_after_forward: validate allows an explicit value only where it trains the same model.
    choice = pcfg.reshard_after_forward
    reshard = reshards_after_forward(mode, dims.pp, pcfg.pp_schedule) if choice == "auto" else choice
    offload = fsdp_offload_policy(mem)
    model = apply_fsdp(model, mesh, reshard_after_forward=reshard, mp_policy=mp_policy, offload_policy=offload,
                       prefetch=pcfg.fsdp_prefetch, expert_mesh=dims.submesh("dp_mod_ep"))  # fmt: skip
    count_fsdp(model, comm or CommMeter(), replicas=dims.size("dp_replicate") if mode == "hsdp" else 1)
    return model


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
    precision: Precision | None = None,
    init_seed: int | None = None,
) -> ParallelModel:
    """`memory` (recompute, offload) and `compile` (training.compile) default to off; `precision` (the resolved
    [precision] section: QAT and fp8 layers, the FSDP2 mixed-precision policy, fp16's scaled pipeline loss)
    defaults to fp32. `init_seed` None: `model` is materialised already (build_model's whole model); an int: it is
    on the meta device, and each stage gets storage for this rank's share only, set to the single-process values
    for that seed (parallel/materialize.py), after sharding and before DDP (which needs real parameters)."""
    if init_seed is not None:
        assert is_meta(model), "init_seed is for a model built on the meta device (build_meta_model)"
    shards = fsdp_applies(dims, pcfg.data_parallel)
    offload = fsdp_offload_policy(memory) is not None and shards
    storage = torch.device("cpu") if offload else device  # FSDP's CPU offload keeps the shards on the host
    loss_parallel = dims.tp_enabled and not dims.pp_enabled  # a pipeline's loss runs inside the schedule
    # Only data-parallel traffic is counted: with tp, pp, cp or ep (its all-to-alls) sending too, comm_bytes is not
    # reported.
    comm = CommMeter(counted=not (dims.tp_enabled or dims.pp_enabled or dims.cp_enabled or dims.ep_enabled))
    mp_policy = precision.mp_policy() if precision is not None else None
    loss_fn = precision.loss_fn(token_mean) if precision is not None else token_mean

    def per_stage(m: nn.Module) -> nn.Module:
        if precision is not None:
            m = apply_qat(m, precision)
            if precision.fp8_recipe is not None:
                m = apply_fp8(m, precision.fp8_recipe, precision.fp8_all_gather)
        if dims.tp_enabled:
            from scaletrain.parallel.tensor_parallel import apply_tp

            m = apply_tp(
                m, dims.submesh("tp"), sequence_parallel=pcfg.sequence_parallel, loss_parallel=loss_parallel
            )
        if dims.ep_enabled:
            from scaletrain.parallel.expert_parallel import apply_ep

            m = apply_ep(m, dims.submesh("ep"))
        if dims.cp_enabled:
            from scaletrain.parallel.context_parallel import apply_cp

            m = apply_cp(m, dims.submesh("cp"), load_balance=pcfg.cp_load_balance)
        m = apply_memory(m, memory, compile=compile, device=device)
        if init_seed is not None and not shards:  # DDP, zero1, or no data parallel: the share is the stage
            materialize(m, init_seed, device, storage_device=storage)
        m = apply_data_parallel(m, dims, pcfg, memory, mp_policy, comm, device=device)
        if init_seed is not None and shards:  # FSDP's DTensor shards
            materialize(m, init_seed, device, storage_device=storage)
        if dims.tp_enabled and not shards:  # on the materialised weight; FSDP2 splits the gradient itself
            from scaletrain.parallel.tensor_parallel import split_embedding_grad

            split_embedding_grad(getattr(m, "module", m))  # under DDP, the model it wraps
        return m

    if dims.pp_enabled:
        from scaletrain.parallel.pipeline import apply_pp

        pp = apply_pp(
            model,
            dims.submesh("pp"),
            schedule=pcfg.pp_schedule,
            n_microbatches=n_microbatches,
            virtual_stages=pcfg.pp_virtual_stages,
            device=device,
            loss_fn=loss_fn,  # under fp16 scaled: the schedule runs backward on it itself
            parallelize_fn=per_stage,
        )
        return ParallelModel(list(pp.modules), pp, loss_parallel, comm)
    return ParallelModel([per_stage(model)], None, loss_parallel, comm)
