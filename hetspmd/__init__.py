"""hetspmd: automatic, device-weighted SPMD sharding for JAX."""

from hetspmd._version import __version__ as __version__
from hetspmd.annotations import annotated_specs as annotated_specs
from hetspmd.cluster import Cluster as Cluster
from hetspmd.cluster import Host as Host
from hetspmd.devices import DeviceSpec as DeviceSpec
from hetspmd.devices import Link as Link
from hetspmd.errors import HetSpmdError as HetSpmdError
from hetspmd.errors import InvalidValueError as InvalidValueError
from hetspmd.errors import TraceError as TraceError
from hetspmd.errors import UnknownNameError as UnknownNameError
from hetspmd.errors import UnpartitionableError as UnpartitionableError
from hetspmd.mesh import HetMesh as HetMesh
from hetspmd.mesh import enumerate_layouts as enumerate_layouts
from hetspmd.microbatch import Weighted as Weighted
from hetspmd.microbatch import grad as grad
from hetspmd.microbatch import value_and_grad as value_and_grad
from hetspmd.microbatch import weighted as weighted
from hetspmd.passes import Graph as Graph
from hetspmd.plan import Plan as Plan
from hetspmd.plan import plan_for as plan_for
from hetspmd.plan import stage_layers as stage_layers
from hetspmd.passes import Role as Role
from hetspmd.passes import trace as trace
from hetspmd.profiler import profile as profile
from hetspmd.runtime import ParallelStep as ParallelStep
from hetspmd.search import search_step as search
from hetspmd.runtime import ShardedBatch as ShardedBatch
from hetspmd.runtime import parallelize as parallelize

__all__ = [
    "annotated_specs", "Cluster", "DeviceSpec", "HetMesh", "Host", "Link", "enumerate_layouts", "profile",
    "ParallelStep", "Plan", "ShardedBatch", "Weighted", "grad", "parallelize", "plan_for", "stage_layers",
    "value_and_grad",
    "search", "weighted",
    "Graph", "HetSpmdError", "InvalidValueError", "Role", "TraceError", "UnknownNameError",
    "UnpartitionableError", "__version__", "trace",
]
