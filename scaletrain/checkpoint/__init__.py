"""Checkpoints: DCP save/load in two stages, commit markers and checksums, retention, safe loading, HF interchange."""

from scaletrain.checkpoint.manager import CheckpointManager
from scaletrain.checkpoint.state import LoaderState, ModelState, OptimizerState, SchedulerState, TrainState

__all__ = ["CheckpointManager", "LoaderState", "ModelState", "OptimizerState", "SchedulerState", "TrainState"]
