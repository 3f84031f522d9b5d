"""Pricing group plans: one program per device kind, each with its own microbatch size and counts.

A group plan (:class:`hetspmd.plan.groups.GroupPlan`, run by
:mod:`hetspmd.runtime.grouped`) lets each device kind run the microbatch that
suits it, where one SPMD program makes every device run the same one. This
module searches group plans with every device on data, except a kind none
of whose microbatches fits its devices data-only, which gets a model axis
(:func:`_model_axis`: its devices a few at a time in one host), one
group per device kind, one remat policy for all or per kind the one that
recomputes least of those that fit, and the optimizer state replicated or
held in shares by free memory (each device updating its share, then sending
the parameters it made to every device), and the gradients crossing devices in
each dtype the search allows (float32, bfloat16), and each kind's group holding its parameters whole or, where
that saves recomputation or lets the kind join, sharded over its devices (:mod:`hetspmd.planner.sharding`; a
pool of one kind has only that one sharded group: plain FSDP). For each kind a microbatch size that fits its memory, for
the global batch each device's count: the smallest makespan whose capacity
covers the batch, found by bisection, then trimmed to the batch exactly
(the largest microbatches first). Optionally a uniform tail: one microbatch
on every device inside the exchange program, after its group's loop, so
that the reduction overlaps its backward pass (nothing overlaps across a
program boundary). The step is the slowest device's loop and tail, plus the
gradient reduction over every device less what the tail hides, plus one
dispatch per program. Plans priced within :data:`TIE` of the fastest count
as alike; of those, the one with the fewest microbatches on its busiest
device is taken, then on all devices, then one without state shares
(fewer programs).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, Sequence

import numpy as np

from hetspmd.hardware.cluster import Cluster
from hetspmd.passes.costing.step_cost import StepProfile
from hetspmd.plan.counts import KindCost, kind_ranks
from hetspmd.plan.groups import GroupPlan, group_plan
from hetspmd.plan.options import REMAT_POLICIES
from hetspmd.planner.data_axis import (GRAD_BYTES, WORKSPACE, NO_TENSOR_PARALLEL, TensorParallel,
                                       gradient_reductions, microbatch_bytes)
from hetspmd.planner import sharding
from hetspmd.planner.group_execution import (PROGRAM_DISPATCH_SECONDS, execution_of, holds_every_process, one_process,
                                             run_groups, shard_groups, shard_key, shard_size)
from hetspmd.planner.group_shares import COPIED, gather_seconds, loop_param_bytes, share_factor, split_fraction
from hetspmd.planner.pricing import (OVERLAP_EFFICIENCY, Costing, DeviceGroups, Evaluated, GroupPart, device_groups,
                                     position_seconds)

# combinations of per-kind microbatch sizes priced at most
MAX_COMBINATIONS = 4096
# plans priced within this fraction of the fastest count as alike, and the one with the fewest microbatches is
# taken: the cost model prices a microbatch of 2m as two of m, which on a device run smaller kernels and more loop
# steps (benchmarks/emulated_hetero.py's group plan took microbatches of 128 on its fast device, priced 0.4% ahead
# of 256, before this rule)
TIE = 0.005


def group_counts(kinds: Sequence[str], costs: dict[str, KindCost], sizes: dict[str, int],
                 global_batch: int) -> tuple[int, ...] | None:
  """Per-position counts with ``sum(count * sizes[kind]) == global_batch`` minimising the slowest position's
  time; ``None`` when the sizes cannot make the batch exactly."""
  order = list(dict.fromkeys(kinds))
  n = {k: kinds.count(k) for k in order}

  def most(k: str, t: float) -> int:  # microbatches position of kind k finishes within t
    c = costs[k]
    return max(0, int((t - c.fixed - c.first) / c.micro + 1e-9))  # at(count) itself finishes count microbatches

  terms = [(costs[k].fixed, costs[k].first, costs[k].micro, n[k] * sizes[k]) for k in order]

  def capacity(t: float) -> int:  # examples the positions finish within t (most() inlined: a hot loop)
    examples = 0
    for fixed, first, micro, weight in terms:
      finished = int((t - fixed - first) / micro + 1e-9)
      if finished > 0:
        examples += weight * finished
    return examples

  high = _least_makespan(order, costs, terms, capacity, global_batch)
  for _ in range(_MAX_RAISES):  # the least makespan may not make the batch exactly: allow the next microbatch
    counts = _trimmed(kinds, {k: most(k, high) for k in order}, sizes, global_batch)
    if counts is not None:
      return counts
    high = min(costs[k].at(most(k, high) + 1) for k in order)
  return None


def _least_makespan(order: Sequence[str], costs: dict[str, KindCost], terms: Sequence[tuple[float, float, float, int]],
                    capacity: Callable[[float], int], global_batch: int) -> float:
  """The least of the times a position finishes a microbatch (``costs[k].at(c)``) by which the positions finish
  ``global_batch`` examples (``capacity``): from the continuous bound (every kind's positions busy from its
  per-step work on, at its rate), one microbatch time after another in order."""
  starts = sorted((fixed + first, micro, weight) for fixed, first, micro, weight in terms)
  rate = offset = 0.0
  for i, (start, micro, weight) in enumerate(starts):  # the kinds under way by the bound
    rate, offset = rate + weight / micro, offset + weight * start / micro
    bound = (global_batch + offset) / rate
    if i + 1 == len(starts) or starts[i + 1][0] >= bound:
      break
  # a microbatch below each kind's continuous count: every time before these finishes fewer than the batch
  counts = {k: max(0, math.floor((bound - costs[k].fixed - costs[k].first) / costs[k].micro) - 1) for k in order}
  while True:
    t = min(costs[k].at(counts[k] + 1) for k in order)
    if capacity(t) >= global_batch:
      return t
    for k, (fixed, first, micro, _) in zip(order, terms):  # the kind finishing at t moves on, even where
      done = counts[k] + 1 if costs[k].at(counts[k] + 1) <= t else counts[k]  # rounding would say otherwise
      counts[k] = max(done, int((t - fixed - first) / micro + 1e-9))


# times group_counts lets the makespan grow by one microbatch to make the batch exactly
_MAX_RAISES = 256


def _trimmed(kinds: Sequence[str], base: dict[str, int], sizes: dict[str, int], global_batch: int
             ) -> tuple[int, ...] | None:
  """``base`` counts per kind less microbatches (the largest first, spread over a kind's positions) so that they
  make ``global_batch`` exactly; None if they cannot."""
  order = list(dict.fromkeys(kinds))
  n = {k: kinds.count(k) for k in order}
  excess = sum(n[k] * base[k] * sizes[k] for k in order) - global_batch
  fewer = {k: 0 for k in order}
  for k in sorted(order, key=lambda k: -sizes[k]):
    take = min(n[k] * base[k], excess // sizes[k])
    fewer[k], excess = take, excess - take * sizes[k]
  if excess:
    return None
  index, rank = kind_ranks(tuple(kinds))
  share, extra = (np.array([divmod(fewer[k], n[k])[i] for k in order]) for i in (0, 1))
  kept = np.array([base[k] for k in order]) - share
  return tuple((kept[index] - (rank < extra[index])).tolist())


def price_groups(costing: Costing, layout: DeviceGroups, sizes: dict[str, int], remat: str | dict[str, str],
                 global_batch: int, *, tail: tuple[int, int] = (0, 0), zero: int = 0,
                 dtype: str = "float32", models: dict[str, TensorParallel] | None = None,
                 sharded: frozenset[str] = frozenset()) -> Evaluated | None:
  """The group plan with microbatch ``sizes[kind]`` and remat policy ``remat`` (one, or one per kind) per kind on
  ``layout`` (every device on data), or None if a kind's microbatch does not fit its memory or the sizes cannot
  make the batch. ``tail``: ``(microbatch, count)`` every device runs in the uniform program after its group's
  loop, under the policy that recomputes most, the reduction overlapping the last one's backward pass.
  ``zero=1``: the optimizer state in shares by free memory (each device updates its share, then sends the
  parameters it made to every device), else replicated. In shares without a tail in one process, each device's
  update takes only its own share's sums, as copies or in two hops (:func:`_reduce_seconds`), and holds those
  rows or its part and its sums after the loop instead of the whole reduced gradient; a sharded group hands the
  owners its parts (:data:`sharding.PARTS_TO_OWNERS`). The sums cross devices in ``dtype``.
  ``models``: a kind's tensor-parallel choice, its devices that many at a time in one host running each
  microbatch together (its group's model axis; see :func:`_peak` for what they hold). ``sharded``: the kinds whose
  group shards its parameters (:mod:`hetspmd.planner.sharding`; data-only, no tail, not ZeRO-3)."""
  n, kinds = len(layout.groups), layout.kinds
  tps = {k: (models or {}).get(k, NO_TENSOR_PARALLEL) for k in dict.fromkeys(kinds)}
  blocked = _blocked(costing.cluster, layout, {k: tp.m for k, tp in tps.items()})
  if blocked is None:
    return None
  size, count = tail
  order = list(dict.fromkeys(kinds))
  remats = remat if isinstance(remat, dict) else {k: remat for k in order}
  last = max(remats.values(), key=REMAT_POLICIES.index)  # the tail's
  if _refused(costing, layout, tps, zero, count, sharded):
    return None
  execution = execution_of(costing, layout, sharded, zero, count, data_only=_data_only(tps))
  owner, hybrid = execution.owners_reduce, execution.hybrid  # each device reduces its own share; hybrid
  narrow = dtype != "float32" and not count  # the group programs hand over bfloat16 rows
  shares = _state_shares(costing, kinds, sizes, tail, remats, owner, tps=tps, zero=zero, narrow=narrow,
                         sharded=sharded, dtype=dtype,
                         shard_sizes={k: shard_size(costing, layout, k) for k in sharded}) if zero else {}
  if zero and not shares:
    return None
  spread = list(map(shares.__getitem__, kinds)) if zero else []
  split = split_fraction(costing.profile, spread) if zero else COPIED  # two hops, copies, padded
  # a sharded group hands each owner its parts of the sums, copied: one joined row per sharded group, one per device
  parts = execution.parts_to_owners and sharding.PARTS_TO_OWNERS
  sums, received = (COPIED, n - sum(layout.kind_counts[k] - 1 for k in sharded)) if parts else (split, n)
  memory = {k: _kind_peak(costing, layout.kind_counts, k, (sizes[k], remats[k]), (size, last), share=shares.get(k),
                          rows=sums[0] * (1 / n + 2 * shares[k]) + sums[2] + sums[1] * received * shares[k] if owner
                          else None, tp=tps[k], zero=zero, narrow=narrow, sharded=sharded, dtype=dtype,
                          g=shard_size(costing, layout, k) if k in sharded else 0, hybrid=hybrid,
                          parts=execution.parts_exchange) for k in order}
  if any(memory[k] > costing.cluster.spec_of(k).memory_bytes for k in order):
    return None
  costs = {k: _group_cost(costing, layout, k, sizes[k], remats[k], shares.get(k), tp=tps[k], zero=zero,
                          sharded=k in sharded, dtype=dtype, hybrid=hybrid) for k in order}
  tails = {k: _kind_cost(costing, k, size, last, n, shares.get(k), zero=zero) if count else None for k in order}
  # every device's tail runs after its loop: for the counts, part of its per-step time
  with_tail = {k: costs[k].with_fixed(costs[k].fixed + (tails[k].at(count) - tails[k].fixed if count else 0.0))
               for k in order}
  counts = group_counts(blocked.kinds, with_tail, sizes, global_batch - n * size * count)
  if counts is None:
    return None
  with_tail = with_tail if count else _without_loops(costing, layout, with_tail, counts, blocked.kinds, tps=tps, sharded=sharded)
  # loop, then tail, on every device; a sharded group's each its most microbatches (masked: they take host share)
  per_position = position_seconds(costing, blocked, with_tail, _lockstep(counts, blocked, sharded), False)
  busiest = per_position.index(max(per_position))  # the first that finishes last
  reduce = _reduce_seconds(costing, layout, dtype, hybrid=hybrid, owner=owner, spread=spread, sums=sums,
                           received=received, parts=sharded if execution.parts_exchange else None)
  gather = gather_seconds(costing, layout, spread, zero) if zero else 0.0
  hidden = _tail_hides(costing, blocked.kinds[busiest], tails, size, reduce) if count else 0.0
  dispatch = PROGRAM_DISPATCH_SECONDS * (len(order) + 1 + (n if zero else 0))
  on = blocked.kinds  # per position
  each = lambda values: tuple(map(values.__getitem__, on))  # a value per kind, per position
  per_device = each(memory) if blocked is layout else tuple(memory[k] for k in on for _ in range(tps[k].m))
  return Evaluated(
      name=_plan_name(layout.name, zero, remats, tail, dtype=dtype, tps=tps, sharded=sharded, hybrid=hybrid),
      device_positions=blocked.devices, kinds=on, microbatch=max(sizes.values()), counts=counts,
      zero_stage=zero, remat=last, compute_seconds=per_position[busiest] + dispatch, comm_seconds=reduce + gather,
      memory_bytes=per_device, global_batch=global_batch, position_seconds=per_position,
      grad_reduce_dtype=dtype, overlap=hidden > 0, hidden_seconds=hidden, group=GroupPart(
          each(sizes), tail=tail, state_shares=each(shares) if zero else (), remats=each(remats),
          group_models=each(tps) if blocked is not layout else (),
          shard_params=tuple(map(sharded.__contains__, on)) if sharded else (), execution=execution))


def _data_only(tps: dict[str, TensorParallel]) -> bool:
  """Whether every kind's group runs a device per data position, no model axis (:meth:`Execution.made`'s
  ``data_only``)."""
  return all(tp.m == 1 for tp in tps.values())


def _refused(costing: Costing, layout: DeviceGroups, tps: dict[str, TensorParallel], zero: int, tail: int,
             sharded: frozenset[str]) -> bool:
  """Whether :func:`price_groups` refuses a combination the runtime does not run: ZeRO-3 beside a model axis; a
  sharded group with a tail, a model axis or one device, or under ZeRO-3 across processes."""
  if zero == 3 and any(tp.m > 1 for tp in tps.values()):
    return True
  return bool(sharded) and bool(tail or (zero == 3 and not execution_of(costing, layout, sharded, zero, tail).zero3_parts)
                                or any(tps[k].m > 1 or shard_size(costing, layout, k) < 2 for k in sharded))


def _reduce_seconds(costing: Costing, layout: DeviceGroups, dtype: str, *, hybrid: bool, owner: bool,
                    spread: list, sums: tuple, received: int, parts: frozenset[str] | None = None) -> float:
  """The exchange's reduction of the sums in ``dtype``: an all-reduce over every device; in a hybrid plan the
  groups' parts added across the groups (:func:`hetspmd.planner.sharding.hybrid_exchange_seconds`); where each
  owner reduces its own sums, the busiest owner's rows (``spread``: the state's shares per position; ``sums``: how
  they travel, :func:`split_fraction`: every device's rows copied to it, the time scaled to the busiest
  device's bytes, :func:`hetspmd.plan.groups.copy_factor`; or, where some devices hold much more than the rest,
  reduce-scattered evenly and then made whole on their owner, :func:`hetspmd.plan.groups.relay_factor`), scaled by
  the rows it ``received`` of each sum against one per device (across processes the exchange program reduces
  every sum onto every device). ``parts``: the sharded kinds where the groups exchange parts
  (:attr:`~hetspmd.plan.execution.Execution.parts_exchange`): the groups' parts added across the groups, with a
  reduce-scatter and an all-gather in each group (:func:`hetspmd.planner.sharding.parts_exchange_seconds`)."""
  if hybrid:
    groups = [g for kind_groups in shard_groups(costing, layout).values() for g in kind_groups]
    return sharding.hybrid_exchange_seconds(costing.cluster, groups, costing.profile, dtype)
  if parts is not None:
    every = run_groups(costing, layout, parts)
    groups = [g for kind_groups in every.values() for g in kind_groups]
    unsharded = [g for kind, kind_groups in every.items() if kind not in parts for g in kind_groups]
    return sharding.parts_exchange_seconds(costing.cluster, groups, unsharded, costing.profile, dtype)
  reduce, _ = costing.gradient_seconds(layout, NO_TENSOR_PARALLEL, 0, dtype)
  return reduce / 2 * share_factor(spread, sums) * received / len(layout.groups) if owner else reduce


def _plan_name(name: str, zero: int, remats: dict[str, str], tail: tuple[int, int], *, dtype: str,
               tps: dict[str, TensorParallel], sharded: frozenset[str], hybrid: bool = False) -> str:
  """A priced group plan's name: its device set's, then the mechanisms it uses."""
  size, count = tail
  return name + ("", ", optimizer state in memory shares", "", ", parameters and optimizer state in memory "
                 "shares")[zero] + (", hybrid (each group holds its state split over its devices)" if hybrid
                                    else "") + (
      ", remat by kind" if len(set(remats.values())) > 1 else "") + (f", tail {count}x{size}" if count else "") + (
      f", {dtype} gradients" if dtype != "float32" else "") + "".join(
      f", model axis {tp.m} on {k}" for k, tp in tps.items() if tp.m > 1) + "".join(
      f", parameters sharded (FSDP) on {k}" for k in remats if k in sharded)


def _lockstep(per_position: Sequence[int], layout: DeviceGroups, sharded: frozenset[str]) -> tuple[float, ...]:
  """Each position's microbatch count, those of a sharded group's devices each the group's most: they run in
  lockstep, every device the group's most microbatches (those it lacks masked)."""
  if not sharded:
    return per_position
  seconds, index = np.array(per_position), layout.kind_index
  for i, k in enumerate(layout.order):
    if k in sharded:
      mine = index == i
      seconds[mine] = seconds[mine].max()
  return tuple(seconds.tolist())


