"""The planner: a StepProfile and a Cluster → ranked, priced plans.

``data_axis`` prices the data axis (gradient reductions, ZeRO gathers,
memory per device); ``pricing`` prices one candidate; ``ranking`` generates
candidates, keeps those that fit and ranks them against the baselines;
``stages`` searches pipeline stage plans; ``building`` turns a priced
candidate (or given choices) into a runnable :class:`~hetspmd.plan.Plan`;
``grouping`` prices group plans (one program per group of one device kind,
joined by exchange programs) and makes the best a
:class:`~hetspmd.plan.GroupPlan`; ``sharding`` prices a group that shards its
parameters over its devices (FSDP inside the group) and the ``fsdp`` baseline.
"""

from hetspmd.planner.building import plan_for as plan_for
from hetspmd.planner.building import plan_from as plan_from
from hetspmd.planner.building import stage_layers as stage_layers
from hetspmd.planner.pricing import OVERLAP_EFFICIENCY as OVERLAP_EFFICIENCY
from hetspmd.planner.pricing import Evaluated as Evaluated
from hetspmd.planner.pricing import evaluate as evaluate
from hetspmd.planner.ranking import BASELINES as BASELINES
from hetspmd.planner.ranking import SearchResult as SearchResult
from hetspmd.planner.ranking import search as search
from hetspmd.planner.stages import StagePlan as StagePlan
from hetspmd.planner.stages import search_stages as search_stages

__all__ = ["BASELINES", "Evaluated", "OVERLAP_EFFICIENCY", "SearchResult", "StagePlan", "evaluate", "plan_for",
           "plan_from", "search", "search_stages", "stage_layers"]
