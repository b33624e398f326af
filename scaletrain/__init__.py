"""scaletrain: PyTorch-native pre-training of Llama-style language models. Importing it checks the torch in use
against the releases this code has been tried on."""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys

__version__ = "0.1.0"

# The torch releases tried (docs/performance.md, "Torch versions"): pyproject.toml declares the same range (a test
# holds them together); `make` and CI install TORCH_PINNED, `make compat TORCH=...` tries another release.
TORCH_RANGE = ((2, 11), (2, 15))  # (major, minor): >= the first, < the second
TORCH_PINNED = "2.13.0"
ANY_TORCH_ENV = "SCALETRAIN_ANY_TORCH"


def torch_version_problem(version: str) -> str | None:
    """Why this torch release is refused; None inside TORCH_RANGE, by major.minor (so 2.13.0+cpu, 2.11.0+cu130 and
    a nightly of a release in the range pass)."""
    (low, high), found = TORCH_RANGE, re.match(r"(\d+)\.(\d+)", version)
    if found and low <= (int(found[1]), int(found[2])) < high:
        return None
    return (
        f"scaletrain supports torch >={'.'.join(map(str, low))},<{'.'.join(map(str, high))} (tried; CI runs "
        f"{TORCH_PINNED}), and this is torch {version}: "
        f"install one in that range (pip install 'torch=={TORCH_PINNED}'), or set {ANY_TORCH_ENV}=1 to try this "
        "one anyway (untried: DCP, FSDP2 and torch.compile change between releases)"
    )


def _torch_version() -> str:
    """The torch in use, without importing it where it is not loaded yet: the run directory's readers (the Slurm
    recipe's exit-status check) need no torch, and importing it costs seconds (14 under load)."""
    if "torch" in sys.modules:
        return sys.modules["torch"].__version__
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # a torch without its metadata (built in place): ask it
        import torch

        return torch.__version__


_problem = torch_version_problem(_torch_version())
if _problem is not None and os.environ.get(ANY_TORCH_ENV) != "1":
    raise ImportError(_problem)