def _group_cost(costing: Costing, layout: DeviceGroups, kind: str, microbatch: int, remat: str,
                share: float | None, *, tp: TensorParallel, zero: int, sharded: bool, dtype: str,
                hybrid: bool = False) -> KindCost:
  """A device of ``kind``'s costs in its group: :func:`_kind_cost`, with a sharded group's collectives and part-sized
  accumulation (:func:`hetspmd.planner.sharding.sharded_kind_cost`) where it shards its parameters (``hybrid``:
  and its update on its part of the state)."""
  n = len(layout.groups)
  if not sharded:
    return _kind_cost(costing, kind, microbatch, remat, n, share, tp=tp, zero=zero)
  cost = _kind_cost(costing, kind, microbatch, remat, n, share, zero=zero or 1)
  return sharding.sharded_kind_cost(costing, kind, cost, _sharded_comm(costing, layout, kind, dtype, remat),
                                    shard_size(costing, layout, kind), state_sharded=hybrid)


def _tail_hides(costing: Costing, kind: str, tails: dict[str, KindCost], size: int, reduce: float) -> float:
  """The reduction's seconds the busiest position's (of ``kind``) last tail microbatch hides: all but the last
  collective's, within :data:`OVERLAP_EFFICIENCY` of its backward pass."""
  window = OVERLAP_EFFICIENCY * tails[kind].micro / costing.recompute * costing.backward_share(kind, size)
  return min(window, reduce * (1 - 1 / gradient_reductions(costing.profile, 1)))


