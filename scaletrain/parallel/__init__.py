"""Each parallelism is one function applied to a built model on a mesh; ParallelDims is the only mesh owner."""

from scaletrain.parallel.data_parallel import apply_ddp
from scaletrain.parallel.mesh import DistEnv, ParallelDims, init_distributed

__all__ = ["apply_ddp", "DistEnv", "ParallelDims", "init_distributed"]
