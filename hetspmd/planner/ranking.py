"""Plan search: device-weighted data parallelism × tensor parallelism, under memory limits.

For a model's :class:`~hetspmd.passes.costing.step_cost.StepProfile` and a cluster, the
search tries every candidate of

* layout: every ``(data, model)`` shape of
  :func:`~hetspmd.hardware.mesh.enumerate_layouts` (a model group is ``model``
  consecutive devices of one kind in one host);
* device set: every device, the devices of the fastest kinds only (the
  slowest kinds left out, which wins on slow networks), and each single
  kind, in whole model groups;
* tensor-parallel choice (``model > 1``): the per-operation strategies of
  :mod:`hetspmd.passes.sharding.strategies`. Their ILP is solved once per (model
  size, device kind), at a reference microbatch, as a small time/memory
  Pareto frontier; every candidate tries the frontier choices of all its
  kinds (one choice per plan: the state's PartitionSpecs are global) and
  keeps the fastest that fits;
* microbatch size: divisors of the global batch;
* ZeRO stage 0, 1 or 3 over ``data`` (on top of the split over ``model``),
  and remat: none, ``all_dots`` (every matmul output saved, reductions and
  gathers recomputed) or ``dots`` (weight-matmul outputs saved, the rest of
  the forward pass recomputed); not ``full``, which lowers no peak;
* the gradients' reduce dtype, float32 or (where the caller allows it, on
  data-only meshes) bfloat16; and the reduction overlapped with the last
  microbatch or not, where a masked microbatch on an idle position would cost
  more than the overlap hides;

prunes those that overflow a device's memory, and for the rest chooses the
integer microbatch count of every data position: minimise the slowest
position's time subject to the counts covering the global batch. Positions of
one kind are interchangeable, so :func:`balanced_counts` finds the optimum by
bisection on the makespan (the same optimum as the small MILP
:func:`milp_counts`, kept as the reference).

A data position is a model group; its speed is its kind's: a microbatch's
compute with split operations at ``1/model``, plus the tensor-parallel
collectives on its host's link, plus adding its gradients into the float32
accumulator. Step time = slowest position's (per-step
optimizer work + per-microbatch time × count) + the gradient reduction
across data positions (:mod:`hetspmd.planner.data_axis`), less what of it hides
behind the busiest position's last backward pass when the plan overlaps
(``OVERLAP_EFFICIENCY`` of that pass; all but the last collective), in
float32 or, where allowed, bfloat16 (half the bytes): a ring
all-reduce within a host, hierarchical (reduce-scatter in hosts, all-reduce
between hosts, all-gather in hosts) across hosts, each stage at the slowest
link it crosses. Each device reduces its own gradient bytes (split
parameters ``1/model``); the ``model`` rings of one host share its network
link. Under ZeRO-1/3 without a model axis the gradients of leaves ZeRO
splits over all positions are reduce-scattered instead, and every split
parameter leaf is gathered once per step. Memory per device: parameters,
float32 gradients and optimizer state after the split over ``model``, ZeRO
over ``data`` (ZeRO-3's parameters are gathered whole for the loop), and one
microbatch's activations less their sharded share.

Baselines are the same evaluation with choices pinned: ``dp_even`` (every
device on ``data``, equal counts), ``dp_proportional`` (counts by peak
FLOP/s), ``fastest_only`` and ``best_homogeneous`` (one kind, equal counts,
any layout).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import numpy as np

from hetspmd.hardware.cluster import Cluster
from hetspmd.planner.data_axis import NO_TENSOR_PARALLEL, REDUCE_BYTES, memory_per_device
from hetspmd.errors import HetSpmdError, PlanDoesNotFitError
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.sharding import strategies
from hetspmd.passes.costing.step_cost import StepProfile
from hetspmd.plan.value import REMAT_POLICIES
from hetspmd.planner.pricing import (Costing, DeviceGroups, Evaluated, balanced_counts, device_groups, even_counts,
                             price_candidate, proportional)
# pricing names callers reach through the search
from hetspmd.planner.pricing import (OVERLAP_EFFICIENCY as OVERLAP_EFFICIENCY, evaluate as evaluate,
                             milp_counts as milp_counts, shared_finish_times as shared_finish_times)

# remat "full" checkpoints the whole loss: it runs the forward pass twice and lowers no peak (see
# data_axis.activation_share), so it never wins and is not searched
SEARCHED_REMAT = tuple(r for r in REMAT_POLICIES if r != "full")

ZERO_STAGES = (0, 1, 3)
MODEL_SIZES = (2, 4, 8)       # model-axis sizes whose strategy spaces profile_step prepares


@dataclasses.dataclass(frozen=True)
class SearchResult:
  plans: tuple[Evaluated, ...]
  baselines: dict[str, Evaluated]
  ideal_throughput: float
  search_seconds: float
  candidates: int


def fits(cluster: Cluster, e: Evaluated) -> bool:
  devices = cluster.devices
  return all(m <= devices[i].spec.memory_bytes for i, m in zip(e.device_positions, e.memory_bytes))


def device_sets(cluster: Cluster, profile: StepProfile, microbatch: int) -> dict[str, tuple[int, ...]]:
  """Candidate device sets: all, fastest kinds only (prefixes by speed), each kind alone."""
  kinds = cluster.kinds
  speed = {k: profile.microbatch_seconds(cluster.spec_of(k), microbatch) for k in kinds}
  by_speed = sorted(kinds, key=lambda k: speed[k])
  devices = cluster.devices
  sets = {"all": tuple(d.id for d in devices)}
  for n in range(1, len(by_speed)):
    chosen = set(by_speed[:n])
    sets[f"fastest {n} kind(s)"] = tuple(d.id for d in devices if d.spec.name in chosen)
  for k in kinds:
    sets[f"only {k}"] = tuple(d.id for d in devices if d.spec.name == k)
  return sets


def microbatch_sizes(global_batch: int, limit: int = 16) -> list[int]:
  """The microbatch sizes the search tries: every divisor of the global batch, or ``limit`` spread evenly in log size.

  A power-of-two batch keeps all its divisors (2048 has 12): with the overlap the best size is often the
  largest one every device can run once (32 for 64 devices at 2048), so none may be skipped.
  """
  divisors = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
  if len(divisors) <= limit:
    return divisors
  logs = np.log(divisors)
  targets = np.linspace(0.0, logs[-1], limit)
  picks = np.unique(np.abs(logs[None, :] - targets[:, None]).argmin(axis=1))
  return [divisors[i] for i in picks]


def model_sizes(cluster: Cluster) -> tuple[int, ...]:
  """Model-axis sizes of the cluster's layouts (:func:`~hetspmd.hardware.mesh.enumerate_layouts`)."""
  from hetspmd.hardware.mesh import enumerate_layouts

  return tuple(mesh.shape[1] for mesh in enumerate_layouts(cluster))