def _without_loops(costing: Costing, layout: DeviceGroups, costs: dict[str, KindCost], counts: Sequence[int],
                   kinds: Sequence[str], *, tps: dict[str, TensorParallel], sharded: frozenset[str]
                   ) -> dict[str, KindCost]:
  """``costs`` with :meth:`Costing.one_pass` for each kind every position of which (``kinds``: per position, as
  ``counts``) runs one microbatch: its groups' programs run no loop. The accumulator is a ``1/g`` part where the
  kind's group shards its parameters (:func:`hetspmd.planner.sharding.sharded_kind_cost`), else ``tp``'s share."""
  def once(kind: str) -> bool:
    return costing.runs_no_loop([c for c, k in zip(counts, kinds) if k == kind])

  def share(kind: str) -> float:
    return 1 / shard_size(costing, layout, kind) if kind in sharded else tps[kind].param_share

  return {k: costing.one_pass(k, cost, share(k)) if once(k) else cost for k, cost in costs.items()}


def _sharded_comm(costing: Costing, layout: DeviceGroups, kind: str, dtype: str, remat: str) -> float:
  """One microbatch's collectives of ``kind``'s sharded group on ``layout`` (computed once per search): over the
  devices of one of its groups as the runtime runs them (:func:`shard_groups`)."""
  key = (kind, tuple(layout.hosts.items()), len(layout.groups), dtype, remat)
  if key not in costing.sharded_comm:
    devices = shard_groups(costing, layout)[kind][0]
    costing.sharded_comm[key] = sharding.microbatch_comm_seconds(costing.cluster, devices, costing.profile, dtype,
                                                                 remat, combined=sharding.combines(kind))
  return costing.sharded_comm[key]


