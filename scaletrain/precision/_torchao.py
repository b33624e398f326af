"""torchao, imported quietly: a CPU build of torch cannot load torchao's CUDA kernels (mxfp8, cutlass) and torchao
logs so at import; the float8 and fake-quant paths used here are plain PyTorch over torch ops."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType


def import_quietly(name: str) -> ModuleType:
    """`importlib.import_module(name)` with torchao's logger held at ERROR while it loads."""
    logger = logging.getLogger("torchao")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return importlib.import_module(name)
    finally:
        logger.setLevel(level)
