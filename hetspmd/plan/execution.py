"""How a group plan runs, decided once: an :class:`Execution`, made from the plan and the processes that run it.

A :class:`~hetspmd.plan.groups.GroupPlan` says what each group computes; how the
step then moves its values depends also on the processes: a group whose devices
run their own trip counts runs in one process (one spanning several is cut), a
group that shards its parameters runs over every process holding its devices,
each device reduces its own share's sums only where one process drives them
all, and so on. Those
decisions are made here and nowhere else. The search prices this value
(:func:`hetspmd.planner.grouping.price_groups` makes it from the layout it
prices), the group lowering builds from it
(:func:`hetspmd.lowering.group_build.build`) and ``explain()`` prints it.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from hetspmd.plan.groups import GroupPlan, is_hybrid, split_by_process


@dataclasses.dataclass(frozen=True)
class Execution:
  """How a group plan runs on given processes.

  ``groups``: the group programs as they run, each as ``(processes, devices, sharded)``, sorted: the processes
  that call it, its number of devices, and whether it holds its parameters split over its devices in its loop
  (FSDP within the group, its devices in lockstep). A group that shards runs as one program over its devices,
  every process holding some calling it (plain FSDP over several hosts is one such group); any other group is
  cut where its devices change process (:func:`~hetspmd.plan.groups.split_by_process`), one process each.
  ``hybrid``: :func:`~hetspmd.plan.groups.is_hybrid`. ``tail``: every device runs the tail's microbatches in the
  uniform program after its group's loop. ``owners_reduce``: under state shares, with no tail and one process,
  each device's update reduces only the sums its own state reads (else the exchange program reduces every sum
  onto every device). ``parts_to_owners``: there, the groups that shard hand the owners their parts of the sums.
  ``zero3_parts``: ZeRO-3 in one process and no tail: a parameter made on one device reaches a sharded group as
  its parts only. ``parts_exchange``: some groups shard and some do not, all of one size and no model axis (each its own
  remat policy), with the state replicated and no tail: each group that does not shard reduce-scatters its sums
  within itself after its loop, onto the parts the sharded groups hold, and the exchange adds parts across the
  groups, as in a hybrid plan (no device hands over a whole-sized row of a sum)."""

  groups: tuple[tuple[tuple[int, ...], int, bool], ...]
  hybrid: bool
  tail: bool
  owners_reduce: bool
  parts_to_owners: bool
  zero3_parts: bool
  parts_exchange: bool = False

  @classmethod
  def made(cls, groups: Sequence[tuple[tuple[int, ...], int, bool]], *, zero_stage: int, shares: bool,
           tail: bool, data_only: bool = True) -> "Execution":
    """The execution of group programs ``groups`` (``(processes, devices, sharded)`` each, as they run) with the
    optimizer state in ``shares`` or not, under ``zero_stage``, with a ``tail`` or not; ``data_only``: every group
    runs a device per data position (no model axis)."""
    groups = tuple(sorted((tuple(sorted(set(p))), n, s) for p, n, s in groups))
    one_process = len({q for p, _, _ in groups for q in p}) == 1
    sharded = [s for _, _, s in groups]
    owners_reduce = shares and not tail and one_process
    sizes = [n for _, n, _ in groups]
    return cls(groups=groups, hybrid=is_hybrid(sharded, sizes, shares=shares, tail=tail),
               tail=tail, owners_reduce=owners_reduce, parts_to_owners=owners_reduce and any(sharded),
               zero3_parts=zero_stage == 3 and shares and not tail and one_process,
               parts_exchange=(any(sharded) and not all(sharded) and len(set(sizes)) == 1 and data_only
                               and not shares and not tail))

  @classmethod
  def of(cls, plan: GroupPlan, process_of: Mapping[int, int]) -> "Execution":
    """``plan`` run by the processes ``process_of`` names (device id -> process index)."""
    groups = split_by_process(plan, process_of).groups
    return cls.made([({process_of[d] for d in g.devices}, len(g.devices), g.shard_params) for g in groups],
                    zero_stage=plan.zero_stage or 0, shares=bool(plan.state_shares), tail=bool(plan.tail_count),
                    data_only=all(g.model == 1 for g in groups))

  @property
  def processes(self) -> int:
    return len({q for p, _, _ in self.groups for q in p})

  @property
  def one_process(self) -> bool:
    return self.processes == 1

  def lines(self) -> list[str]:
    """What this value decides, in words (``explain()``)."""
    sharded = sum(s for _, _, s in self.groups)
    said = [f"{len(self.groups)} group program(s) over {self.processes} process(es)"
            + (f", {sharded} sharding their parameters (FSDP within the group, in lockstep)" if sharded else "")]
    if self.hybrid:
      said.append("hybrid: each group holds its state split over its devices")
    if self.tail:
      said.append("a tail in the uniform program")
    if self.owners_reduce:
      said.append("each owner reduces its own share's sums" + (", the sharded groups handing it their parts"
                                                                 if self.parts_to_owners else ""))
    if self.zero3_parts:
      said.append("ZeRO-3 parameters reach sharded groups as parts")
    if self.parts_exchange:
      said.append("the unsharded groups reduce-scatter their sums onto the sharded groups' parts, the parts added "
                  "across the groups")
    return ["  execution: " + "; ".join(said)]
