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
* ZeRO stage 0 or 1 over ``data`` (on top of the split over ``model``; ZeRO-3 is priced as ZeRO-1 with more
  memory, so never ranks ahead: :data:`SEARCHED_ZERO`),
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
any layout); and ``fsdp``, a group plan of one group of every device
(:func:`hetspmd.planner.sharding.fsdp_baseline`: equal counts, the
parameters, gradients and optimizer state sharded over all of them, gathered
per layer), which the ranked single programs may fall below; with
``groups``, it is among the group plans offered (``SearchResult.group_plan``),
so the fastest plan offered (``SearchResult.fastest``) is never below it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from hetspmd.hardware.cluster import Cluster
from hetspmd.planner.data_axis import NO_TENSOR_PARALLEL, REDUCE_BYTES, memory_per_device
from hetspmd.planner.group_execution import holds_every_process
from hetspmd.planner.grouping import search_groups
from hetspmd.planner.sharding import fsdp_baseline
from hetspmd.errors import HetSpmdError, PlanDoesNotFitError
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.costing.step_cost import StepProfile
from hetspmd.plan.counts import balanced_counts, divisors as all_divisors, even_counts, proportional_counts
from hetspmd.plan.options import REMAT_POLICIES, ZERO_STAGES
from hetspmd.plan.state_layout import group_conflict
from hetspmd.hardware.mesh import enumerate_layouts
from hetspmd.planner.pricing import (Candidate, Costing, DeviceGroups, Evaluated, device_groups, measured_timing,
                                     price_candidate)

# remat "full" checkpoints the whole loss: it runs the forward pass twice and lowers no peak (see
# data_axis.activation_share), so it never wins and is not searched
SEARCHED_REMAT = tuple(r for r in REMAT_POLICIES if r != "full")
# ZeRO-3 in one program is priced as ZeRO-1 (the same update on shards, reduction and gather) and holds more on
# every device (it gathers the split parameters whole for the loop, beside their shards: see
# data_axis.memory_per_device), so it never ranks ahead of ZeRO-1 and is not searched (group plans price it apart)
SEARCHED_ZERO = tuple(z for z in ZERO_STAGES if z != 3)



@dataclasses.dataclass(frozen=True)
class SearchResult:
  """Ranked plans (``plans[0]`` the best: never below a baseline, every baseline being a candidate too), the best
  of each baseline, and ``homogeneous_equivalent``: the best plan the same search finds on the pool with every
  device its mean (:meth:`~hetspmd.hardware.cluster.Cluster.homogeneous_equivalent`), for a plan of that pool,
  not this one."""

  plans: tuple[Evaluated, ...]
  baselines: dict[str, Evaluated]
  ideal_throughput: float
  search_seconds: float
  candidates: int
  homogeneous_equivalent: Evaluated | None = None
  group_plan: Evaluated | None = None  # the best group plan (one program per kind: hetspmd.planner.grouping)
  homogeneous_ideal: float | None = None  # the homogeneous equivalent's own ideal throughput

  @property
  def fastest(self) -> Evaluated:
    """The fastest plan the search offers: the best single program, or the best group plan where faster."""
    best = self.plans[0]
    return self.group_plan if self.group_plan is not None and self.group_plan.throughput > best.throughput else best

  @property
  def heterogeneity_tax(self) -> float | None:
    """``1 - (best / ideal) / (homogeneous_equivalent / its own ideal)``: how much further the best plan falls
    short of its pool's ideal than the best plan of the pool's homogeneous equivalent falls short of that
    pool's ideal (each pool's ideal: its devices' own throughputs added, no communication). 0 where the
    differences between the devices cost nothing; a raw throughput ratio is :attr:`throughput_vs_homogeneous`."""
    if self.homogeneous_equivalent is None or not self.homogeneous_ideal:
      return None
    equivalent = self.homogeneous_equivalent.throughput / self.homogeneous_ideal
    return 1.0 - (self.plans[0].throughput / self.ideal_throughput) / equivalent

  @property
  def throughput_vs_homogeneous(self) -> float | None:
    """``best / homogeneous_equivalent`` in throughput, each pool's best plan (the ratio of two pools whose
    ideals differ: a device's step time is not linear in its peak and bandwidth)."""
    if self.homogeneous_equivalent is None:
      return None
    return self.plans[0].throughput / self.homogeneous_equivalent.throughput


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
  divisors = all_divisors(global_batch)
  if len(divisors) <= limit:
    return divisors
  logs = np.log(divisors)
  targets = np.linspace(0.0, logs[-1], limit)
  picks = np.unique(np.abs(logs[None, :] - targets[:, None]).argmin(axis=1))
  return [divisors[i] for i in picks]


