"""hetspmd: automatic, device-weighted SPMD sharding for JAX."""

from hetspmd._version import __version__ as __version__
from hetspmd.errors import HetSpmdError as HetSpmdError
from hetspmd.errors import InvalidValueError as InvalidValueError
from hetspmd.errors import TraceError as TraceError
from hetspmd.errors import UnknownNameError as UnknownNameError
from hetspmd.errors import UnpartitionableError as UnpartitionableError
from hetspmd.passes import Graph as Graph
from hetspmd.passes import Role as Role
from hetspmd.passes import trace as trace

__all__ = [
    "Graph", "HetSpmdError", "InvalidValueError", "Role", "TraceError", "UnknownNameError",
    "UnpartitionableError", "__version__", "trace",
]
