"""`scaletrain train | prepare-data`: parse the command, load and validate the config, run or launch workers.

Bad input ends here as one plain message and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import signal
import sys
import time
import traceback
from datetime import datetime
from pathlib import Path

from scaletrain.config import Config
from scaletrain.errors import ConfigError, UserError

USAGE = """\
scaletrain train        --config FILE [--nproc N] [--max-restarts R] [--section.key VALUE ...]
scaletrain prepare-data --config FILE [--train-tokenizer --vocab-size N [--tokenizer-out PATH]] [--section.key VALUE ...]
scaletrain convert      --to hf RUN_OR_CHECKPOINT OUT_DIR  |  --from hf HF_DIR [--out config.toml]
scaletrain parity       --config FILE --layouts "tp=2" "pp=2,pp_schedule=1f1b" ... [--steps 10] [--rtol 1e-5]

Any config key can be overridden as --section.key VALUE or --section.key=VALUE. Keys:
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # `kill -USR1 <pid>` prints every thread's stack to stderr and carries on: how a stuck run is looked into.
    with contextlib.suppress(
        AttributeError, OSError, ValueError
    ):  # stderr without a descriptor (embedded, tests)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    parser = _parser()
    if not argv or argv[0] in ("-h", "--help") or (len(argv) > 1 and argv[1] in ("-h", "--help")):
        from scaletrain.config_io import help_text

        print(USAGE + help_text(Config))
        return 0
    args, overrides = parser.parse_known_args(argv)
    try:
        if args.command == "train":
            return _train(args, overrides)
        if args.command == "parity":
            return _parity(args, overrides)
        if args.command == "convert":
            return _convert(args, overrides)
        return _prepare_data(args, overrides)
    except ConfigError as e:
        print(f"error: {e.render()}", file=sys.stderr)
        return 2
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "\ninterrupted (Ctrl-C); everything written so far is kept in the run directory", file=sys.stderr
        )
        return 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scaletrain", add_help=False)
    p.add_argument("command", choices=["train", "prepare-data", "parity", "convert"])
    p.add_argument("--config", default=None)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--max-restarts", type=int, default=None)
    p.add_argument("--train-tokenizer", action="store_true")
    p.add_argument("--vocab-size", type=int, default=0)
    p.add_argument("--tokenizer-out", default="tokenizer.json")
    p.add_argument("--layouts", nargs="+", default=[])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--to", choices=["hf"], default=None)
    p.add_argument("--from", dest="from_", choices=["hf"], default=None)
    p.add_argument("--out", default="hf_init.toml")
    return p


def _convert(args: argparse.Namespace, rest: list[str]) -> int:
    from scaletrain.convert import from_hf, to_hf

    if args.to == "hf" and len(rest) == 2:
        print(to_hf(Path(rest[0]), Path(rest[1])))
        return 0
    if args.from_ == "hf" and len(rest) == 1:
        print(from_hf(Path(rest[0]), Path(args.out)))
        return 0
    raise ConfigError(
        "usage: scaletrain convert --to hf RUN_OR_CHECKPOINT OUT_DIR, or "
        "scaletrain convert --from hf HF_DIR [--out config.toml]"
    )


def _parity(args: argparse.Namespace, overrides: list[str]) -> int:
    from scaletrain.parity import run_parity

    if not args.layouts:
        raise ConfigError(
            'parity needs --layouts, e.g. --layouts "dp_shard=2" "tp=2" "pp=2,pp_schedule=gpipe"'
        )
    results = run_parity(args.config, args.layouts, args.steps, overrides, args.rtol)
    return 0 if all(r.ok for r in results) else 1


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from scaletrain.config import load_config

    if args.nproc < 1:
        raise ConfigError("--nproc must be >= 1")
    if args.max_restarts is not None:
        overrides = overrides + ["--resilience.max_restarts", str(args.max_restarts)]
    under = _under_torchrun()
    world = int(os.environ.get("WORLD_SIZE", "1")) if under else args.nproc
    # Workers of our launcher (which checked the run directory), restarted workers and ranks other than 0 find the
    # run directory their own job made: that is no conflict.
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    first = os.environ.get("RANK", "0") == "0" and not restarted and "SCALETRAIN_ATTEMPT" not in os.environ
    cfg = load_config(args.config, overrides, world_size=world, check_run_dir=first)
    launching = not under and (args.nproc > 1 or cfg.resilience.max_restarts > 0)
    if launching:
        from scaletrain.launch import launch_local

        return launch_local(cfg, args.config, overrides, args.nproc, cfg.resilience.max_restarts)
    from scaletrain.train import train

    try:
        train(cfg)
    except (UserError, KeyboardInterrupt):
        raise
    except BaseException:
        # A crashed worker must exit now: a background checkpoint upload blocked on a dead peer would otherwise
        # hold the process (and its agent's restart) until the collective timeout.
        text = traceback.format_exc()
        sys.stderr.write(text)
        sys.stderr.flush()
        _linger_if_a_peer_failed(text)
        os._exit(1)
    return 0


LINGER_S = 3.0  # many times the agent's monitor interval (0.1 s)


def _linger_if_a_peer_failed(error: str) -> None:
    """A rank whose collective broke because a peer died waits before exiting, so that the agent, which reports
    the first worker it finds dead, finds the peer that failed (killed, out of memory) rather than this one. The
    agent ends the wait at once: it stops the other workers with SIGTERM as soon as it sees a failure."""
    from scaletrain.resilience.diagnose import classify

    if _under_torchrun() and classify(1, None, error).kind == "collective_timeout":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the preemption handler: the agent's stop ends us
        time.sleep(LINGER_S)


def default_run_dir(cfg: Config) -> str:
    return f"runs/{cfg.run.name or 'run'}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def _prepare_data(args: argparse.Namespace, overrides: list[str]) -> int:
    from scaletrain.config import load_config
    from scaletrain.data import load_tokenizer, prepare_data
    from scaletrain.data.sources import embedded_corpus_files, list_files, read_documents
    from scaletrain.data.tokenizer import train_bpe

    if args.train_tokenizer:
        if args.vocab_size < 257:
            raise ConfigError("--train-tokenizer needs --vocab-size N with N > 256 (the byte alphabet)")
        cfg = load_config(args.config, overrides + ["--data.tokenizer", "byte"])
        out = Path(args.tokenizer_out)
        srcs = cfg.data.sources
        files = (
            [(f, s.format, s.field) for i, s in enumerate(srcs) for f in list_files(s, i)]
            if srcs
            else [(f, "text", "text") for f in embedded_corpus_files()]
        )
        texts = (doc for f, fmt, field in files for doc in read_documents(f, fmt, field))
        tokenizer = train_bpe(texts, args.vocab_size, out)
        print(
            f"tokenizer with {tokenizer.vocab_size} tokens written to {out}; train with --data.tokenizer {out}"
        )
        cfg.data.tokenizer = str(out)
    else:
        cfg = load_config(args.config, overrides)
        tokenizer = load_tokenizer(cfg.data.tokenizer)
    for path, weight in prepare_data(cfg.data, tokenizer):
        print(f"prepared {path} (weight {weight})")
    return 0
