"""The runtime: ``parallelize`` / ``ParallelStep`` (``step``), call binding and the Flax adapter (``binding``),
placing batches on the devices (``placement``)."""

from hetspmd.runtime.placement import ShardedBatch as ShardedBatch
from hetspmd.runtime.step import ParallelStep as ParallelStep
from hetspmd.runtime.step import parallelize as parallelize

__all__ = ["ParallelStep", "ShardedBatch", "parallelize"]
