"""Plan search: device-weighted data parallelism × tensor parallelism, under memory limits.

For a model's :class:`~hetspmd.passes.cost.StepProfile` and a cluster, the
search tries every candidate of

* layout: every ``(data, model)`` shape of
  :func:`~hetspmd.mesh.enumerate_layouts` (a model group is ``model``
  consecutive devices of one kind in one host);
* device set: every device, the devices of the fastest kinds only (the
  slowest kinds left out, which wins on slow networks), and each single
  kind, in whole model groups;
* tensor-parallel choice (``model > 1``): the per-operation strategies of
  :mod:`hetspmd.passes.strategies`. Their ILP is solved once per (model
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
across data positions (:mod:`hetspmd.data_axis`), less what of it hides
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
import math
import time
from typing import Any, Callable, Sequence

import numpy as np

from hetspmd.cluster import Cluster
from hetspmd.data_axis import (NO_TENSOR_PARALLEL, REDUCE_BYTES, TensorParallel, gather_seconds, gradient_reductions,
                               gradient_seconds, memory_per_device, zero_split)
from hetspmd.errors import HetSpmdError
from hetspmd.passes import _jax_adapter as jx, strategies, strategy_ilp
from hetspmd.passes.cost import StepProfile
from hetspmd.plan import REMAT_POLICIES

# remat "full" checkpoints the whole loss: it runs the forward pass twice and lowers no peak (see
# data_axis.activation_share), so it never wins and is not searched
SEARCHED_REMAT = tuple(r for r in REMAT_POLICIES if r != "full")

ZERO_STAGES = (0, 1, 3)
# Share of the last microbatch's backward pass that hides gradient reductions overlapped with it: the
# collectives' kernels share the device with the backward's (not yet calibrated on a device)
OVERLAP_EFFICIENCY = 0.8
MODEL_SIZES = (2, 4, 8)       # model-axis sizes whose strategy spaces profile_step prepares
FRONTIER_POINTS = 3           # tensor-parallel choices per (model size, kind) below the fastest


class PlanDoesNotFitError(HetSpmdError):
  """No candidate fits device memory."""




@dataclasses.dataclass(frozen=True)
class Evaluated:
  """One costed candidate plan."""

  name: str
  device_positions: tuple[int, ...]   # cluster device ids in mesh order (data-major)
  kinds: tuple[str, ...]              # per data position
  microbatch: int
  counts: tuple[int, ...]             # per data position
  zero_stage: int
  remat: str                          # a plan remat policy: one of hetspmd.plan.REMAT_POLICIES
  compute_seconds: float              # slowest position, tensor-parallel collectives included
  comm_seconds: float                 # gradient reduction over data
  memory_bytes: tuple[int, ...]       # per device
  global_batch: int
  tensor_parallel: TensorParallel = NO_TENSOR_PARALLEL
  model_comm_seconds: float = 0.0     # the slowest position's tensor-parallel collectives
  position_seconds: tuple[float, ...] = ()  # per data position: its microbatches' time
  grad_reduce_dtype: str = "float32"  # the dtype gradients cross data in
  overlap: bool = False               # reductions overlapped with the last microbatch's backward pass
  hidden_seconds: float = 0.0         # of comm_seconds: hidden behind that backward pass
  overlap_microbatches: int = 1       # the overlapped last pass runs this many microbatches as one batch

  @property
  def model(self) -> int:
    return self.tensor_parallel.m

  @property
  def step_seconds(self) -> float:
    return self.compute_seconds + self.comm_seconds - self.hidden_seconds

  @property
  def throughput(self) -> float:
    return self.global_batch / self.step_seconds

  def to_json(self, ideal: float) -> dict[str, Any]:
    return {
        "name": self.name,
        "throughput": self.throughput,
        "predicted_step_seconds": self.step_seconds,
        "compute_seconds": self.compute_seconds,
        "communication_seconds": self.comm_seconds,
        "hidden_communication_seconds": self.hidden_seconds,
        "grad_reduce_dtype": self.grad_reduce_dtype,
        "overlap_reduction": self.overlap,
        "overlap_microbatches": self.overlap_microbatches,
        "model_communication_seconds": self.model_comm_seconds,
        "efficiency": self.throughput / ideal,
        "mesh": {"data": len(self.counts), "model": self.model},
        "tensor_parallel": self.tensor_parallel.description,
        "devices": list(self.device_positions),
        "kinds": list(self.kinds),
        "microbatch": self.microbatch,
        "microbatch_counts": list(self.counts),
        "zero_stage": self.zero_stage,
        "remat": self.remat,
        "memory_bytes": list(self.memory_bytes),
    }


@dataclasses.dataclass(frozen=True)
class SearchResult:
  plans: tuple[Evaluated, ...]
  baselines: dict[str, Evaluated]
  ideal_throughput: float
  search_seconds: float
  candidates: int


@dataclasses.dataclass(frozen=True)
class _KindCost:
  micro: float  # seconds per microbatch
  fixed: float  # seconds per step
  model_comm: float = 0.0  # of micro: tensor-parallel collectives
  first: float = 0.0  # seconds the first microbatch costs over a later one

  def at(self, count: int) -> float:
    """Seconds of a position with ``count`` microbatches."""
    return self.fixed + (self.first + self.micro * count if count > 0 else 0.0)


# --- counts -------------------------------------------------------------------------


def milp_counts(kinds: Sequence[str], costs: dict[str, _KindCost], total: int) -> tuple[int, ...]:
  """Per-device counts minimising the slowest device's time; ``sum == total`` (reference MILP).

  Variables per kind ``k`` with ``n_k`` devices: base count ``c_k``, how many
  of its devices take one more ``e_k`` (``0 <= e_k <= n_k z_k``), the binary
  ``z_k``; and the makespan ``T >= fixed_k + micro_k (c_k + z_k)``, where
  ``fixed_k`` includes the first microbatch's extra (:attr:`_KindCost.first`).
  """
  from scipy.optimize import Bounds, LinearConstraint, milp

  order = list(dict.fromkeys(kinds))
  n = {k: kinds.count(k) for k in order}
  K = len(order)
  # x = [c_0..c_K-1, e_0.., z_0.., T]
  size = 3 * K + 1
  c_idx, e_idx, z_idx, t_idx = (lambda i: i), (lambda i: K + i), (lambda i: 2 * K + i), 3 * K
  rows, lower, upper = [], [], []
  cover = np.zeros(size)
  for i, k in enumerate(order):
    cover[c_idx(i)], cover[e_idx(i)] = n[k], 1
  rows.append(cover), lower.append(total), upper.append(total)
  for i, k in enumerate(order):
    link = np.zeros(size)
    link[e_idx(i)], link[z_idx(i)] = 1, -n[k]
    rows.append(link), lower.append(-np.inf), upper.append(0)
    makespan = np.zeros(size)
    makespan[t_idx], makespan[c_idx(i)], makespan[z_idx(i)] = 1, -costs[k].micro, -costs[k].micro
    rows.append(makespan), lower.append(costs[k].fixed + costs[k].first), upper.append(np.inf)
  objective = np.zeros(size)
  objective[t_idx] = 1
  integrality = np.ones(size)
  integrality[t_idx] = 0
  ub = np.full(size, np.inf)
  for i, k in enumerate(order):
    ub[e_idx(i)], ub[z_idx(i)] = n[k], 1
  result = milp(objective, constraints=LinearConstraint(np.array(rows), lower, upper), integrality=integrality,
                bounds=Bounds(np.zeros(size), ub))
  if not result.success:
    raise HetSpmdError(f"count MILP failed: {result.message}")
  x = np.round(result.x).astype(int)
  counts, extra_left = [], {k: x[e_idx(i)] for i, k in enumerate(order)}
  for kind in kinds:
    i = order.index(kind)
    bump = 1 if extra_left[kind] > 0 else 0
    extra_left[kind] -= bump
    counts.append(int(x[c_idx(i)] + bump))
  return tuple(counts)


def balanced_counts(kinds: Sequence[str], costs: dict[str, _KindCost], total: int) -> tuple[int, ...]:
  """Per-position counts minimising the slowest position's time; ``sum == total``.

  Start from the continuous bound on the makespan ``T`` (every position busy
  until ``T``, no one below its per-step work) and step through the
  breakpoints ``fixed_k + micro_k c`` until the capacity ``sum_k n_k
  floor((T - fixed_k) / micro_k)`` covers ``total``; then take the surplus,
  one microbatch at a time, from the kind whose busiest position finishes
  last. Counts within a kind differ by at most one, the first positions of a
  kind taking the larger. ``fixed_k`` includes the first microbatch's extra.
  """
  order = list(dict.fromkeys(kinds))
  n = {k: kinds.count(k) for k in order}
  micro = {k: max(costs[k].micro, 1e-300) for k in order}
  fixed = {k: costs[k].fixed + costs[k].first for k in order}
  rate = sum(n[k] / micro[k] for k in order)
  bound = max(max(fixed.values()), (total + sum(n[k] * fixed[k] / micro[k] for k in order)) / rate)
  top = {k: max(0, math.floor((bound - fixed[k]) / micro[k] * (1 - 1e-12))) for k in order}
  capacity = sum(n[k] * top[k] for k in order)
  while capacity < total:
    kind = min(order, key=lambda k: fixed[k] + micro[k] * (top[k] + 1))
    top[kind] += 1
    capacity += n[kind]
  full = dict(n)  # positions of each kind at the top count; the rest hold one less
  surplus = capacity - total
  while surplus > 0:
    kind = max((k for k in order if top[k] > 0), key=lambda k: fixed[k] + micro[k] * top[k])
    take = min(surplus, full[kind])
    full[kind] -= take
    surplus -= take
    if full[kind] == 0:
      top[kind] -= 1
      full[kind] = n[kind]
  counts, seen = [], {k: 0 for k in order}
  for kind in kinds:
    counts.append(top[kind] if seen[kind] < full[kind] else top[kind] - 1)
    seen[kind] += 1
  return tuple(counts)


def even_counts(n: int, total: int) -> tuple[int, ...]:
  return tuple(total // n + (1 if i < total % n else 0) for i in range(n))


def proportional(weights: Sequence[float], total: int) -> tuple[int, ...]:
  from hetspmd.plan import proportional_counts

  return proportional_counts(weights, total)


# --- layouts and tensor-parallel choices -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Layout:
  """A device set cut into model groups (data positions)."""

  name: str
  groups: tuple[tuple[int, ...], ...]
  kinds: tuple[str, ...]        # per group
  hosts: dict[int, int]         # host -> groups in it
  memory: int                   # smallest device memory
  devices: tuple[int, ...]      # the groups, flattened

  @property
  def m(self) -> int:
    return len(self.groups[0])


def _layout(cluster: Cluster, name: str, positions: Sequence[int], m: int) -> _Layout:
  devices = cluster.devices
  groups = tuple(tuple(positions[i:i + m]) for i in range(0, len(positions), m))
  for g in groups:
    if len(g) != m or len({devices[i].host for i in g}) != 1:
      raise HetSpmdError(f"devices {list(g)} do not form a model group of {m} in one host")
  hosts: dict[int, int] = {}
  for g in groups:
    hosts[devices[g[0]].host] = hosts.get(devices[g[0]].host, 0) + 1
  return _Layout(name, groups, tuple(devices[g[0]].spec.name for g in groups), hosts,
                 min(devices[i].spec.memory_bytes for i in positions), tuple(positions))


class _Costing:
  """Per-search caches: per-node seconds, strategy spaces, ILP frontiers, assessed choices."""

  def __init__(self, cluster: Cluster, profile: StepProfile, reference_microbatch: int, recompute: float = 1.0):
    self.cluster, self.profile, self.reference = cluster, profile, reference_microbatch
    self.recompute = recompute
    self.specs = {k: cluster.spec_of(k) for k in cluster.kinds}
    self.links = {k: min((h.intra for h in cluster.hosts if h.device.name == k), key=lambda l: l.bandwidth)
                  for k in cluster.kinds}
    self.fixed = {k: profile.step_fixed_seconds(s) for k, s in self.specs.items()}
    self._node_seconds: dict[tuple[str, int], np.ndarray] = {}
    self._spaces: dict[int, strategies.StrategySpace] = dict(profile.strategy_spaces)
    self._frontiers: dict[int, tuple[TensorParallel, ...]] = {}
    self._assessed: dict[tuple, strategy_ilp.Solution] = {}
    self._remat: dict[tuple[str, int, str], float] = {}
    self._reductions: dict[tuple, float] = {}
    self._first: dict[tuple[str, int], float] = {}
    self._backward: dict[tuple[str, int], float] = {}

  def gradient_seconds(self, layout: "_Layout", tp: TensorParallel, zero: int,
                       reduce_dtype: str = "float32") -> tuple[float, float]:
    """(:func:`gradient_seconds` in ``reduce_dtype``, ZeRO's parameter gather: :func:`gather_seconds`)."""
    key = (tuple(sorted(layout.hosts.items())), tp.m, tp.param_share, min(zero, 1), reduce_dtype)
    if key not in self._reductions:
      reduce = gradient_seconds(self.cluster, layout.hosts, self.profile, tp, zero, REDUCE_BYTES[reduce_dtype])
      gather = gather_seconds(self.cluster, layout.hosts, self.profile, tp) if zero >= 1 else 0.0
      self._reductions[key] = (reduce, gather)
    return self._reductions[key]

  def backward_share(self, kind: str, microbatch: int) -> float:
    """The backward pass's share of a microbatch's compute (what an overlapped reduction can hide behind)."""
    key = (kind, microbatch)
    if key not in self._backward:
      seconds = self.node_seconds(kind, microbatch)
      plain = float(seconds.sum())
      backward = float(seconds[~self.profile.forward].sum()) if self.profile.forward.size else 2 * plain / 3
      self._backward[key] = backward / plain if plain > 0 else 0.0
    return self._backward[key]

  def node_seconds(self, kind: str, microbatch: int) -> np.ndarray:
    key = (kind, microbatch)
    if key not in self._node_seconds:
      self._node_seconds[key] = self.profile.node_seconds(self.specs[kind], microbatch) * ~self.profile.per_step
    return self._node_seconds[key]

  def space(self, m: int) -> strategies.StrategySpace:
    """Prepared by :func:`profile_step` for :data:`MODEL_SIZES`; built here (once) for other sizes."""
    if m not in self._spaces:
      self._spaces[m] = strategies.strategy_space(self.profile, m)
    return self._spaces[m]

  def choices(self, m: int) -> tuple[TensorParallel, ...]:
    """The union over kinds of each kind's time/memory frontier on a model axis of ``m``."""
    if m == 1:
      return (NO_TENSOR_PARALLEL,)
    if m not in self._frontiers:
      space, found = self.space(m), {}
      for kind in self.cluster.kinds:
        for solution in strategy_ilp.frontier(space, self.node_seconds(kind, self.reference), self.links[kind],
                                            self.reference, FRONTIER_POINTS + 1):
          found.setdefault(solution.choice, solution)
      self._frontiers[m] = tuple(_tensor_parallel(space, s) for s in found.values())
    return self._frontiers[m]

  def first_extra(self, kind: str, microbatch: int) -> float:
    """The first microbatch's extra seconds over a later one (writes to fresh memory), without tensor parallelism."""
    key = (kind, microbatch)
    if key not in self._first:
      self._first[key] = self.profile.first_microbatch_extra_seconds(self.specs[kind], microbatch)
    return self._first[key]

  def remat_factor(self, kind: str, microbatch: int, remat: str) -> float:
    """Compute with the policy's recomputation over compute without."""
    key = (kind, microbatch, remat)
    if key not in self._remat:
      seconds = self.node_seconds(kind, microbatch)
      plain = float(seconds.sum())
      again = float(seconds[self.profile.recomputed(remat)].sum())
      self._remat[key] = (1.0 + again / plain if plain > 0 else 1.0) * self.recompute
    return self._remat[key]

  def kind_cost(self, kind: str, tp: TensorParallel, microbatch: int, remat: str, zero: int, n: int) -> _KindCost:
    remat_factor = self.remat_factor(kind, microbatch, remat)
    zs = zero_split(self.profile, n, tp)
    fixed = self.fixed[kind] * tp.param_share * (zs.kept(n) if zero >= 1 else 1)  # the update runs on ZeRO's shards
    if zero >= 1 and n > 1:  # every device writes the gathered parameters into its memory
      fixed += self.profile.param_bytes * zs.gathered * tp.param_share / self.specs[kind].write_rate
    accumulate = self.profile.accumulate_seconds(self.specs[kind]) * tp.param_share
    plain = float(self.node_seconds(kind, microbatch).sum())
    first = self.first_extra(kind, microbatch) * remat_factor
    if tp.m == 1:
      return _KindCost(plain * remat_factor + accumulate, fixed, first=first)
    key = (tp.m, tp.choice, kind, microbatch)
    if key not in self._assessed:
      self._assessed[key] = strategy_ilp.assess(self.space(tp.m), tp.choice, self.node_seconds(kind, microbatch),
                                              self.links[kind], microbatch)
    solution = self._assessed[key]
    share = solution.compute_seconds / plain if plain > 0 else 1.0
    return _KindCost(solution.compute_seconds * remat_factor + solution.comm_seconds + accumulate, fixed,
                     solution.comm_seconds, first * share)


def _tensor_parallel(space: strategies.StrategySpace, solution: strategy_ilp.Solution) -> TensorParallel:
  m = space.m
  sharded = sum(d.options[o].activation_share for d, o in zip(space.decisions, solution.choice))
  return TensorParallel(
      m=m, choice=solution.choice, description=strategy_ilp.describe(space, solution.choice),
      model_dims=tuple(sorted(strategy_ilp.param_dims(space, solution.choice).items())),
      param_share=solution.param_elements / max(1, space.param_elements),
      activation_share=max(1 / m, 1 - min(1.0, sharded) * (1 - 1 / m)))


# --- evaluation ------------------------------------------------------------------------


def _evaluate(costing: _Costing, layout: _Layout, tp: TensorParallel, microbatch: int, zero: int, remat: str,
              global_batch: int, counts_rule: Any, name: str, reduce_dtypes: Sequence[str] = ("float32",),
              overlap: bool = False, fuse: bool = False) -> list[Evaluated]:
  """One candidate costed once per reduce dtype (the counts and compute are the same for all).

  ``overlap``: each position's last microbatch runs after its loop (a position with none runs one,
  masked), and the gradient reductions hide behind the busiest one's backward pass. ``fuse`` (weighted
  counts only): also try that last pass as ``k`` microbatches run as one batch (:func:`_fused`).
  """
  n = len(layout.groups)
  total = global_batch // microbatch
  costs = {k: costing.kind_cost(k, tp, microbatch, remat, zero, n) for k in dict.fromkeys(layout.kinds)}
  counts = counts_rule(layout.kinds, costs) if callable(counts_rule) else tuple(counts_rule)
  if len(counts) != n or sum(counts) != total:
    return []
  memory = (memory_per_device(costing.profile, n, microbatch, zero, remat, tp),) * len(layout.devices)
  # a masked microbatch on a position with none can cost more than the overlap saves: try both
  options = [False, True] if overlap and n > 1 and min(counts) == 0 else [overlap and n > 1]
  timed = []
  for peeled in options:
    per_position = _position_seconds(costing, layout, costs, counts, peeled)
    busiest = max(range(n), key=lambda i: per_position[i])
    kind = layout.kinds[busiest]
    # the final loop's last microbatch: not the earlier loops' recomputed work (exact batch statistics)
    window = OVERLAP_EFFICIENCY * costs[kind].micro / costing.recompute * costing.backward_share(kind, microbatch)
    model_comm = costs[kind].model_comm * max(counts[busiest], int(peeled))
    timed.append((peeled, tuple(counts), per_position, busiest, window if peeled else 0.0, model_comm, memory, 1))
  if fuse and overlap and n > 1:
    timed += _fused(costing, layout, tp, microbatch, zero, remat, total)
  reductions = gradient_reductions(costing.profile, tp.m)
  out = []
  for dtype in reduce_dtypes:
    reduce, gather = costing.gradient_seconds(layout, tp, zero, dtype)
    best = None
    for peeled, counts, per_position, busiest, window, model_comm, memory, k in timed:
      # all but the last collective can run under the busiest position's last backward pass
      hidden = min(window, reduce * (1 - 1 / reductions))
      if k > 1 and hidden <= 0:  # a fused pass with nothing to hide is only a coarser weighting
        continue
      e = Evaluated(name, layout.devices, layout.kinds, microbatch, counts, zero, remat, per_position[busiest],
                    reduce + gather, memory, global_batch, tp, model_comm, per_position,
                    dtype, peeled and hidden > 0, hidden, k)
      if best is None or e.step_seconds < best.step_seconds:
        best = e
    out.append(best)
  return out


# the fused pass's sizes tried, as shares of the most microbatches every position can run
FUSED_SHARES = (1.0, 0.875, 0.75, 0.5, 0.25)


def _fused(costing: _Costing, layout: _Layout, tp: TensorParallel, microbatch: int, zero: int, remat: str,
           total: int) -> list[tuple]:
  """Timings of the candidate with its overlapped last pass fused: ``k`` microbatches run as one batch.

  A bigger last pass has a longer backward pass to hide the gradient reductions under, while the loop's
  small microbatches still weight the positions: position ``i`` runs ``counts[i] - k`` microbatches in
  its loop, then ``k * microbatch`` examples at once. Every position runs the fused pass, so the counts
  are the weighted counts of the other ``total - n k`` microbatches, on top of ``k`` each.
  """
  n = len(layout.groups)
  most = total // n
  out = []
  for k in sorted({max(2, round(share * most)) for share in FUSED_SHARES if share * most >= 2}):
    if total == n * k:  # the fused pass is all of every position's work: the plain plan at k * microbatch
      continue
    size = k * microbatch
    memory = (memory_per_device(costing.profile, n, size, zero, remat, tp),) * len(layout.devices)
    if memory[0] > layout.memory:
      continue
    costs, fused, loop_costs = {}, {}, {}
    for kind in dict.fromkeys(layout.kinds):
      loop, last = costing.kind_cost(kind, tp, microbatch, remat, zero, n), costing.kind_cost(kind, tp, size, remat,
                                                                                           zero, n)
      # for the counts: every position runs the fused pass, then its share of the loop
      costs[kind] = _KindCost(loop.micro, loop.fixed + last.micro, loop.model_comm, max(loop.first, last.first))
      fused[kind], loop_costs[kind] = last, loop
    extra = balanced_counts(layout.kinds, costs, total - n * k)
    # the fused pass, then the loop (its first microbatch writing to fresh memory), or the pass alone first
    work = [fused[kind].micro + (loop_costs[kind].first + loop_costs[kind].micro * c if c else fused[kind].first)
            for kind, c in zip(layout.kinds, extra)]
    per_position = _shared_seconds(costing, layout, loop_costs, work)
    busiest = max(range(n), key=lambda i: per_position[i])
    kind = layout.kinds[busiest]
    window = OVERLAP_EFFICIENCY * fused[kind].micro / costing.recompute * costing.backward_share(kind, size)
    model_comm = costs[kind].model_comm * extra[busiest] + fused[kind].model_comm
    out.append((True, tuple(c + k for c in extra), per_position, busiest, window, model_comm, memory, k))
  return out


def _position_seconds(costing: _Costing, layout: _Layout, costs: dict, counts: Sequence[int],
                      peeled: bool) -> tuple[float, ...]:
  """Each position's seconds for its microbatches (one at least when ``peeled``), on hosts that share compute."""
  work = [costs[k].at(max(c, 1) if peeled else c) - costs[k].fixed for k, c in zip(layout.kinds, counts)]
  return _shared_seconds(costing, layout, costs, work)


def _shared_seconds(costing: _Costing, layout: _Layout, costs: dict, work: list[float]) -> tuple[float, ...]:
  """Each position's per-step seconds plus its microbatch ``work``, on hosts whose devices share compute."""
  cluster = costing.cluster
  for h in layout.hosts:
    host = cluster.hosts[h]
    if host.alone_speedup > 1.0:
      mine = [i for i, g in enumerate(layout.groups) if cluster.devices[g[0]].host == h]
      finish = shared_finish_times([work[i] for i in mine], layout.m, host.count, host.alone_speedup)
      for i, f in zip(mine, finish):
        work[i] = f
  return tuple(costs[k].fixed + w for k, w in zip(layout.kinds, work))


def shared_finish_times(seconds: Sequence[float], group: int, capacity: int, speedup: float) -> tuple[float, ...]:
  """When each position finishes its work on a host whose devices share compute.

  ``seconds[i]``: position ``i``'s work at the rate of one device while all
  ``capacity`` devices of the host are busy; a position occupies ``group``
  devices. Processor sharing: while ``k`` positions are unfinished each runs
  ``min(speedup, capacity / (k × group))`` times that rate, so positions that
  finish early leave their share to the rest.
  """
  order = sorted(range(len(seconds)), key=lambda i: seconds[i])
  finish = [0.0] * len(seconds)
  now = done = 0.0
  for rank, i in enumerate(order):
    active = len(order) - rank
    rate = min(speedup, capacity / (active * group))
    now += (seconds[i] - done) / max(rate, 1e-12)
    done = seconds[i]
    finish[i] = now
  return tuple(finish)


def evaluate(cluster: Cluster, profile: StepProfile, positions: Sequence[int], microbatch: int, zero: int,
             remat: str, global_batch: int, counts_rule: Callable[[Sequence[str], dict], tuple[int, ...]] | Any,
             name: str, tensor_parallel: TensorParallel = NO_TENSOR_PARALLEL, reduce_dtype: str = "float32",
             overlap: bool = False) -> Evaluated | None:
  """Costs one candidate: ``positions`` (device ids) cut into groups of ``tensor_parallel.m``."""
  costing = _Costing(cluster, profile, microbatch)
  layout = _layout(cluster, name, positions, tensor_parallel.m)
  found = _evaluate(costing, layout, tensor_parallel, microbatch, zero, remat, global_batch, counts_rule, name,
                    (reduce_dtype,), overlap)
  return found[0] if found else None


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
  """Model-axis sizes of the cluster's layouts (:func:`~hetspmd.mesh.enumerate_layouts`)."""
  from hetspmd.mesh import enumerate_layouts

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
  statistics, whose earlier loops run part of the forward pass again: :func:`hetspmd.lowering.recompute_factor`).
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
  costing = _Costing(cluster, profile, sizes[len(sizes) // 2], recompute)
  tensor_parallel = bool(profile.traces or profile.strategy_spaces)  # a hand-made profile has no graph to split
  ms = tuple(m for m in model_sizes(cluster) if (models is None or m in models) and (m == 1 or tensor_parallel))
  plans: list[Evaluated] = []
  best: dict[str, Evaluated] = {}
  overflow: list[Evaluated] = []
  candidates = 0

  made: dict[tuple, _Layout] = {}

  def layout_of(name: str, positions: tuple[int, ...], m: int) -> _Layout:
    if (positions, m) not in made:
      made[(positions, m)] = _layout(cluster, name, positions, m)
    return dataclasses.replace(made[(positions, m)], name=name)

  def consider(e: Evaluated | None, layout: _Layout, bucket: str | None) -> None:
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

  def fastest_fitting(layout: _Layout, microbatch: int, zero: int, remat: str, rule: Any, name: str,
                      bucket: str | None, fuse: bool = False) -> None:
    """The layout's candidates with every tensor-parallel choice that fits (the leanest if none does)."""
    choices = costing.choices(layout.m)
    fitting = [tp for tp in choices
               if memory_per_device(profile, len(layout.groups), microbatch, zero, remat, tp) <= layout.memory]
    for tp in fitting or [min(choices, key=lambda t: t.param_share)]:
      dtypes = tuple(grad_reduce_dtypes) if layout.m == 1 else ("float32",)
      for e in _evaluate(costing, layout, tp, microbatch, zero, remat, global_batch, rule, name, dtypes, overlap,
                         fuse=fuse):
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
              for e in _evaluate(costing, layouts["all"], NO_TENSOR_PARALLEL, microbatch, zero, remat,
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
  from hetspmd.passes import cost, trace

  small, large = PROFILE_BATCHES
  graphs = [trace(fn, state, _with_batch(batch, b)) for b in PROFILE_BATCHES]
  return with_strategy_spaces(cost.step_profile(graphs[0], graphs[1], small, large))


def with_strategy_spaces(profile: StepProfile, sizes: Sequence[int] = MODEL_SIZES) -> StepProfile:
  """``profile`` with the tensor-parallel strategy spaces of ``sizes`` built (the search reuses them)."""
  spaces = {m: strategies.strategy_space(profile, m) for m in sizes}
  return dataclasses.replace(profile, strategy_spaces={**profile.strategy_spaces, **spaces})


def plan_from(evaluated: Evaluated, cluster: Cluster, state: Any, ideal: float | None = None):
  """The runnable :class:`~hetspmd.plan.Plan` of one search result."""
  from hetspmd.plan import Plan, zero_shards_for

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
  :func:`hetspmd.plan.auto_state_specs`.
  """
  from hetspmd.plan import auto_state_specs

  model_specs = _model_specs(state, axis_names, model_dims)
  return auto_state_specs(state, axis_names, mesh_shape, zero_stage, model_specs=model_specs, zero_shards=zero_shards)


def _model_specs(state: Any, axis_names: Sequence[str], model_dims: dict[str, int]) -> dict[str, tuple]:
  """``{path suffix: spec}`` of the chosen model-axis splits, for :func:`hetspmd.plan.auto_state_specs`."""
  from hetspmd._pytree import leaves_with_paths
  from hetspmd.plan import _role_of

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