def model_sizes(cluster: Cluster) -> tuple[int, ...]:
  """Model-axis sizes of the cluster's layouts (:func:`~hetspmd.hardware.mesh.enumerate_layouts`)."""
  return tuple(mesh.shape[1] for mesh in enumerate_layouts(cluster))


@dataclasses.dataclass(frozen=True)
class SearchSpace:
  """What a search may choose from, for one profile on one cluster at one global batch."""

  cluster: Cluster
  profile: StepProfile
  global_batch: int
  model_sizes: tuple[int, ...]
  remat_policies: tuple[str, ...]
  grad_reduce_dtypes: tuple[str, ...]
  overlap: bool
  fuse_overlap: bool
  every_process: tuple[int, ...] | None = None  # each device's process: every candidate holds devices of each

  @property
  def microbatches(self) -> list[int]:
    return microbatch_sizes(self.global_batch)

  @property
  def fastest_kind(self) -> str:
    specs = {k: self.cluster.spec_of(k) for k in self.cluster.kinds}
    return min(self.cluster.kinds, key=lambda k: self.profile.microbatch_seconds(specs[k], 1))

  def peak(self, kind: str) -> float:
    """The float32 matmuls' peak of ``kind``: dp_proportional's weights."""
    return self.cluster.spec_of(kind).f32_matmul_flops(jx.reduced_precision_f32_matmuls())


def candidates(space: SearchSpace, microbatch: int, layouts: Callable[[str, tuple[int, ...], int], DeviceGroups]
               ) -> Iterator[Candidate]:
  """Every candidate at one microbatch size, baselines included (a baseline is a candidate with its count rule and
  device set pinned, ``baseline`` naming the one it stands for). A candidate without a tensor-parallel choice
  (``tp=None``) stands for each choice that fits (:func:`tensor_parallel_choices`)."""
  total = space.global_batch // microbatch
  peak = {k: space.peak(k) for k in space.cluster.kinds}
  weighted = lambda kinds, costs: balanced_counts(kinds, costs, total)
  even = lambda kinds, costs: even_counts(len(kinds), total)
  prop = lambda kinds, costs: proportional_counts([peak[k] for k in kinds], total)
  sets = device_sets(space.cluster, space.profile, microbatch)
  if space.every_process:  # a set that leaves a running process without devices cannot run there
    sets = {name: ids for name, ids in sets.items() if holds_every_process(ids, space.every_process)}
  fastest = space.fastest_kind
  for m in space.model_sizes:
    groups = {name: layouts(name, positions, m) for name, positions in sets.items()}
    suffix = "" if m == 1 else f", model {m}"
    for zero in SEARCHED_ZERO:
      for remat in _policies_at(space, microbatch):
        base = Candidate(groups["all"], microbatch, zero, remat, space.global_batch, weighted, "", None,
                         space.grad_reduce_dtypes, space.overlap)
        for set_name, layout in groups.items():
          yield base.replace(layout=layout, name=f"weighted, {set_name}{suffix}", fuse=space.fuse_overlap)
        if m == 1:
          for rule, baseline in ((even, "dp_even"), (prop, "dp_proportional")):
            yield base.replace(counts=rule, name=baseline, tp=NO_TENSOR_PARALLEL, baseline=baseline)
        if f"only {fastest}" in groups:
          yield base.replace(layout=groups[f"only {fastest}"], counts=even, name="fastest_only" + suffix,
                             baseline="fastest_only")
        for kind in space.cluster.kinds:
          if f"only {kind}" in groups:
            yield base.replace(layout=groups[f"only {kind}"], counts=even, name=f"only {kind}{suffix}",
                               baseline="best_homogeneous")


