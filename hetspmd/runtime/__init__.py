"""The runtime: ``parallelize`` / ``ParallelStep`` (``step``), which runs a single program itself and a group plan
through ``GroupedStep`` (``grouped``: places, calls and explains the group programs); call binding, static
values and the Flax adapter (``binding``); placing batches on the devices (``placement``)."""

from hetspmd.runtime.grouped import GroupedStep as GroupedStep
from hetspmd.runtime.grouped import run_groups as run_groups
from hetspmd.runtime.placement import GroupedBatch as GroupedBatch
from hetspmd.runtime.placement import ShardedBatch as ShardedBatch
from hetspmd.runtime.step import ParallelStep as ParallelStep
from hetspmd.runtime.step import parallelize as parallelize

__all__ = ["GroupedBatch", "GroupedStep", "ParallelStep", "ShardedBatch", "parallelize", "run_groups"]
