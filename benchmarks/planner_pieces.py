"""The CPU time model's per-layout terms, measured one at a time (issue 35 item 2): each layout is trained on 2
spawned gloo ranks as the probe trains its own (train.build_core, the fastest of several steps after a barrier),
beside the same shape under plain fsdp, so what tp, sequence parallel, ring attention and selective recompute add
is measured by difference and printed beside what the probed profile predicts they add.

    nice -n -10 python benchmarks/planner_pieces.py [--rounds 3]

Shapes: the probe's fit shape (dim 64, 2 layers, seq 64) and planner_validate's d256 (dim 256, 4 layers, seq 128,
micro-batch 4) — the shape the sp and cp+selective rows missed on. Rounds are interleaved; medians are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from scaletrain.parallel.layout import Layout  # noqa: E402
from scaletrain.planning.estimators.hardware import load_profile  # noqa: E402
from scaletrain.planning.estimators.inputs import model_args, parse_unvalidated  # noqa: E402
from scaletrain.planning.estimators.search import estimate  # noqa: E402
from scaletrain.planning.probe import FIT, _step_s  # noqa: E402

D256 = ["--model.dim", "256", "--model.n_layers", "4", "--model.n_heads", "4", "--model.n_kv_heads", "2"]
D256 += ["--model.ffn_hidden", "704", "--data.seq_len", "128", "--training.global_batch", "8"]
D256 += ["--training.micro_batch", "4", "--parallel.data_parallel", "fsdp", "--training.threads", "1"]
SHAPES = {"fit": FIT, "d256": D256}
KV2 = ["--model.n_kv_heads", "2"]
SPLITS = {
    "fsdp": [],
    "tp2": ["--parallel.tp", "2", *KV2],
    "tp2 sp": ["--parallel.tp", "2", *KV2, "--parallel.sequence_parallel", "true"],
    "cp2": ["--parallel.cp", "2"],
    "cp2 sel": ["--parallel.cp", "2", "--memory.recompute", "selective"],
    "fsdp sel": ["--memory.recompute", "selective"],
}


def _rank(rank: int, world: int, port: int, out: str, layouts: list[list[str]]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    times = [_step_s(over, world) for over in layouts]
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def run(layouts: list[list[str]]) -> list[float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "times")
        mp.start_processes(_rank, args=(2, port, out, layouts), nprocs=2, start_method="spawn")
        return json.loads(Path(out).read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--measured", default="", help="saved times (JSON): re-predict only")
    opt = ap.parse_args()
    names = [(s, k) for s in SHAPES for k in SPLITS]
    layouts = [[*SHAPES[s], *SPLITS[k]] for s, k in names]
    if opt.measured:
        saved = json.loads(Path(opt.measured).read_text())
        rounds, loads = saved["rounds"], saved["loads"]
    else:
        rounds, loads = [], []
        for r in range(opt.rounds):
            rounds.append(run(layouts))
            loads.append(open("/proc/loadavg").read().split()[0])
            print(f"round {r + 1}: load average {loads[-1]}", flush=True)
        path = Path(tempfile.gettempdir()) / "planner_pieces.json"
        path.write_text(json.dumps({"rounds": rounds, "loads": loads}))
        print(f"saved to {path}")
    profile = load_profile("cpu", Path(os.environ.get("SCALETRAIN_CACHE", Path.home() / ".cache/scaletrain")))
    print(f"profile: {profile.source}")
    got, pred = {}, {}
    for i, (shape, split) in enumerate(names):
        times = sorted(r[i] for r in rounds)
        got[shape, split] = statistics.median(times)
        cfg = parse_unvalidated(None, layouts[i])
        pred[shape, split] = estimate(cfg, model_args(cfg), Layout.of(cfg, 2), profile).time["step_time_s"]
        print(f"{shape:<5} {split:<9} measured {1e3 * got[shape, split]:7.1f} ms ({1e3 * times[0]:.1f}-"
              f"{1e3 * times[-1]:.1f})  predicted {1e3 * pred[shape, split]:7.1f} ms  "
              f"{100 * (pred[shape, split] / got[shape, split] - 1):+.0f}%")  # fmt: skip
    print("what each adds (ms): measured / predicted")
    for shape in SHAPES:
        for what, (a, b) in {"tp over fsdp": ("tp2", "fsdp"), "sp over tp": ("tp2 sp", "tp2"),
                             "cp over fsdp": ("cp2", "fsdp"), "selective over cp": ("cp2 sel", "cp2"),
                             "selective over fsdp": ("fsdp sel", "fsdp")}.items():  # fmt: skip
            m = got[shape, a] - got[shape, b]
            p = pred[shape, a] - pred[shape, b]
            print(f"  {shape:<5} {what:<20} {1e3 * m:7.1f} / {1e3 * p:7.1f}")
    print(f"load averages per round: {', '.join(loads)}")


if __name__ == "__main__":
    main()
