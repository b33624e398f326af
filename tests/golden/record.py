"""Record the golden losses: `python -m tests.golden.record` (rewrites tests/golden/debug.json).

Per-step losses, grad norms and validation losses of configs/debug.toml in deterministic mode, for one process and
two layouts. Record them on the code BEFORE a change that must not move them; a change that does move them
re-records in the same commit and says why in its message.

One recording per kind of CPU: the same code gives other bits where the CPU's features pick other fp32 kernels
(an AMX Xeon moved the first loss by 1 ulp from the recording made without AMX). Recording adds or replaces this
CPU's and keeps the others; a change that moves the losses re-records on every kind it can reach and drops the rest.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from scaletrain.metrics import cpu_features
from tests.helpers import QUICK, read_jsonl, train_cli

GOLDEN = Path(__file__).with_name("debug.json")
COMMON = [*QUICK, "--training.deterministic", "true", "--metrics.log_interval", "1"]
# name -> extra CLI arguments. Two processes each: a data-parallel and a pipeline layout.
LAYOUTS: dict[str, list[str]] = {
    "single": [],
    "fsdp2": ["--nproc", "2", "--parallel.data_parallel", "fsdp"],
    "pp2_1f1b": ["--nproc", "2", "--parallel.pp", "2", "--parallel.pp_schedule", "1f1b"],
}


def run_layout(name: str, run_dir: Path) -> dict:
    train_cli(run_dir, *COMMON, *LAYOUTS[name], quick=False)  # COMMON holds QUICK
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    evals = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "eval"]
    return {
        "loss": [m["loss"] for m in metrics],
        "grad_norm": [m["grad_norm"] for m in metrics],
        "val_loss": {str(e["step"]): e["val_loss"] for e in evals},
    }


# Where no recording was made on this kind of CPU, the losses must agree with one within this relative difference
# (kernel choices move fp32 sums by ulps; a change to the computation moves them by far more).
OTHER_CPU_RTOL = 1e-5


def recordings() -> list[dict]:
    """The recordings, each {"cpu", "recorded_on", "layouts"}."""
    return json.loads(GOLDEN.read_text())["recordings"]


def golden_problem(
    name: str, got: dict, keys: tuple[str, ...] = ("loss", "grad_norm", "val_loss")
) -> str | None:
    """None when `got` (run_layout's dict, or the `keys` of it) reproduces a recording of layout `name` bit for bit,
    or, on a CPU with no recording of its own, agrees with one within OTHER_CPU_RTOL; else what moved."""
    cpu, recs = cpu_features(), recordings()
    wants = [{k: r["layouts"][name][k] for k in keys} for r in recs]
    mine = {k: got[k] for k in keys}
    if any(mine == want for want in wants):
        return None
    own = [r for r in recs if r["cpu"] == cpu]
    if own:
        return f"{name}: {keys} moved from the golden run recorded on {own[0]['recorded_on']} on this CPU ({cpu})"
    if any(_close(mine, want) for want in wants):
        print(f"{name}: no golden recording on {cpu}; within {OTHER_CPU_RTOL} of another CPU's (to record: "
              "python -m tests.golden.record)")  # fmt: skip
        return None
    return (
        f"{name}: {keys} differ by more than {OTHER_CPU_RTOL} from every recording (none on this CPU: {cpu})"
    )


def _close(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return abs(a - b) <= OTHER_CPU_RTOL * abs(b)


def main() -> None:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    mine = {"cpu": cpu_features(), "recorded_on": commit, "layouts": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in LAYOUTS:
            mine["layouts"][name] = run_layout(name, Path(tmp) / name)
            print(name, mine["layouts"][name]["loss"][-1], file=sys.stderr)
    others = [r for r in recordings() if r["cpu"] != mine["cpu"]] if GOLDEN.exists() else []
    out = {"config": "configs/debug.toml", "args": COMMON, "recordings": [*others, mine]}
    GOLDEN.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {GOLDEN} for {mine['cpu']}; kept the recordings of {[r['cpu'] for r in others]}")


if __name__ == "__main__":
    main()
