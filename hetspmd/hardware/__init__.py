"""Hardware as values: device specs and links, the profiler that measures them, the Cluster, the (data, model) mesh.

Modules import one way: ``devices`` (specs, links, presets, unit parsing)
< ``profiler`` (measures devices into those values) < ``cluster`` (hosts
of devices; built from specs, presets or a profile) < ``mesh``.
"""

from hetspmd.hardware.devices import DEVICE_PRESETS as DEVICE_PRESETS
from hetspmd.hardware.devices import LINK_PRESETS as LINK_PRESETS
from hetspmd.hardware.devices import DeviceSpec as DeviceSpec
from hetspmd.hardware.devices import Link as Link
from hetspmd.hardware.devices import link as link
from hetspmd.hardware.devices import parse_bandwidth as parse_bandwidth
from hetspmd.hardware.devices import parse_latency as parse_latency
from hetspmd.hardware.devices import parse_size as parse_size
from hetspmd.hardware.profiler import Profile as Profile
from hetspmd.hardware.profiler import device_spec as device_spec
from hetspmd.hardware.profiler import profile as profile
from hetspmd.hardware.cluster import CLUSTER_PRESETS as CLUSTER_PRESETS
from hetspmd.hardware.cluster import Cluster as Cluster
from hetspmd.hardware.cluster import Host as Host
from hetspmd.hardware.mesh import HetMesh as HetMesh
from hetspmd.hardware.mesh import enumerate_layouts as enumerate_layouts

__all__ = [
    "CLUSTER_PRESETS", "Cluster", "DEVICE_PRESETS", "DeviceSpec", "HetMesh", "Host", "LINK_PRESETS", "Link",
    "Profile", "device_spec", "enumerate_layouts", "link", "parse_bandwidth", "parse_latency", "parse_size",
    "profile",
]
