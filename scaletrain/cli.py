"""`scaletrain train | prepare-data | parity | convert | generate | eval`: parse the command, load and validate
the config, then run it here or hand it to the launcher (scaletrain.launch), which this module calls and which
never calls back.

Bad input ends here as one plain message and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from scaletrain import __version__
from scaletrain.checkpoint.convert import from_hf, parse_size, to_hf, to_quantized
from scaletrain.checkpoint.hf.files import EXPORT_DTYPES
from scaletrain.checkpoint.run_model import read_data_position
from scaletrain.compare.bench import results_json, run_bench
from scaletrain.compare.parity import ATOL, RTOL, run_parity
from scaletrain.config import Config, MetricsConfig
from scaletrain.config.io import all_keys, help_text, to_dict
from scaletrain.data import load_tokenizer, prepare_data
from scaletrain.data.sources import Skipped, embedded_corpus_files, list_files, read_documents
from scaletrain.data.streaming import describe_position
from scaletrain.data.tokenizer import train_bpe
from scaletrain.errors import CONFIG_EXIT_CODE, ConfigError, report_errors
from scaletrain.hardware import gpu_count, uses_cuda
from scaletrain.inference.evaluate import evaluate_text
from scaletrain.inference.generate import (
    SAMPLE_TOKENS,
    check_sampling,
    generate_text,
    generation_report,
    record_samples,
)
from scaletrain.inference.loader import load_model
from scaletrain.launch import install_stack_dump, launch_local, run_training, under_torchrun
from scaletrain.planning.calibrate import run_calibrate
from scaletrain.planning.commands import auto_overrides, dry_run, run_plan
from scaletrain.precision.qat import WEIGHT_DTYPES
from scaletrain.resilience.membership import restart_count
from scaletrain.resilience.preemption import follow_agent
from scaletrain.run.directory import RunDir, continue_command, default_run_dir, find_run, shown
from scaletrain.validate import load_config

USAGE = """\
scaletrain train        --config FILE [--nproc N] [--max-restarts R] [--dry-run] [--section.key VALUE ...]
scaletrain prepare-data --config FILE [--train-tokenizer --vocab-size N [--tokenizer-out PATH]] [--section.key VALUE ...]
scaletrain convert      --to hf RUN_OR_CHECKPOINT OUT_DIR [--dtype fp32|bf16] [--max-shard-size 5GB]  |  --from hf HF_DIR [--out config.toml]  |  --quantize int8_int4|int8_int8 RUN_OR_CHECKPOINT OUT_DIR
scaletrain parity       --config FILE --layouts "tp=2" "pp=2,pp_schedule=1f1b" ... [--steps 10] [--rtol 1e-5] [--atol 2e-5] [--section.key VALUE ...]
scaletrain generate     RUN_DIR|HF_DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K] [--seed S] [--tokenizer T] [--device D] [--json]
scaletrain eval         RUN_DIR|HF_DIR --data FILE_OR_GLOB [--field F] [--seq-len S] [--tokenizer T] [--batch B] [--max-windows N] [--device D] [--json]
scaletrain report       RUN_DIR [RUN_DIR ...] [--out DIR]
scaletrain data-position RUN_DIR|CHECKPOINT [--json]
scaletrain bench        --config FILE --variants "precision.compute=bf16" "parallel.grad_compression=powersgd" ... [--nproc N] [--steps 20] [--rounds 3] [--json FILE] [--section.key VALUE ...]
scaletrain plan         --model PRESET --devices N --device h100|h200|a100|b200|cpu [--gpus-per-node 8] --seq-len S --global-batch-tokens T [--top K] [--json]  |  --config FILE --nproc N [--device KIND] [--json] [--section.key VALUE ...]  |  --calibrate [--nproc N]
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
    root.add_argument("--version", action="version", version=version_line())
    commands = root.add_subparsers(
        prog="scaletrain", dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )
    train = commands.add_parser("train", help="train a model (--nproc N: N local workers)")
    train.add_argument("--config", help="TOML config file (configs/debug.toml runs in seconds on a CPU)")
    train.add_argument(
        "--nproc", type=int, default=1, help="local worker processes (torchrun's elastic agent)"
    )
    train.add_argument("--max-restarts", type=int, help="same as --resilience.max_restarts")
    train.add_argument(
        "--dry-run", action="store_true", help="validate, print the mesh, batch and estimate; start nothing"
    )
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
        default=RTOL,
        help="largest relative difference of losses and grad norms accepted",
    )
    parity.add_argument(
        "--atol", type=float, default=ATOL, help="largest absolute difference of final parameters accepted"
    )
    parity.set_defaults(run=_parity)

    convert = commands.add_parser(
        "convert",
        overrides=False,
        help="checkpoint to/from Hugging Face (the families of docs/models.md), or quantised",
    )
    direction = convert.add_mutually_exclusive_group(required=True)
    direction.add_argument("--to", choices=["hf"], help="--to hf RUN_OR_CHECKPOINT OUT_DIR")
    direction.add_argument(
        "--from", dest="from_", choices=["hf"], help="--from hf HF_DIR [--out config.toml]"
    )
    direction.add_argument(
        "--quantize", choices=list(WEIGHT_DTYPES), help="--quantize SCHEME RUN_OR_CHECKPOINT OUT_DIR"
    )
    convert.add_argument("--out", default="hf_init.toml", help="--from hf: the config file to write")
    convert.add_argument(
        "--dtype", choices=list(EXPORT_DTYPES), default="fp32", help="--to hf: the weights' dtype"
    )
    convert.add_argument(
        "--max-shard-size", default="5GB", help="--to hf: the largest safetensors file (e.g. 5GB, 500MB)"
    )
    convert.add_argument("paths", nargs="*", metavar="PATH")
    convert.set_defaults(run=_convert)
    root.commands = {"train": train, "prepare-data": prep, "parity": parity, "convert": convert}
    root.commands.update(_add_inference_commands(commands))
    root.commands["report"] = _add_report_command(commands)
    root.commands["data-position"] = _add_data_position_command(commands)
    root.commands["plan"] = _add_plan_command(commands)
    root.commands["bench"] = _add_bench_command(commands)
    return root