def _policies_at(space: SearchSpace, microbatch: int) -> tuple[str, ...]:
  """The remat policies worth pricing at ``microbatch``: remat ``"layers"`` only where the smallest device cannot
  hold the microbatch under a lighter policy (ZeRO-1 over every device, data only); each policy adds a full set
  of candidates."""
  lighter = tuple(r for r in space.remat_policies if r != "layers")
  if lighter == space.remat_policies or not lighter:
    return space.remat_policies
  n = space.cluster.num_devices
  smallest = min(space.cluster.spec_of(k).memory_bytes for k in space.cluster.kinds)
  if min(memory_per_device(space.profile, n, microbatch, 1, r) for r in lighter) <= smallest:
    return lighter
  return space.remat_policies


def tensor_parallel_choices(costing: Costing, c: Candidate) -> Iterator[Candidate]:
  """``c`` with each tensor-parallel choice whose memory fits its layout (the leanest if none does); a
  candidate with a choice, as it is. A model axis reduces its gradients in float32 only."""
  if c.tp is not None:
    yield c
    return
  layout = c.layout
  choices = costing.choices(layout.m)
  fitting = [tp for tp in choices
             if costing.memory(len(layout.groups), c.microbatch, c.zero, c.remat, tp)
             <= layout.memory]
  dtypes = c.reduce_dtypes if layout.m == 1 else ("float32",)
  for tp in fitting or [min(choices, key=lambda t: t.param_share)]:
    yield c.replace(tp=tp, reduce_dtypes=dtypes)


def _priced_once(costing: Costing, c: Candidate, priced: dict[tuple, list[Evaluated]]) -> list[Evaluated]:
  """:func:`price_candidate` of ``c``, reusing the price of an earlier candidate of one microbatch size that
  differs from it only in name (a baseline on a device set the weighted plans also try, the fastest kind both
  alone and as ``fastest 1 kind(s)``): ``priced`` holds them by what they run."""
  key = (c.layout.devices, c.layout.m, c.zero, c.remat, c.counts, c.tp, c.reduce_dtypes, c.overlap, c.fuse)
  if key not in priced:
    priced[key] = price_candidate(costing, c)
    return priced[key]
  return [e if e is None else dataclasses.replace(e, name=c.name) for e in priced[key]]


@dataclasses.dataclass
class _Tally:
  """The search's running account: ranked plans, the best of each baseline, what overflowed memory."""

  plans: list = dataclasses.field(default_factory=list)
  best: dict = dataclasses.field(default_factory=dict)
  overflow: list = dataclasses.field(default_factory=list)
  candidates: int = 0

  def add(self, e: Evaluated | None, c: Candidate) -> None:
    if e is None:
      return
    self.candidates += 1
    if max(e.memory_bytes) > c.layout.memory:  # every device of a plan holds the same bytes
      self.overflow.append(e)
      return
    self.plans.append(e)  # a baseline is a plan too: the best plan is never below one
    bucket = c.baseline
    if bucket is not None and (bucket not in self.best or e.step_seconds < self.best[bucket].step_seconds):
      self.best[bucket] = e


