"""Measuring memory: the activation bytes a forward leaves for its backward (measure.saved_activation_bytes), what
the tests and benchmarks/memory.py compare the planner's activation formula with. The techniques that save memory
(recompute, offload) are applied with the other parallelisms in scaletrain/parallel/."""

from scaletrain.memory.measure import saved_activation_bytes

__all__ = ["saved_activation_bytes"]
