"""The memory check's estimate beside what the kernel measures: each case trains 2 steps through the real CLI
(`scaletrain train --nproc N`) and every worker's resident peak (VmHWM in /proc/<pid>/status, polled every 50 ms
until the worker exits) is put beside the estimate the check makes before launch (issue 35).

    python benchmarks/memory_matrix.py [--only N,...] [--json OUT] [--env KEY=VALUE ...] [--held-out]
                                       [--measured OUT]  (re-estimate saved measurements, run nothing)

The estimate is `scaletrain.planning.estimators.memory.per_rank_bytes` as `validate` calls it (the CPU terms included); the
goal is estimate >= measured on the fullest rank and within 15% of it. A case's memory in all stays under ~3 GiB
(the host is shared); the 16-rank 0.43B case of the issue is only estimated (`--dry-run`), never run here."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scaletrain.planning.estimators.inputs import parse_unvalidated  # noqa: E402
from scaletrain.planning.estimators.memory import memory_estimate  # noqa: E402

CONFIG = str(ROOT / "configs" / "debug.toml")
MiB = 2**20


def shape(dim: int, ffn: int, layers: int, vocab: int, heads: int = 8, kv: int = 4) -> list[str]:
    return [
        *("--model.dim", str(dim), "--model.ffn_hidden", str(ffn), "--model.n_layers", str(layers)),
        *("--model.vocab_size", str(vocab), "--model.n_heads", str(heads), "--model.n_kv_heads", str(kv)),
    ]


def dp(mode: str, **sizes: int) -> list[str]:
    out = ["--parallel.data_parallel", mode]
    for k, v in sizes.items():
        out += [f"--parallel.{k}", str(v)]
    return out


# (processes, model shape, layout, sequence length). Shapes: FFN/dim from 1 to 6, vocabularies 512 to 50k.
WIDE = shape(1024, 4096, 4, 512, 16, 4)  # the block (ffn 4x) with its tiny vocabulary, 4 layers
NARROW = shape(512, 512, 6, 50304)  # ffn = dim, a 50k vocabulary
MID = shape(768, 2048, 4, 8192, 12, 4)
TALL = shape(384, 2304, 8, 32000, 6, 2)  # ffn 6x
CASES: list[tuple[int, list[str], list[str], int]] = [
    (2, WIDE, dp("fsdp"), 32),
    (4, WIDE, dp("fsdp"), 32),
    (2, WIDE, dp("ddp"), 32),
    (2, WIDE, dp("zero1"), 32),
    (2, WIDE, dp("zero2"), 32),
    (4, WIDE, dp("hsdp", dp_replicate=2, dp_shard=2), 32),
    (4, WIDE, dp("fsdp", tp=2), 32),
    (4, WIDE, dp("fsdp", pp=2), 32),
    (2, NARROW, dp("fsdp"), 64),
    (4, NARROW, dp("fsdp"), 64),
    (2, NARROW, dp("ddp"), 64),
    (4, NARROW, dp("zero2"), 64),
    (4, MID, dp("fsdp"), 64),
    (4, MID, dp("zero1"), 64),
    (2, TALL, dp("fsdp", tp=2), 64),
    (4, TALL, dp("fsdp", pp=2), 64),
]
# Held out: not looked at while the terms were modelled (benchmark only).
HELD_OUT: list[tuple[int, list[str], list[str], int]] = [
    (4, shape(896, 3584, 4, 2048, 14, 2), dp("fsdp"), 48),
    (2, shape(640, 1280, 6, 16384, 10, 2), dp("zero2"), 64),
    (4, shape(640, 2560, 4, 4096, 10, 2), dp("hsdp", dp_replicate=2, dp_shard=2), 64),
    (4, shape(512, 2048, 8, 24000, 8, 4), dp("fsdp", tp=2), 64),
    (2, shape(1024, 2048, 3, 1024, 16, 4), dp("ddp"), 32),
    (4, shape(768, 1536, 6, 12000, 12, 4), dp("fsdp", pp=2), 64),
]
# Activations dominant (2048 tokens a micro-batch, 8 layers), 16-bit compute under both cast mechanisms and
# recompute on and off, beside fp32: what the cases above (fp32, 32-64 tokens) never weighed.
LONG = shape(512, 1536, 8, 8192, 8, 4)
BF16, FULL = ["--precision.compute", "bf16"], ["--memory.recompute", "full"]
ACTIVATIONS: list[tuple[int, list[str], list[str], int]] = [
    (2, LONG, dp("ddp"), 2048),
    (2, LONG, dp("ddp") + BF16, 2048),
    (2, LONG, dp("ddp") + BF16 + FULL, 2048),
    (2, LONG, dp("fsdp") + BF16, 2048),
    (2, LONG, dp("fsdp") + BF16 + FULL, 2048),
]
COMMON = ["--training.steps", "4", "--training.eval_interval", "0", "--checkpoint.enabled", "false"]
COMMON += ["--metrics.progress", "false", "--metrics.tensorboard", "false", "--metrics.log_interval", "1"]


def overrides(n: int, model: list[str], layout: list[str], seq: int) -> list[str]:
    pp = int(layout[layout.index("--parallel.pp") + 1]) if "--parallel.pp" in layout else 1
    return [*COMMON, *model, *layout, "--data.seq_len", str(seq), "--training.micro_batch", "1",
            "--training.global_batch", str(n * pp)]  # fmt: skip


def _kib(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(x.split()[1]) for x in f if x.startswith(field + ":")), None)
    except OSError:
        return None


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _descendants(root: int) -> list[tuple[int, int]]:
    """(pid, parent pid) of every process below `root`."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out += [(c, pid) for c in children.get(pid, [])]
        todo += children.get(pid, [])
    return out


