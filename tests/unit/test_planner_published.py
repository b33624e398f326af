"""The planner's GPU efficiency figures are the published measurements they cite (issue 35 item 3), each one
pinned to its source's number, and its estimates of the published Llama 3 runs (benchmarks/published_runs.py)
are the table docs/planner.md shows. No network: the figures are constants in the code."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from scaletrain.config import ModelConfig, ParallelConfig
from scaletrain.models.presets import resolve_model_args
from scaletrain.parallel.layout import Layout, layout_problems
from scaletrain.parallel.mesh import ParallelDims
from scaletrain.planning.estimators.hardware import GPUS, load_profile
from scaletrain.planning.estimators.inputs import model_args
from scaletrain.planning.estimators.time import (
    ATTENTION_BACKWARD_FLOPS,
    ATTENTION_SHARES,
    _block_times,
    _links,
    _matmuls,
    _Shape,
)

ROOT = Path(__file__).resolve().parents[2]
TB, GB = 1e12, 1e9


def test_each_gpu_efficiency_figure_is_its_sources_measurement():
    h100, h200 = GPUS["h100"], GPUS["h200"]
    # GEMMs: ml-engineering's MAMF table (H100 SXM bf16 794.5, fp8 1,402.6; H200 fp8 1,453.4 TFLOP/s).
    rates = {p: h100.matmul[p][1] / TB for p in ("bf16", "fp16", "fp8")}
    assert rates == pytest.approx({"bf16": 794.5, "fp16": 794.5, "fp8": 1402.6})
    assert h200.matmul["fp8"][1] == pytest.approx(1453.4 * TB)
    assert GPUS["a100"].matmul["bf16"][1] == pytest.approx(271.2 * TB)
    # Attention on H100 SXM5 (FlashAttention-3 paper), of 989.4: FlashAttention-2 333 forward (causal) and 318
    # backward; cuDNN 529 and 518.
    shares = {kernel: tuple(989.4 * x for x in pair) for kernel, pair in ATTENTION_SHARES.items()}
    assert shares == {"flash": pytest.approx((333, 318)), "cudnn": pytest.approx((529, 518))}
    assert ATTENTION_BACKWARD_FLOPS == 2.5
    # Links: NCCL's ring all-gather on NVLink 4, 361.4 GB/s; a node's NICs at 364.87 of 400 GB/s.
    assert h100.intra_bw == pytest.approx(361.4 * GB) and h200.intra_bw == pytest.approx(361.4 * GB)
    assert h100.inter_bw == pytest.approx(50 * GB * 364.87 / 400)
    # The MFU's peaks stay the datasheet's.
    assert h100.peak_flops["bf16"] == pytest.approx(989.4 * TB)


@pytest.mark.parametrize("kernel", ["auto", "flash", "cudnn"])
def test_a_block_runs_its_linears_at_the_gemm_rate_and_attention_at_its_kernels(kernel):
    args = resolve_model_args(ModelConfig(preset="8B", attention=kernel), None, 8192)
    h100 = GPUS["h100"]
    b = _block_times(args, ParallelConfig(), h100, "bf16", 1, 8192, 1.0)
    flops = _matmuls(_Shape(8192, 8192, args.dim, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim,
                            args.ffn_hidden))  # fmt: skip
    t0, rate, peak = h100.matmul["bf16"][0], h100.matmul["bf16"][1], h100.peak_flops["bf16"]
    linear, attention = sum(flops[:7]), sum(flops[7:])
    forward, backward = ATTENTION_SHARES["cudnn" if kernel == "cudnn" else "flash"]
    assert b["fwd"] == pytest.approx(9 * t0 + linear / rate + attention / (peak * forward))
    # FlashAttention's own FLOP count: backward is 2.5x forward.
    assert b["bwd"] == pytest.approx(18 * t0 + 2 * linear / rate + 2.5 * attention / (peak * backward))


def test_a_group_spanning_nodes_moves_its_members_nics_and_a_cpu_keeps_its_link():
    h100 = GPUS["h100"]
    # fsdp over 16 GPUs on 2 nodes: 8 members a node, 8 NICs (up to NVLink's rate).
    links = _links(h100, ParallelDims.from_config(ParallelConfig(data_parallel="fsdp"), 16), 8)
    assert links["dp_shard_cp"].bw == pytest.approx(min(h100.intra_bw, 8 * h100.inter_bw))
    # tp 8 fills each node: the dp group has one member a node, one NIC.
    links = _links(h100, ParallelDims.from_config(ParallelConfig(tp=8), 16), 8)
    assert links["dp_cp"].bw == h100.inter_bw and links["tp"].bw == h100.intra_bw
    # A CPU profile's spanning group stays at its inter-node link (unchanged CPU behaviour).
    cpu = dataclasses.replace(load_profile("cpu"), intra_bw=2e9, inter_bw=1e9)
    links = _links(cpu, ParallelDims.from_config(ParallelConfig(data_parallel="fsdp"), 4), 2)
    assert links["dp_shard_cp"].bw == 1e9


def _published_runs():
    spec = importlib.util.spec_from_file_location("published_runs", ROOT / "benchmarks" / "published_runs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("published_runs", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_published_run_is_set_up_as_a_layout_scaletrain_runs():
    runs = _published_runs()
    for run in runs.RUNS:
        cfg = run.config()
        assert layout_problems(cfg, Layout.of(cfg, run.world), model_args(cfg)) == [], run.title
        assert all(gpu in runs.PROFILES for gpu in run.gpus) and run.source and run.differs


def test_docs_planner_holds_the_planners_table_of_the_published_runs():
    """docs/planner.md's table is what the planner predicts for each published run, figure for figure: a change to
    the estimators that moves a prediction must update the table (benchmarks/planner_validate.py --published)."""
    text = (ROOT / "docs" / "planner.md").read_text()
    start = text.index("| run | published tok/s/GPU |")
    shown = text[start:].split("\n\n")[0].strip()
    assert shown == _published_runs().table()
