"""Peak resident memory per rank of `model.init_from = "hf:DIR"` under fsdp on N gloo ranks (issue 23 item 3):
the whole load (build_model, load_hf_weights, then parallelize, as the build did) beside the sharded one (the
model built on meta, parallelised, each rank's shards allocated with to_empty, then load_hf_sharded reading only
those rows from the safetensors files).

Each rank is a fresh spawned process; it reports its resident memory before the model exists (the interpreter
and torch), its peak (ru_maxrss) after the load, and the bytes it read from the files. The checkpoint is a random
Llama saved by transformers in 100 MB files with model.safetensors.index.json; it is made once under --dir.

    python benchmarks/hf_import.py [--ranks 4 --dim 1024 --layers 6 --vocab 32000 --ffn 2816 --dir /tmp/hf_bench]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaletrain.checkpoint.hf.core import args_from_hf_config  # noqa: E402
from scaletrain.checkpoint.hf.sharded import (
    load_hf_sharded,  # noqa: E402
    load_hf_weights,  # noqa: E402
)
from scaletrain.config import ParallelConfig  # noqa: E402
from scaletrain.models import ModelArgs, build_meta_model, build_model  # noqa: E402
from scaletrain.parallel.mesh import ParallelDims  # noqa: E402
from scaletrain.parallel.parallelize import parallelize  # noqa: E402

CPU = torch.device("cpu")
MiB = 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _make_checkpoint(path: Path, a: argparse.Namespace) -> None:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab,
        hidden_size=a.dim,
        intermediate_size=a.ffn,
        num_hidden_layers=a.layers,
        num_attention_heads=a.dim // 64,
        num_key_value_heads=a.dim // 64,
        max_position_embeddings=256,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(path), max_shard_size="100MB")


def _rank(rank: int, world: int, port: int, path: str, mode: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    before = _rss()
    hf = Path(path)
    args = ModelArgs(**args_from_hf_config(json.loads((hf / "config.json").read_text())), max_seq_len=256)
    pcfg = ParallelConfig(data_parallel="fsdp")
    dims = ParallelDims.from_config(pcfg, world)
    dims.build_mesh("cpu")
    pre = 0  # the peak before the load (sharded: after the shards are allocated)
    if mode == "whole":  # train.build before issue 23: every rank loads the whole model, then shards it
        model = build_model(args, 0, CPU)
        load_hf_weights(model, hf)
        read = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
        pm = parallelize(model, dims, pcfg, device=CPU, n_microbatches=1)
        del model
    else:  # meta, sharded, then only this rank's rows read
        pm = parallelize(build_meta_model(args), dims, pcfg, device=CPU, n_microbatches=1)
        for part in pm.parts:
            part.to_empty(device=CPU)
        pre = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        read = load_hf_sharded(pm.parts, hf, args)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    after = _rss()
    Path(out, f"{mode}{rank}.json").write_text(
        json.dumps(dict(before=before, pre=pre, peak=peak, after=after, read=read))
    )
    dist.destroy_process_group()


def _run(mode: str, path: Path, ranks: int, out: str) -> list[dict]:
    ctx = mp.get_context("spawn")
    port = 29500 + os.getpid() % 1000 + (7 if mode == "whole" else 0)
    procs = [ctx.Process(target=_rank, args=(r, ranks, port, str(path), mode, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [json.loads(Path(out, f"{mode}{r}.json").read_text()) for r in range(ranks)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "hf_import_bench")
    a = ap.parse_args()
    if not (a.dir / "config.json").is_file():
        _make_checkpoint(a.dir, a)
    size = sum(f.stat().st_size for f in a.dir.glob("*.safetensors"))
    files = len(list(a.dir.glob("*.safetensors")))
    print(f"checkpoint: {size / MiB:.0f} MiB fp32 in {files} files; fsdp over {a.ranks} ranks (MiB per rank)")
    print(
        f"{'load':8} {'rank':>4} {'before':>8} {'pre-load':>8} {'peak':>8} {'peak-before':>12} {'after':>8} {'read':>8}"
    )
    with tempfile.TemporaryDirectory() as out:
        for mode in ("whole", "sharded"):
            for r, m in enumerate(_run(mode, a.dir, a.ranks, out)):
                b, p = m["before"] / MiB, m["peak"] / MiB
                print(
                    f"{mode:8} {r:>4} {b:8.0f} {m['pre'] / MiB:8.0f} {p:8.0f} {p - b:12.0f} {m['after'] / MiB:8.0f} {m['read'] / MiB:8.0f}"
                )


if __name__ == "__main__":
    main()
