"""The plan in its two forms, values both: a single program (``Plan``: its versioned JSON, options (remat, ZeRO,
reduce dtypes), microbatch counts and the state layout) and group programs (``GroupPlan``: groups of devices,
each with its own microbatch, counts, remat and model axis, joined by uniform exchange programs; the state in
memory shares).

A plan is a value: it imports the hardware only through the device ids and
kinds it records, and nothing of the planner that makes it or the lowering
that runs it.
"""

from hetspmd.plan.annotations import annotated_specs as annotated_specs
from hetspmd.plan.counts import KindCost as KindCost
from hetspmd.plan.counts import balanced_counts as balanced_counts
from hetspmd.plan.counts import default_microbatch as default_microbatch
from hetspmd.plan.counts import even_counts as even_counts
from hetspmd.plan.counts import microbatch_for as microbatch_for
from hetspmd.plan.counts import milp_counts as milp_counts
from hetspmd.plan.counts import proportional_counts as proportional_counts
from hetspmd.plan.groups import Group as Group
from hetspmd.plan.groups import GroupPlan as GroupPlan
from hetspmd.plan.groups import group_plan as group_plan
from hetspmd.plan.groups import shares_for as shares_for
from hetspmd.plan.options import GRAD_REDUCE_DTYPES as GRAD_REDUCE_DTYPES
from hetspmd.plan.options import REMAT_POLICIES as REMAT_POLICIES
from hetspmd.plan.options import STAGE_AXIS as STAGE_AXIS
from hetspmd.plan.options import ZERO_STAGES as ZERO_STAGES
from hetspmd.plan.state_layout import auto_state_specs as auto_state_specs
from hetspmd.plan.state_layout import shards_axis as shards_axis
from hetspmd.plan.state_layout import state_specs as state_specs
from hetspmd.plan.state_layout import zero_shards_for as zero_shards_for
from hetspmd.plan.value import SCHEMA_VERSION as SCHEMA_VERSION
from hetspmd.plan.value import Plan as Plan

__all__ = ["GRAD_REDUCE_DTYPES", "Group", "GroupPlan", "KindCost", "Plan", "REMAT_POLICIES", "SCHEMA_VERSION", "STAGE_AXIS", "ZERO_STAGES",
           "annotated_specs", "auto_state_specs", "balanced_counts", "default_microbatch", "even_counts",
           "group_plan", "microbatch_for", "milp_counts", "proportional_counts", "shares_for", "shards_axis", "state_specs", "zero_shards_for"]
