"""Checkpoints, both tiers: DCP save/load in two stages, commit markers and checksums, retention, safe loading, the
in-memory snapshot tier, HF interchange."""

from scaletrain.checkpoint.manager import CheckpointManager, build_checkpointing
from scaletrain.checkpoint.state import LoaderState, ModelState, TrainState

__all__ = ["CheckpointManager", "build_checkpointing", "LoaderState", "ModelState", "TrainState"]
