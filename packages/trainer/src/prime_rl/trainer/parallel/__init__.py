"""Parallelism: the device mesh and the transforms applied to a model, one `apply_*` module each."""

from prime_rl.trainer.parallel.compile import apply_compile
from prime_rl.trainer.parallel.dims import ParallelDims, WorldMesh
from prime_rl.trainer.parallel.fsdp import apply_fsdp
from prime_rl.trainer.parallel.parallelize import parallelize_model

__all__ = ["ParallelDims", "WorldMesh", "apply_compile", "apply_fsdp", "parallelize_model"]
