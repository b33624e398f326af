"""Published Llama 3 training runs (torchtitan, Megatron-Bridge) set up in the planner as they ran: model, layout,
batch, sequence, precision, recompute and the GPU they ran on. Each run's figures, source and where our features
differ are stated here once; `python benchmarks/planner_validate.py --published` prints the table docs/planner.md
holds, and tests/unit/test_planner_published.py pins it. No figure of these runs is used to set the planner's
efficiency figures (estimators/hardware.py, estimators/time.py cite their own sources).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from scaletrain.config import (
    Config,
    DataConfig,
    MemoryConfig,
    ModelConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainingConfig,
)
from scaletrain.hardware import PLANNED_GPUS
from scaletrain.parallel.layout import Layout
from scaletrain.planning.estimators.hardware import GPUS, DeviceProfile, GiB, _gpu
from scaletrain.planning.estimators.inputs import model_args
from scaletrain.planning.estimators.search import estimate

TORCHTITAN = (
    "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (commit 820504e2; runs at torchtitan 9dec370, "
    "torch 1963fc8, Dec 2024)"
)
TORCHTITAN_ASYNC_TP = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (commit 2887250b; runs June 2025)"
TRAINY = (
    "pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md (commit 4a61bd87; June 2025)"
)
MEGATRON = (
    "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md (commit 4ab94dfa), 25.11 NeMo container, "
    "DGX-H100, FP8-CS; recipe scripts/performance/configs/llama/llama3_workload_base_configs.py at c5dd4b6b"
)


def _h100_as_torchtitan_ran(bf16_tflops: float, fp8_tflops: float) -> DeviceProfile:
    """torchtitan's H100s (its benchmark's Hardware section): 96 GB HBM2e at 2.4 TB/s, the default 500 W power
    limit, NVLink and 400 Gb/s RDMA per GPU as DGX. Their footnote: the peak is "between SXM and NVL, and we don't
    know its exact value", so the run is planned at both ends: the SXM's datasheet peaks (989.4 / 1,978.9) and the
    H100 NVL's (NVIDIA H100 datasheet, 2023: 835 BF16 / 1,670.5 FP8 dense, half the sparse figures). The matmul
    rate keeps the measured share of the peak (MEASURED_MATMUL_TFLOPS); HBM is the stated 2.4 TB/s."""
    spec = dataclasses.replace(
        PLANNED_GPUS["h100"],
        peak_tflops={"bf16": bf16_tflops, "fp8": fp8_tflops, "fp32": 66.9},
        hbm_tbps=2.4,
        memory_bytes=96 * GiB,
    )
    return dataclasses.replace(_gpu(spec), name=f"H100 96GB HBM2e 500 W (bf16 peak {bf16_tflops:g})")


PROFILES: dict[str, DeviceProfile] = {
    "h100": GPUS["h100"],
    "h200": GPUS["h200"],
    "h100-500w-sxm": _h100_as_torchtitan_ran(989.4, 1978.9),
    "h100-500w-nvl": _h100_as_torchtitan_ran(835.0, 1670.5),
}


@dataclass(frozen=True)
class Run:
    """One published run: its figures per GPU, and the planner's configuration of it."""

    title: str
    source: str
    preset: str
    world: int
    seq: int
    global_batch: int
    micro: int
    parallel: ParallelConfig
    recompute: str
    precision: str
    gpus: tuple[str, ...]  # PROFILES keys: one, or the two ends of a range
    tokens_per_s: float  # published, per GPU
    memory_gib: float | None  # published peak per GPU (None: not published)
    differs: str  # where the run differs from what scaletrain runs (and so from what the planner models)
    recompute_every: int = 2
    attention: str = (
        "auto"  # model.attention: the kernel the run used (cudnn: Transformer Engine's fused attention)
    )
    loss: str = "chunked"  # model.loss: how the run computed its loss (TT_LOSS for torchtitan's)
    compile: bool = False  # training.compile: torchtitan's compile of each block (COMPILED)

    def config(self) -> Config:
        t = TrainingConfig(global_batch=self.global_batch, micro_batch=self.micro, eval_interval=0,
                           compile=self.compile)  # fmt: skip
        memory = MemoryConfig(recompute=self.recompute, recompute_every=self.recompute_every)
        model = ModelConfig(preset=self.preset, attention=self.attention, loss=self.loss)
        return Config(model=model, data=DataConfig(seq_len=self.seq), training=t,
                      parallel=self.parallel, memory=memory, precision=PrecisionConfig(compute=self.precision))  # fmt: skip