def version_line() -> str:
    """`scaletrain --version`: the package's version and torch's (the one a bug report needs beside it)."""
    return f"scaletrain {__version__} (torch {torch.__version__}, Python {platform.python_version()})"


def _entered(path: str) -> Path:
    """A path as the user typed it, resolved against the working directory as it enters (~ expanded): every
    later step and message names the same place."""
    return Path(path).expanduser().absolute()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    install_stack_dump()
    follow_agent()  # a worker of the user's own torchrun ends with its agent
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
    typed = ["train", *(["--config", args.config] if args.config else [])]
    typed += [
        *(["--nproc", str(args.nproc)] if args.nproc > 1 else []),
        *_flag("--max-restarts", args.max_restarts),
    ]
    typed += overrides  # the command as typed, for the line that says how to continue
    if args.max_restarts is not None:
        overrides = [*overrides, "--resilience.max_restarts", str(args.max_restarts)]
    under = under_torchrun()
    world = int(os.environ.get("WORLD_SIZE", "1")) if under else args.nproc
    # Under an outside torchrun only the first attempt's rank 0 checks the run directory: the other ranks and
    # restarted workers find the one their own job made, and that is no conflict. (Workers of launch_local load
    # their config in launch.worker_main.)
    restarted = restart_count() > 0
    first = os.environ.get("RANK", "0") == "0" and not restarted
    overrides = auto_overrides(args.config, overrides, world)  # parallel.auto: the planner's layout
    cfg = load_config(args.config, overrides, world_size=world, check_run_dir=first)
    # Local CUDA workers take one GPU each (local rank -> cuda:local_rank): more workers than GPUs would fail in
    # each worker's set_device, or share a GPU, which NCCL refuses; say so once, before anything starts.
    if not under and uses_cuda(cfg.training.device) and args.nproc > (gpus := gpu_count()):
        raise ConfigError(f"--nproc {args.nproc} asks for more CUDA workers than the {gpus} GPU(s) this machine "
                          f"has: give --nproc {gpus} or fewer (one worker per GPU)")  # fmt: skip
    if args.dry_run:
        print(dry_run(cfg, world))
        return 0
    # No --run.dir: the run this same command trained before, else a new directory (scaletrain.run.directory), loaded
    # again so that every check sees it. Under an outside torchrun every rank finds the same earlier run, and a new
    # directory is rank 0's to make (job.build).
    run = None if cfg.run.dir else (find_run if under else default_run_dir)(cfg.run.name, to_dict(cfg))
    if run is not None:
        try:
            cfg = load_config(
                args.config, [*overrides, "--run.dir", str(run.path)], world, check_run_dir=first
            )
        except ConfigError:
            if not any(run.path.iterdir()):
                run.path.rmdir()  # made just now for this start: nothing to keep
            raise
        overrides = [*overrides, "--run.dir", str(run.path)]
    run = RunDir.at(cfg.run.dir) if cfg.run.dir else None
    is_main = os.environ.get("RANK", "0") == "0"
    if run is not None and cfg.data.when_dry == "stop" and (dry := run.ran_dry()) is not None:
        if is_main:
            print(f"{shown(run.path)} ended at step {dry['step']}: {dry['source']} ({dry['path']}) has been read to its "
                  "end and data.when_dry = 'stop': nothing left to read, nothing changed. To read it again in a new "
                  "order, run again with --data.when_dry repeat --run.accept_changes data.when_dry")  # fmt: skip
        return 0
    if run is not None and (done := run.finished(cfg.training.steps)) is not None:
        if is_main:
            print(f"{shown(run.path)} finished at step {done} of {cfg.training.steps}: nothing to train, nothing "
                  f"changed. Sample it: scaletrain generate {shown(run.path)} --prompt TEXT; to train it further, "
                  "raise --training.steps and add --run.accept_changes training.steps; for a new run, give a new "
                  "--run.dir")  # fmt: skip
        return 0
    code = 1
    try:
        if not under and (args.nproc > 1 or cfg.resilience.max_restarts > 0):
            code = launch_local(cfg, args.config, overrides, args.nproc, cfg.resilience.max_restarts)
        else:
            code = run_training(cfg)  # STOPPED_EXIT_CODE when stopped early
    finally:
        ended = run is not None and (
            run.finished(cfg.training.steps) is not None or run.ran_dry() is not None
        )
        if run is not None and is_main and run.started() and not ended:
            print(f"to continue this run: {continue_command(typed, run.path)}", file=sys.stderr)
    if code == 0 and cfg.metrics.sample_prompt and is_main and run is not None:
        print("\n".join(record_samples(run, cfg.metrics)))
    if code == 0 and cfg.metrics.report and is_main and run is not None:
        _report_after_training(run.path)
    return code