def search(cluster: Cluster, profile: StepProfile, global_batch: int, top: int = 5,
           progress: Callable[[str], None] | None = None, models: Sequence[int] | None = None, *,
           remat_policies: Sequence[str] = SEARCHED_REMAT, recompute: float = 1.0,
           grad_reduce_dtypes: Sequence[str] = ("float32",), overlap: bool = True,
           fuse_overlap: bool = True, homogeneous: bool = False, groups: bool = False,
           every_process: Sequence[int] | None = None) -> SearchResult:
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
  ``homogeneous``: also search the pool's homogeneous equivalent (``SearchResult.homogeneous_equivalent``; a pool
  of one kind is its own), for the heterogeneity tax. ``groups``: also price group plans (one program per device
  kind, each its own microbatch: :func:`hetspmd.planner.grouping.search_groups`), reported apart
  (``SearchResult.group_plan``; :mod:`hetspmd.runtime.grouped` runs them). ``every_process``: each device's process
  (by cluster position), where only plans that give every process devices may run (a job whose processes are all
  running: one left without devices could not take part).
  """
  start = time.perf_counter()
  unknown = [d for d in grad_reduce_dtypes if d not in REDUCE_BYTES]
  if unknown or not grad_reduce_dtypes:
    raise HetSpmdError(f"grad_reduce_dtypes must name some of {tuple(REDUCE_BYTES)}, got {tuple(grad_reduce_dtypes)}")
  tensor_parallel = bool(profile.traces or profile.strategy_spaces)  # a hand-made profile has no graph to split
  space = SearchSpace(cluster, profile, global_batch,
                      tuple(m for m in model_sizes(cluster) if (models is None or m in models)
                            and (m == 1 or tensor_parallel)),
                      tuple(remat_policies), tuple(grad_reduce_dtypes), overlap, fuse_overlap,
                      None if every_process is None else tuple(every_process))
  sizes = space.microbatches
  costing = Costing(cluster, profile, sizes[len(sizes) // 2], recompute)
  layouts = functools.lru_cache(maxsize=None)(lambda positions, m: device_groups(cluster, "", positions, m))
  named = lambda name, positions, m: dataclasses.replace(layouts(positions, m), name=name)
  tally = _Tally()
  for n_done, microbatch in enumerate(sizes):
    priced: dict[tuple, list[Evaluated]] = {}
    for c in candidates(space, microbatch, named):
      for concrete in tensor_parallel_choices(costing, c):
        for e in _priced_once(costing, concrete, priced):
          tally.add(e, concrete)
    if progress:
      progress(f"microbatch {microbatch} ({n_done + 1}/{len(sizes)}), {tally.candidates} candidates costed")
  if not tally.plans:
    raise PlanDoesNotFitError(_overflow_message(cluster, tally.overflow))
  ranked = _top(tally.plans, top)
  equivalent = None
  if homogeneous:
    equivalent = ranked[0] if cluster.is_homogeneous else _homogeneous_best(
        cluster, profile, global_batch, remat_policies=space.remat_policies, recompute=recompute,
        grad_reduce_dtypes=space.grad_reduce_dtypes, overlap=overlap, fuse_overlap=fuse_overlap,
        models=space.model_sizes, progress=_prefixed(progress, "homogeneous equivalent: "))
  grouped = None
  if groups:
    grouped = search_groups(cluster, profile, global_batch, sizes, remat_policies=space.remat_policies,
                            recompute=recompute, grad_reduce_dtypes=space.grad_reduce_dtypes, progress=progress,
                            every_process=space.every_process)
  baselines = dict(tally.best)
  fsdp = fsdp_baseline(costing, global_batch, sizes, space.remat_policies, space.grad_reduce_dtypes)
  if fsdp is not None:  # a group plan (one group of every device): not among the ranked single programs
    baselines["fsdp"] = fsdp
    if groups:
      grouped = _faster(grouped, fsdp)  # the group plans offered include it: the fsdp plan runs
  ideal = ideal_throughput(cluster, profile, global_batch)
  homogeneous_ideal = None if not homogeneous else ideal if cluster.is_homogeneous else ideal_throughput(
      cluster.homogeneous_equivalent(), profile, global_batch)
  return SearchResult(ranked, baselines, ideal, time.perf_counter() - start, tally.candidates, equivalent, grouped,
                      homogeneous_ideal)


def group_plan_alone(cluster: Cluster, profile: StepProfile, global_batch: int, *,
                     remat_policies: Sequence[str] = SEARCHED_REMAT,
                     grad_reduce_dtypes: Sequence[str] = ("float32",),
                     progress: Callable[[str], None] | None = None, recompute: float = 1.0,
                     every_process: Sequence[int] | None = None) -> Evaluated | None:
  """The best group plan over the microbatch sizes :func:`search` tries, for a pool where no single program fits
  (:func:`search` then raises :class:`PlanDoesNotFitError`): a group plan holds what each device needs of its own
  microbatch and its share of the state, which one program cannot give devices of different memory. The ``fsdp``
  plan (one group of every device) is among them. ``recompute`` and ``every_process``: as :func:`search`'s."""
  space = SearchSpace(cluster, profile, global_batch, (1,), tuple(remat_policies), tuple(grad_reduce_dtypes),
                      True, True)
  sizes = space.microbatches
  grouped = search_groups(cluster, profile, global_batch, sizes, remat_policies=space.remat_policies,
                          grad_reduce_dtypes=space.grad_reduce_dtypes, progress=progress, recompute=recompute,
                          every_process=every_process)
  fsdp = fsdp_baseline(Costing(cluster, profile, sizes[len(sizes) // 2], recompute), global_batch, sizes,
                       space.remat_policies, space.grad_reduce_dtypes)
  return _faster(grouped, fsdp)


def _faster(a: Evaluated | None, b: Evaluated | None) -> Evaluated | None:
  """The faster of two plans (either may be None); a tie keeps ``a``."""
  if a is None or b is None:
    return a or b
  return b if b.throughput > a.throughput else a


# how much faster than the best single program a group plan must be priced for the search to run it: a group
# plan runs more programs (each dispatched, the partial sums written out between them) than the cost model's
# dispatch term sees, and on two CPU processes (benchmarks/emulated_hetero.py) it measured from 2.6 points of the
# step ideal below to 3.6 above the weighted single program, over three runs (4-7 points below before its link
# was measured); it must be priced clearly ahead to be worth its extra programs
GROUP_PLAN_MARGIN = 1.05


# where parallelize(plan="search") prices group plans at all, beside the margin (searches_group_plans); and what
# group programs refuse at run time (hetspmd.lowering.groups.check), where the step then runs as one program
GROUP_PLAN_CONDITIONS = ("on the pool's own JAX devices, with specs a group keeps (each parameter whole or split along "
                         "one dimension over 'model'), for a step their programs take")


def searches_group_plans(specs: Any, bound: bool = True) -> bool:
  """Whether ``parallelize(plan="search")`` prices group plans for a step: on the pool's own JAX devices
  (``bound``: a cluster bound to them, as ``parallelize`` binds a spec), with ``specs`` a group keeps
  (:func:`~hetspmd.plan.state_layout.group_conflict`: Linen's and NNX's annotations over ``model``). In one
  process or several: each process feeds the examples its devices run, under either form
  (``step.process_examples()``)."""
  return bound and not group_conflict(specs)


def chosen_group_plan(result: SearchResult, margin: float = GROUP_PLAN_MARGIN) -> Evaluated | None:
  """The search's group plan where it is priced at least ``margin`` times the best single program's throughput
  (then worth its extra programs), else None."""
  g = result.group_plan
  return g if g is not None and result.plans and g.throughput >= margin * result.plans[0].throughput else None


def _prefixed(progress: Callable[[str], None] | None, prefix: str) -> Callable[[str], None] | None:
  """``progress`` with ``prefix`` before each line (None stays None)."""
  return None if progress is None else (lambda message: progress(prefix + message))


def _homogeneous_best(cluster: Cluster, profile: StepProfile, global_batch: int, **options: Any) -> Evaluated | None:
  """The best plan on ``cluster``'s homogeneous equivalent (``None`` if nothing fits there)."""
  try:
    return search(cluster.homogeneous_equivalent(), profile, global_batch, top=1, homogeneous=False,
                  **options).plans[0]  # options may carry progress
  except PlanDoesNotFitError:
    return None


def _top(plans: Sequence[Evaluated], top: int) -> tuple[Evaluated, ...]:
  """The ``top`` fastest distinct plans; a tie goes to fewer, larger microbatches, then to more devices at work
  (a device kind given nothing only where no plan as fast gives it work)."""
  ranked = sorted(plans, key=lambda e: (float(f"{e.step_seconds:.9g}"), sum(e.counts),
                                        -e.model * sum(c > 0 for c in e.counts)))
  unique: list[Evaluated] = []
  for e in ranked:
    if not any(_same_plan(e, u) for u in unique):
      unique.append(e)
    if len(unique) == top:
      break
  return tuple(unique)


def ideal_throughput(cluster: Cluster, profile: StepProfile, global_batch: int) -> float:
  """Every device busy on its own share of the batch, with no communication: the sum of their throughputs."""
  share = max(1, global_batch // cluster.num_devices)
  per_kind = {}
  for k in cluster.kinds:
    spec = cluster.spec_of(k)
    timing = measured_timing(cluster.calibration.of(k), profile, spec) if cluster.calibration else None
    per_kind[k] = share / (timing.micro(share) if timing is not None else profile.microbatch_seconds(spec, share))
  return sum(per_kind[d.spec.name] for d in cluster.devices)


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


# the baselines that are single programs (candidates of the search: the best plan is never below one)
SINGLE_PROGRAM_BASELINES = ("dp_even", "dp_proportional", "fastest_only", "best_homogeneous")
# and fsdp (hetspmd.planner.sharding.fsdp_baseline: every device, an even batch, the parameters and optimizer state
# sharded over all of them, gathered per layer), where it fits
BASELINES = SINGLE_PROGRAM_BASELINES + ("fsdp",)