def _workers(root: int) -> list[int]:
    """The launcher's workers: the children of its fork server (launch._start_fork_server)."""
    tree = _descendants(root)
    servers = {pid for pid, _ in tree if b"forkserver" in _cmdline(pid)}
    return [pid for pid, parent in tree if parent in servers]


def measure(n: int, args: list[str], env: dict) -> dict:
    """Every worker's VmHWM (MiB), polled until it exits; the run's wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "scaletrain", "train", "--config", CONFIG, "--nproc", str(n), *args]
        proc = subprocess.Popen([*cmd, "--run.dir", tmp], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        peaks: dict[int, int] = {}
        t0 = time.perf_counter()
        while proc.poll() is None:
            for pid in _workers(proc.pid):
                hwm = _kib(pid, "VmHWM")
                if hwm is not None:
                    peaks[pid] = max(peaks.get(pid, 0), hwm)
            time.sleep(0.05)
        out = proc.stdout.read() if proc.stdout else ""
        if proc.returncode:
            raise RuntimeError(f"{' '.join(args)} failed:\n{out[-3000:]}")
    return {"peaks_mib": sorted(v / 1024 for v in peaks.values()), "wall_s": time.perf_counter() - t0}


def describe(n: int, model: list[str], layout: list[str], seq: int) -> str:
    m = dict(zip(model[::2], model[1::2]))
    lay = dict(zip(layout[::2], layout[1::2]))
    sizes = " ".join(  # parallel sizes by name (tp2), other settings by value (bf16, full)
        f"{k.split('.')[-1]}{v}" if k.startswith("--parallel.") else v
        for k, v in lay.items()
        if k != "--parallel.data_parallel"
    )
    return (f"n={n} {lay['--parallel.data_parallel']}{' ' + sizes if sizes else ''} d{m['--model.dim']} "
            f"f{m['--model.ffn_hidden']} L{m['--model.n_layers']} V{m['--model.vocab_size']} s{seq}")  # fmt: skip


def estimate_mib(n: int, args: list[str], env: dict) -> float:
    cfg = parse_unvalidated(CONFIG, args)
    return memory_estimate(cfg, n)["total"] / MiB


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated case numbers (from 1)")
    ap.add_argument("--held-out", action="store_true", help="the held-out cases instead")
    ap.add_argument("--activations", action="store_true", help="the long-sequence 16-bit cases instead")
    ap.add_argument("--json", default="", help="write the measurements here")
    ap.add_argument(
        "--env", action="append", default=[], help="KEY=VALUE for the workers (e.g. MALLOC_ARENA_MAX=0)"
    )
    ap.add_argument("--estimate-only", action="store_true")
    ap.add_argument(
        "--measured", default="", help="a saved --json: re-estimate its measurements, run nothing"
    )
    opt = ap.parse_args()
    cases = HELD_OUT if opt.held_out else ACTIVATIONS if opt.activations else CASES
    env = {**os.environ, **dict(kv.split("=", 1) for kv in opt.env)}
    rows = [int(x) for x in opt.only.split(",") if x] or range(1, len(cases) + 1)
    saved = {r["case"]: r for r in json.loads(Path(opt.measured).read_text())} if opt.measured else {}
    rows = [i for i in rows if i in saved] if saved else rows
    print(
        f"{'#':>2} {'case':<44} {'estimate':>8} {'max rank':>8} {'min rank':>8} {'est/meas':>8} {'wall s':>6}"
    )
    results, worst_lo, worst_hi = [], float("inf"), 0.0
    for i in rows:
        n, model, layout, seq = cases[i - 1]
        args = overrides(n, model, layout, seq)
        est = estimate_mib(n, args, env)
        if opt.estimate_only:
            print(f"{i:>2} {describe(n, model, layout, seq):<44} {est:>8.0f}", flush=True)
            continue
        m = saved[i] if saved else measure(n, args, env)
        ratio = est / m["peaks_mib"][-1]
        worst_lo, worst_hi = min(worst_lo, ratio), max(worst_hi, ratio)
        print(f"{i:>2} {describe(n, model, layout, seq):<44} {est:>8.0f} {m['peaks_mib'][-1]:>8.0f} "
              f"{m['peaks_mib'][0]:>8.0f} {ratio:>8.3f} {m['wall_s']:>6.1f}", flush=True)  # fmt: skip
        results.append({"case": i, "describe": describe(n, model, layout, seq), "estimate_mib": est, **m})
    if results:
        print(f"est/meas from {worst_lo:.3f} to {worst_hi:.3f} (goal: 1.00 to 1.15)")
    if opt.json:
        Path(opt.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