def _flag(name: str, value: object) -> list[str]:
    return [] if value is None else [name, str(value)]


def _add_report_command(commands: argparse._SubParsersAction) -> _Parser:
    report = commands.add_parser("report", overrides=False, help="plots and an HTML page of runs")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (several: overlaid)")
    report.add_argument("--out", help="where index.html and the PNGs go (default: <first RUN_DIR>/report)")
    report.set_defaults(run=_report)
    return report


def _add_plan_command(commands: argparse._SubParsersAction) -> _Parser:
    plan = commands.add_parser("plan", help="predict memory and step time; search the best layout")
    plan.add_argument("--model", help="search the layouts of this preset (else: --config's own layout)")
    plan.add_argument("--devices", type=int, help="devices to plan for (the search)")
    plan.add_argument("--device", help="h100, h200, a100, b200 or cpu (the calibrated profile if any)")
    plan.add_argument("--gpus-per-node", type=int, default=8, help="devices per node (tp stays inside one)")
    plan.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence (the search)")
    plan.add_argument(
        "--global-batch-tokens", type=int, default=0, help="tokens per step (0: seq-len x devices)"
    )
    plan.add_argument("--top", type=int, default=10, help="plans to show")
    plan.add_argument("--json", action="store_true", help="print JSON")
    plan.add_argument("--config", help="--config FILE: estimate that config's layout")
    plan.add_argument("--nproc", type=int, default=1, help="world size of --config; ranks of --calibrate")
    plan.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine and save its profile: its GPUs where it has them (--device cpu: its cores)",
    )
    plan.set_defaults(run=_plan)
    return plan


