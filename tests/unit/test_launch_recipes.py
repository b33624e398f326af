"""The launch recipes use only flags that exist: every torchrun flag of examples/slurm/train.sbatch,
examples/kubernetes/pytorchjob.yaml and the commands of docs/launching.md is checked against torchrun's own
argument parser, and every scaletrain command against the CLI's parser and the config keys (its overrides then
load as a config: known keys, values of the right types and choices, a valid time limit)."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest
import yaml
from torch.distributed.run import get_args_parser

from scaletrain.cli import _overrides_only, build_parser
from scaletrain.config import Config
from scaletrain.config.io import all_keys, parse_overrides, read_toml, to_dataclass
from scaletrain.errors import STOPPED_EXIT_CODE, ConfigError
from scaletrain.resilience.timelimit import limit_problems

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
PYTORCHJOB = ROOT / "examples" / "kubernetes" / "pytorchjob.yaml"
LAUNCHING = ROOT / "docs" / "launching.md"
TORCHRUN_FLAGS = {s for a in get_args_parser()._actions for s in a.option_strings}


class RecipeError(AssertionError):
    pass


def check_command(tokens: list[str]) -> str:
    """Check `torchrun [flags] -m scaletrain COMMAND ...` or `scaletrain COMMAND ...`; return the command."""
    if tokens[0] == "torchrun":
        tokens = _torchrun(tokens[1:])
    elif tokens[0] == "scaletrain":
        tokens = tokens[1:]
    else:
        raise RecipeError(f"not a launch command: {shlex.join(tokens)}")
    parser = build_parser()
    try:
        args, rest = parser.parse_known_args(tokens)
    except SystemExit as e:
        raise RecipeError(f"scaletrain refuses {shlex.join(tokens)}") from e
    try:
        overrides = _overrides_only(parser.commands[args.command], rest)
    except ConfigError as e:
        raise RecipeError(str(e)) from e
    keys = set(all_keys(Config))
    unknown = [a for a in overrides if a.startswith("--") and a[2:].partition("=")[0] not in keys]
    if unknown:
        raise RecipeError(f"no such config key: {unknown}")
    if (
        args.command == "train"
    ):  # the values too: types and choices, the duration (memory fit is the cluster's)
        raw = read_toml(str(ROOT / args.config)) if args.config else {}
        problems = parse_overrides(overrides, raw)
        cfg, type_problems = to_dataclass(Config, raw)
        problems += type_problems or limit_problems(cfg.run, cfg.training.steps, cfg.checkpoint.enabled)
        if problems:
            raise RecipeError("; ".join(problems))
    return args.command


def _torchrun(tokens: list[str]) -> list[str]:
    """torchrun's own flags must be real ones (exactly: argparse would take a prefix); returns scaletrain's part."""
    module = next((i for i, t in enumerate(tokens) if t in ("-m", "--module")), None)
    if module is None or tokens[module + 1] != "scaletrain":
        raise RecipeError(f"torchrun must run the scaletrain module (-m scaletrain): {shlex.join(tokens)}")
    for t in tokens[:module]:
        if t.startswith("-") and t.partition("=")[0] not in TORCHRUN_FLAGS:
            raise RecipeError(f"torchrun has no flag {t.partition('=')[0]}")
    try:
        parsed = get_args_parser().parse_args(tokens)
    except SystemExit as e:
        raise RecipeError(f"torchrun refuses {shlex.join(tokens)}") from e
    assert parsed.training_script == "scaletrain"
    return parsed.training_script_args


def _shell_variables(script: str) -> dict[str, str]:
    """NAME=${NAME:-default} and NAME=value assignments of a script, by their defaults."""
    env = {}
    for name, value in re.findall(r"^(\w+)=(\S+)$", script, re.M):
        m = re.fullmatch(r"\$\{\w+:-(.*)\}", value)
        env[name] = m[1] if m else value
    return env


def _expand(token: str, env: dict[str, str]) -> str:
    """Shell variables by the script's defaults; Slurm's and computed ones by a stand-in ("2", a host name)."""
    stand_in = {"SLURM_NNODES": "2", "HEAD_NODE": "node001", "SLURM_JOB_ID": "1234", "SLURM_JOB_NAME": "st"}
    for _ in range(3):  # defaults that name other variables
        token = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m[1], stand_in.get(m[1], "1")), token)
    return token


def _sbatch_command() -> tuple[list[str], str]:
    script = SBATCH.read_text()
    joined = script.replace("\\\n", " ")
    (line,) = [ln.strip() for ln in joined.splitlines() if ln.strip().startswith("srun ")]
    tokens = shlex.split(line.rstrip("&"))
    env = _shell_variables(script)
    tokens = [_expand(t, env) for t in tokens]
    return tokens[tokens.index("torchrun") :], script


def test_slurm_recipe_uses_real_flags_and_requeues_on_the_stop_code():
    tokens, script = _sbatch_command()
    assert check_command(tokens) == "train"
    torchrun = get_args_parser().parse_args(tokens[1:])
    assert torchrun.nnodes == "2" and re.search(r"#SBATCH --nodes=2$", script, re.M)
    assert torchrun.rdzv_backend == "c10d" and torchrun.rdzv_endpoint.startswith("node001:")
    assert "HEAD_NODE=$(scontrol show hostnames" in script  # the first node of the allocation
    assert "--run.time_limit" in tokens and "SCALETRAIN_JOB_START" in script
    # The requeue: on the documented "stopped early" status, read back by a function that exists.
    assert f'"$status" -eq {STOPPED_EXIT_CODE} ]' in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    module, name = re.search(r"from ([\w.]+) import (\w+)", script).groups()
    assert callable(getattr(importlib.import_module(module), name))
    signal = re.search(r"#SBATCH --signal=B:(\w+)@\d+", script)[1]
    assert re.search(rf"^trap .* {signal}$", script, re.M)


def test_kubernetes_recipe_is_an_elastic_pytorchjob_with_real_flags():
    job = yaml.safe_load(PYTORCHJOB.read_text())
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    elastic = job["spec"]["elasticPolicy"]
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert elastic["rdzvBackend"] == "c10d"
    assert elastic["minReplicas"] <= worker["replicas"] <= elastic["maxReplicas"]
    (container,) = worker["template"]["spec"]["containers"]
    tokens = [*container.get("command", []), *container.get("args", [])]
    assert check_command(tokens) == "train"
    # Environment variables read as torchrun flags (PET_<DEST>) must name real ones too.
    dests = {a.dest.upper() for a in get_args_parser()._actions}
    pet = [e["name"] for e in container.get("env", []) if e["name"].startswith("PET_")]
    assert all(p[4:] in dests for p in pet), pet


def test_every_command_in_docs_launching_is_real():
    text = LAUNCHING.read_text()
    commands = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            while tokens and "=" in tokens[0] and not tokens[0].startswith("-"):
                tokens = tokens[1:]  # VAR=value prefixes
            if tokens and tokens[0] in ("torchrun", "scaletrain"):
                commands.append(check_command([_expand(t, {}) for t in tokens]))
    assert commands.count("train") >= 3


@pytest.mark.parametrize(
    "bad, why",
    [
        ("torchrun --nprocs-per-node 8 -m scaletrain train", "torchrun has no flag --nprocs-per-node"),
        ("torchrun --nproc 8 -m scaletrain train", "torchrun has no flag --nproc"),  # argparse would take it
        ("torchrun train.py", "-m scaletrain"),
        ("scaletrain train --config configs/debug.toml --run.time_limt 1h", "run.time_limt"),
        ("scaletrain train --config configs/debug.toml --steps 5", "has no option --steps"),
        ("scaletrain train --config configs/debug.toml --run.time_limit soon", "run.time_limit 'soon'"),
        ("scaletrain trian", "scaletrain refuses"),
    ],
)
def test_the_checker_refuses_flags_that_do_not_exist(bad, why, capsys):
    with pytest.raises(RecipeError, match=re.escape(why)):
        check_command(shlex.split(bad))


STUBS = {
    # srun: drop its own options, run the rest (one node's torchrun).
    "srun": 'while [[ "$1" == --* ]]; do shift; done; exec "$@"',
    "scontrol": 'if [ "$1" = show ]; then printf "node001\\nnode002\\n"; else echo "$@" >> "$STUB_LOG"; fi',
    # torchrun: what the workers leave in the run directory when they stop early (or fail), and exit.
    "torchrun": 'echo "$@" > "$STUB_ARGS"; dir=$(python -c "import sys; a=sys.argv; print(a[a.index(\'--run.dir\')+1])" "$@")\n'
    'mkdir -p "$dir"; printf \'{"kind": "start"}\\n{"kind": "end", "stopped": "time_limit"}\\n\' > "$dir/events.jsonl"\n'
    'exit "$STUB_STATUS"',
}


@pytest.mark.parametrize("torchrun_status, requeued, status", [(0, True, 0), (1, False, 1)])
def test_slurm_recipe_requeues_a_job_stopped_early_and_not_a_failed_one(
    tmp_path, torchrun_status, requeued, status
):
    """The script itself, run with stand-ins for srun, scontrol and torchrun."""
    import os
    import subprocess
    import sys

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, body in STUBS.items():
        (bin_ / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_ / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_}:{Path(sys.executable).parent}:{os.environ['PATH']}", SLURM_JOB_ID="77",
               SLURM_JOB_NAME="st", SLURM_NNODES="2", SLURM_JOB_NODELIST="node[001-002]", RUN_DIR=str(tmp_path / "run"),
               STUB_LOG=str(tmp_path / "scontrol.log"), STUB_ARGS=str(tmp_path / "args"), STUB_STATUS=str(torchrun_status))  # fmt: skip
    done = subprocess.run(
        ["bash", str(SBATCH)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == status, done.stderr
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("--rdzv-endpoint") + 1] == "node001:29400" and "--run.time_limit" in args
    log = (tmp_path / "scontrol.log").read_text() if (tmp_path / "scontrol.log").exists() else ""
    assert log == ("requeue 77\n" if requeued else "")
