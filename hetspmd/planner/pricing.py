"""Pricing one candidate plan: per-kind costs, microbatch counts, the overlapped and fused last pass.

A candidate is a device set cut into model groups (:class:`DeviceGroups`, one data position each), a
tensor-parallel choice, a microbatch size, a ZeRO stage and a remat policy. :class:`Costing` holds the
search's caches (per-node seconds, strategy spaces, ILP frontiers); :func:`price_candidate` turns one
candidate into an :class:`Evaluated` per reduce dtype: counts per position (:func:`balanced_counts`, or a
baseline's rule), each position's seconds on hosts whose devices share compute, the gradient reduction and
what of it hides behind the busiest position's last backward pass, and memory per device. The model behind
the numbers is described in :mod:`hetspmd.planner.ranking` and ``docs/cost-model.md``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import numpy as np

from hetspmd.hardware.cluster import Cluster
from hetspmd.planner.data_axis import (NO_TENSOR_PARALLEL, REDUCE_BYTES, TensorParallel, gather_seconds, gradient_reductions,
                               gradient_seconds, memory_per_device, zero_split)
from hetspmd.errors import HetSpmdError
from hetspmd.passes.sharding import ilp as strategy_ilp, strategies
from hetspmd.passes.costing.step_cost import StepProfile
from hetspmd.passes.profile import block_nodes, layer_nodes
from hetspmd.hardware.calibration import KindTiming
from hetspmd.plan.counts import KindCost, balanced_counts

# Share of the last microbatch's backward pass that hides gradient reductions overlapped with it: the
# collectives' kernels share the device with the backward's (not yet calibrated on a device)
OVERLAP_EFFICIENCY = 0.8
FRONTIER_POINTS = 3           # tensor-parallel choices per (model size, kind) below the fastest


@dataclasses.dataclass(frozen=True)
class Evaluated:
  """One costed candidate plan."""

  name: str
  device_positions: tuple[int, ...]   # cluster device ids in mesh order (data-major)
  kinds: tuple[str, ...]              # per data position
  microbatch: int
  counts: tuple[int, ...]             # per data position
  zero_stage: int
  remat: str                          # a plan remat policy: one of hetspmd.plan.options.REMAT_POLICIES
  compute_seconds: float              # slowest position, tensor-parallel collectives included
  comm_seconds: float                 # gradient reduction over data
  memory_bytes: tuple[int, ...]       # per device (of device_positions)
  global_batch: int
  tensor_parallel: TensorParallel = NO_TENSOR_PARALLEL
  model_comm_seconds: float = 0.0     # the slowest position's tensor-parallel collectives
  position_seconds: tuple[float, ...] = ()  # per data position: its microbatches' time
  grad_reduce_dtype: str = "float32"  # the dtype gradients cross data in
  overlap: bool = False               # reductions overlapped with the last microbatch's backward pass
  hidden_seconds: float = 0.0         # of comm_seconds: hidden behind that backward pass
  overlap_microbatches: int = 1       # the overlapped last pass runs this many microbatches as one batch
  group: GroupPart | None = None      # a group plan's own part; None for a single program

  @property
  def examples(self) -> tuple[int, ...]:
    """Examples per data position."""
    if self.group is None:
      return tuple(c * self.microbatch for c in self.counts)
    (size, count), sizes = self.group.tail, self.group.microbatches
    return tuple(c * m + size * count for c, m in zip(self.counts, sizes))

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
        **(self.group.to_json() if self.group is not None else {}),
    }


@dataclasses.dataclass(frozen=True)
class GroupPart:
  """What a group plan's :class:`Evaluated` adds to the shared core, per data position: its own microbatch
  size, state share, remat policy, model axis and whether its group shards its parameters; the tail; and how the
  plan runs (:class:`~hetspmd.plan.execution.Execution`), as priced."""

  microbatches: tuple[int, ...]       # each position's own microbatch size
  tail: tuple[int, int] = (0, 0)      # (microbatch, count) every position runs in the uniform program
  state_shares: tuple[float, ...] = ()  # each position's share of the optimizer state (ZeRO-1)
  remats: tuple[str, ...] = ()        # each position's remat policy (Evaluated.remat: the tail's)
  group_models: tuple[TensorParallel, ...] = ()  # each position's model axis (none: one device each)
  shard_params: tuple[bool, ...] = ()  # whether each position's group shards its parameters (FSDP)
  execution: Any = None               # how it runs, as priced

  def to_json(self) -> dict[str, Any]:
    return {"microbatches": list(self.microbatches), "tail": {"microbatch": self.tail[0], "count": self.tail[1]},
            "state_shares": list(self.state_shares), "remats": list(self.remats),
            **({"group_models": [tp.m for tp in self.group_models]} if self.group_models else {}),
            **({"shard_params": list(self.shard_params)} if self.shard_params else {})}


# --- layouts and tensor-parallel choices -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeviceGroups:
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

  @functools.cached_property
  def order(self) -> tuple[str, ...]:
    """The kinds in order of first appearance."""
    return tuple(dict.fromkeys(self.kinds))

  @functools.cached_property
  def kind_counts(self) -> dict[str, int]:
    """Each kind's positions."""
    return {k: self.kinds.count(k) for k in self.order}

  @functools.cached_property
  def kind_index(self) -> np.ndarray:
    """Each position's kind as its index in :attr:`order`."""
    at = {k: i for i, k in enumerate(self.order)}
    return np.array([at[k] for k in self.kinds], dtype=np.intp)


