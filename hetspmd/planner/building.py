"""Building plans: ``plan_for`` from a cluster and given choices, ``plan_from`` from a priced candidate."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from hetspmd._pytree import leaves_with_paths
from hetspmd.errors import HetSpmdError, InvalidValueError
from hetspmd.hardware.cluster import Cluster
from hetspmd.hardware.mesh import HetMesh, enumerate_layouts
from hetspmd.plan.counts import divisors, even_counts, microbatch_for, proportional_counts
from hetspmd.plan.options import STAGE_AXIS, SpecEntry
from hetspmd.plan.state_layout import auto_state_specs, model_specs_for, state_specs, zero_shards_for
from hetspmd.plan.value import Plan
from hetspmd.planner.pricing import Evaluated
from hetspmd.planner.stages import split_layers


def plan_for(cluster: Cluster, state: Any, *, global_batch: int, layout: HetMesh | tuple[int, ...] | None = None,
             microbatch: int | None = None, counts: Sequence[int] | None = None, zero_stage: int = 0,
             remat: str = "none", dtype: str = "float32", grad_reduce_dtype: str = "float32",
             overlap_reduction: bool = False, specs: Mapping[str, Sequence[SpecEntry]] | None = None,
             stages: Sequence[int] = (), overlap_microbatches: int = 1) -> Plan:
  """A plan over ``cluster`` with microbatch counts proportional to device speed.

  Args:
    cluster: devices bound to JAX (``Cluster.from_devices`` / ``emulate``).
    state: the train state (arrays or ``ShapeDtypeStruct``s) whose leaves
      get PartitionSpecs.
    global_batch: examples per step.
    layout: a ``HetMesh`` or a ``(data, model)`` shape; default all data.
    microbatch: examples per microbatch; default :func:`default_microbatch`.
    counts: microbatches per data position; default proportional to each
      position's peak FLOP/s in ``dtype``.
    grad_reduce_dtype: the dtype gradients cross ``data`` in
      (:data:`GRAD_REDUCE_DTYPES`); accumulation stays float32.
    overlap_reduction: run each position's last microbatch outside its loop,
      so that gradient reductions can overlap its backward pass.
    overlap_microbatches: with ``overlap_reduction``, how many of each
      position's microbatches that last pass runs, as one batch (every
      position runs at least this many): a longer backward pass to hide the
      reductions under, beside small microbatches that weight the devices.
    specs: ``{path suffix: spec}`` kept as given for the leaves they match
      (e.g. ``hetspmd.annotated_specs(params, rules)``: the model's own
      ``nnx.with_partitioning`` / ``nn.with_logical_partitioning``
      annotations); other leaves get hetspmd's choice.
    stages: layers per pipeline stage, in order (e.g. ``(8, 4)``), for a
      step whose model runs its layers as one scan over stacked parameters
      (``nn.scan``, ``nnx.scan``): the devices form ``len(stages)``
      consecutive groups (whole hosts first), and a faster group takes
      more layers; each group splits every microbatch's examples evenly
      (see :mod:`hetspmd.lowering.staged`). ``counts`` default to the global batch's
      microbatches spread as evenly as they go (the ticks are lockstep,
      so weighting the data positions would not pay; a position past its
      count skips the ticks' work). State leaves of ``sum(stages)`` rows
      (the stacked layers and their optimizer moments) are split over the
      stages in equal blocks when the stage count divides the layers; the
      rest of the state is replicated.
  """
  if cluster.jax_device_ids is None:
    raise HetSpmdError("the cluster is not bound to JAX devices; use Cluster.from_devices(jax.devices()) or "
                       "Cluster.emulate(jax.devices(), kinds=[...]) to run on this machine")
  if not isinstance(global_batch, int) or global_batch < 1:
    raise InvalidValueError(f"global_batch must be a positive integer, got {global_batch!r}")
  if stages:
    given = {"layout": layout is not None, "zero_stage": zero_stage != 0,
             "overlap_reduction": overlap_reduction, "specs": specs is not None, "dtype": dtype != "float32",
             "overlap_microbatches": overlap_microbatches != 1}
    if any(given.values()):
      raise InvalidValueError(f"pipeline stages choose their own mesh and state layout and run with ZeRO-0 "
                              f"and no overlap; drop {[k for k, v in given.items() if v]} or drop stages")
    return _staged_plan(cluster, state, tuple(stages), global_batch=global_batch, microbatch=microbatch,
                        counts=counts, remat=remat, grad_reduce_dtype=grad_reduce_dtype)
  mesh = _layout(cluster, layout)
  microbatch = microbatch_for(global_batch, mesh.shape[0], microbatch, counts)
  if counts is None:
    counts = proportional_counts(mesh.speed_weights(dtype), global_batch // microbatch)
  devices = cluster.devices
  shards = zero_shards_for(state, mesh.axis_names, mesh.shape, zero_stage, specs)
  return Plan(
      axis_names=mesh.axis_names,
      mesh_shape=mesh.shape,
      device_ids=tuple(cluster.jax_device_ids[i] for i in mesh.device_ids),
      global_batch=global_batch,
      microbatch=microbatch,
      microbatch_counts=tuple(int(c) for c in counts),
      state_specs=auto_state_specs(state, mesh.axis_names, mesh.shape, zero_stage, specs=specs,
                                   zero_shards=shards),
      zero_stage=zero_stage,
      zero_shards=shards,
      remat=remat,
      grad_reduce_dtype=grad_reduce_dtype,
      overlap_reduction=overlap_reduction,
      overlap_microbatches=overlap_microbatches,
      device_kinds=tuple(devices[i].spec.name for i in mesh.device_ids),
  )


def stage_layers(cluster: Cluster, stages: int, layers: int, dtype: str = "float32") -> tuple[int, ...]:
  """Layers per stage for ``stages`` equal groups of consecutive devices (as ``plan_for(stages=...)`` forms them).

  A stage's tick lasts its layer count over its speed, the peak FLOP/s in ``dtype`` of its slowest device
  (every device of a stage runs an equal share of each microbatch); the split minimises the slowest
  stage: one layer each, then every further layer to the stage that would finish it first.
  """
  n = cluster.num_devices
  if stages < 1 or n % stages:
    raise InvalidValueError(f"{n} devices do not form {stages} stages of equal size; valid stage counts: "
                            f"{divisors(n)}")
  if layers < stages:
    raise InvalidValueError(f"{layers} layers cannot fill {stages} stages; every stage needs at least one")
  width = n // stages
  devices = cluster.devices
  speed = [min(devices[i].spec.peak_flops(dtype) for i in range(s * width, (s + 1) * width)) for s in range(stages)]
  return split_layers([1.0 / v for v in speed], [0.0] * stages, layers)


def _stacked_leaf(leaf: Any, stages: tuple[int, ...]) -> bool:
  """A state leaf of the layer stack (parameters, their optimizer moments): split over ``stage`` in even blocks,
  which the staged program moves to the stages' uneven layers and back (``hetspmd.lowering.staged``)."""
  layers = sum(stages)
  return np.ndim(leaf) >= 1 and np.shape(leaf)[0] == layers and layers % len(stages) == 0


def _staged_plan(cluster: Cluster, state: Any, stages: tuple[int, ...], *, global_batch: int,
                 microbatch: int | None, counts: Sequence[int] | None, remat: str, grad_reduce_dtype: str) -> Plan:
  n, S = cluster.num_devices, len(stages)
  if n % S:
    raise InvalidValueError(f"{n} devices do not form {S} stages of equal size; valid stage counts: "
                            f"{divisors(n)}")
  positions = n // S
  microbatch = microbatch_for(global_batch, positions, microbatch, counts)
  if counts is None and global_batch < positions * microbatch:
    raise InvalidValueError(f"global batch {global_batch} does not split into microbatches of {microbatch} with at "
                            f"least one for each of the {positions} data positions; valid microbatches: "
                            f"{[d for d in divisors(global_batch) if d <= global_batch // positions]}")
  # every tick is lockstep across the data positions, so the fastest split is the most even one (the
  # stages' layers carry the weighting); a position past its count skips the ticks' work
  counts = even_counts(positions, global_batch // microbatch) if counts is None else tuple(counts)
  grid = np.arange(n).reshape(S, positions).T  # stage s holds devices s * positions ... (consecutive hosts)
  mesh = HetMesh(cluster, ("data", STAGE_AXIS), (positions, S), tuple(int(i) for i in grid.ravel()))
  devices = cluster.devices
  return Plan(
      axis_names=mesh.axis_names, mesh_shape=mesh.shape,
      device_ids=tuple(cluster.jax_device_ids[i] for i in mesh.device_ids), global_batch=global_batch,
      microbatch=microbatch, microbatch_counts=tuple(int(c) for c in counts),
      state_specs=tuple((p, (STAGE_AXIS,) if _stacked_leaf(leaf, stages) else ()) for p, leaf in leaves_with_paths(state)),
      remat=remat,
      grad_reduce_dtype=grad_reduce_dtype, stages=stages,
      device_kinds=tuple(devices[i].spec.name for i in mesh.device_ids))


def _layout(cluster: Cluster, layout: HetMesh | tuple[int, ...] | None) -> HetMesh:
  if isinstance(layout, HetMesh):
    return layout
  layouts = list(enumerate_layouts(cluster))
  if layout is None:
    return layouts[0]
  for mesh in layouts:
    if mesh.shape == tuple(layout):
      return mesh
  raise InvalidValueError(f"layout {tuple(layout)} is not valid for {cluster}; valid (data, model) shapes: "
                          f"{[m.shape for m in layouts]}")


def plan_from(evaluated: Evaluated, cluster: Cluster, state: Any, ideal: float | None = None):
  """The runnable :class:`~hetspmd.plan.value.Plan` of one search result."""
  ids = cluster.jax_device_ids
  device_ids = tuple(ids[i] if ids is not None else i for i in evaluated.device_positions)
  tp = evaluated.tensor_parallel
  predicted = {"step_seconds": evaluated.step_seconds, "throughput": evaluated.throughput,
               "compute_seconds": evaluated.compute_seconds, "communication_seconds": evaluated.comm_seconds,
               "hidden_communication_seconds": evaluated.hidden_seconds,
               "memory_bytes_per_device": float(max(evaluated.memory_bytes))}
  if tp.m > 1:
    predicted["model_communication_seconds"] = evaluated.model_comm_seconds
  if ideal:
    predicted["efficiency"] = evaluated.throughput / ideal
  axes, shape = ("data", "model"), (len(evaluated.counts), tp.m)
  firsts = evaluated.device_positions[::tp.m]
  per_position = (("memory_bytes", tuple(float(evaluated.memory_bytes[i * tp.m]) for i in range(len(firsts)))),
                  ("memory_capacity_bytes", tuple(float(cluster.devices[d].spec.memory_bytes) for d in firsts)),
                  ("communication_seconds", (evaluated.comm_seconds - evaluated.hidden_seconds,) * len(firsts)))
  if evaluated.position_seconds:
    per_position = (("compute_seconds", evaluated.position_seconds),) + per_position
  model_specs = model_specs_for(state, axes, dict(tp.model_dims))
  shards = zero_shards_for(state, axes, shape, evaluated.zero_stage, model_specs=model_specs)
  return Plan(axis_names=axes, mesh_shape=shape, device_ids=device_ids, global_batch=evaluated.global_batch,
              microbatch=evaluated.microbatch, microbatch_counts=evaluated.counts,
              state_specs=state_specs(state, axes, shape, evaluated.zero_stage, dict(tp.model_dims), shards),
              zero_stage=evaluated.zero_stage, zero_shards=shards, remat=evaluated.remat,
              grad_reduce_dtype=evaluated.grad_reduce_dtype,
              overlap_reduction=evaluated.overlap, overlap_microbatches=evaluated.overlap_microbatches,
              device_kinds=tuple(k for k in evaluated.kinds for _ in range(tp.m)), predicted=tuple(predicted.items()),
              predicted_per_position=per_position)