def _hybrid(costing: Costing, layout: DeviceGroups, sharded: frozenset[str], zero: int, tail: int) -> bool:
  """Whether the plan priced is hybrid (:func:`hetspmd.plan.groups.is_hybrid`, of its :func:`execution_of`)."""
  return execution_of(costing, layout, sharded, zero, tail).hybrid


def _blocked(cluster: Cluster, layout: DeviceGroups, models: dict[str, int]) -> DeviceGroups | None:
  """``layout`` (every device a position) with each kind's devices ``models[kind]`` at a time as one position, the
  devices of a position in one host; None when a host's devices of a kind do not make whole positions."""
  if all(m == 1 for m in models.values()):
    return layout
  devices, pending, blocks = cluster.devices, {}, []
  for i in layout.devices:
    key = (devices[i].spec.name, devices[i].host)
    pending.setdefault(key, []).append(i)
    if len(pending[key]) == models[key[0]]:
      blocks.append(tuple(pending.pop(key)))
  if pending:
    return None
  hosts: dict[int, int] = {}
  for b in blocks:
    hosts[devices[b[0]].host] = hosts.get(devices[b[0]].host, 0) + 1
  return DeviceGroups(layout.name, tuple(blocks), tuple(devices[b[0]].spec.name for b in blocks), hosts,
                      layout.memory, tuple(i for b in blocks for i in b))


def _state_shares(costing: Costing, kinds: Sequence[str], sizes: dict[str, int], tail: tuple[int, int],
                  remats: dict[str, str], owner: bool = False, *, tps: dict[str, TensorParallel] | None = None,
                  zero: int = 1, narrow: bool = False, sharded: frozenset[str] = frozenset(),
                  dtype: str = "float32", shard_sizes: dict[str, int] | None = None) -> dict[str, float]:
  """Each kind's per-device share of the optimizer state (``zero=3``: and of the parameters), in proportion to
  what the rest of the step leaves free on it (``owner``: no reduced gradient after the loop); empty when the
  free memory of every device together cannot hold the state."""
  profile, counts = costing.profile, {k: kinds.count(k) for k in dict.fromkeys(kinds)}
  last = max(remats.values(), key=REMAT_POLICIES.index)
  free = {}
  for k in counts:
    used = _kind_peak(costing, counts, k, (sizes[k], remats[k]), (tail[0], last), share=0.0,
                      rows=0.0 if owner else None, tp=(tps or {}).get(k, NO_TENSOR_PARALLEL), zero=zero, narrow=narrow,
                      sharded=sharded, dtype=dtype, g=(shard_sizes or {}).get(k, 0))
    free[k] = max(costing.cluster.spec_of(k).memory_bytes - used, 0)
  total = sum(free[k] * counts[k] for k in free)  # whole bytes: the sum over devices, exactly
  shared = profile.opt_state_bytes + (profile.param_bytes if zero == 3 else 0)
  if total <= 0 or total < shared * WORKSPACE:
    return {}
  return {k: free[k] / total for k in free}


