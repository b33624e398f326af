"""Pre-tokenised data read in place (issue 23 item 5): for a generated raw uint16 token file (4 GB by default), the
time from nothing to the first batch and the process's resident memory, for a cold cache (the file is indexed, or,
before, copied into shards) and a warm one (a cache hit), and what the cache holds.

Each measurement runs in a fresh process whose code is this checkout or, with --old, another (e.g. the code before
the change, unpacked with `git archive COMMIT scaletrain | tar -x -C /tmp/old`). The file stays in the page cache
between runs, so the times are of the code, not of the disk.

    python benchmarks/data_in_place.py [--gb 4] [--old /tmp/old] [--keep DIR]
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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# Run in a child, with only the public data API that the old code has too.
CHILD = r"""
import json, os, resource, sys, time
import scaletrain
from scaletrain.config import DataConfig, SourceConfig
from scaletrain.data import ByteTokenizer
from scaletrain.data.loader import build_loader

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

path, cache = sys.argv[1:]
cfg = DataConfig(sources=[SourceConfig(path=path, format="tokens", dtype="uint16")], cache_dir=cache, seq_len=2048)
before = rss()
t0 = time.perf_counter()
loader = build_loader(cfg, ByteTokenizer(), 64, 0, 1, seed=0, log=lambda s: None)
loader.next_batch()
first = time.perf_counter() - t0
for _ in range(49):
    loader.next_batch()
print(json.dumps({
    "code": os.path.dirname(os.path.dirname(scaletrain.__file__)),
    "first_batch_s": first,
    "rss_after_50_batches_mib": (rss() - before) / 2**20,
    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "baseline_rss_mib": before / 2**20,
}))
"""


def generate(path: Path, gb: float) -> None:
    """Byte-tokenizer ids (0..256, an end-of-document id every ~500 tokens), written 64 MiB at a time."""
    n = int(gb * 1e9) // 2
    rng = np.random.default_rng(0)
    chunk = 1 << 25
    with open(path, "wb") as f:
        for start in range(0, n, chunk):
            ids = rng.integers(0, 256, min(chunk, n - start), dtype=np.uint16)
            ids[::500] = 256
            ids.tofile(f)


def measure(code: Path, token_file: Path, cache: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(token_file), str(cache)], env=env, cwd=code, check=True,
        capture_output=True, text=True,
    ).stdout  # fmt: skip
    result = json.loads(out.strip().splitlines()[-1])
    if Path(result["code"]).resolve() != code.resolve():
        raise RuntimeError(f"the child imported scaletrain from {result['code']}, not {code}")
    result["cache_mib"] = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()) / 2**20
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=4.0, help="size of the generated token file")
    ap.add_argument("--old", type=Path, help="a directory holding another scaletrain/ to compare with")
    ap.add_argument(
        "--keep", type=Path, help="where to write (and keep) the token file; default a temporary one"
    )
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="data_in_place-"))
    work.mkdir(parents=True, exist_ok=True)
    token_file = work / "tokens.bin"
    if not token_file.is_file() or token_file.stat().st_size != int(args.gb * 1e9) // 2 * 2:
        generate(token_file, args.gb)
    print(f"token file: {token_file} ({token_file.stat().st_size / 1e9:.2f} GB)")
    codes = {"before": args.old, "after": ROOT} if args.old else {"after": ROOT}
    try:
        for name, code in codes.items():
            cache = work / f"cache-{name}"
            shutil.rmtree(cache, ignore_errors=True)
            for state in ("cold cache", "warm cache"):
                r = measure(code, token_file, cache)
                print(
                    f"{name:6s} {state}: first batch {r['first_batch_s']:6.2f} s, resident memory +"
                    f"{r['rss_after_50_batches_mib']:6.0f} MiB after 50 batches (peak {r['peak_rss_mib']:.0f} MiB, "
                    f"of which {r['baseline_rss_mib']:.0f} before opening), cache holds {r['cache_mib']:.1f} MiB"
                )
            shutil.rmtree(cache, ignore_errors=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