def search(cluster: Cluster, profile: StepProfile, global_batch: int, top: int = 5,
           progress: Callable[[str], None] | None = None, models: Sequence[int] | None = None,
           remat_policies: Sequence[str] = SEARCHED_REMAT, recompute: float = 1.0,
           grad_reduce_dtypes: Sequence[str] = ("float32",), overlap: bool = True,
           fuse_overlap: bool = True) -> SearchResult:
  """Ranks device-weighted plans and evaluates the baselines (see module docstring).

  ``grad_reduce_dtypes``: the dtypes gradients may cross ``data`` in (data-only meshes; ``("float32",
  "bfloat16")`` lets the search halve the bytes where that pays); ``overlap``: every plan, baselines
  included, overlaps its reductions with the last microbatch's backward pass, as PyTorch DDP does;
  ``fuse_overlap``: weighted plans may run that pass as several microbatches at once
  (``Plan.overlap_microbatches``; not for steps with per-microbatch batch statistics).

  ``models`` restricts the model-axis sizes tried (default: every layout's); ``remat_policies`` the remat
  policies (``("none",)`` for a step that cannot apply one: it does not use ``hetspmd.value_and_grad``).
  ``recompute``: the microbatch work the step's program does over one pass of it (> 1 with exact batch
  statistics, whose earlier loops run part of the forward pass again: :func:`hetspmd.lowering.weighted.recompute_factor`).
  """
  start = time.perf_counter()
  unknown = [d for d in grad_reduce_dtypes if d not in REDUCE_BYTES]
  if unknown or not grad_reduce_dtypes:
    raise HetSpmdError(f"grad_reduce_dtypes must name some of {tuple(REDUCE_BYTES)}, got {tuple(grad_reduce_dtypes)}")
  specs = {k: cluster.spec_of(k) for k in cluster.kinds}
  reduced = jx.reduced_precision_f32_matmuls()
  peak = {k: s.f32_matmul_flops(reduced) for k, s in specs.items()}  # float32 matmuls' peak: dp_proportional
  fastest_kind = min(cluster.kinds, key=lambda k: profile.microbatch_seconds(specs[k], 1))
  sizes = microbatch_sizes(global_batch)
  costing = Costing(cluster, profile, sizes[len(sizes) // 2], recompute)
  tensor_parallel = bool(profile.traces or profile.strategy_spaces)  # a hand-made profile has no graph to split
  ms = tuple(m for m in model_sizes(cluster) if (models is None or m in models) and (m == 1 or tensor_parallel))
  plans: list[Evaluated] = []
  best: dict[str, Evaluated] = {}
  overflow: list[Evaluated] = []
  candidates = 0

  made: dict[tuple, DeviceGroups] = {}

  def layout_of(name: str, positions: tuple[int, ...], m: int) -> DeviceGroups:
    if (positions, m) not in made:
      made[(positions, m)] = device_groups(cluster, name, positions, m)
    return dataclasses.replace(made[(positions, m)], name=name)

  def consider(e: Evaluated | None, layout: DeviceGroups, bucket: str | None) -> None:
    nonlocal candidates
    if e is None:
      return
    candidates += 1
    if max(e.memory_bytes) > layout.memory:  # every device of a plan holds the same bytes
      overflow.append(e)
      return
    if bucket is None:
      plans.append(e)
    elif bucket not in best or e.step_seconds < best[bucket].step_seconds:
      best[bucket] = e

  def fastest_fitting(layout: DeviceGroups, microbatch: int, zero: int, remat: str, rule: Any, name: str,
                      bucket: str | None, fuse: bool = False) -> None:
    """The layout's candidates with every tensor-parallel choice that fits (the leanest if none does)."""
    choices = costing.choices(layout.m)
    fitting = [tp for tp in choices
               if memory_per_device(profile, len(layout.groups), microbatch, zero, remat, tp) <= layout.memory]
    for tp in fitting or [min(choices, key=lambda t: t.param_share)]:
      dtypes = tuple(grad_reduce_dtypes) if layout.m == 1 else ("float32",)
      for e in price_candidate(costing, layout, tp, microbatch, zero, remat, global_batch, rule, name, dtypes,
                               overlap, fuse=fuse):
        consider(e, layout, bucket)

  for n_done, microbatch in enumerate(sizes):
    total = global_batch // microbatch
    sets = device_sets(cluster, profile, microbatch)
    weighted = lambda kinds, costs: balanced_counts(kinds, costs, total)
    even = lambda kinds, costs: even_counts(len(kinds), total)
    prop = lambda kinds, costs: proportional([peak[k] for k in kinds], total)
    for m in ms:
      layouts = {name: layout_of(name, positions, m) for name, positions in sets.items()}
      suffix = "" if m == 1 else f", model {m}"
      for zero in ZERO_STAGES:
        for remat in remat_policies:
          for set_name, layout in layouts.items():
            fastest_fitting(layout, microbatch, zero, remat, weighted, f"weighted, {set_name}{suffix}", None,
                            fuse=fuse_overlap)
          if m == 1:
            for rule, bucket in ((even, "dp_even"), (prop, "dp_proportional")):
              for e in price_candidate(costing, layouts["all"], NO_TENSOR_PARALLEL, microbatch, zero, remat,
                                       global_batch, rule, bucket, tuple(grad_reduce_dtypes), overlap):
                consider(e, layouts["all"], bucket)
          fastest_fitting(layouts[f"only {fastest_kind}"], microbatch, zero, remat, even, "fastest_only" + suffix,
                          "fastest_only")
          for kind in cluster.kinds:
            fastest_fitting(layouts[f"only {kind}"], microbatch, zero, remat, even, f"only {kind}{suffix}",
                            "best_homogeneous")
    if progress:
      progress(f"microbatch {microbatch} ({n_done + 1}/{len(sizes)}), {candidates} candidates costed")
  if not plans:
    raise PlanDoesNotFitError(_overflow_message(cluster, overflow))
  plans.sort(key=lambda e: (float(f"{e.step_seconds:.9g}"), sum(e.counts)))  # a tie: fewer, larger microbatches
  unique: list[Evaluated] = []
  for e in plans:
    if not any(_same_plan(e, u) for u in unique):
      unique.append(e)
    if len(unique) == top:
      break
  share = max(1, global_batch // cluster.num_devices)
  per_kind = {k: share / profile.microbatch_seconds(s, share) for k, s in specs.items()}
  ideal = sum(per_kind[d.spec.name] for d in cluster.devices)
  return SearchResult(tuple(unique), best, ideal, time.perf_counter() - start, candidates)


def _same_plan(a: Evaluated, b: Evaluated) -> bool:
  """Whether two results are one plan for the table: the same counts, or the same examples per position at the
  same cost (a fused last pass of ``k`` microbatches of ``m`` is the same work as ``k / 2`` of ``2 m``)."""
  if (a.device_positions != b.device_positions or a.tensor_parallel.choice != b.tensor_parallel.choice
      or a.grad_reduce_dtype != b.grad_reduce_dtype):
    return False
  if a.counts == b.counts and a.microbatch == b.microbatch and a.overlap_microbatches == b.overlap_microbatches:
    return True
  examples = lambda e: tuple(c * e.microbatch for c in e.counts)
  return (examples(a) == examples(b) and a.overlap_microbatches * a.microbatch == b.overlap_microbatches * b.microbatch
          and f"{a.step_seconds:.9g}" == f"{b.step_seconds:.9g}")


def _overflow_message(cluster: Cluster, overflow: Sequence[Evaluated]) -> str:
  devices = cluster.devices
  smallest = min(overflow, key=lambda e: max(m - devices[i].spec.memory_bytes
                                             for i, m in zip(e.device_positions, e.memory_bytes)))
  worst = max(zip(smallest.device_positions, smallest.memory_bytes),
              key=lambda im: im[1] - devices[im[0]].spec.memory_bytes)
  spec = devices[worst[0]].spec
  over = worst[1] - spec.memory_bytes
  split = f", model axis {smallest.model}" if smallest.model > 1 else ""
  return (f"no plan fits: even the smallest candidate (microbatch {smallest.microbatch}, ZeRO-{smallest.zero_stage}, "
          f"remat {smallest.remat}{split}) needs {worst[1] / 2**30:.2f} GiB on a {spec.name} with "
          f"{spec.memory_bytes / 2**30:.2f} GiB, {over / 2**30:.2f} GiB ({over:,} bytes) too much. "
          "What would fit: more devices (ZeRO splits the optimizer state over them, a model axis the parameters), "
          "a smaller global batch or sequence, or devices with more memory.")


BASELINES = ("dp_even", "dp_proportional", "fastest_only", "best_homogeneous")


# --- from a step function --------------------------------------------------------------

PROFILE_BATCHES = (2, 4)


def _with_batch(batch: Any, size: int) -> Any:
  import jax

  def resize(x):
    shape = tuple(np.shape(x))
    if not shape:
      raise HetSpmdError("every batch leaf needs a leading batch axis; got a scalar")
    return jax.ShapeDtypeStruct((size,) + shape[1:], x.dtype)

  return jax.tree.map(resize, batch)


def profile_step(fn: Callable[..., Any], state: Any, batch: Any) -> StepProfile:
  """Traces ``fn(state, batch)`` at two batch sizes, fits the per-node costs, prepares the strategy spaces."""
  from hetspmd.passes.costing import step_cost as cost
  from hetspmd.passes.frontend.tracing import trace

  small, large = PROFILE_BATCHES
  graphs = [trace(fn, state, _with_batch(batch, b)) for b in PROFILE_BATCHES]
  return with_strategy_spaces(cost.step_profile(graphs[0], graphs[1], small, large))


def with_strategy_spaces(profile: StepProfile, sizes: Sequence[int] = MODEL_SIZES) -> StepProfile:
  """``profile`` with the tensor-parallel strategy spaces of ``sizes`` built (the search reuses them)."""
  spaces = {m: strategies.strategy_space(profile, m) for m in sizes}
  return dataclasses.replace(profile, strategy_spaces={**profile.strategy_spaces, **spaces})


def plan_from(evaluated: Evaluated, cluster: Cluster, state: Any, ideal: float | None = None):
  """The runnable :class:`~hetspmd.plan.value.Plan` of one search result."""
  from hetspmd.plan.value import Plan, zero_shards_for

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
  model_specs = _model_specs(state, axes, dict(tp.model_dims))
  shards = zero_shards_for(state, axes, shape, evaluated.zero_stage, model_specs=model_specs)
  return Plan(axis_names=axes, mesh_shape=shape, device_ids=device_ids, global_batch=evaluated.global_batch,
              microbatch=evaluated.microbatch, microbatch_counts=evaluated.counts,
              state_specs=state_specs(state, axes, shape, evaluated.zero_stage, dict(tp.model_dims), shards),
              zero_stage=evaluated.zero_stage, zero_shards=shards, remat=evaluated.remat,
              grad_reduce_dtype=evaluated.grad_reduce_dtype,
              overlap_reduction=evaluated.overlap, overlap_microbatches=evaluated.overlap_microbatches,
              device_kinds=tuple(k for k in evaluated.kinds for _ in range(tp.m)), predicted=tuple(predicted.items()),
              predicted_per_position=per_position)


def state_specs(state: Any, axis_names: Sequence[str], mesh_shape: Sequence[int], zero_stage: int,
                model_dims: dict[str, int], zero_shards: int = 0) -> tuple[tuple[str, tuple], ...]:
  """PartitionSpecs of every state leaf: the chosen model-axis splits, then ZeRO over data.

  ``model_dims`` maps parameter paths (``params/h/0/mlp/c_fc/kernel``) to the
  dimension split over the model axis; the optimizer state that mirrors a
  parameter follows it, and ZeRO is added as in
  :func:`hetspmd.plan.value.auto_state_specs`.
  """
  from hetspmd.plan.value import auto_state_specs

  model_specs = _model_specs(state, axis_names, model_dims)
  return auto_state_specs(state, axis_names, mesh_shape, zero_stage, model_specs=model_specs, zero_shards=zero_shards)


def _model_specs(state: Any, axis_names: Sequence[str], model_dims: dict[str, int]) -> dict[str, tuple]:
  """``{path suffix: spec}`` of the chosen model-axis splits, for :func:`hetspmd.plan.value.auto_state_specs`."""
  from hetspmd._pytree import leaves_with_paths
  from hetspmd.plan.value import _role_of

  model = axis_names[1] if len(axis_names) > 1 else None
  # Every parameter gets an entry (whole ones too), keyed by its path below the
  # state's top level, so the longest-suffix match never borrows another's.
  model_specs = {}
  for path, leaf in leaves_with_paths(state):
    if path in model_dims or _role_of(path, getattr(leaf, "dtype", "float32")) == "param":
      dim = model_dims.get(path)
      model_specs[path.split("/", 1)[-1]] = () if dim is None or model is None else (None,) * dim + (model,)
  return model_specs


def search_step(fn: Callable[..., Any], state: Any, batch: Any, cluster: Cluster, *, global_batch: int,
                top: int = 5, progress: Callable[[str], None] | None = None,
                models: Sequence[int] | None = None, grad_reduce_dtypes: Sequence[str] = ("float32",),
                overlap: bool = True, fuse_overlap: bool = True) -> SearchResult:
  """``hetspmd.search``: trace ``fn(state, batch)``, cost it, and rank plans for ``cluster``.

  ``fuse_overlap=False`` for a step with per-microbatch batch statistics (BatchNorm under
  ``batch_stats="local"``): a fused overlapped pass would compute them over several microbatches.
  """
  if not isinstance(global_batch, int) or global_batch < 1:
    from hetspmd.errors import InvalidValueError

    raise InvalidValueError(f"global_batch must be a positive integer, got {global_batch!r}")
  if progress:
    progress("tracing the step at two batch sizes")
  return search(cluster, profile_step(fn, state, batch), global_batch, top, progress, models,
                grad_reduce_dtypes=grad_reduce_dtypes, overlap=overlap, fuse_overlap=fuse_overlap)
