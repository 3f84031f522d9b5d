"""The group plan's features, one entry each, as :mod:`hetspmd.passes` registers its rules.

A group plan is a plain schedule of programs (each group's loop, the
exchange) plus features. Each entry names, for one feature: when a plan has it
(from the plan and its :class:`~hetspmd.plan.execution.Execution`), the stages
of the group programs it uses (:mod:`hetspmd.lowering.group_stages`; ``loop``
is the group's loop itself), the role its held leaves take
(:class:`hetspmd.lowering.group_build.HeldLeaf`), the functions that move its
values (``module.function`` under :mod:`hetspmd.lowering`: :mod:`~hetspmd.lowering.transfers`,
:mod:`~hetspmd.lowering.param_shards`), the functions that price it
(``module.function`` under :mod:`hetspmd.planner`), and its lines in
``explain()``. ``explain()`` is made from this table, and a test resolves every
name in it, so an entry cannot name what does not exist.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from hetspmd.plan.groups import GroupPlan, relays

Lines = Callable[[GroupPlan, Any, Any], list]  # (plan, execution, the built programs or None) -> explain lines


@dataclasses.dataclass(frozen=True)
class Feature:
  """One group plan feature (see the module docstring)."""

  name: str
  applies: Callable[[GroupPlan, Any], bool]  # (plan, execution) -> whether the plan has it
  stages: tuple[str, ...]
  role: str | None
  transfers: tuple[str, ...]
  price: tuple[str, ...]
  explain: Lines


def _replicated(plan: GroupPlan, execution: Any, built: Any) -> list[str]:
  return ["  state replicated on every device (ZeRO-0); each group's program runs its loop, one uniform program "
          "over every device reduces and updates"]


def _shares(plan: GroupPlan, execution: Any, built: Any) -> list[str]:
  three = plan.zero_stage == 3
  return [("  each device sends the parameters it holds to every device; " if three else "  ") +
          "each group's program runs its loop; one uniform program over every device reduces the sums and computes "
          "what reads no held leaf; each device's own program updates its held leaves" +
          (" and keeps the parameters it made" if three else " and sends the parameters it made to every device")]


def _zero3_parts(plan: GroupPlan, execution: Any, built: Any) -> list[str]:
  if built is not None and not built.parted:
    return []  # none qualifies: each is read whole by the exchange or another owner's update
  parted = f" ({len(built.parted)} parameters)" if built is not None else ""
  return [f"  ZeRO-3 parameters made on one device reach the groups that shard them as their parts only{parted}"]


def _relays(plan: GroupPlan, execution: Any, built: Any) -> list[str]:
  return ["  some devices hold much more state than the rest: sums and parameters cross in two hops (split evenly, "
          "then gathered)"]


def _hybrid(plan: GroupPlan, execution: Any, built: Any) -> list[str]:
  split = f" ({len(built.held_split)} leaves)" if built is not None else ""
  return [f"  hybrid: every group holds its parameters and optimizer state split over its devices between steps"
          f"{split}, each group its own copy (one group: FSDP); each group's program runs its loop; one uniform "
          "program over every device adds the groups' parts and updates each part where it is held; a leaf the "
          "group's size does not divide is held whole"]


def _parts_exchange(plan: GroupPlan, execution: Any, built: Any) -> list[str]:
  if built is not None and not built.part_sums:  # a step of several loops: an earlier loop's sums feed a later one
    return ["  the groups hand over whole-shaped rows: the step runs several microbatch loops, whose sums are not "
            "split (the groups would otherwise exchange parts)"]
  sums = f" ({len(built.part_sums)} sums)" if built is not None else ""
  return [f"  the groups that do not shard reduce-scatter their sums within the group after their loop, onto the "
          f"parts the sharded groups hold{sums}: no device hands over a whole-sized row; one uniform program adds "
          "the parts across the groups and updates, every device getting the whole new state"]


def _tail(plan: GroupPlan, execution: Any, built: Any) -> list[str]:
  return [f"  tail: every device runs {plan.tail_count} microbatch(es) of {plan.tail_microbatch} in the uniform "
          "program after its group's loop, the reduction overlapping the last one's backward pass"]


def _casts(plan: GroupPlan, execution: Any, built: Any) -> list[str]:
  if built is None or not built.casts:
    return []
  names = sorted({str(d) for d in built.casts.values()})
  return [f"  {len(built.casts)} of {len(built.params)} parameters sent as their {', '.join(names)} casts (the step "
          "reads them only so); each device updates the ones it holds as they are"]


def _none(plan: GroupPlan, execution: Any, built: Any) -> list[str]:
  return []  # said per group in the plan's summary


def _sharded(plan: GroupPlan, execution: Any, built: Any) -> list[str]:
  return []  # per group, in GroupedStep's own lines (its devices, what it holds, the XLA flags)


FEATURES: tuple[Feature, ...] = (
    Feature("replicated state", lambda plan, ex: not plan.state_shares and not ex.hybrid, ("loop", "spread"), None,
            ("transfers.on",), ("grouping._reduce_seconds",), _replicated),
    Feature("memory shares", lambda plan, ex: bool(plan.state_shares), ("hold",), "opt_state",
            ("transfers.held_on", "transfers.broadcast", "transfers.rows_on"), ("grouping._state_shares", "group_shares.gather_seconds"), _shares),
    Feature("ZeRO-3 parts", lambda plan, ex: ex.zero3_parts, ("loop",), "param", ("transfers.parts_on",),
            ("group_shares.loop_param_bytes", "group_shares.gather_seconds"), _zero3_parts),
    Feature("relays", lambda plan, ex: ex.owners_reduce and relays(plan.state_shares), (), None,
            ("transfers.relayed", "transfers.scatter_program"), ("group_shares.gather_seconds", "grouping._reduce_seconds"), _relays),
    Feature("FSDP within a group", lambda plan, ex: any(s for _, _, s in ex.groups), ("loop",), None,
            ("param_shards.shard_program", "param_shards.ParamShards", "transfers.Pieces"),
            ("sharding.sharded_kind_cost", "sharding.sharded_peak", "sharding.microbatch_comm_seconds"), _sharded),
    Feature("hybrid", lambda plan, ex: ex.hybrid, ("loop",), None, ("transfers.split_on", "transfers.group_part", "transfers.part_rows"),
            ("sharding.hybrid_exchange_seconds",), _hybrid),
    Feature("parts exchange", lambda plan, ex: ex.parts_exchange, ("loop",), None,
            ("param_shards.ParamShards", "transfers.part_rows"),
            ("sharding.parts_exchange_seconds", "sharding.sharded_peak"), _parts_exchange),
    Feature("tail", lambda plan, ex: ex.tail, (), None, (), ("grouping._kind_cost",), _tail),
    Feature("casts", lambda plan, ex: plan.zero_stage == 3, ("widen",), "param", ("transfers.cast_value",),
            ("group_shares.loop_param_bytes",), _casts),
    Feature("model axis", lambda plan, ex: any(g.model > 1 for g in plan.groups), ("constrain", "spread"), None,
            (), ("grouping._model_axis",), _none),
    Feature("narrow reduction", lambda plan, ex: plan.grad_reduce_dtype != "float32", ("narrow",), None, (),
            ("grouping._reduce_seconds",), _none),
    Feature("remat per group", lambda plan, ex: len({g.remat for g in plan.groups}) > 1, ("reorder",), None, (),
            ("grouping._least_recompute",), _none),
)


def explained(plan: GroupPlan, execution: Any, built: Any) -> list[str]:
  """The lines of every feature ``plan`` has, in table order."""
  return [line for f in FEATURES if f.applies(plan, execution) for line in f.explain(plan, execution, built)]
