"""Record the golden losses: `python -m tests.golden.record` (rewrites tests/golden/debug.json).

Per-step losses, grad norms and validation losses of configs/debug.toml in deterministic mode, for one process and
two layouts. Record them on the code BEFORE a change that must not move them; a change that does move them
re-records in the same commit and says why in its message.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.helpers import DEBUG, QUICK, read_jsonl, run_cli

GOLDEN = Path(__file__).with_name("debug.json")
COMMON = [*QUICK, "--training.deterministic", "true", "--metrics.log_interval", "1"]
# name -> extra CLI arguments. Two processes each: a data-parallel and a pipeline layout.
LAYOUTS: dict[str, list[str]] = {
    "single": [],
    "fsdp2": ["--nproc", "2", "--parallel.data_parallel", "fsdp"],
    "pp2_1f1b": ["--nproc", "2", "--parallel.pp", "2", "--parallel.pp_schedule", "1f1b"],
}


def run_layout(name: str, run_dir: Path) -> dict:
    run_cli("train", "--config", DEBUG, "--run.dir", str(run_dir), *COMMON, *LAYOUTS[name])
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    evals = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "eval"]
    return {
        "loss": [m["loss"] for m in metrics],
        "grad_norm": [m["grad_norm"] for m in metrics],
        "val_loss": {str(e["step"]): e["val_loss"] for e in evals},
    }


def main() -> None:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    out = {"recorded_on": commit, "config": "configs/debug.toml", "args": COMMON, "layouts": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in LAYOUTS:
            out["layouts"][name] = run_layout(name, Path(tmp) / name)
            print(name, out["layouts"][name]["loss"][-1], file=sys.stderr)
    GOLDEN.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
