"""torchao, an optional dependency (the `fp8` extra): found before launch, imported only where fp8 or QAT run, and
refused with what to install when it is missing or does not import with the torch in use. Imported quietly: a CPU
build of torch cannot load torchao's CUDA kernels (mxfp8, cutlass) and torchao logs so at import; the float8 and
fake-quant paths used here are plain PyTorch over torch ops."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
from types import ModuleType

import torch

from scaletrain.errors import UserError

TORCHAO = "torchao==0.18.0"  # the release tried with torch 2.13.0 (pyproject.toml's fp8 extra)
INSTALL = "pip install 'scaletrain[fp8]'"


def torchao_problem(feature: str) -> str | None:
    """Why `feature` (e.g. "fp8 training") cannot have torchao here; None when it is installed."""
    if importlib.util.find_spec("torchao") is not None:
        return None
    return f"{feature} needs torchao, which is not installed: {INSTALL} (or pip install '{TORCHAO}')"


def import_quietly(name: str, feature: str = "fp8 or QAT") -> ModuleType:
    """`importlib.import_module(name)` with torchao's logger held at ERROR while it loads; a UserError naming the
    fix when torchao is missing or fails to import with this torch."""
    problem = torchao_problem(feature)
    if problem is not None:
        raise UserError(problem)
    logger = logging.getLogger("torchao")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return importlib.import_module(name)
    # torchao built against another torch fails in many ways (ImportError, AttributeError, RuntimeError).
    except Exception as e:
        version = importlib.metadata.version("torchao")
        raise UserError(
            f"{feature}: torchao {version} does not import with torch {torch.__version__} "
            f"({type(e).__name__}: {e}); install the torchao release made for this torch ({TORCHAO} goes with "
            "torch 2.13)"
        ) from e
    finally:
        logger.setLevel(level)
