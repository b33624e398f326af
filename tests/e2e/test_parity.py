"""`scaletrain parity` over mixed layouts, up to 8 processes: every layout's fp32 losses and gradient norms equal
the single-process run's within rtol 1e-5 over the same steps, and its final parameters within atol 2e-5 (the
harness users run, run by CI); and the parameter comparison fails when a parameter differs."""

import math
import re

import torch

from scaletrain.compare.parity import ParityResult, compare_run, format_result, param_diff
from tests.helpers import DEBUG, FIXED_PEAK, run_cli

# Through the real CLI on the debug config (its data, tokenizer and checkpoints): three dimensions at once, and zero2
# with tp and sp (no harness case pairs zero2 with tp). tp x cp and interleaved x fsdp are trained by the harness
# (tests/distributed/test_hybrid_layouts.py: cp2_tp2_sp, interleaved_1f1b_fsdp2), as is each other pair.
MIXED = [
    "pp=2,dp_shard=2,tp=2,data_parallel=fsdp",  # 8 processes
    "dp_shard=2,tp=2,data_parallel=zero2,sequence_parallel=true",
]
# The figures of one layout's line: loss, grad norm, params, the worst parameter's name, the verdict.
LINE = re.compile(
    r"loss (\S+)  grad norm (\S+)  max abs diff: params (\S+) \((\S+)\)  (OK|MISMATCH) \(rtol 1e-05, atol 2e-05\)$"
)


def test_mixed_layouts_match_the_single_process_run():
    proc = run_cli(
        "parity",
        "--config",
        DEBUG,
        "--steps",
        "4",
        "--layouts",
        *MIXED,
        "--training.micro_batch",
        "2",
        *FIXED_PEAK,
        # Overridden: parity always saves a final checkpoint, to compare the parameters.
        "--checkpoint.enabled",
        "false",
        timeout=900,
        check=False,
    )
    print(proc.stdout)
    lines = [line for line in proc.stdout.splitlines() if "nproc" in line]
    assert len(lines) == len(MIXED), proc.stdout + proc.stderr
    figures = [LINE.search(line.rstrip()) for line in lines]
    assert all(f and f[5] == "OK" for f in figures), proc.stdout
    # The parameters were compared: every layout's final weights were read back, and are not all bit-equal to
    # the reference's (were they, the comparison might be of one run with itself).
    assert all(f[4].startswith(("layers.", "tok_embeddings", "norm", "output")) for f in figures), proc.stdout
    assert max(float(f[3]) for f in figures) > 0, proc.stdout
    assert proc.returncode == 0


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "layers.0.attention.wq.weight": torch.randn(8, 8, generator=g),
        "layers.0.ffn.w1.weight": torch.randn(16, 8, generator=g),
        "norm.weight": torch.ones(8),
    }


def test_param_diff_names_the_worst_parameter():
    ref, got = _params(), _params()
    assert param_diff(ref, got) == (0.0, "layers.0.attention.wq.weight")  # equal: the first name, 0
    got["layers.0.ffn.w1.weight"][3, 5] += 3e-5
    got["norm.weight"][0] -= 1e-6
    diff, name = param_diff(ref, got)
    assert name == "layers.0.ffn.w1.weight" and math.isclose(diff, 3e-5, rel_tol=1e-2)
    got["norm.weight"][1] = float("nan")  # a NaN is the worst difference there is
    diff, name = param_diff(ref, got)
    assert math.isnan(diff) and name == "norm.weight" and not diff <= 2e-5


def test_param_diff_refuses_missing_extra_and_reshaped_parameters():
    ref, got = _params(), _params()
    got["output.weight"] = got.pop("norm.weight")
    assert param_diff(ref, got) == (math.inf, "missing norm.weight; extra output.weight")
    got = _params()
    got["norm.weight"] = torch.ones(4)
    assert param_diff(ref, got) == (math.inf, "norm.weight has shape (4,), the reference's (8,)")


def test_a_layout_with_equal_losses_but_other_final_parameters_mismatches():
    metrics = [{"loss": 5.0 - 0.1 * i, "grad_norm": 2.0 + 0.01 * i} for i in range(10)]
    ref, got = _params(), _params()
    got["layers.0.attention.wq.weight"][0, 0] += 1e-5  # within atol
    assert compare_run("tp=2", 2, (metrics, ref), (metrics, got), 1e-5, 2e-5).ok
    got["layers.0.attention.wq.weight"][0, 0] += 2e-5
    result = compare_run("tp=2", 2, (metrics, ref), (metrics, got), 1e-5, 2e-5)
    assert not result.ok and result.max_loss_rel == result.max_grad_norm_rel == 0.0
    assert result.worst_param == "layers.0.attention.wq.weight" and math.isclose(
        result.max_param_abs, 3e-5, rel_tol=1e-2
    )
    del got["norm.weight"]
    assert not compare_run(
        "tp=2", 2, (metrics, ref), (metrics, got), 1e-5, 1.0
    ).ok  # a missing name fails any atol
    loss_off = [{**m, "loss": m["loss"] * (1 + 1e-4)} for m in metrics]
    assert not compare_run("tp=2", 2, (metrics, ref), (loss_off, ref), 1e-5, 2e-5).ok


def test_a_layout_line_shows_the_parameter_figures_and_its_verdict():
    ok = ParityResult("tp=2", 2, 1.2e-7, 3.4e-6, 5.6e-6, "layers.0.attention.wq.weight", True)
    line = format_result(ok, 1e-5, 2e-5)
    assert line.startswith("tp=2" + " " * 36 + " nproc 2  max rel diff: ")
    assert LINE.search(line).groups() == (
        "1.20e-07",
        "3.40e-06",
        "5.60e-06",
        "layers.0.attention.wq.weight",
        "OK",
    )
    bad = ParityResult("tp=2", 2, 1.2e-7, 3.4e-6, math.inf, "missing norm.weight", False)
    assert format_result(bad, 1e-5, 2e-5).endswith(
        "params inf (missing norm.weight)  MISMATCH (rtol 1e-05, atol 2e-05)"
    )
    failed = ParityResult("tp=2", 2, math.inf, math.inf, math.inf, "", False, "run failed (train ...)")
    assert format_result(failed, 1e-5, 2e-5).endswith("nproc 2  FAILED: run failed (train ...)")