def _add_bench_command(commands: argparse._SubParsersAction) -> _Parser:
    bench = commands.add_parser(
        "bench", help="time config switches beside the plain config, alternating rounds"
    )
    bench.add_argument("--config")
    bench.add_argument(
        "--variants", nargs="+", required=True, help='e.g. "precision.compute=bf16" "a.b=1,c.d=2"'
    )
    bench.add_argument("--nproc", type=int, default=1, help="local worker processes of every run")
    bench.add_argument("--steps", type=int, default=20, help="steps of each run")
    bench.add_argument("--rounds", type=int, default=3, help="rounds of (plain, variant 1, variant 2, ...)")
    bench.add_argument("--json", help="also write the results to this file")
    bench.set_defaults(run=_bench)
    return bench


def _bench(args: argparse.Namespace, overrides: list[str]) -> int:
    kw = dict(nproc=args.nproc, steps=args.steps, rounds=args.rounds)
    results = run_bench(args.config, args.variants, overrides, **kw)
    if args.json:
        Path(args.json).write_text(results_json(results))
    return 0 if all(not r.error for r in results) else 1


def _plan(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.calibrate:
        return run_calibrate(args.config, overrides, args.device, args.nproc)
    return run_plan(
        config=args.config, overrides=overrides, model=args.model, devices=args.devices, device=args.device,
        gpus_per_node=args.gpus_per_node, seq_len=args.seq_len, global_batch_tokens=args.global_batch_tokens,
        top=args.top, as_json=args.json, nproc=args.nproc,
    )  # fmt: skip


def _write_report(runs: list[Path], out: Path | None = None) -> Path:
    # Here, not at the top: the report's matplotlib is 0.3 s of every command's start-up (measured with -X importtime),
    # and only `report` and a training run with metrics.report draw one.
    from scaletrain.report import write_report

    return write_report(runs, out)


def _report(args: argparse.Namespace, overrides: list[str]) -> int:
    page = _write_report([Path(p) for p in args.runs], Path(args.out) if args.out else None)
    print(f"report: {page}")
    return 0


def _add_data_position_command(commands: argparse._SubParsersAction) -> _Parser:
    position = commands.add_parser(
        "data-position", overrides=False, help="where a run's data loader stands: read and left, per source"
    )
    position.add_argument(
        "path", metavar="RUN_DIR", help="a run directory (its newest intact checkpoint) or a checkpoint"
    )
    position.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    position.set_defaults(run=_data_position)
    return position


def _data_position(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg, state, ckpt = read_data_position(_entered(args.path))
    if not cfg.data.streaming:
        summary = {"checkpoint": ckpt, "next_sample": int(state["next_sample"]), "sources": []}
    else:
        summary = {"checkpoint": ckpt, "next_sample": int(state["next_sample"]),
                   "sources": describe_position(cfg.data, state)}  # fmt: skip
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"{ckpt}: next sample {summary['next_sample']:,} of the mixed stream")
    if not cfg.data.streaming:
        print("prepared shards (data.streaming off): the mixture is a function of the sample index alone")
    for s in summary["sources"]:
        print(f"{s['source']} ({s['path']}): epoch {s['epoch']}, shard {s['shard']} of {s['shards']} "
              f"({s['current']}) at token {s['token_offset']:,}, shuffle seed {s['seed']}; "
              f"{s['samples']:,} samples ({s['tokens_trained']:,} tokens) trained; "
              f"{s['shards_left']} shard(s), {s['mib_left']:,} MiB left in this epoch")  # fmt: skip
    return 0


def _report_after_training(run_dir: Path) -> None:
    """metrics.report: the run's report, printed last. A report that cannot be drawn is a warning: the trained
    run and its checkpoint stand, and its exit status stays the training's."""
    try:
        print(f"report: {_write_report([run_dir])}")
    except Exception as e:
        print(f"warning: no report ({e}); try again with: scaletrain report {run_dir}", file=sys.stderr)


def _parity(args: argparse.Namespace, overrides: list[str]) -> int:
    results = run_parity(args.config, args.layouts, args.steps, overrides, args.rtol, args.atol)
    return 0 if all(r.ok for r in results) else 1


def _convert(args: argparse.Namespace, overrides: list[str]) -> int:
    paths = [_entered(p) for p in args.paths]
    if args.to == "hf" and len(paths) == 2:
        print(to_hf(*paths, args.dtype, parse_size(args.max_shard_size)))
        return 0
    if args.from_ == "hf" and len(paths) == 1:
        print(from_hf(paths[0], _entered(args.out)))
        return 0
    if args.quantize and len(paths) == 2:
        print(to_quantized(*paths, args.quantize))
        return 0
    raise ConfigError(
        "usage: scaletrain convert --to hf RUN_OR_CHECKPOINT OUT_DIR, or "
        "scaletrain convert --from hf HF_DIR [--out config.toml], or "
        f"scaletrain convert --quantize {{{','.join(WEIGHT_DTYPES)}}} RUN_OR_CHECKPOINT OUT_DIR"
    )


def _add_inference_commands(commands: argparse._SubParsersAction) -> dict[str, _Parser]:
    """`generate` and `eval`: one process, on a run's newest checkpoint or a Hugging Face directory."""
    gen = commands.add_parser("generate", overrides=False, help="sample from a run's checkpoint or an HF dir")
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument(
        "--max-new-tokens", type=int, default=SAMPLE_TOKENS, help="at most this many new tokens (%(default)s)"
    )
    # The sampling defaults are the train samples' (metrics.sample_*): one choice, made in the config.
    temperature, top_k = MetricsConfig.sample_temperature, MetricsConfig.sample_top_k
    gen.add_argument(
        "--temperature", type=float, default=temperature, help="softmax temperature (%(default)s); 0: greedy"
    )
    gen.add_argument(
        "--top-k", type=int, default=top_k, help="sample among the k likeliest tokens (%(default)s); 0: all"
    )
    gen.add_argument("--seed", type=int, default=0, help="the same seed gives the same tokens (%(default)s)")
    gen.set_defaults(run=_generate)
    ev = commands.add_parser("eval", overrides=False, help="loss and perplexity over text")
    ev.add_argument("--data", required=True, help="a text, jsonl or parquet file, a directory or a glob")
    ev.add_argument("--seq-len", type=int, default=0, help="tokens per window; 0: the model's context")
    ev.add_argument("--field", default="text", help="the jsonl key or parquet column that holds the text")
    ev.add_argument("--batch", type=int, default=8, help="windows per forward")
    ev.add_argument("--max-windows", type=int, default=0, help="only the first N windows; 0: all")
    ev.set_defaults(run=_eval)
    for p in (gen, ev):
        p.add_argument("path", metavar="RUN_DIR|HF_DIR", help="a run (its newest checkpoint) or an HF dir")
        p.add_argument("--tokenizer", help="'byte' or a tokenizer.json; default: the run's or HF_DIR's")
        p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu", help="auto: CUDA if any")
        p.add_argument("--json", action="store_true", help="print one JSON object")
    return {"generate": gen, "eval": ev}


def _generate(args: argparse.Namespace, overrides: list[str]) -> int:
    check_sampling(args.max_new_tokens, args.temperature, args.top_k)  # before the model is loaded
    loaded = load_model(_entered(args.path), _tokenizer(args.tokenizer), args.device)
    ids, result, text = generate_text(
        loaded, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed
    )
    print(generation_report(args.prompt, ids, result, text, args.json))
    if result.stop == "context":
        print(f"note: stopped at the model's context of {loaded.args.max_seq_len} tokens", file=sys.stderr)
    return 0


def _eval(args: argparse.Namespace, overrides: list[str]) -> int:
    loaded = load_model(_entered(args.path), _tokenizer(args.tokenizer), args.device)
    data = str(_entered(args.data))  # a glob stays a glob
    result = evaluate_text(loaded, data, args.seq_len, args.batch, args.max_windows, args.field)
    print(result.render(args.json))
    return 0


def _tokenizer(flag: str | None) -> str | None:
    """--tokenizer: 'byte', or a tokenizer.json's path resolved as it enters."""
    return flag if flag in (None, "byte") else str(_entered(flag))


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
        data = dataclasses.replace(cfg.data, tokenizer=str(out))  # the loaded config stays as loaded
    else:
        data = load_config(args.config, overrides).data
        tokenizer = load_tokenizer(data.tokenizer)
    if data.streaming:
        print("data.streaming: the sources are read and tokenised while training runs; nothing to prepare")
        return 0
    for path, weight in prepare_data(data, tokenizer):
        print(f"prepared {path} (weight {weight})")
    return 0
