"""The torch releases scaletrain supports, declared once (scaletrain.TORCH_RANGE) and held to pyproject.toml and the
Makefile; a torch outside them refused at import; torchao optional (the fp8 extra), refused with the fix where fp8 or
QAT need it and it is missing."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import scaletrain
from scaletrain.config import ModelConfig, PrecisionConfig
from scaletrain.config.io import read_toml
from scaletrain.errors import UserError
from scaletrain.models.presets import resolve_model_args
from scaletrain.precision import _torchao
from scaletrain.precision.fp8 import fp8_problems
from scaletrain.precision.qat import qat_problems

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_declares_the_range_and_the_makefile_installs_the_pin():
    project = read_toml(str(ROOT / "pyproject.toml"))["project"]
    (low, high) = (".".join(map(str, v)) for v in scaletrain.TORCH_RANGE)
    torch_req = [d for d in project["dependencies"] if re.match(r"torch\b", d)]
    assert torch_req == [f"torch>={low},<{high}"]
    assert not any(d.startswith("torchao") for d in project["dependencies"]), "torchao is the fp8 extra"
    assert project["optional-dependencies"]["fp8"] == [_torchao.TORCHAO]
    assert "scaletrain[fp8]" in project["optional-dependencies"]["test"]  # CI keeps testing fp8 and QAT
    assert f"torch=={scaletrain.TORCH_PINNED}" in (ROOT / "Makefile").read_text()
    assert scaletrain.torch_version_problem(scaletrain.TORCH_PINNED) is None


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.11.0", "2.12.1", "2.13.0+cpu", "2.14.1"])
def test_the_releases_tried_are_accepted(version):
    assert scaletrain.torch_version_problem(version) is None


@pytest.mark.parametrize("version", ["2.10.1", "2.15.0", "2.15.0a0+git1234", "3.0.0", "unknown"])
def test_other_releases_are_refused_with_the_range_and_the_way_out(version):
    problem = scaletrain.torch_version_problem(version)
    assert problem and ">=2.11,<2.15" in problem and version in problem
    assert scaletrain.ANY_TORCH_ENV in problem and "pip install 'torch==" in problem


def test_importing_scaletrain_under_another_torch_fails_with_the_reason_unless_asked_to_try():
    code = "import torch; torch.__version__ = '2.10.0'; import scaletrain; print('imported')"
    env = {k: v for k, v in os.environ.items() if k != scaletrain.ANY_TORCH_ENV}
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode != 0 and "ImportError: scaletrain supports torch >=2.11,<2.15" in run.stderr
    env[scaletrain.ANY_TORCH_ENV] = "1"
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0 and "imported" in run.stdout, run.stderr


@pytest.fixture
def no_torchao(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a)
    )


def test_fp8_and_qat_without_torchao_are_refused_with_the_extra_to_install(no_torchao):
    (problem,) = fp8_problems("cuda", capability=(9, 0))
    assert "needs torchao" in problem and "pip install 'scaletrain[fp8]'" in problem
    args = resolve_model_args(ModelConfig(preset="debug"), 257, 64)
    problems = qat_problems(PrecisionConfig(qat="int8_int4", qat_group_size=16), args, tp=1)
    assert problems and "precision.qat needs torchao" in problems[0] and "scaletrain[fp8]" in problems[0]
    assert qat_problems(PrecisionConfig(), args, tp=1) == []  # QAT off: nothing to install
    with pytest.raises(
        UserError, match=r"needs torchao, which is not installed: pip install 'scaletrain\[fp8\]'"
    ):
        _torchao.import_quietly("torchao.quantization", "precision.qat")


def test_a_torchao_that_does_not_import_with_this_torch_is_refused_with_both_versions(monkeypatch):
    pytest.importorskip("torchao")

    def broken(name):
        raise AttributeError("module 'torch' has no attribute 'float4_e2m1fn_x2'")

    monkeypatch.setattr(_torchao.importlib, "import_module", broken)
    with pytest.raises(
        UserError, match=rf"torchao \S+ does not import with torch {re.escape(torch.__version__)}"
    ):
        _torchao.import_quietly("torchao.float8", "fp8 training")


def test_reading_a_run_directory_imports_no_torch():
    """The Slurm recipe reads the exit status with RunDir (examples/slurm/train.sbatch): the version check must not
    import torch for it (seconds per requeue); the installed torch's version is read from its metadata."""
    code = "import sys; from scaletrain.run.directory import RunDir; print('torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "False", run.stderr


def test_the_cli_starts_without_the_report_or_dynamo():
    """Every launch imports the CLI (twice under --nproc: the launcher, then the fork server): matplotlib (the
    report) and torch._dynamo cost 0.3 s each there, and only `scaletrain report`, metrics.report and a compiled or
    training worker need them (cli.py, models' compile_disabled, parallel/pipeline.py)."""
    code = "import sys, scaletrain.cli; print(sorted(m for m in ('matplotlib', 'torch._dynamo') if m in sys.modules))"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "[]", (run.stdout, run.stderr)