def device_groups(cluster: Cluster, name: str, positions: Sequence[int], m: int) -> DeviceGroups:
  devices = cluster.devices
  groups = tuple(tuple(positions[i:i + m]) for i in range(0, len(positions), m))
  for g in groups:
    if len(g) != m or len({devices[i].host for i in g}) != 1:
      raise HetSpmdError(f"devices {list(g)} do not form a model group of {m} in one host")
  hosts: dict[int, int] = {}
  for g in groups:
    hosts[devices[g[0]].host] = hosts.get(devices[g[0]].host, 0) + 1
  return DeviceGroups(name, groups, tuple(devices[g[0]].spec.name for g in groups), hosts,
                 min(devices[i].spec.memory_bytes for i in positions), tuple(positions))


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One point of the search: a device layout cut into model groups, a microbatch size, a ZeRO stage, a remat
  policy, the rule that sets each position's microbatch count (``counts(kinds, costs)``, or the counts
  themselves), a tensor-parallel choice, the dtypes the gradients may cross ``data`` in, and whether the
  reductions overlap the last backward pass (``overlap``) and that pass may run several microbatches at once
  (``fuse``). A baseline is a candidate with some of these pinned; ``baseline`` names the one it stands for."""

  layout: DeviceGroups
  microbatch: int
  zero: int
  remat: str
  global_batch: int
  counts: Any
  name: str
  tp: TensorParallel = NO_TENSOR_PARALLEL
  reduce_dtypes: tuple[str, ...] = ("float32",)
  overlap: bool = False
  fuse: bool = False
  baseline: str | None = None

  @property
  def total(self) -> int:
    """Microbatches in the step."""
    return self.global_batch // self.microbatch

  def replace(self, **changes: Any) -> "Candidate":
    return Candidate(**{**self.__dict__, **changes})  # every field is an init field: dataclasses.replace, faster


def measured_timing(timing: KindTiming | None, profile: StepProfile, spec: Any) -> KindTiming | None:
  """A kind's measured times as the search prices them: ``timing`` itself where it timed the step's
  microbatches; where it timed one layer (:mod:`hetspmd.runtime.layer_timing`: ``part="layer"``, the layer
  scan's forward and backward; ``part="unrolled"``, the forward and backward of one numbered block of a step
  that unrolls its layers, set against the block's predicted forward scaled by the microbatch's predicted
  seconds over its forward's (:func:`_block_pass`: the step's backward is tied to no block); ``part="block"``,
  that block's forward alone), the predicted microbatch scaled by that part's measured over predicted seconds
  at each measured size, with the per-step seconds predicted (its ``part`` stays: the first microbatch's extra
  and the recomputation of exact batch statistics are priced as predicted, not measured). The rest of the
  microbatch (embedding, head, loss) takes the same correction: priced from a datasheet, it is off by as much
  as the timed part is. None without a timing, or where the profile finds no such part to scale from."""
  if timing is None or timing.part == "step":
    return timing
  found = layer_nodes(profile) if timing.part == "layer" else (block_nodes(profile), 1)
  if found is None or found[0] is None:
    return None
  mask, length = found
  accumulate = profile.accumulate_seconds(spec)
  points = []
  for size, seconds in timing.points:
    nodes = profile.node_seconds(spec, size)
    predicted = float(nodes[mask].sum()) / length * (_block_pass(profile, nodes) if timing.part == "unrolled" else 1)
    if predicted <= 0:
      return None
    points.append((size, profile.microbatch_seconds(spec, size) * seconds / predicted + accumulate))
  return KindTiming(timing.kind, tuple(points), profile.step_fixed_seconds(spec), timing.remat, part=timing.part)


def _block_pass(profile: StepProfile, nodes: np.ndarray) -> float:
  """A microbatch's predicted seconds over its forward's (``nodes``: per node, predicted): what a block's
  forward is scaled by to price its forward and backward."""
  each = ~profile.per_step
  forward = float(nodes[each & profile.forward].sum()) if profile.forward.size else 0.0
  return float(nodes[each].sum()) / forward if forward > 0 else 3.0


class Costing:
  """Per-search caches: per-node seconds, strategy spaces, ILP frontiers, assessed choices."""

  def __init__(self, cluster: Cluster, profile: StepProfile, reference_microbatch: int, recompute: float = 1.0):
    self.cluster, self.profile, self.reference = cluster, profile, reference_microbatch
    self.recompute = recompute
    self.specs = {k: cluster.spec_of(k) for k in cluster.kinds}
    self.links = {k: min((h.intra for h in cluster.hosts if h.device.name == k), key=lambda l: l.bandwidth)
                  for k in cluster.kinds}
    self.measured = {k: measured_timing(cluster.calibration.of(k), profile, self.specs[k])
                     for k in cluster.kinds} if cluster.calibration else {}
    self.measured = {k: t for k, t in self.measured.items() if t is not None}
    self.measured_remat = {(k, r): cluster.calibration.of(k, r) for k, t in self.measured.items()
                           if t.part == "step" for r in cluster.calibration.remats(k)
                           if r != t.remat and cluster.calibration.of(k, r).part == "step"}
    self.fixed = {k: self._measured_fixed(k) if k in self.measured else profile.step_fixed_seconds(s)
                  for k, s in self.specs.items()}
    self.sharing = frozenset(h for h, host in enumerate(cluster.hosts) if host.alone_speedup > 1.0)
    self._node_seconds: dict[tuple[str, int], np.ndarray] = {}
    self._spaces: dict[int, strategies.StrategySpace] = dict(profile.strategy_spaces)
    self._frontiers: dict[int, tuple[TensorParallel, ...]] = {}
    self._assessed: dict[tuple, strategy_ilp.Solution] = {}
    self._remat: dict[tuple[str, int, str], float] = {}
    self._reductions: dict[tuple, float] = {}
    self._first: dict[tuple[str, int], float] = {}
    self._backward: dict[tuple[str, int], float] = {}
    self._kind_costs: dict[tuple, KindCost] = {}
    self._memory: dict[tuple, int] = {}
    self.sharded_comm: dict[tuple, float] = {}  # hetspmd.planner.grouping._sharded_comm's
    self.shard_groups: dict[tuple, dict] = {}  # hetspmd.planner.group_execution.shard_groups

  def _measured_fixed(self, kind: str) -> float:
    """A kind's measured per-step seconds without the accumulator's zeros its timed loops wrote (priced apart:
    :meth:`one_pass`) and the gradient reduction its timing program ran over its devices
    (hetspmd.runtime.calibrating times a kind's devices together): the search prices communication itself."""
    timing = self.measured[kind]
    zeros = self.profile.zeroing_seconds(self.specs[kind]) if timing.part == "step" else 0.0
    if timing.devices < 2:
      return max(timing.fixed - zeros, 0.0)
    host = next(h for h, host in enumerate(self.cluster.hosts) if host.device.name == kind)
    reduce = gradient_seconds(self.cluster, {host: min(timing.devices, self.cluster.hosts[host].count)},
                              self.profile, NO_TENSOR_PARALLEL, 0, REDUCE_BYTES["float32"])
    return max(timing.fixed - reduce - zeros, 0.0)

  @staticmethod
  def runs_no_loop(counts) -> bool:
    """Whether a program whose positions run ``counts`` runs no microbatch loop (:meth:`one_pass`): one each
    (hetspmd.lowering.loop: a uniform count of one)."""
    return set(counts) == {1}

  def one_pass(self, kind: str, cost: KindCost, share: float) -> KindCost:
    """``cost`` (a position's, :meth:`kind_cost`) where every position of its program runs one microbatch: the
    program runs no loop, so it neither zeros a gradient accumulator nor adds into one (XLA folds both away);
    ``share``: of the parameters' elements the position accumulates (its tensor-parallel share)."""
    spec = self.specs[kind]
    return KindCost(cost.micro - self.profile.accumulate_seconds(spec) * share,
                    cost.fixed - self.profile.zeroing_seconds(spec) * share, cost.model_comm, cost.first)

  def gradient_seconds(self, layout: "DeviceGroups", tp: TensorParallel, zero: int,
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
    """Seconds of each per-microbatch node in one microbatch: predicted, or where the cluster carries the step's
    measured times for ``kind`` (:mod:`hetspmd.hardware.calibration`), the prediction scaled to them."""
    key = (kind, microbatch)
    if key not in self._node_seconds:
      seconds = self.profile.node_seconds(self.specs[kind], microbatch) * ~self.profile.per_step
      self._node_seconds[key] = seconds * self.measured_scale(kind, microbatch, seconds)
    return self._node_seconds[key]

  def measured_scale(self, kind: str, microbatch: int, seconds: np.ndarray) -> float:
    """Measured over predicted seconds of one microbatch of ``kind`` (1 without a measurement): the prediction
    as the measurement ran it, under its remat policy and with the gradient accumulation."""
    timing = self.measured.get(kind)
    plain = float(seconds.sum())
    if timing is None or plain <= 0:
      return 1.0
    again = float(seconds[self.profile.recomputed(timing.remat)].sum())
    accumulate = self.profile.accumulate_seconds(self.specs[kind])
    micro = timing.micro(microbatch)
    recompute = self.recompute if timing.part == "step" else 1.0  # a layer's scale holds no recomputation
    return max(micro - accumulate, 0.1 * micro) / ((plain + again) * recompute)

  def space(self, m: int) -> strategies.StrategySpace:
    """Prepared by :func:`hetspmd.passes.profile.profile_step` for :data:`hetspmd.passes.profile.MODEL_SIZES`; built here (once)
    for other sizes."""
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
    """The first microbatch's extra seconds over a later one (writes to fresh memory), without tensor parallelism
    (measured, it is part of the per-step seconds)."""
    key = (kind, microbatch)
    if key not in self._first:
      measured = kind in self.measured and self.measured[kind].part == "step"
      self._first[key] = (0.0 if measured
                          else self.profile.first_microbatch_extra_seconds(self.specs[kind], microbatch))
    return self._first[key]

  def remat_factor(self, kind: str, microbatch: int, remat: str) -> float:
    """Compute with the policy's recomputation over compute without: where the kind was timed under the policy,
    its measured microbatch (less the accumulation) over the compute its scaled nodes price; else the nodes the
    policy recomputes, priced."""
    key = (kind, microbatch, remat)
    if key not in self._remat:
      seconds = self.node_seconds(kind, microbatch)
      plain = float(seconds.sum())
      timing = self.measured_remat.get((kind, remat))
      if timing is not None and plain > 0:
        micro = timing.micro(microbatch)
        self._remat[key] = max(micro - self.profile.accumulate_seconds(self.specs[kind]), 0.1 * micro) / plain
      else:
        again = float(seconds[self.profile.recomputed(remat)].sum())
        self._remat[key] = (1.0 + again / plain if plain > 0 else 1.0) * self.recompute
    return self._remat[key]

  def kind_cost(self, kind: str, tp: TensorParallel, microbatch: int, remat: str, zero: int, n: int) -> KindCost:
    """A position's microbatch and per-step costs (computed once per search for each set of arguments)."""
    key = (kind, tp.m, tp.choice, tp.param_share, microbatch, remat, min(zero, 1), n)  # what it reads of tp
    if key not in self._kind_costs:
      self._kind_costs[key] = self._kind_cost(kind, tp, microbatch, remat, zero, n)
    return self._kind_costs[key]

  def memory(self, n: int, microbatch: int, zero: int, remat: str, tp: TensorParallel = NO_TENSOR_PARALLEL, *,
             optimizer_share: float | None = None, reduced_share: float | None = None) -> int:
    """:func:`memory_per_device` for this profile (computed once per search for each set of arguments)."""
    key = (n, microbatch, zero, remat, tp.m, tp.choice, tp.param_share, tp.activation_share, optimizer_share,
           reduced_share)
    if key not in self._memory:
      self._memory[key] = memory_per_device(self.profile, n, microbatch, zero, remat, tp,
                                            optimizer_share=optimizer_share, reduced_share=reduced_share)
    return self._memory[key]

  def _kind_cost(self, kind: str, tp: TensorParallel, microbatch: int, remat: str, zero: int, n: int) -> KindCost:
    remat_factor = self.remat_factor(kind, microbatch, remat)
    zs = zero_split(self.profile, n, tp)
    fixed = self.fixed[kind] * tp.param_share * (zs.kept(n) if zero >= 1 else 1)  # the update runs on ZeRO's shards
    fixed += self.profile.zeroing_seconds(self.specs[kind]) * tp.param_share  # the whole accumulator, every step
    if zero >= 1 and n > 1:  # every device writes the gathered parameters into its memory
      fixed += self.profile.param_bytes * zs.gathered * tp.param_share / self.specs[kind].write_rate
    accumulate = self.profile.accumulate_seconds(self.specs[kind]) * tp.param_share
    plain = float(self.node_seconds(kind, microbatch).sum())
    first = self.first_extra(kind, microbatch) * remat_factor
    if tp.m == 1:
      return KindCost(plain * remat_factor + accumulate, fixed, first=first)
    key = (tp.m, tp.choice, kind, microbatch)
    if key not in self._assessed:
      self._assessed[key] = strategy_ilp.assess(self.space(tp.m), tp.choice, self.node_seconds(kind, microbatch),
                                              self.links[kind], microbatch)
    solution = self._assessed[key]
    share = solution.compute_seconds / plain if plain > 0 else 1.0
    again = remat in ("layers", "full") and bool(self.profile.recomputed(remat).any())
    comm = solution.comm_seconds * (RECOMPUTED_COLLECTIVES if again else 1.0)
    return KindCost(solution.compute_seconds * remat_factor + comm + accumulate, fixed, comm, first * share)


# A layer recomputed on a model axis runs its forward collectives again: half of a tensor-parallel layer's
# collectives are its forward pass's (Megatron: two all-reduces forward, two backward), so 1.5x
RECOMPUTED_COLLECTIVES = 1.5


def _tensor_parallel(space: strategies.StrategySpace, solution: strategy_ilp.Solution) -> TensorParallel:
  m = space.m
  sharded = sum(d.options[o].activation_share for d, o in zip(space.decisions, solution.choice))
  return TensorParallel(
      m=m, choice=solution.choice, description=strategy_ilp.describe(space, solution.choice),
      model_dims=tuple(sorted(strategy_ilp.param_dims(space, solution.choice).items())),
      param_share=solution.param_elements / max(1, space.param_elements),
      activation_share=max(1 / m, 1 - min(1.0, sharded) * (1 - 1 / m)))


# --- evaluation ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Timing:
  """One way to run a candidate's microbatches, before the gradient reduction is priced."""

  peeled: bool                         # each position's last pass runs after its loop, overlapping the reduction
  counts: tuple[int, ...]              # microbatches per position
  position_seconds: tuple[float, ...]  # per position: its per-step work and its microbatches
  busiest: int                         # the position that finishes last
  window: float                        # seconds of the busiest position's last backward pass that hide reductions
  model_comm: float                    # the busiest position's tensor-parallel collectives
  memory: tuple[int, ...]              # per device
  fused: int = 1                       # microbatches the last pass runs as one batch

  def evaluated(self, c: Candidate, dtype: str, reduce: float, hidden: float) -> Evaluated:
    return Evaluated(
        name=c.name, device_positions=c.layout.devices, kinds=c.layout.kinds, microbatch=c.microbatch,
        counts=self.counts, zero_stage=c.zero, remat=c.remat, compute_seconds=self.position_seconds[self.busiest],
        comm_seconds=reduce, memory_bytes=self.memory, global_batch=c.global_batch, tensor_parallel=c.tp,
        model_comm_seconds=self.model_comm, position_seconds=self.position_seconds, grad_reduce_dtype=dtype,
        overlap=self.peeled and hidden > 0, hidden_seconds=hidden, overlap_microbatches=self.fused)


def price_candidate(costing: Costing, c: Candidate) -> list[Evaluated]:
  """One candidate costed once per reduce dtype (the counts and compute are the same for all).

  With ``c.overlap`` each position's last microbatch runs after its loop (a position with none runs one,
  masked), and the gradient reductions hide behind the busiest one's backward pass. ``c.fuse`` (weighted
  counts only): also try that last pass as ``k`` microbatches run as one batch (:func:`fused_timings`).
  """
  layout, tp, microbatch = c.layout, c.tp, c.microbatch
  n = len(layout.groups)
  costs = {k: costing.kind_cost(k, tp, microbatch, c.remat, c.zero, n) for k in dict.fromkeys(layout.kinds)}
  counts = c.counts(layout.kinds, costs) if callable(c.counts) else tuple(c.counts)
  if len(counts) != n or sum(counts) != c.total:
    return []
  if costing.runs_no_loop(counts):
    costs = {k: costing.one_pass(k, cost, tp.param_share) for k, cost in costs.items()}
  memory = (costing.memory(n, microbatch, c.zero, c.remat, tp),) * len(layout.devices)
  # a masked microbatch on a position with none can cost more than the overlap saves: try both
  options = [False, True] if c.overlap and n > 1 and min(counts) == 0 else [c.overlap and n > 1]
  timed = []
  for peeled in options:
    per_position = position_seconds(costing, layout, costs, counts, peeled)
    busiest = per_position.index(max(per_position))  # the first that finishes last
    kind = layout.kinds[busiest]
    # the final loop's last microbatch: not the earlier loops' recomputed work (exact batch statistics)
    window = OVERLAP_EFFICIENCY * costs[kind].micro / costing.recompute * costing.backward_share(kind, microbatch)
    model_comm = costs[kind].model_comm * max(counts[busiest], int(peeled))
    timed.append(Timing(peeled, tuple(counts), per_position, busiest, window if peeled else 0.0, model_comm, memory))
  if c.fuse and c.overlap and n > 1:
    timed += fused_timings(costing, c)
  return [_fastest(costing, c, timed, dtype) for dtype in c.reduce_dtypes]


def _fastest(costing: Costing, c: Candidate, timed: Sequence[Timing], dtype: str) -> Evaluated | None:
  """The fastest of a candidate's timings with its gradients reduced in ``dtype``."""
  reductions = gradient_reductions(costing.profile, c.tp.m)
  reduce, gather = costing.gradient_seconds(c.layout, c.tp, c.zero, dtype)
  best = None
  for timing in timed:
    # all but the last collective can run under the busiest position's last backward pass
    hidden = min(timing.window, reduce * (1 - 1 / reductions))
    if timing.fused > 1 and hidden <= 0:  # a fused pass with nothing to hide is only a coarser weighting
      continue
    e = timing.evaluated(c, dtype, reduce + gather, hidden)
    if best is None or e.step_seconds < best.step_seconds:
      best = e
  return best


# the fused pass's sizes tried, as shares of the most microbatches every position can run
FUSED_SHARES = (1.0, 0.875, 0.75, 0.5, 0.25)


def fused_timings(costing: Costing, c: Candidate) -> list[Timing]:
  """Timings of the candidate with its overlapped last pass fused: ``k`` microbatches run as one batch.

  A bigger last pass has a longer backward pass to hide the gradient reductions under, while the loop's
  small microbatches still weight the positions: position ``i`` runs ``counts[i] - k`` microbatches in
  its loop, then ``k * microbatch`` examples at once. Every position runs the fused pass, so the counts
  are the weighted counts of the other ``total - n k`` microbatches, on top of ``k`` each.
  """
  layout, tp, microbatch, zero, remat, total = c.layout, c.tp, c.microbatch, c.zero, c.remat, c.total
  n = len(layout.groups)
  most = total // n
  out = []
  for k in sorted({max(2, round(share * most)) for share in FUSED_SHARES if share * most >= 2}):
    if total == n * k:  # the fused pass is all of every position's work: the plain plan at k * microbatch
      continue
    size = k * microbatch
    memory = (costing.memory(n, size, zero, remat, tp),) * len(layout.devices)
    if memory[0] > layout.memory:
      continue
    costs, fused, loop_costs = {}, {}, {}
    for kind in dict.fromkeys(layout.kinds):
      loop, last = costing.kind_cost(kind, tp, microbatch, remat, zero, n), costing.kind_cost(kind, tp, size, remat,
                                                                                           zero, n)
      # for the counts: every position runs the fused pass, then its share of the loop
      costs[kind] = KindCost(loop.micro, loop.fixed + last.micro, loop.model_comm, max(loop.first, last.first))
      fused[kind], loop_costs[kind] = last, loop
    extra = balanced_counts(layout.kinds, costs, total - n * k)
    # the fused pass, then the loop (its first microbatch writing to fresh memory), or the pass alone first
    work = [fused[kind].micro + (loop_costs[kind].first + loop_costs[kind].micro * c if c else fused[kind].first)
            for kind, c in zip(layout.kinds, extra)]
    per_position = _shared_seconds(costing, layout, loop_costs, work)
    busiest = per_position.index(max(per_position))
    kind = layout.kinds[busiest]
    window = OVERLAP_EFFICIENCY * fused[kind].micro / costing.recompute * costing.backward_share(kind, size)
    model_comm = costs[kind].model_comm * extra[busiest] + fused[kind].model_comm
    out.append(Timing(True, tuple(c + k for c in extra), per_position, busiest, window, model_comm, memory, k))
  return out


def position_seconds(costing: Costing, layout: DeviceGroups, costs: dict, counts: Sequence[int],
                      peeled: bool) -> tuple[float, ...]:
  """Each position's seconds for its microbatches (one at least when ``peeled``), on hosts that share compute."""
  index, order = layout.kind_index, layout.order
  micro, first, fixed = (np.array([getattr(costs[k], f) for k in order]) for f in ("micro", "first", "fixed"))
  c = np.asarray(counts)
  if peeled:
    c = np.maximum(c, 1)
  base = fixed[index]
  # KindCost.at(c) - fixed, in the same order of operations
  work = np.where(c > 0, (base + (first[index] + micro[index] * c)) - base, 0.0)
  return _shared_seconds(costing, layout, costs, work)


def _shared_seconds(costing: Costing, layout: DeviceGroups, costs: dict, work: Sequence[float]
                    ) -> tuple[float, ...]:
  """Each position's per-step seconds plus its microbatch ``work``, on hosts whose devices share compute."""
  work = np.array(work, dtype=float)
  cluster = costing.cluster
  for h in costing.sharing.intersection(layout.hosts):
    host = cluster.hosts[h]
    mine = [i for i, g in enumerate(layout.groups) if cluster.devices[g[0]].host == h]
    finish = shared_finish_times([float(work[i]) for i in mine], len(layout.groups[mine[0]]), host.count,
                                 host.alone_speedup)  # a host's positions are one kind's: one size
    work[mine] = finish
  fixed = np.array([costs[k].fixed for k in layout.order])
  return tuple((fixed[layout.kind_index] + work).tolist())


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
             remat: str, *, global_batch: int, counts_rule: Callable[[Sequence[str], dict], tuple[int, ...]] | Any,
             name: str, tensor_parallel: TensorParallel = NO_TENSOR_PARALLEL, reduce_dtype: str = "float32",
             overlap: bool = False) -> Evaluated | None:
  """Costs one candidate: ``positions`` (device ids) cut into groups of ``tensor_parallel.m``."""
  costing = Costing(cluster, profile, microbatch)
  layout = device_groups(cluster, name, positions, tensor_parallel.m)
  found = price_candidate(costing, Candidate(layout, microbatch, zero, remat, global_batch, counts_rule, name,
                                             tensor_parallel, (reduce_dtype,), overlap))
  return found[0] if found else None
