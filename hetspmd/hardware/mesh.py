"""HetMesh: a JAX mesh over a cluster, with per-position device weights.

The first axis (``data``) is the weighted one: position ``i`` along it is a
group of devices (one row of the mesh) whose share of the batch follows the
group's speed. Every other axis (``model``) is unweighted: each
group along it must be one device kind on one host, so that XLA's uniform
partitioning inside the group is also balanced.

Devices are laid out host-major, so a model group is a run of consecutive
devices within a host.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, Sequence

import numpy as np

from hetspmd.hardware.cluster import Cluster
from hetspmd.errors import InvalidValueError

WEIGHTED_AXIS = "data"


@dataclasses.dataclass(frozen=True, slots=True)
class HetMesh:
  """A device layout over a cluster.

  Attributes:
    cluster: the cluster the layout is over.
    axis_names: e.g. ``("data", "model")``; the first axis is weighted.
    shape: devices along each axis; the product is the cluster size.
    device_ids: cluster device ids in mesh order (row-major).
  """

  cluster: Cluster
  axis_names: tuple[str, ...]
  shape: tuple[int, ...]
  device_ids: tuple[int, ...]

  def __post_init__(self):
    if len(self.axis_names) != len(self.shape) or not self.axis_names:
      raise InvalidValueError(f"HetMesh axis names {self.axis_names} and shape {self.shape} must have equal length")
    if len(set(self.axis_names)) != len(self.axis_names):
      raise InvalidValueError(f"HetMesh axis names repeat: {self.axis_names}")
    if any(s < 1 for s in self.shape):
      raise InvalidValueError(f"HetMesh axis sizes must be positive, got {dict(zip(self.axis_names, self.shape))}")
    n = self.cluster.num_devices
    if math.prod(self.shape) != n:
      raise InvalidValueError(
          f"mesh shape {dict(zip(self.axis_names, self.shape))} holds {math.prod(self.shape)} devices; "
          f"the cluster has {n}")
    if sorted(self.device_ids) != list(range(n)):
      raise InvalidValueError(f"device_ids must be a permutation of 0..{n - 1}, got {self.device_ids}")
    self._check_unweighted_groups()

  def _check_unweighted_groups(self) -> None:
    devices = self.cluster.devices
    grid = self.device_grid()
    for axis in range(1, len(self.shape)):
      if self.axis_names[axis] == "stage":  # pipeline stages are groups of hosts by design
        continue
      groups = np.moveaxis(grid, axis, -1).reshape(-1, self.shape[axis])
      for group in groups:
        members = [devices[i] for i in group]
        kinds = {d.spec.name for d in members}
        hosts = {d.host for d in members}
        if len(kinds) > 1 or len(hosts) > 1:
          raise InvalidValueError(
              f"the {self.axis_names[axis]!r} group of devices {list(map(int, group))} mixes "
              f"{'kinds ' + ', '.join(sorted(kinds)) if len(kinds) > 1 else ''}"
              f"{' and ' if len(kinds) > 1 and len(hosts) > 1 else ''}"
              f"{'hosts ' + ', '.join(map(str, sorted(hosts))) if len(hosts) > 1 else ''}; "
              f"groups along an unweighted axis must be one device kind on one host")

  def replace(self, **changes: Any) -> "HetMesh":
    return dataclasses.replace(self, **changes)

  # --- views ---------------------------------------------------------------

  def device_grid(self) -> np.ndarray:
    return np.asarray(self.device_ids, dtype=np.int64).reshape(self.shape)

  @property
  def axis_sizes(self) -> dict[str, int]:
    return dict(zip(self.axis_names, self.shape))

  def groups(self) -> list[tuple[int, ...]]:
    """Device ids of each position along the weighted axis."""
    return [tuple(int(i) for i in row.ravel()) for row in self.device_grid()]

  def speed_weights(self, dtype: str = "float32") -> tuple[float, ...]:
    """Each weighted-axis position's peak FLOP/s, relative to the total."""
    devices = self.cluster.devices
    speeds = [sum(devices[i].spec.peak_flops(dtype) for i in group) for group in self.groups()]
    total = math.fsum(speeds)
    return tuple(s / total for s in speeds)

  def memory_bytes(self) -> tuple[int, ...]:
    """Smallest device memory in each weighted-axis position."""
    devices = self.cluster.devices
    return tuple(min(devices[i].spec.memory_bytes for i in group) for group in self.groups())

  def weights(self, dtype: str = "float32") -> dict[str, tuple[float, ...]]:
    """Per-axis, per-position relative speed; unweighted axes are uniform."""
    out = {self.axis_names[0]: self.speed_weights(dtype)}
    for name, size in zip(self.axis_names[1:], self.shape[1:]):
      out[name] = (1.0 / size,) * size
    return out

  def jax_mesh(self, devices: Sequence[Any] | None = None, axis_types: Any = None):
    """The ``jax.sharding.Mesh``, with explicit axis types (Auto by default).

    ``devices`` defaults to the cluster's ``jax_device_ids`` looked up in
    ``jax.devices()``.
    """
    import jax
    from jax.sharding import AxisType, Mesh

    if devices is None:
      if self.cluster.jax_device_ids is None:
        raise InvalidValueError(
            "this cluster is not bound to JAX devices; build it with Cluster.from_devices or Cluster.emulate, "
            "or pass devices=")
      by_id = {d.id: d for d in jax.devices()}
      missing = [i for i in self.cluster.jax_device_ids if i not in by_id]
      if missing:
        raise InvalidValueError(f"JAX devices {missing} of this cluster are not visible ({len(by_id)} are)")
      devices = [by_id[i] for i in self.cluster.jax_device_ids]
    if len(devices) != self.cluster.num_devices:
      raise InvalidValueError(f"got {len(devices)} devices for a {self.cluster.num_devices}-device cluster")
    ordered = np.empty(len(devices), dtype=object)
    ordered[:] = [devices[i] for i in self.device_ids]
    types = (AxisType.Auto,) * len(self.shape) if axis_types is None else tuple(axis_types)
    return Mesh(ordered.reshape(self.shape), self.axis_names, axis_types=types)


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(cluster: Cluster, axes: Sequence[str] = ("data", "model")) -> Iterator[HetMesh]:
  """Every valid layout of ``cluster`` over ``axes``, host-major.

  One axis: the single layout with every device along it. Two axes
  ``(weighted, unweighted)``: one layout per unweighted size ``m`` that
  divides every host's device count (so each group is one host's run of
  same-kind devices), in increasing ``m``.
  """
  axes = tuple(axes)
  n = cluster.num_devices
  ids = tuple(range(n))
  if len(axes) == 1:
    yield HetMesh(cluster, axes, (n,), ids)
    return
  if len(axes) != 2:
    raise InvalidValueError(f"layouts have one or two axes (weighted, unweighted), got {axes}")
  common = math.gcd(*(h.count for h in cluster.hosts))
  for m in _divisors(common):
    yield HetMesh(cluster, axes, (n // m, m), ids)
