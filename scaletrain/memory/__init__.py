"""Memory techniques applied to a built model from outside it: activation recompute (full, every k-th block,
selective), activation offload to host memory, and the FSDP2 policy that keeps optimizer state on the host."""

from scaletrain.memory.offload import apply_activation_offload, fsdp_offload_policy, offload_problems
from scaletrain.memory.recompute import apply_recompute, recomputed_blocks

__all__ = [
    "apply_activation_offload",
    "apply_recompute",
    "fsdp_offload_policy",
    "offload_problems",
    "recomputed_blocks",
]
