"""How the [precision] section runs: the mechanism that casts (per-op autocast, or FSDP2's MixedPrecisionPolicy
where FSDP2 wraps the model), the loss scaler fp16 needs, fp8 and QAT's choices, the checks made before launch, and
the start-up warning on CPUs without bf16 matrix units."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from scaletrain.config import PrecisionConfig
from scaletrain.hardware import cpu_flags
from scaletrain.precision.fp8 import fp8_problems
from scaletrain.precision.scaler import LossScaler

Mechanism = Literal["none", "autocast", "fsdp"]

# fp8 runs the blocks' Linear layers in float8 (torchao) and everything else in bf16, as torchtitan does.
COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,
}
REDUCE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Precision:
    """One run's precision, resolved once (train.py) and handed to `parallelize` (QAT and fp8 layers, the FSDP
    policy, the pipeline's scaled loss) and to `build_step_runner` (autocast, the loss scaler)."""

    name: str  # precision.compute
    mechanism: Mechanism
    device_type: str
    reduce_dtype: torch.dtype = torch.float32
    scaler: LossScaler | None = None  # fp16 only
    fp8_recipe: str | None = None  # fp8 only: "tensorwise" or "rowwise"
    fp8_all_gather: bool = False  # fp8 tensorwise under FSDP2: all-gather the weights in float8
    qat: str = "none"  # precision.qat: the fake-quantisation scheme of the blocks' Linear layers
    qat_group_size: int = 32

    @property
    def compute_dtype(self) -> torch.dtype:
        return COMPUTE_DTYPES[self.name]

    @property
    def mfu_peak(self) -> Literal["bf16", "fp32"]:
        """The device peak MFU is reported against (see mfu_precision)."""
        return mfu_precision(self.name, self.device_type)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context of every forward: autocast to the compute dtype under the autocast mechanism, else none (the
        FSDP policy has already cast the parameters)."""
        if self.mechanism == "autocast":
            return torch.autocast(self.device_type, dtype=self.compute_dtype)
        return contextlib.nullcontext()

    def mp_policy(self) -> MixedPrecisionPolicy | None:
        """What `apply_fsdp` gets. Under the fsdp mechanism each unit's all-gather casts the sharded fp32 parameters
        to the compute dtype (the fp32 shards stay the master weights the optimizer steps) and gradients are reduced
        in reduce_dtype into fp32 shards. Under autocast parameters stay fp32; only a reduce dtype other than fp32
        needs a policy. None: FSDP2's default (no casting), so fp32 runs are untouched."""
        param = self.compute_dtype if self.mechanism == "fsdp" else None
        if param is None and self.reduce_dtype == torch.float32:
            return None
        return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=self.reduce_dtype)

    def loss_fn(self, base: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        """The loss a pipeline schedule runs backward on (it calls backward itself): scaled under fp16."""
        if self.scaler is None:
            return base
        scaler = self.scaler
        return lambda output, target: scaler.scale_loss(base(output, target))

    def describe(self) -> str:
        """One line for the start-up log: which precision runs and by which mechanism."""
        names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        compute, reduce = names[self.compute_dtype], names[self.reduce_dtype]
        if self.name == "fp32":
            return "fp32" if reduce == "fp32" else f"fp32, {reduce} gradient reduction (FSDP2)"
        how = {
            "autocast": f"torch.autocast({self.device_type}, {compute})",
            "fsdp": f"FSDP2 MixedPrecisionPolicy ({compute} parameters in compute, {reduce} gradient reduction, "
            "fp32 master weights)",
        }[self.mechanism]
        extra = ""
        if self.scaler is not None:
            extra = f", dynamic loss scale from {self.scaler.scale:g} (x2 after {self.scaler.growth_interval} clean)"
        if self.fp8_recipe is not None:
            gather = ", fp8 all-gather" if self.fp8_all_gather else ""
            extra = f", torchao float8 {self.fp8_recipe} Linear layers{gather}"
        return f"{self.name} via {how}{extra}"


def cast_mechanism(compute: str, mechanism: str, fsdp: bool) -> Mechanism:
    """How `compute` is cast to: none in fp32; precision.mechanism auto picks FSDP2's policy where FSDP2 wraps the
    model (`fsdp`), autocast elsewhere."""
    if compute == "fp32":
        return "none"
    if mechanism == "auto":
        return "fsdp" if fsdp else "autocast"
    return mechanism  # type: ignore[return-value]


def resolve_precision(p: PrecisionConfig, fsdp: bool, device: torch.device | str) -> Precision:
    """The precision section `p` on `device` (or its type); `fsdp`: whether FSDP2 wraps the model
    (Layout.fsdp).

    auto picks the FSDP policy where FSDP2 wraps the model: the all-gathers then move half the bytes, each unit's
    cast happens once per gather instead of once per op and use, and no fp32 copy of a gathered unit is ever held
    (docs/performance.md, Precision, has the comparison)."""
    mechanism = cast_mechanism(p.compute, p.mechanism, fsdp)
    scaler = None
    if p.compute == "fp16":
        scaler = LossScaler(p.loss_scale_init, p.loss_scale_growth_interval)
    fp8 = p.fp8_recipe if p.compute == "fp8" else None
    return Precision(
        p.compute,
        mechanism,
        device.type if isinstance(device, torch.device) else device,
        REDUCE_DTYPES[p.reduce_dtype] if fsdp else torch.float32,
        scaler,
        fp8,
        fp8_all_gather=fp8 == "tensorwise" and fsdp,
        qat=p.qat,
        qat_group_size=p.qat_group_size,
    )


def precision_problems(p: PrecisionConfig, fsdp: bool, device_type: str, tp: int = 1) -> list[str]:
    """precision.compute and its companions against the layout and the device, each with what to change (QAT's
    own: qat.qat_problems)."""
    problems = []
    if p.mechanism == "fsdp" and not fsdp and p.compute != "fp32":
        problems.append(
            "precision.mechanism 'fsdp' needs a layout that FSDP2 wraps (parallel.data_parallel fsdp, zero2 or "
            "hsdp over more than one rank); use auto or autocast"
        )
    if p.reduce_dtype != "fp32" and not fsdp:
        problems.append(
            f"precision.reduce_dtype '{p.reduce_dtype}' applies to FSDP2's gradient reduction only (fsdp, zero2 or "
            "hsdp over more than one rank); leave it fp32 for this layout"
        )
    if p.compute == "fp16":
        if p.loss_scale_init <= 0 or p.loss_scale_growth_interval < 1:
            problems.append(
                "precision.loss_scale_init must be > 0 and precision.loss_scale_growth_interval >= 1, got "
                f"{p.loss_scale_init} and {p.loss_scale_growth_interval}"
            )
    if p.compute == "fp8":
        problems += fp8_problems(device_type, tp)
    return problems


def mfu_precision(name: str, device_type: str) -> Literal["bf16", "fp32"]:
    """The peak MFU is measured against. On GPUs fp16's tensor-core rate equals bf16's (every GPU of the table) and
    fp8 is reported against the bf16 peak (as torchtitan does), so a gain from fp8 shows as MFU above bf16's. On a
    CPU fp16 has no peak of its own: the fp32 peak, the host's best, is the honest reference."""
    if name == "fp32" or (device_type == "cpu" and name == "fp16"):
        return "fp32"
    return "bf16"


def cpu_precision_warning(name: str, device_type: str, flags: set[str] | None = None) -> str | None:
    """The start-up warning for bf16/fp16 on a CPU without bf16 matrix units (no AMX-BF16, no AVX512-BF16), None
    otherwise. There, autocast converts every matmul's operands and runs it without hardware support."""
    if device_type != "cpu" or name not in ("bf16", "fp16"):
        return None
    flags = cpu_flags() if flags is None else flags
    if flags & {"amx_bf16", "avx512_bf16"} or (name == "fp16" and "amx_fp16" in flags):
        return None
    return (
        f"precision.compute {name} on a CPU without bf16 matrix units (no amx_bf16 or avx512_bf16 in "
        "/proc/cpuinfo): autocast there converts every matmul's operands and computes without hardware support; "
        "bf16 was measured 3-4x slower than fp32 for every stack (bare PyTorch, torchtitan, scaletrain), and on "
        "the debug model bf16 ~9x and fp16 ~11x slower; use --precision.compute fp32"
    )
