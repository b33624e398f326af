"""`scaletrain train | prepare-data | parity | convert`: parse the command, load and validate the config, then run
it here or hand it to the launcher (scaletrain.launch), which this module calls and which never calls back.

Bad input ends here as one plain message and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scaletrain.config import Config
from scaletrain.config_io import all_keys, help_text, load_config
from scaletrain.convert import from_hf, to_hf
from scaletrain.data import load_tokenizer, prepare_data
from scaletrain.data.sources import Skipped, embedded_corpus_files, list_files, read_documents
from scaletrain.data.tokenizer import train_bpe
from scaletrain.errors import CONFIG_EXIT_CODE, ConfigError, report_errors
from scaletrain.launch import install_stack_dump, launch_local, run_training, under_torchrun
from scaletrain.parity import run_parity

USAGE = """\
scaletrain train        --config FILE [--nproc N] [--max-restarts R] [--section.key VALUE ...]
scaletrain prepare-data --config FILE [--train-tokenizer --vocab-size N [--tokenizer-out PATH]] [--section.key VALUE ...]
scaletrain convert      --to hf RUN_OR_CHECKPOINT OUT_DIR  |  --from hf HF_DIR [--out config.toml]
scaletrain parity       --config FILE --layouts "tp=2" "pp=2,pp_schedule=1f1b" ... [--steps 10] [--rtol 1e-5] [--atol 2e-5] [--section.key VALUE ...]
"""
KEYS_HELP = "Any config key can be overridden as --section.key VALUE or --section.key=VALUE. Keys:\n"


class _Parser(argparse.ArgumentParser):
    """No prefix matching (`--step` is not `--steps`), and, for a command that takes config overrides, a help
    that ends with every config key (built only when help is asked for: it reads the dataclasses' source)."""

    def __init__(self, *args: Any, overrides: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)
        self.overrides = overrides
        self.commands: dict[str, _Parser] = {}

    def flags(self) -> list[str]:
        """Its long options, for a message that lists them (argparse keeps them in `_actions` only)."""
        return sorted(
            {s for a in self._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
        )

    def format_help(self) -> str:
        text = super().format_help()
        return text + "\n" + KEYS_HELP + help_text(Config) if self.overrides else text


def build_parser() -> _Parser:
    """One sub-parser per command, each with only its own flags; config overrides are what parse_known_args
    leaves over, checked by _overrides_only."""
    root = _Parser(prog="scaletrain", usage=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = root.add_subparsers(
        prog="scaletrain", dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )
    train = commands.add_parser("train", help="train a model (--nproc N: N local workers)")
    train.add_argument("--config", help="TOML config file (configs/debug.toml runs in seconds on a CPU)")
    train.add_argument(
        "--nproc", type=int, default=1, help="local worker processes (torchrun's elastic agent)"
    )
    train.add_argument("--max-restarts", type=int, help="same as --resilience.max_restarts")
    train.set_defaults(run=_train)

    prep = commands.add_parser("prepare-data", help="tokenise the data into cached shards; train a tokenizer")
    prep.add_argument("--config")
    prep.add_argument("--train-tokenizer", action="store_true", help="train a byte-level BPE tokenizer first")
    prep.add_argument("--vocab-size", type=int, default=0, help="its vocabulary (> 256)")
    prep.add_argument(
        "--tokenizer-out", default="tokenizer.json", help="where it is written (never overwritten)"
    )
    prep.set_defaults(run=_prepare_data)

    parity = commands.add_parser("parity", help="compare parallel layouts with the single-process run")
    parity.add_argument("--config")
    parity.add_argument("--layouts", nargs="+", required=True, help='e.g. "tp=2" "pp=2,pp_schedule=gpipe"')
    parity.add_argument("--steps", type=int, default=10, help="steps of each run")
    parity.add_argument(
        "--rtol",
        type=float,
        default=1e-5,
        help="largest relative difference of losses and grad norms accepted",
    )
    parity.add_argument(
        "--atol", type=float, default=2e-5, help="largest absolute difference of final parameters accepted"
    )
    parity.set_defaults(run=_parity)

    convert = commands.add_parser("convert", overrides=False, help="checkpoint to/from Hugging Face Llama")
    direction = convert.add_mutually_exclusive_group(required=True)
    direction.add_argument("--to", choices=["hf"], help="--to hf RUN_OR_CHECKPOINT OUT_DIR")
    direction.add_argument(
        "--from", dest="from_", choices=["hf"], help="--from hf HF_DIR [--out config.toml]"
    )
    convert.add_argument("--out", default="hf_init.toml", help="--from hf: the config file to write")
    convert.add_argument("paths", nargs="*", metavar="PATH")
    convert.set_defaults(run=_convert)
    root.commands = {"train": train, "prepare-data": prep, "parity": parity, "convert": convert}
    return root


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    install_stack_dump()
    parser = build_parser()
    if not argv:
        parser.print_help()
        return 0
    try:
        args, rest = parser.parse_known_args(argv)
    except SystemExit as e:  # --help (0), or a command line argparse refuses (2, its message printed)
        return e.code if isinstance(e.code, int) else CONFIG_EXIT_CODE
    command: Callable[[argparse.Namespace, list[str]], int] = args.run
    return report_errors(lambda: command(args, _overrides_only(parser.commands[args.command], rest)))


def _overrides_only(sub: _Parser, rest: list[str]) -> list[str]:
    """`rest` when it holds only `--section.key VALUE` overrides (load_config checks those); an unknown flag of
    any other form is refused, naming the command's own flags and the config key it may have meant."""
    problems = []
    for i, arg in enumerate(rest):
        if not sub.overrides:
            problems.append(
                f"'{sub.prog}' takes no argument '{arg}' (it takes {', '.join(sub.flags())} and PATHs)"
            )
            break
        if not arg.startswith("--") or len(arg) == 2:
            continue  # an override's value, or a stray word that load_config reports in context
        flag, _, value = arg.partition("=")
        if "." in flag:
            continue
        value = value or (rest[i + 1] if i + 1 < len(rest) and not rest[i + 1].startswith("--") else "VALUE")
        problems.append(_unknown_flag(sub, flag, value))
    if problems:
        raise ConfigError(problems)
    return rest


def _unknown_flag(sub: _Parser, flag: str, value: str) -> str:
    name = flag[2:].replace("-", "_")
    keys = all_keys(Config)
    leaves = {k.rsplit(".", 1)[-1]: k for k in reversed(keys)}  # the first key of each leaf name wins
    if (
        name in leaves
    ):  # a config key without its section is the likeliest meaning (--steps: --training.steps)
        hint = f"; did you mean --{leaves[name]} {value}?"
    elif near := difflib.get_close_matches(flag, sub.flags(), n=1):
        hint = f"; did you mean {near[0]}?"
    elif near := difflib.get_close_matches(name, list(leaves), n=1):
        hint = f"; did you mean --{leaves[near[0]]} {value}?"
    else:
        hint = ""
    return (
        f"'{sub.prog}' has no option {flag}{hint} (it takes {', '.join(sub.flags())}, and any config key as "
        "--section.key VALUE)"
    )


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.nproc < 1:
        raise ConfigError("--nproc must be >= 1")
    if args.max_restarts is not None:
        overrides = [*overrides, "--resilience.max_restarts", str(args.max_restarts)]
    under = under_torchrun()
    world = int(os.environ.get("WORLD_SIZE", "1")) if under else args.nproc
    # Under an outside torchrun only the first attempt's rank 0 checks the run directory: the other ranks and
    # restarted workers find the one their own job made, and that is no conflict. (Workers of launch_local load
    # their config in launch.worker_main.)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    first = os.environ.get("RANK", "0") == "0" and not restarted
    cfg = load_config(args.config, overrides, world_size=world, check_run_dir=first)
    if not under and (args.nproc > 1 or cfg.resilience.max_restarts > 0):
        return launch_local(cfg, args.config, overrides, args.nproc, cfg.resilience.max_restarts)
    run_training(cfg)
    return 0


def _parity(args: argparse.Namespace, overrides: list[str]) -> int:
    results = run_parity(args.config, args.layouts, args.steps, overrides, args.rtol, args.atol)
    return 0 if all(r.ok for r in results) else 1


def _convert(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.to == "hf" and len(args.paths) == 2:
        print(to_hf(Path(args.paths[0]), Path(args.paths[1])))
        return 0
    if args.from_ == "hf" and len(args.paths) == 1:
        print(from_hf(Path(args.paths[0]), Path(args.out)))
        return 0
    raise ConfigError(
        "usage: scaletrain convert --to hf RUN_OR_CHECKPOINT OUT_DIR, or "
        "scaletrain convert --from hf HF_DIR [--out config.toml]"
    )


def _prepare_data(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.train_tokenizer:
        if args.vocab_size < 257:
            raise ConfigError("--train-tokenizer needs --vocab-size N with N > 256 (the byte alphabet)")
        cfg = load_config(args.config, [*overrides, "--data.tokenizer", "byte"])
        out = Path(args.tokenizer_out)
        srcs = cfg.data.sources
        files = (
            [(f, s.format, s.field) for i, s in enumerate(srcs) for f in list_files(s, i)]
            if srcs
            else [(f, "text", "text") for f in embedded_corpus_files()]
        )
        skipped = Skipped()  # not UTF-8 text: left out with a warning, as prepare_data does
        texts = (doc for f, fmt, field in files for doc in read_documents(f, fmt, field, skipped=skipped))
        tokenizer = train_bpe(texts, args.vocab_size, out)
        if skipped:
            print(f"warning: the tokenizer's training text left out {skipped.describe()}", file=sys.stderr)
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
