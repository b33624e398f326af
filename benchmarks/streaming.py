"""The streaming loader (data.streaming) against the prepared-shards path on the same data: first-batch latency and
steady tokens/s, with the cache cold and warm.

The data: jsonl shards of random words written here, read (1) as prepared shards (prepare-data's tokenised cache:
cold = tokenising first, warm = the cache found), (2) streamed from the local files, (3) streamed from s3:// on moto's
S3 server on loopback (cold = an empty shard cache, warm = a second start over the filled one). Loopback has no
network latency or bandwidth limit: what (3) adds over (2) is the S3 protocol and the cache's copy. Each case runs
`--rounds` times, interleaved; the median and the spread (min-max) are reported, with the machine's load average.

    python benchmarks/streaming.py [--shards 8] [--shard-mb 2] [--seq 1024] [--batch 16] [--steps 0] [--rounds 3]

With `--ranks N` it measures the reading split over N data-parallel ranks instead: N gloo processes stream the s3://
corpus, each with its own cache directory, once each walking every shard itself (as before the token-count index)
and once splitting the reading; per rank, the bytes it fetched, its first-batch latency and its own tokens/s.
A rank saves bytes only where a global batch spans several shards (shards smaller than a batch's tokens):
    python benchmarks/streaming.py --ranks 2 --shards 64 --shard-mb 0.0625 --batch 64 --seq 1024

The steady phase reads about one epoch of the corpus (--steps 0), so streaming crosses every shard boundary.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scaletrain.config import DataConfig, SourceConfig  # noqa: E402
from scaletrain.data.loader import build_loader  # noqa: E402
from scaletrain.data.tokenizer import ByteTokenizer  # noqa: E402

WORDS = [
    w.strip() for w in "the of and to in a is that for it as was with be by on not he this are or his".split()
]


def write_shards(root: Path, shards: int, shard_mb: float) -> Path:
    rng = random.Random(0)
    d = root / "corpus"
    d.mkdir()
    for k in range(shards):
        with open(d / f"part-{k:03d}.jsonl", "w") as f:
            size = 0
            while size < shard_mb * 2**20:
                line = json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(50, 400)))}) + "\n"
                f.write(line)
                size += len(line)
    return d


def measure(cfg: DataConfig, seq: int, batch: int, steps: int) -> tuple[float, float]:
    """(seconds from building the loader to its first batch, tokens/s over the next `steps` batches)."""
    t0 = time.perf_counter()
    loader = build_loader(cfg, ByteTokenizer(), batch, 0, 1, 1234, lambda s: None, run_tokens=10**12)
    loader.next_batch()
    first = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(steps):
        loader.next_batch()
    rate = steps * batch * seq / (time.perf_counter() - t1)
    if hasattr(loader, "close"):
        loader.close()
    return first, rate


def s3_server(corpus: Path) -> tuple[object, str]:
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")  # fmt: skip
    import boto3

    client = boto3.client("s3")
    client.create_bucket(Bucket="bench")
    for f in sorted(corpus.iterdir()):
        client.upload_file(str(f), "bench", f"corpus/{f.name}")
    return server, "s3://bench/corpus/"


def _rank(rank: int, ranks: int, port: int, url: str, tmp: str, split: bool, seq: int, batch: int, steps: int,
          out) -> None:  # fmt: skip
    """One of `ranks` gloo processes streaming `url`: its first-batch latency, its own tokens/s and the bytes it
    fetched (its own cache directory's files: what the store sent it)."""
    import torch.distributed as dist

    from scaletrain.data.streaming import build_streaming_loader

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), AWS_ACCESS_KEY_ID=f"rank{rank}")
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    group = dist.new_group(backend="gloo") if split else None
    cache = Path(tmp) / f"rank{rank}"
    cfg = DataConfig(sources=[SourceConfig(path=url)], streaming=True, seq_len=seq, val_fraction=0,
                     cache_dir=str(cache), read_ahead=2)  # fmt: skip
    dist.barrier()
    t0 = time.perf_counter()
    loader = build_streaming_loader(
        cfg, ByteTokenizer(), batch, rank, ranks, 1234, 10**12, lambda s: None, group
    )
    loader.next_batch()
    first = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(steps):
        loader.next_batch()
    rate = steps * batch // ranks * seq / (time.perf_counter() - t1)
    loader.close()
    fetched = sum(f.stat().st_size for f in (cache / "stream").glob("*.shard"))
    exchanges = loader.token_counts.exchanges if loader.token_counts is not None else 0
    out.put((rank, first, rate, fetched, exchanges / (steps + 1)))
    dist.destroy_process_group()