FSDP = ParallelConfig(data_parallel="fsdp")
TT_H100 = ("h100-500w-sxm", "h100-500w-nvl")
# torchtitan's per-op selective AC (selective_ac_option = "op") is memory.recompute = selective_op, run as they ran it.
# torchtitan computes its loss on the whole micro-batch's logits (bf16 under FSDP's mixed precision), their fp32
# copy and the fp32 log-softmax, F.cross_entropy(pred.flatten(0, 1).float(), ...) (train.py at 9dec370,
# components/loss.py at e7c0cae): scaletrain's model.loss = "whole", and its runs are planned with it.
TT_LOSS = "whole"
# From June 2025 torchtitan compiles that loss when the model is compiled (build_cross_entropy_loss in
# components/loss.py at e7c0cae; at 9dec370 the line is commented out, "compiling loss function causes CUDA
# errors"): model.loss = "whole_compiled", for the compiled runs at those commits whose memory is published.
TT_LOSS_COMPILED = "whole_compiled"
RESERVED = (
    "memory published as torch's max_reserved (train.py at 9dec370): the allocator's blocks, used or not"
)
COMPILED = "torch.compile fuses the element-wise ops the planner charges as eager kernels"
FLOAT8 = "torchao float8 tensorwise Linear (our fp8)"
RUNS: tuple[Run, ...] = (
    Run("torchtitan Llama 3.1 8B, 8 H100, FSDP, bf16 (table 1)", TORCHTITAN, "8B", 8, 8192, 16, 2, FSDP,
        "selective_op", "bf16", TT_H100, 5762, 82.4, RESERVED, loss=TT_LOSS),
    Run("torchtitan Llama 3.1 8B, 128 H100, FSDP, bf16 (table 3)", TORCHTITAN, "8B", 128, 8192, 256, 2, FSDP,
        "selective_op", "bf16", TT_H100, 5605, 67.0, RESERVED, loss=TT_LOSS),
    Run("torchtitan Llama 3.1 8B, 8 H100, FSDP, compile + float8 (table 1)", TORCHTITAN, "8B", 8, 8192, 16, 2,
        FSDP, "selective_op", "fp8", TT_H100, 8532, 76.8, f"{RESERVED}; {COMPILED}; {FLOAT8}", loss=TT_LOSS, compile=True),
    Run("torchtitan Llama 3.1 8B, 64 H100, FSDP 8 TP 8, compile, bf16 (async-TP doc, vanilla TP)",
        TORCHTITAN_ASYNC_TP, "8B", 64, 8192, 96, 12,
        ParallelConfig(data_parallel="fsdp", tp=8, sequence_parallel=True), "selective_op", "bf16", TT_H100, 4378,
        None, COMPILED, loss=TT_LOSS, compile=True),
    Run("torchtitan Llama 3.1 70B, 256 H100, FSDP 32 TP 8, compile + float8, full AC (table 4)", TORCHTITAN, "70B",
        256, 8192, 512, 16, ParallelConfig(data_parallel="fsdp", tp=8, sequence_parallel=True), "full", "fp8",
        TT_H100, 829, 71.9, f"{COMPILED}; {FLOAT8}; {RESERVED}", loss=TT_LOSS, compile=True),
    Run("torchtitan Llama 3.1 70B, 256 H100, FSDP 32 TP 8, compile, bf16, full AC (async-TP doc, vanilla TP)",
        TORCHTITAN_ASYNC_TP, "70B", 256, 8192, 512, 16,
        ParallelConfig(data_parallel="fsdp", tp=8, sequence_parallel=True), "full", "bf16", TT_H100, 597.3, None,
        COMPILED, loss=TT_LOSS, compile=True),
    Run("torchtitan Llama 3.1 8B, 32 H200 (4 nodes), FSDP, compile + float8 (Trainy)", TRAINY, "8B", 32, 8192, 64,
        2, FSDP, "selective_op", "fp8", ("h200",), 10938, 47.96,
        f"{COMPILED}; {FLOAT8} with float8 FSDP all-gather (ours gathers bf16)", loss=TT_LOSS_COMPILED, compile=True),
    Run("Megatron-Bridge Llama 3 8B, 8 H100, FSDP, FP8-CS", MEGATRON, "8B", 8, 8192, 128, 1,
        ParallelConfig(data_parallel="fsdp", grad_sync="micro_batch"), "every_k", "fp8", ("h100",), 14451, None,
        "full recompute of 5 of 32 blocks (ours: every 6th block, 5.3 of 32); Transformer Engine's FP8 current "
        "scaling and fused norms and casts; its cuDNN attention is our model.attention = cudnn",
        recompute_every=6, attention="cudnn"),
    Run("Megatron-Bridge Llama 3 70B, 64 H100, TP 4 PP 8 VP 5, FP8-CS", MEGATRON, "70B", 64, 8192, 128, 1,
        ParallelConfig(data_parallel="zero2", tp=4, pp=8, sequence_parallel=True, pp_schedule="interleaved_1f1b",
                       pp_virtual_stages=5), "none", "fp8", ("h100",), 1602, None,
        "DDP with the distributed optimizer (ours: zero2, the nearest layout scaletrain runs with tp and pp: "
        "gradients and optimizer states sharded over the 2 data-parallel ranks); TP communication overlapped with GEMMs "
        "(userbuffers); embedding and loss in stages of their own (ours: the head counted on every stage); "
        "Transformer Engine's fused norms and casts; its cuDNN attention is our model.attention = cudnn",
        attention="cudnn"),
)  # fmt: skip


def predict(run: Run) -> list[tuple[float, float]]:
    """(tokens/s per GPU, peak GiB of the fullest rank) on each of the run's profiles."""
    cfg = run.config()
    out = []
    for gpu in run.gpus:
        plan = estimate(cfg, model_args(cfg), Layout.of(cfg, run.world), PROFILES[gpu], 8)
        out.append((plan.time["tokens_per_s"] / run.world, plan.memory["total"] / GiB))
    return out


def _span(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if lo == hi else f"{format(lo, fmt)}–{format(hi, fmt)}"


def table() -> str:
    """The comparison as a Markdown table: published and predicted per GPU, and predicted / published."""
    rows = ["| run | published tok/s/GPU | predicted | ratio | published GiB | predicted | ratio |",
            "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for run in RUNS:
        got = predict(run)
        tps, mem = [t for t, _ in got], [m for _, m in got]
        pub_mem = "—" if run.memory_gib is None else f"{run.memory_gib:g}"
        mem_ratio = "—" if run.memory_gib is None else _span([m / run.memory_gib for m in mem], ".2f")
        rows.append(f"| {run.title} | {run.tokens_per_s:,g} | {_span(tps, ',.0f')} | "
                    f"{_span([t / run.tokens_per_s for t in tps], '.2f')} | {pub_mem} | {_span(mem, '.1f')} | "
                    f"{mem_ratio} |")  # fmt: skip
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
