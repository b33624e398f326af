"""profile.*: the strict step-range parser, the interval arithmetic behind the overlap fraction, the event
classification on constructed traces, and one real 2-process run whose chosen rank alone writes a trace that
parses, with a summary whose overlap fraction is a fraction (and whose metrics log the counted DDP bytes)."""

from __future__ import annotations

import json

import pytest

from scaletrain.config import ProfileConfig
from scaletrain.metrics.profile import (
    classify,
    format_summary,
    intersection,
    merge,
    overlap_fraction,
    parse_steps,
    profile_problems,
    summarize,
)
from tests.helpers import events, read_jsonl, train_cli


@pytest.mark.parametrize("text, span", [("10-12", (10, 12)), (" 3 - 3 ", (3, 3)), ("7", (7, 7)), ("", None)])
def test_parse_steps(text, span):
    assert parse_steps(text) == span


@pytest.mark.parametrize("text", ["12-10", "0-2", "a-b", "1-2-3", "1,2", "-3", "2-"])
def test_parse_steps_refuses_other_forms(text):
    with pytest.raises(ValueError, match="'A-B'"):
        parse_steps(text)


def test_profile_problems_name_the_fix():
    ok = ProfileConfig(steps="2-3", ranks=[0, 1])
    assert profile_problems(ok, steps=10, world_size=2, cuda=False) == []
    (late,) = profile_problems(ProfileConfig(steps="9-12"), steps=10, world_size=1, cuda=False)
    assert "ends after training.steps 10" in late
    (rank,) = profile_problems(ProfileConfig(steps="2", ranks=[2]), steps=10, world_size=2, cuda=False)
    assert "[2]" in rank and "0..1" in rank
    (mem,) = profile_problems(ProfileConfig(steps="2", memory=True), steps=10, world_size=1, cuda=False)
    assert "CUDA" in mem
    assert "must be 'A-B'" in profile_problems(ProfileConfig(steps="x"), 10, 1, False)[0]


def test_interval_union_and_intersection():
    assert merge([(5, 7), (0, 2), (1, 3), (7, 8), (9, 9)]) == [(0, 3), (5, 8)]
    a, b = merge([(0, 10), (20, 30)]), merge([(5, 25)])
    assert intersection(a, b) == 10  # [5, 10] and [20, 25]
    assert intersection(b, a) == 10
    assert intersection(a, merge([(10, 20)])) == 0  # touching is not overlapping
    # Communication [0, 10] + [20, 30] (20 long); compute covers [5, 25]: half of it ran beside compute.
    assert overlap_fraction([(0, 10), (20, 30)], [(5, 15), (12, 25)]) == 0.5
    assert overlap_fraction([(0, 4)], [(0, 4), (1, 2)]) == 1.0
    assert overlap_fraction([(0, 4)], [(4, 8)]) == 0.0
    assert overlap_fraction([], [(0, 1)]) is None


def _x(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "cat": cat}


def test_classify_counts_outermost_aten_ops_and_not_a_collectives_own_work():
    trace = [
        _x("autograd::engine::evaluate_function: MmBackward0", 0, 100),  # a wrapper, not an aten op
        _x("aten::mm", 0, 30),
        _x("aten::t", 1, 2),  # inside aten::mm: not counted again
        _x("c10d::allreduce_", 40, 20),
        _x("aten::copy_", 45, 5),  # the collective's own copy: communication, not compute
        _x("gloo:all_reduce", 50, 40, tid=2, cat="user_annotation"),  # the transfer, on gloo's thread
        _x("aten::mm", 70, 30),
        {"ph": "i", "name": "aten::mm", "ts": 0, "tid": 1, "pid": 1},  # not a span
    ]
    comm, compute = classify(trace)
    assert merge(comm) == [(40, 90)]
    assert merge(compute) == [(0, 30), (70, 100)]
    s = summarize(trace, [], (2, 3))
    assert s["comm_s"] == pytest.approx(50e-6) and s["compute_s"] == pytest.approx(60e-6)
    assert s["overlap_fraction"] == pytest.approx(20 / 50)
    assert "overlap fraction 40.0%" in format_summary(s)


def test_classify_on_gpu_uses_kernels():
    trace = [
        _x("aten::mm", 0, 100),
        _x("sm90_gemm", 10, 50, tid=7, cat="kernel"),
        _x("ncclDevKernel_AllReduce_Sum_f32", 40, 40, tid=8, cat="kernel"),
    ]
    assert overlap_fraction(*classify(trace)) == pytest.approx(20 / 40)


def test_trace_written_by_the_chosen_rank_only(tmp_path):
    run = tmp_path / "run"
    train_cli(
        run, nproc=2, steps=3, training__eval_interval=0, metrics__log_interval=1, profile__steps="2-3",
        profile__ranks="[1]",
    )  # fmt: skip
    files = sorted(p.name for p in (run / "profile").iterdir())
    assert files == ["rank1.summary.json", "rank1.summary.txt", "rank1.trace.json"]
    trace = json.loads((run / "profile" / "rank1.trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert "aten::mm" in names and any(n.startswith("gloo:") for n in names)
    s = json.loads((run / "profile" / "rank1.summary.json").read_text())
    assert s["steps"] == [2, 3] and len(s["top_ops"]) > 3
    assert s["comm_s"] > 0 and s["compute_s"] > s["comm_s"] * 0.1
    assert 0 <= s["overlap_fraction"] <= 1 and 0 <= s["overlap_s"] <= s["comm_s"]
    # The metrics carry the counted DDP bytes: every fp32 gradient once (a 2-rank ring sends 2(W-1)/W = 1x).
    (start,) = events(run, "start")
    assert [m["comm_bytes"] for m in read_jsonl(run / "metrics.jsonl")] == [4.0 * start["parameters"]] * 3