def per_rank(args: argparse.Namespace, tmp: Path) -> None:
    """--ranks N: N processes stream s3:// with the reading split over a gloo group ("split") or each walking every
    shard itself ("every rank", as before the token-count index); the bytes each fetched and its tokens/s."""
    import torch.multiprocessing as mp

    corpus = write_shards(tmp, args.shards, args.shard_mb)
    server, url = s3_server(corpus)
    load_before = os.getloadavg()[0]
    corpus_bytes = sum(f.stat().st_size for f in corpus.iterdir())
    steps = args.steps or max(1, corpus_bytes // (args.batch * args.seq) - 2)
    ctx = mp.get_context("spawn")
    results: dict[str, list[list[tuple]]] = {}
    for r in range(args.rounds):
        for name, split in (("every rank reads every shard", False), ("split reading", True)):
            run_dir = tmp / f"{r}-{split}"
            out = ctx.Queue()
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            procs = [ctx.Process(target=_rank, args=(k, args.ranks, port, url, str(run_dir), split, args.seq,
                                                     args.batch, steps, out)) for k in range(args.ranks)]  # fmt: skip
            for p in procs:
                p.start()
            got = sorted(out.get(timeout=600) for _ in procs)
            for p in procs:
                p.join()
            results.setdefault(name, []).append(got)
            shutil.rmtree(run_dir)
    server.stop()
    load_after = os.getloadavg()[0]
    print(f"{args.ranks} ranks, {args.shards} jsonl shards x {args.shard_mb} MiB ({corpus_bytes / 2**20:.1f} MiB) on "
          f"s3:// (moto, loopback), byte tokenizer, seq {args.seq}, global batch {args.batch}, {steps} steady "
          f"batches (~one epoch), {args.rounds} rounds; load average {load_before:.1f} before, {load_after:.1f} "
          f"after ({os.cpu_count()} CPUs)")  # fmt: skip
    print(
        f"{'case':<30} {'rank':>4} {'fetched MiB (min-max)':>24} {'first batch s':>16} {'tok/s (min-max)':>26} {'exchanges/step':>14}"
    )
    out_json = {}
    for name, rounds in results.items():
        for k in range(args.ranks):
            firsts = [rnd[k][1] for rnd in rounds]
            rates = [rnd[k][2] for rnd in rounds]
            mib = [rnd[k][3] / 2**20 for rnd in rounds]
            exchanges = [rnd[k][4] for rnd in rounds]
            out_json[f"{name}/rank{k}"] = {"fetched_mib": mib, "first_batch_s": firsts, "tokens_per_s": rates,
                                           "exchanges_per_step": exchanges}  # fmt: skip
            print(f"{name:<30} {k:>4} {statistics.median(mib):>9.2f} ({min(mib):.2f}-{max(mib):.2f})    "
                  f"{statistics.median(firsts):>12.3f}    {statistics.median(rates):>12,.0f} "
                  f"({min(rates):,.0f}-{max(rates):,.0f})    {statistics.median(exchanges):.2f}")  # fmt: skip
    print(json.dumps({"load_avg": [load_before, load_after], "corpus_mib": corpus_bytes / 2**20,
                      "results": out_json}))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--shard-mb", type=float, default=2.0)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=0, help="steady batches; 0: one epoch of the corpus")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--ranks", type=int, default=0, help="N > 1: the bytes each of N ranks fetches, split or not"
    )
    args = ap.parse_args()
    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    tmp = Path(tempfile.mkdtemp(prefix="bench-streaming-"))
    if args.ranks > 1:
        per_rank(args, tmp)
        shutil.rmtree(tmp)
        return
    corpus = write_shards(tmp, args.shards, args.shard_mb)
    server, url = s3_server(corpus)
    load_before = os.getloadavg()[0]
    corpus_tokens = sum(f.stat().st_size for f in corpus.iterdir())  # ~ bytes: the byte tokenizer
    args.steps = args.steps or max(1, corpus_tokens // (args.batch * args.seq) - 2)

    def cfg(path: str, streaming: bool, cache: Path) -> DataConfig:
        return DataConfig(sources=[SourceConfig(path=path)], streaming=streaming, seq_len=args.seq,
                          val_fraction=0, cache_dir=str(cache), workers=1, read_ahead=2)  # fmt: skip

    results: dict[str, list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        cache = tmp / f"cache{r}"
        cases = [
            ("prepared, cold (tokenising first)", cfg(str(corpus), False, cache)),
            ("prepared, warm (cache found)", cfg(str(corpus), False, cache)),
            ("streaming local files", cfg(str(corpus), True, cache)),
            ("streaming s3://, cache cold", cfg(url, True, cache)),
            ("streaming s3://, cache warm", cfg(url, True, cache)),
        ]
        for name, c in cases:
            results.setdefault(name, []).append(measure(c, args.seq, args.batch, args.steps))
        shutil.rmtree(cache)
    server.stop()
    load_after = os.getloadavg()[0]
    mb = args.shards * args.shard_mb
    print(f"{args.shards} jsonl shards x {args.shard_mb} MiB ({mb:.0f} MiB), byte tokenizer, seq {args.seq}, "
          f"batch {args.batch}, {args.steps} steady batches, {args.rounds} rounds; load average {load_before:.1f} "
          f"before, {load_after:.1f} after ({os.cpu_count()} CPUs)")  # fmt: skip
    print(f"{'case':<36} {'first batch s (min-max)':>26} {'steady tok/s (min-max)':>30}")
    out = {}
    for name, rows in results.items():
        firsts, rates = [f for f, _ in rows], [t for _, t in rows]
        out[name] = {"first_batch_s": firsts, "tokens_per_s": rates}
        print(f"{name:<36} {statistics.median(firsts):>9.3f} ({min(firsts):.3f}-{max(firsts):.3f})    "
              f"{statistics.median(rates):>12,.0f} ({min(rates):,.0f}-{max(rates):,.0f})")  # fmt: skip
    print(json.dumps({"load_avg": [load_before, load_after], "results": out}))
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