def _kind_peak(costing: Costing, counts: dict[str, int], kind: str, loop: tuple[int, str], tail: tuple[int, str], *,
               share: float | None, rows: float | None, tp: TensorParallel, zero: int, narrow: bool,
               sharded: frozenset[str], dtype: str, g: int = 0, hybrid: bool = False, parts: bool = False) -> int:
  """A device of ``kind``'s bytes (``counts``: each kind's positions, one device each): :func:`_peak`, or in a
  group of ``g`` devices (its kind's count where 0) sharding its parameters (``kind`` in ``sharded``)
  :func:`hetspmd.planner.sharding.sharded_peak` (``hybrid``: holding its part of the state between steps)."""
  if kind in sharded:
    return sharding.sharded_peak(costing.profile, g or counts[kind], loop, share, rows, dtype, zero=zero,
                                 state_sharded=hybrid, part_row=parts)
  return _peak(costing, sum(counts.values()), loop, tail, share, rows, tp=tp, zero=zero, narrow=narrow)


def _peak(costing: Costing, n: int, loop: tuple[int, str], tail: tuple[int, str], share: float | None,
          rows: float | None = None, *, tp: TensorParallel = NO_TENSOR_PARALLEL, zero: int = 0,
          narrow: bool = False) -> int:
  """A device's bytes: the larger of its loop's ``(microbatch, remat)`` and the tail's (none when its microbatch
  is 0), with ``share`` of the optimizer state (all of it when None) and, after the loop, ``rows`` (a fraction of
  the gradients beside its own rows: every device's rows of its share, or under two hops its even part of every
  sum, its share joined and the padded copies it sends) or the reduced gradients (None).

  On a model axis (``tp``) the loop holds ``tp``'s share of the gradient accumulator and of a microbatch's
  activations beside whole parameters (the uniform programs read them whole: they are replicated between
  steps); after the loop its row is made whole (from a whole gathered copy), beside the reduced gradients or
  the rows it reduces.

  Under ZeRO-3 (``zero=3``, data-only) ``share`` is of the parameters and the optimizer state together, and the
  programs hold the parameters as they receive them: the casts of those the step reads only through casts
  (:func:`loop_param_bytes`), the others whole. ``narrow``: the group program casts its float32 accumulator to
  bfloat16 rows as it ends (a plan without a tail that reduces in bfloat16), so after the loop a device holds
  those rows and the reduced gradients (or the rows it reduces) at half the bytes, and no accumulator."""
  tail_peak = costing.memory(n, tail[0], 0, tail[1], optimizer_share=share, reduced_share=rows) if tail[0] else 0
  if tp.m == 1 and narrow:
    p = costing.profile
    params = _params_held(p, zero, share)
    optimizer = p.opt_state_bytes * (1.0 if share is None else share)
    after = p.param_count * 2 * (1.0 + (1.0 if rows is None else rows))  # its rows, and the reduced or received
    working = max(microbatch_bytes(p, loop[0], loop[1]) + p.param_count * GRAD_BYTES, after)
    return max(tail_peak, int((params + optimizer + working) * WORKSPACE))
  if tp.m == 1:
    peak = max(tail_peak, costing.memory(n, loop[0], 0, loop[1], optimizer_share=share, reduced_share=rows))
    # under ZeRO-3 the parameters as received and the share of them held, in place of whole float32 ones
    return peak + int((_params_held(costing.profile, zero, share) - costing.profile.param_bytes) * WORKSPACE)
  p = costing.profile
  grads = p.param_count * GRAD_BYTES
  optimizer = p.opt_state_bytes * (1.0 if share is None else share)
  # after the loop its row made whole beside the whole copy XLA gathers to make it (measured: 0.85-1.0 of the
  # gradients' bytes in temporaries, benchmarks/group_memory.py); then, in the next program, the row beside the
  # reduced gradients or the rows it reduces
  working = max(microbatch_bytes(p, loop[0], loop[1], tp) + grads * tp.param_share,
                grads * max(2.0, 1.0 + (1.0 if rows is None else rows)))
  return max(tail_peak, int((p.param_bytes + optimizer + working) * WORKSPACE))


def _params_held(profile: StepProfile, zero: int, share: float | None) -> float:
  """A device's parameter bytes through a step: whole float32, or under ZeRO-3 as the programs receive them
  (:func:`loop_param_bytes`) beside its ``share`` of the float32 ones."""
  if zero != 3:
    return profile.param_bytes
  return loop_param_bytes(profile) + (share or 0.0) * profile.param_bytes


def _kind_cost(costing: Costing, kind: str, microbatch: int, remat: str, n: int, share: float | None, *,
               tp: TensorParallel = NO_TENSOR_PARALLEL, zero: int = 1) -> KindCost:
  """A device's microbatch costs (on a model axis: ``tp``'s, its update whole, and its row made whole over the
  axis after the loop); with a state ``share`` its update covers that share of the optimizer state and it writes
  the parameters the others send it (under ZeRO-3, as the programs receive them)."""
  cost = costing.kind_cost(kind, tp, microbatch, remat, 0, n)
  spec = costing.specs[kind]
  whole = costing.profile.zeroing_seconds(spec) * tp.param_share  # its accumulator's zeros, as Costing prices them
  if tp.m > 1:
    whole += costing.profile.param_count * GRAD_BYTES * (tp.m - 1) / tp.m / costing.links[kind].bandwidth
    cost = cost.with_fixed(costing.fixed[kind] + whole)
  if share is None:
    return cost
  received = loop_param_bytes(costing.profile) if zero == 3 else costing.profile.param_bytes
  return cost.with_fixed(costing.fixed[kind] * share + received / spec.write_rate + whole)


