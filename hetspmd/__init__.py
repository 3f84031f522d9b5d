"""hetspmd: automatic, device-weighted SPMD sharding for JAX.

The public surface, by pipeline stage: the hardware (``Cluster``), the
front end (``trace``), the plan in its two forms (a single program:
``Plan``, ``plan_for``; group programs: ``GroupPlan``, ``group_plan``,
``shares_for``), the search (``search``), the runtime (``parallelize``,
which runs either form; ``run_groups`` for a group plan made by hand), and
what a step may use (``value_and_grad``, ``weighted``).
"""

from hetspmd._version import __version__ as __version__
from hetspmd.autodiff import Weighted as Weighted
from hetspmd.autodiff import grad as grad
from hetspmd.autodiff import value_and_grad as value_and_grad
from hetspmd.autodiff import weighted as weighted
from hetspmd.errors import HetSpmdError as HetSpmdError
from hetspmd.errors import InvalidValueError as InvalidValueError
from hetspmd.errors import PlanDoesNotFitError as PlanDoesNotFitError
from hetspmd.errors import TraceError as TraceError
from hetspmd.errors import UnknownNameError as UnknownNameError
from hetspmd.errors import UnpartitionableError as UnpartitionableError
from hetspmd.hardware.cluster import Cluster as Cluster
from hetspmd.hardware.cluster import Host as Host
from hetspmd.hardware.devices import DeviceSpec as DeviceSpec
from hetspmd.hardware.devices import Link as Link
from hetspmd.hardware.mesh import HetMesh as HetMesh
from hetspmd.hardware.mesh import enumerate_layouts as enumerate_layouts
from hetspmd.hardware.profiler import profile as profile
from hetspmd.passes import Graph as Graph
from hetspmd.passes import Role as Role
from hetspmd.passes import trace as trace
from hetspmd.plan.annotations import annotated_specs as annotated_specs
from hetspmd.plan.balance import Rebalance as Rebalance
from hetspmd.plan.groups import GroupPlan as GroupPlan
from hetspmd.plan.groups import group_plan as group_plan
from hetspmd.plan.groups import shares_for as shares_for
from hetspmd.plan.value import Plan as Plan
from hetspmd.planner.building import plan_for as plan_for
from hetspmd.planner.building import stage_layers as stage_layers
from hetspmd.runtime.placement import ShardedBatch as ShardedBatch
from hetspmd.runtime.grouped import GroupedStep as GroupedStep
from hetspmd.runtime.grouped import run_groups as run_groups
from hetspmd.runtime.step import ParallelStep as ParallelStep
from hetspmd.runtime.step import parallelize as parallelize
from hetspmd.step_search import StepSearch as StepSearch
from hetspmd.step_search import search as search

__all__ = [
    "annotated_specs", "Cluster", "DeviceSpec", "HetMesh", "Host", "Link", "enumerate_layouts", "profile",
    "GroupPlan", "GroupedStep", "ParallelStep", "Plan", "Rebalance", "ShardedBatch", "Weighted", "grad", "parallelize", "plan_for", "stage_layers",
    "value_and_grad", "group_plan", "run_groups", "shares_for",
    "search", "StepSearch", "weighted",
    "Graph", "HetSpmdError", "InvalidValueError", "PlanDoesNotFitError", "Role", "TraceError", "UnknownNameError",
    "UnpartitionableError", "__version__", "trace",
]
