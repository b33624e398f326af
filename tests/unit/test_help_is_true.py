"""What `scaletrain --help` and each command's --help list is what the code has: the commands, each command's flags,
the model presets, the planner's GPU kinds (issue 22: stale lists were shown by --help)."""

from __future__ import annotations

import argparse
import re

from scaletrain.cli import USAGE, build_parser
from scaletrain.models.presets import PRESETS
from scaletrain.planning.estimators.hardware import GPUS


def _commands() -> dict[str, argparse.ArgumentParser]:
    root = build_parser()
    return next(a for a in root._actions if isinstance(a, argparse._SubParsersAction)).choices


def _usage_lines() -> dict[str, str]:
    return {line.split()[1]: line for line in USAGE.splitlines() if line.startswith("scaletrain ")}


def test_the_usage_lists_every_command_and_no_other():
    assert sorted(_usage_lines()) == sorted(_commands())


def test_each_usage_line_names_every_flag_of_its_command():
    lines = _usage_lines()
    missing = {name: [f for f in sub.flags() if f not in lines[name]] for name, sub in _commands().items()}
    assert not {name: flags for name, flags in missing.items() if flags}


def test_the_preset_help_names_every_preset():
    help_text = _commands()["train"].format_help()
    entry = help_text.split("--model.preset", 1)[1].split("\n  --", 1)[0]
    named = {word.rstrip(".") for word in re.findall(r"[\w.]+", entry)}  # names hold dots: qwen3_0.6b
    assert [p for p in PRESETS if p not in named] == []


def test_the_plan_help_names_every_gpu_kind():
    device = next(a for a in _commands()["plan"]._actions if "--device" in a.option_strings)
    listed = device.help.replace(",", " ").split()
    assert set(GPUS) <= set(listed) and "cpu" in listed
    assert "|".join([*GPUS, "cpu"]) in _usage_lines()["plan"]
