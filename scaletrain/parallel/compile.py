"""torch.compile per transformer block: each block is one graph (the same code for every layer, so one compile
serves them all after the first), compiled in place with `Module.compile()` so parameter names do not change."""

from __future__ import annotations

import logging

from torch import nn

log = logging.getLogger(__name__)


def apply_compile(model: nn.Module) -> nn.Module:
    """Compile every block of `model.layers` in place. Compiling happens lazily at the first forward (seconds to
    minutes): that first step is compile time, not training throughput."""
    for block in model.layers.values():
        block.compile()
    log.info("applied torch.compile to %d blocks (compiled at the first forward)", len(model.layers))
    return model
