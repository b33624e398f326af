"""`convert --to hf` host memory (issue 23 item 4): the peak resident memory of exporting a run's checkpoint, against
the model's size, for this checkout and (with --old) another one, e.g. the code before the streaming export,
unpacked with `git archive COMMIT scaletrain | tar -x -C /tmp/old`. The export alone is measured, each in a fresh
process: the transformers check that `convert` runs after it holds the model twice in fp32 by design.

    python benchmarks/hf_export.py [--dim 1536] [--layers 12] [--max-shard-mb 500] [--old /tmp/old] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The export path of each version, through functions both have (before: the whole model loaded, then exported).
CHILD = r"""
import json, resource, sys
from pathlib import Path
run, out, streaming, dtype, cap = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", sys.argv[4], sys.argv[5]
import scaletrain.checkpoint.hf as hf
from scaletrain.checkpoint import run_model
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if streaming:
    ckpt = run_model.open_run_checkpoint(run)
    hf.write_hf(out, ckpt.args, ckpt.shapes(), ckpt.read, dtype=dtype, max_shard_bytes=int(cap))
else:
    model = run_model.load_run_model(run)[0]
    hf.export_hf(model.eval(), out)
print(json.dumps({"code": hf.__file__, "base_mib": base / 1024,
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def train(run: Path, dim: int, layers: int) -> None:
    """One step of a model of `dim` x `layers` and its checkpoint (model and optimizer state, DCP)."""
    flags = {
        "model.dim": dim, "model.n_layers": layers, "model.n_heads": dim // 128, "model.n_kv_heads": dim // 512,
        "model.ffn_hidden": dim * 8 // 3 // 256 * 256, "training.steps": 1, "training.global_batch": 2,
        "training.micro_batch": 2, "training.eval_interval": 0, "data.seq_len": 32, "metrics.progress": "false",
    }  # fmt: skip
    args = [a for k, v in flags.items() for a in (f"--{k}", str(v))]
    cmd = [sys.executable, "-m", "scaletrain", "train", "--config", str(ROOT / "configs/debug.toml")]
    subprocess.run([*cmd, "--run.dir", str(run), *args], cwd=ROOT, check=True, capture_output=True)


def measure(code: Path, run: Path, out: Path, streaming: bool, dtype: str, cap: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(code)}
    cmd = [sys.executable, "-c", CHILD, str(run), str(out), "1" if streaming else "0", dtype, str(cap)]
    result = json.loads(
        subprocess.run(cmd, env=env, cwd=code, check=True, capture_output=True, text=True).stdout
    )
    if not Path(result["code"]).resolve().is_relative_to(code.resolve()):
        raise RuntimeError(f"the child imported scaletrain from {result['code']}, not {code}")
    result["files"] = len(list(out.glob("*.safetensors")))
    result["out_mib"] = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--max-shard-mb", type=int, default=500, help="the streaming export's file cap")
    ap.add_argument("--old", type=Path, help="a directory holding another scaletrain/ to compare with")
    ap.add_argument("--keep", type=Path, help="where to write (and keep) the run; default a temporary one")
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="hf_export-"))
    run = work / "run"
    if not (run / "checkpoints").is_dir():
        train(run, args.dim, args.layers)
    import torch.distributed.checkpoint as dcp  # the model's size, from the checkpoint's metadata

    from scaletrain.checkpoint.run_model import newest_intact_path

    meta = dcp.FileSystemReader(newest_intact_path(str(run / "checkpoints"))).read_metadata()
    sizes = [m.size.numel() * m.properties.dtype.itemsize for k, m in meta.state_dict_metadata.items()
             if k.startswith("model.") and hasattr(m, "size")]  # fmt: skip
    print(f"model: {sum(sizes) / 2**20:.0f} MiB in fp32, largest tensor {max(sizes) / 2**20:.0f} MiB")
    cases = [("after", ROOT, True, "fp32"), ("after", ROOT, True, "bf16")]
    if args.old:
        cases.insert(0, ("before", args.old, False, "fp32"))
    try:
        for name, code, streaming, dtype in cases:
            r = measure(code, run, work / "hf", streaming, dtype, args.max_shard_mb * 10**6)
            print(
                f"{name:6s} {dtype}: peak RSS {r['peak_mib']:6.0f} MiB ({r['peak_mib'] - r['base_mib']:+6.0f} MiB over "
                f"the {r['base_mib']:.0f} MiB of the imports), {r['files']} file(s), {r['out_mib']:.0f} MiB written"
            )
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