def search_groups(cluster: Cluster, profile: StepProfile, global_batch: int, sizes: Sequence[int], *,
                  remat_policies: Sequence[str] = ("none",), recompute: float = 1.0,
                  grad_reduce_dtypes: Sequence[str] = ("float32",),
                  progress: Callable[[str], None] | None = None,
                  every_process: Sequence[int] | None = None) -> Evaluated | None:
  """The fastest group plan of one group per device kind, over the devices of every kind or of the fastest two
  or more kinds (``every_process``: each device's process, where a set must hold devices of each), each kind's microbatch in ``sizes`` and the gradients crossing devices in one of
  ``grad_reduce_dtypes``; None if none fits. A pool of one kind has only its sharded group plans (one group
  holding its parameters split over every device: plain FSDP; unsharded, it would be one program). Of the
  plans priced within ``TIE`` of the fastest, over every device set, the one :func:`_fewest_microbatches`
  prefers. ``progress``: called with a line of text every eighth of each device set's microbatch
  combinations. Remat ``"layers"`` is priced only where a kind needs it (:func:`_needed_policies`)."""
  kinds = cluster.kinds
  costing = Costing(cluster, profile, sizes[len(sizes) // 2], recompute)
  remat_policies = _needed_policies(costing, sizes, remat_policies, recompute)
  speed = {k: profile.microbatch_seconds(cluster.spec_of(k), sizes[0]) for k in kinds}
  by_speed = sorted(kinds, key=lambda k: speed[k])
  near: list[Evaluated] = []
  for n in range(len(kinds), 1 if len(kinds) > 1 else 0, -1):
    chosen = set(by_speed[:n])
    name = "group programs by kind" + ("" if n == len(kinds) else f" (fastest {n} kinds)")
    ids = tuple(d.id for d in cluster.devices if d.spec.name in chosen)
    if every_process is not None and not holds_every_process(ids, every_process):
      continue  # a running process would hold no device
    layout = device_groups(cluster, name, ids, 1)
    near = _near(near + _near_on(costing, layout, global_batch, sizes, remat_policies, one_loop=recompute <= 1.0,
                                 dtypes=tuple(grad_reduce_dtypes), progress=progress, only_sharded=len(kinds) == 1))
  return min(near, key=_fewest_microbatches) if near else None


def _needed_policies(costing: Costing, sizes: Sequence[int], policies: Sequence[str], recompute: float
                     ) -> Sequence[str]:
  """``policies`` without ``"layers"`` where every kind's group may fit one of ``sizes`` without it (data-only, on
  a model axis, or sharded: :func:`_kind_fits`): each policy multiplies the per-kind combinations priced."""
  lighter = tuple(r for r in policies if r != "layers")
  if lighter == tuple(policies) or not lighter:
    return policies
  cluster = costing.cluster
  layout = device_groups(cluster, "group programs by kind", tuple(d.id for d in cluster.devices), 1)
  plain, models, shardable = _kind_fits(costing, layout, sizes, lighter, recompute <= 1.0,
                                        only_sharded=len(cluster.kinds) == 1)
  return lighter if all(plain[k] or k in models or shardable[k] for k in plain) else policies


def _near(plans: list[Evaluated]) -> list[Evaluated]:
  """The plans priced within ``TIE`` of the fastest of them."""
  fastest = min((p.step_seconds for p in plans), default=0.0)
  return [p for p in plans if p.step_seconds <= fastest * (1 + TIE)]


def _near_on(costing: Costing, layout: DeviceGroups, global_batch: int, sizes: Sequence[int],
             remat_policies: Sequence[str], *, one_loop: bool = True, dtypes: Sequence[str] = ("float32",),
             progress: Callable[[str], None] | None = None, only_sharded: bool = False) -> list[Evaluated]:
  """The group plans on ``layout``'s devices priced within ``TIE`` of the fastest, over per-kind microbatches,
  tails, the optimizer state replicated or in shares, the gradients' reduce dtypes, and remat: one policy for
  every group, or per kind the one that recomputes least of those that fit its microbatch. A kind none of whose
  microbatches fits data-only gets a model axis (:func:`_model_axis`). A kind of two devices or more is tried
  with its parameters sharded over its group too (:mod:`hetspmd.planner.sharding`), where its microbatch fits so
  (``only_sharded``: only so, for a pool of one kind, whose unsharded group is the single program). Without
  ``one_loop`` (a step whose exact batch statistics take loops of their own) neither a tail, a policy per kind, a
  model axis nor a sharded group."""
  order = list(dict.fromkeys(layout.kinds))
  plain, models, shardable = _kind_fits(costing, layout, sizes, remat_policies, one_loop, only_sharded=only_sharded)
  fits = {k: [m for m in sizes if m in plain[k] or m in shardable[k]] for k in order}
  tails = [(0, 0)] + ([(m, 1) for m in sizes if m * len(layout.devices) < global_batch
                       and all(m in plain[k] and k not in models for k in order)] if one_loop else [])
  # ZeRO-3 lowers a step's peak only where the programs take parameters as narrower casts
  zeros = ((0, 1) + ((3,) if costing.profile.cast_param_bytes else ())) if costing.profile.opt_state_bytes > 0 else (0,)
  # beside a sharded group ZeRO-3 also keeps whole parameters off its devices (in one process: they reach it as
  # parts only, hetspmd.lowering.group_build.GroupPrograms.parted)
  sharded_zeros = (0, 1, 3) if costing.profile.opt_state_bytes > 0 and one_process(costing, layout) else zeros
  near: list[Evaluated] = []
  total = min(math.prod(len(fits[k]) for k in order), MAX_COMBINATIONS)
  report = {max(1, total * i // 8) for i in range(1, 9)} if progress else set()  # every eighth, and the last
  priced = 0
  for done, combo in enumerate(itertools.islice(itertools.product(*(fits[k] for k in order)), MAX_COMBINATIONS), 1):
    chosen = dict(zip(order, combo))
    ways = [[False] * (m in plain[k]) + [True] * (m in shardable[k]) for k, m in chosen.items()]
    for shard in itertools.product(*ways):
      sharded = frozenset(k for k, s in zip(order, shard) if s)
      for e in _combination(costing, layout, global_batch, chosen, policies=remat_policies, one_loop=one_loop,
                            models={k: tp for k, tp in models.items() if k not in sharded}, sharded=sharded,
                            tails=tails if not sharded else [(0, 0)],
                            zeros=sharded_zeros if sharded else zeros, dtypes=dtypes):
        near, priced = _near(near + [e]), priced + 1
    if done in report:
      progress(f"group plans on {layout.name}: {done}/{total} microbatch combinations, {priced} plans priced")
  return near


def _kind_fits(costing: Costing, layout: DeviceGroups, sizes: Sequence[int], policies: Sequence[str],
               one_loop: bool, *, only_sharded: bool = False) -> tuple[dict, dict, dict]:
  """Per kind: the microbatches that may fit its group unsharded (data-only, or on the model axis
  :func:`_model_axis` gives a kind none of whose microbatches fits data-only), those model axes, and the
  microbatches worth trying sharded (:func:`_sharding_helps`; none for a kind of one device). ``only_sharded``:
  none unsharded."""
  order = list(dict.fromkeys(layout.kinds))
  n = len(layout.groups)
  plain = {k: [m for m in sizes if not only_sharded and _may_fit(costing, k, m, n, policies)] for k in order}
  models = {}
  for k in order:
    if not plain[k] and one_loop and not only_sharded:
      found = _model_axis(costing, layout, k, sizes, policies)
      if found is not None:
        models[k], plain[k] = found
  g = {k: shard_size(costing, layout, k) for k in order}
  hybrid = _hybrid(costing, layout, frozenset(order), 0, 0)  # every kind sharded would make a hybrid plan
  shardable = {k: [m for m in sizes if one_loop and g[k] >= 2 and _sharding_helps(
      costing, k, m, g[k], policies, n if m in plain[k] and k not in models else 0, hybrid=hybrid)] for k in order}
  if any(shardable.values()) and hybrid:  # then every kind sharded too
    shardable = {k: shardable[k] or [m for m in sizes if one_loop and g[k] >= 2 and
                                     _may_fit_sharded(costing, k, m, g[k], policies, hybrid=hybrid)] for k in order}
  return plain, models, shardable


def _sharding_helps(costing: Costing, kind: str, microbatch: int, g: int, policies: Sequence[str], n: int, *,
                    hybrid: bool = False) -> bool:
  """Whether to try a microbatch on ``kind``'s group sharded over its ``g`` devices: where it may fit so
  (:func:`_may_fit_sharded`) and the group unsharded (``n`` positions in all; 0: it does not fit data-only) cannot
  run it under the policy that recomputes least with the whole optimizer state on every device (a sharded group
  pays collectives every microbatch; where the group fits so unsharded, sharding it saves neither recomputation
  nor state shares, and is not priced, which keeps the search's time). ``hybrid``: every group may shard, each
  then holding its part of the state (:func:`_hybrid`)."""
  if not _may_fit_sharded(costing, kind, microbatch, g, policies, hybrid=hybrid):
    return False
  lightest = min(policies, key=lambda r: (costing.remat_factor(kind, microbatch, r), REMAT_POLICIES.index(r)))
  return not n or (_peak(costing, n, (microbatch, lightest), (0, lightest), None, None)
                   > costing.cluster.spec_of(kind).memory_bytes)


def _combination(costing: Costing, layout: DeviceGroups, global_batch: int, chosen: dict[str, int], *,
                 policies: Sequence[str], one_loop: bool, models: dict[str, TensorParallel], sharded: frozenset[str],
                 tails: Sequence[tuple[int, int]], zeros: Sequence[int], dtypes: Sequence[str]) -> list[Evaluated]:
  """The group plans priced of one choice of per-kind microbatches (``chosen``) and sharded kinds, over remat,
  tails, ZeRO stages and reduce dtypes: those that fit."""
  order = list(dict.fromkeys(layout.kinds))
  n = len(layout.groups)
  choices = [dict.fromkeys(order, r) for r in policies]
  if one_loop and len(policies) > 1 and len(order) > 1:  # first: a tie goes to the least recomputation
    hybrid = _hybrid(costing, layout, sharded, 0, 0)
    least = {k: _least_recompute(costing, k, chosen[k], n, policies, models.get(k, NO_TENSOR_PARALLEL),
                                 shard=shard_size(costing, layout, k) if k in sharded else 0, hybrid=hybrid)
             for k in order}
    # one policy for all is priced once; "layers" (on the traced step) beside a policy that checkpoints the loss
    # cuts the backward pass otherwise, and the groups' sums would not line up: not a runnable mix
    mixed = "layers" in least.values() and set(least.values()) - {"layers", "none"}
    choices = ([] if mixed else [least]) + [c for c in choices if c != least]
  out = []
  for remats, tail, zero, dtype in itertools.product(choices, tails, zeros, dtypes):
    e = price_groups(costing, layout, chosen, remats, global_batch, tail=tail, zero=zero, dtype=dtype,
                     models=models, sharded=sharded)
    if e is not None:
      out.append(e)
  return out


# model axes a kind's group may take (devices of a kind in one host, a power of two as the single program's)
GROUP_MODEL_SIZES = (2, 4, 8)


def _model_axis(costing: Costing, layout: DeviceGroups, kind: str, sizes: Sequence[int],
                policies: Sequence[str]) -> tuple[TensorParallel, list[int]] | None:
  """For a kind none of whose microbatches fits its devices data-only: the smallest model axis (its devices in
  each host making whole positions), and on it the split whose microbatch runs fastest, under which some of
  ``sizes`` may fit; with those sizes. None when none does (or the step's profile has no graph to split)."""
  profile, cluster = costing.profile, costing.cluster
  if not (profile.traces or profile.strategy_spaces):
    return None
  n = len(layout.groups)
  rows = 0.0 if one_process(costing, layout) else None  # the least it holds after the loop (no tail)
  spec = cluster.spec_of(kind)
  per_host, devices = {}, cluster.devices
  for i in layout.devices:
    if devices[i].spec.name == kind:
      per_host[devices[i].host] = per_host.get(devices[i].host, 0) + 1
  for m in GROUP_MODEL_SIZES:
    if any(count % m for count in per_host.values()):
      continue
    ranked = sorted(costing.choices(m), key=lambda tp: costing.kind_cost(kind, tp, sizes[0], "none", 0, n).micro)
    for tp in ranked:
      fitting = [s for s in sizes if any(_peak(costing, n, (s, r), (0, r), 0.0, rows, tp=tp) <= spec.memory_bytes
                                         for r in policies)]
      if fitting:
        return tp, fitting
  return None


def _may_fit(costing: Costing, kind: str, microbatch: int, n: int, policies: Sequence[str],
             tp: TensorParallel = NO_TENSOR_PARALLEL) -> bool:
  """Whether a microbatch may fit a device of ``kind`` under one of ``policies``: with none of the optimizer state
  and none of the reduced gradients, the least any group plan holds there (:func:`price_groups` checks the rest)."""
  spec = costing.cluster.spec_of(kind)
  zero = 3 if costing.profile.cast_param_bytes and tp.m == 1 else 0  # ZeRO-3 holds the least where it applies
  return any(_peak(costing, n, (microbatch, r), (0, r), 0.0, 0.0, tp=tp, zero=zero) <= spec.memory_bytes
             for r in policies)


def _may_fit_sharded(costing: Costing, kind: str, microbatch: int, g: int, policies: Sequence[str], *,
                     hybrid: bool = False) -> bool:
  """Whether a microbatch may fit a device of ``kind`` in a sharded group of ``g`` under one of ``policies``, with
  none of the optimizer state and none of the reduced gradients, or (``hybrid``) its part of the state
  (:func:`price_groups` checks the rest)."""
  spec = costing.cluster.spec_of(kind)
  return any(min(sharding.sharded_peak(costing.profile, g, (microbatch, r), 0.0, 0.0, "bfloat16"),
                 sharding.sharded_peak(costing.profile, g, (microbatch, r), None, None, state_sharded=True)
                 if hybrid else math.inf) <= spec.memory_bytes for r in policies)


def _fewest_microbatches(e: Evaluated) -> tuple:
  """Of plans priced alike: the fewest microbatches on the busiest device, then on all devices together, then
  the fewest programs (no state shares), then no sharded group (fewer collectives), then float32 gradients
  (exact), then the price. A linear cost model
  prices a microbatch of 2m as two of m; on a device the larger one runs larger kernels and fewer loop steps,
  and each extra program adds a round of transfers."""
  tail = e.group.tail[1]
  counts = [c + tail for c in e.counts]
  return (max(counts), sum(counts), bool(e.zero_stage), any(e.group.shard_params), e.grad_reduce_dtype != "float32",
          e.step_seconds)


def _least_recompute(costing: Costing, kind: str, microbatch: int, n: int, policies: Sequence[str],
                     tp: TensorParallel = NO_TENSOR_PARALLEL, *, shard: int = 0, hybrid: bool = False) -> str:
  """Of ``policies``, the one recomputing least whose microbatch fits a device of ``kind`` with the optimizer
  state held elsewhere (the most recomputing one when none fits); ``shard``: in a sharded group of that many
  (``hybrid``: holding its part of the state)."""
  spec = costing.cluster.spec_of(kind)
  ranked = sorted(policies, key=lambda r: (costing.remat_factor(kind, microbatch, r), REMAT_POLICIES.index(r)))
  for r in ranked:
    peak = (sharding.sharded_peak(costing.profile, shard, (microbatch, r), None, None, state_sharded=True)
            if shard and hybrid else
            sharding.sharded_peak(costing.profile, shard, (microbatch, r), 0.0, None) if shard else
            _peak(costing, n, (microbatch, r), (0, r), 0.0, None, tp=tp))
    if peak <= spec.memory_bytes:
      return r
  return max(policies, key=REMAT_POLICIES.index)


def to_group_plan(cluster: Cluster, e: Evaluated, ideal: float | None = None) -> GroupPlan:
  """The :class:`GroupPlan` of a priced group plan: one group per kind (a sharded kind, one per host:
  :func:`shard_key`; one group of every device where its execution has one, as the ``fsdp`` plan), devices by JAX id where the cluster is bound to JAX devices (else by cluster position), with the
  search's predictions (``ideal``: the pool's ideal throughput, for the efficiency): the step, and per device its
  peak bytes beside its memory and its compute."""
  ids = cluster.jax_device_ids or tuple(range(cluster.num_devices))
  part = e.group
  tps = part.group_models or (NO_TENSOR_PARALLEL,) * len(e.kinds)
  firsts = list(itertools.accumulate((tp.m for tp in tps), initial=0))
  on = lambda i: [e.device_positions[j] for j in range(firsts[i], firsts[i + 1])]  # position i's devices
  groups, shares, order, devices = [], [], [], []
  where = shard_key(cluster)
  kinds = range(len(e.kinds))
  # a sharded kind's devices one group per host, as the pricing sized them (shard_groups): equal groups that all
  # shard make the plan hybrid in the file too
  key = lambda i: (e.kinds[i], where[on(i)[0]] if part.shard_params and part.shard_params[i] else None)
  if part.execution is not None and len(part.execution.groups) == 1:  # one group of every device (the fsdp plan)
    key = lambda i: None
  for group in dict.fromkeys(key(i) for i in kinds):
    mine = [i for i in kinds if key(i) == group]
    tp = tps[mine[0]]
    each = [i for i in mine for _ in range(tp.m)]  # each of the group's devices' position
    ours = [d for i in mine for d in on(i)]
    groups.append(([ids[d] for d in ours], part.microbatches[mine[0]], [e.counts[i] for i in each],
                   part.remats[mine[0]] if part.remats else e.remat, tp.m, tp.model_dims,
                   bool(part.shard_params and part.shard_params[mine[0]])))
    shares += [part.state_shares[i] for i in each] if part.state_shares else []
    order += each
    devices += ours
  predicted = {"step_seconds": e.step_seconds, "throughput": e.throughput, "compute_seconds": e.compute_seconds,
               "communication_seconds": e.comm_seconds, "hidden_communication_seconds": e.hidden_seconds,
               **({"efficiency": e.throughput / ideal} if ideal else {})}
  at = {d: j for j, d in enumerate(e.device_positions)}
  per_device = {"memory_bytes": [e.memory_bytes[at[d]] for d in devices],
                "memory_capacity_bytes": [cluster.devices[d].spec.memory_bytes for d in devices]}
  if e.position_seconds:
    per_device["compute_seconds"] = [e.position_seconds[i] for i in order]
  plan = group_plan(groups, e.global_batch, tail=part.tail,
                    state_shares=tuple(s / sum(shares) for s in shares) if shares else (),
                    zero_stage=e.zero_stage if shares else None, grad_reduce_dtype=e.grad_reduce_dtype)
  return dataclasses.replace(plan, predicted=tuple(predicted.items()),
                             predicted_per_device=tuple((k, tuple(v)) for k, v in per_device.items()))
