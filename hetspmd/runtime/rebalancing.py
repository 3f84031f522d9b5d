"""Rebalancing a running single program: measure each kind's share of the step, move microbatches, keep going.

Inside one SPMD program a device's loop end is not visible (fast devices wait in the reduction), so every
``Rebalance.every`` calls each process times its kinds' share of the step on one of their devices
(:class:`~hetspmd.runtime.calibrating.KindTimer`: one microbatch and two, at the plan's microbatch
size and remat policy), the times are gathered across processes, and the damped controller
(:mod:`hetspmd.plan.balance`) decides. New counts run as the same plan with other ``microbatch_counts``: each
set of counts builds its program once (kept, so returning to earlier counts compiles nothing). Across processes
a decision at one call applies ``max(lag, 1)`` calls later, so each process's loader can ask for its next
examples first (``step.process_examples(ahead=...)``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np

from hetspmd.errors import HetSpmdError
from hetspmd.plan.balance import Balance, Rebalance, update
from hetspmd.plan.groups import GroupPlan
from hetspmd.runtime import placement
from hetspmd.runtime.calibrating import KindTimer, gathered, local_kind_devices

WARN_ABOVE = 0.25  # measured against predicted: a warning past this relative difference
# room a single program's buffers get when new counts outgrow them: later moves within it compile nothing
SLOT_HEADROOM = 0.25


@dataclasses.dataclass
class Rebalancer:
  """A front's rebalancing (``parallelize(..., rebalance=...)``): the controller's state, what is scheduled,
  the runners of each set of counts, and the history of measurements."""

  option: Rebalance
  balance: Balance | None = None
  calls: int = 0
  pending: dict = dataclasses.field(default_factory=dict)   # call number -> counts that call runs
  history: list = dataclasses.field(default_factory=list)   # one dict per measurement
  clock: LoopClock = dataclasses.field(default_factory=lambda: LoopClock())
  group_clock: GroupClock = dataclasses.field(default_factory=lambda: GroupClock())
  _timers: dict = dataclasses.field(default_factory=dict, repr=False)   # kind -> KindTimer
  _runners: dict = dataclasses.field(default_factory=dict, repr=False)  # counts -> runner
  _owed: bool = False  # a measurement was due before the loops had been timed

  def clock_for(self, mesh: Any) -> LoopClock | None:
    """The clock a program over ``mesh`` times its loops with, where this rebalancing measures loops."""
    platform = mesh.devices.flat[0].platform
    loop = self.option.measure == "loop" or (self.option.measure == "auto" and platform == "cpu")
    return self.clock if loop and mesh.shape[mesh.axis_names[0]] > 1 else None

  def before_call(self, front: Any, args: tuple, kwargs: dict) -> None:
    """Before call ``calls + 1`` of ``front`` (its plan resolved): the last call's loop times kept, the counts
    due now put in force, and a measurement where one is due."""
    runner = front._runner
    plan = runner.plan
    _check_plan(plan, runner)
    if self.balance is None:
      self.balance = Balance(plan_counts(plan), _position_kinds(plan), sizes=_position_sizes(plan))
      self._runners[plan_counts(plan)] = runner
    self.calls += 1
    self.clock.keep()
    if self.calls in self.pending:
      self._apply(front, self.pending.pop(self.calls))
    if (self.calls - 1) % self.option.every == 0 or self._owed:
      self._measure(front, args, kwargs)
    self.clock.ran = plan_counts(front._runner.plan)

  def counts_at(self, ahead: int) -> tuple[int, ...] | None:
    """The counts the call ``ahead`` calls after the next one runs (None: the plan's)."""
    if self.balance is None:
      return None
    counts, upto = self.balance.counts, self.calls + 1 + ahead
    for at in sorted(self.pending):
      if at <= upto:
        counts = self.pending[at]
    return counts

  @property
  def compiles(self) -> int:
    """Programs built over every set of counts run so far (a program that runs several sets counted once)."""
    caches = {id(getattr(r, "_programs", r)): r.program_count for r in self._runners.values()}
    return sum(caches.values())

  def write_history(self, path: str | Path) -> None:
    Path(path).write_text("".join(json.dumps(h) + "\n" for h in self.history))

  def describe(self) -> list[str]:
    o = self.option
    lines = [f"  rebalancing: every {o.every} call(s), threshold {o.threshold:.0%}, smoothing {o.smoothing}, "
             f"{o.confirm} agreeing measurement(s) to move, applied {o.lag} call(s) later; "
             f"{len(self._runners)} set(s) of counts run, {self.compiles} program(s) built"]
    for h in self.history[-6:]:
      kinds = "; ".join(f"{k} {v['microbatch_seconds'] * 1e3:.3g} ms a microbatch + {v['step_seconds'] * 1e3:.3g} ms"
                        for k, v in h["measured"].items())
      moved = f" -> {h['moved_to']} from call {h['applies_at']}" if h["moved_to"] else ""
      lines.append(f"    call {h['call']}: counts {h['counts']}{moved}; {kinds}")
      lines.append("      busiest position's compute: measured " + f"{h['measured_step_seconds'] * 1e3:.3g} ms"
                   + (f", predicted {h['predicted_step_seconds'] * 1e3:.3g} ms" if h.get("predicted_step_seconds")
                      else ""))
    return lines

  def process_examples(self, runner: Any, ahead: int) -> np.ndarray:
    """This process's examples for the call ``ahead`` calls after the next one."""
    counts = self.counts_at(ahead)
    if counts is None or counts == plan_counts(runner.plan):
      return runner.process_examples()
    plan = with_counts(runner.plan, counts)
    if isinstance(plan, GroupPlan):
      return plan.examples_of(d.id for d in jax.local_devices())
    return placement.process_examples(plan, plan.mesh())

  def _apply(self, front: Any, counts: tuple[int, ...]) -> None:
    if counts not in self._runners:
      runner = front._runner
      plan = with_counts(runner.plan, counts)
      # programs that read the counts at run time: buffers with room, so later moves compile nothing
      plan = (with_group_slots(runner.plan, plan) if runner.grouped else
              plan.replace(slots=slots_for(runner.plan, counts)))
      new = type(runner).of(front, plan)
      any(new.adopt(r) for r in self._runners.values())
      self._runners[counts] = new
    front._runner = self._runners[counts]

  def timed(self, front: Any, args: tuple, kwargs: dict, only: frozenset | None = None
            ) -> dict[str, tuple[float, float]]:
    """``{kind: (seconds per microbatch, seconds per step)}`` of every kind of the plan (or those in ``only``):
    this process's kinds timed on one of their devices at the plan's microbatch size, gathered across
    processes. An idle kind whose device cannot run the step (out of memory, a state split across processes)
    is left out: it stays idle."""
    plan = front._runner.plan
    idle = self.balance.idle()
    mine = {}
    for kind, device in local_kind_devices(plan.device_ids, _device_kinds(plan)).items():
      if only is not None and kind not in only:
        continue
      if kind not in self._timers:
        self._timers[kind] = KindTimer(front, device, plan.remat)
      try:
        timing = self._timers[kind].timing(kind, args, kwargs, [plan.microbatch])
      except (jax.errors.JaxRuntimeError, HetSpmdError):  # on this process only: the others still gather
        if kind not in idle:
          raise
        continue
      mine[kind] = (timing.points[0][1], timing.fixed)
    return gathered(tuple(dict.fromkeys(self.balance.kinds)), mine)

  def grouped(self, front: Any) -> dict[str, tuple[float, float]] | None:
    """``{group label: (seconds per microbatch, 0)}`` from the group programs' times as they ran in the last
    call (each its time over its longest count), gathered across processes; None until every group that runs
    microbatches has one (a group running none is not timed, and keeps none)."""
    mine = {}
    for g, (seconds, count) in self.group_clock.take().items():
      if count:
        mine[f"group {g}"] = (seconds / count, 0.0)
    found = gathered(tuple(dict.fromkeys(self.balance.kinds)), mine)
    running = set(self.balance.kinds) - self.balance.idle()
    return found if running <= set(found) else None

  def looped(self, front: Any, args: tuple, kwargs: dict) -> dict[str, tuple[float, float]] | None:
    """``{kind: (seconds per microbatch, 0)}`` from the loops timed inside the step since the last measurement
    (each kind its slowest position's mean), gathered across processes; None where the loops are not timed
    (another measure, a lockstep loop, several loops) or some running kind has no timed loop yet. A kind that
    runs no microbatch has no loop to time: it is timed on a device once (:meth:`timed`), and that time kept
    while it stays idle."""
    runner = front._runner
    if runner.grouped or runner.lockstep or self.clock_for(runner._mesh) is None or not self.clock.used:
      return None
    kinds = self.balance.kinds
    mine: dict[str, tuple[float, float]] = {}
    for position, micro in self.clock.per_microbatch().items():
      if micro > mine.get(kinds[position], (0.0, 0.0))[0]:
        mine[kinds[position]] = (micro, 0.0)
    found = gathered(tuple(dict.fromkeys(kinds)), mine)
    idle = frozenset(kinds) - set(found)
    if idle - self.balance.idle():
      return None
    self.clock.sums = {}
    if idle and idle != self.clock.idle[0]:  # timed once while the same kinds stay idle
      self.clock.idle = idle, {k: (micro, 0.0)  # as the loops give theirs: no per-step seconds
                               for k, (micro, _) in self.timed(front, args, kwargs, only=idle).items() if k in idle}
    return {**found, **{k: v for k, v in self.clock.idle[1].items() if k in idle}}

  def _measure(self, front: Any, args: tuple, kwargs: dict) -> None:
    runner = front._runner
    plan = runner.plan
    if runner.grouped:
      measured = self.grouped(front)
      if measured is None:  # the programs are timed as they run: the first measurement follows the first call
        self._owed = True
        return
    elif self.clock_for(runner._mesh) is not None and not runner.lockstep and self.calls == 1:
      self._owed = True  # the loops are timed as the step runs: the first measurement follows the first call
      return
    else:
      measured = self.looped(front, args, kwargs) or self.timed(front, args, kwargs)
    self._owed = False
    before = self.balance
    self.balance = update(before, measured, self.option)
    entry = self._entry(plan, measured, before)
    if self.balance.counts != before.counts:
      at = self.calls + max(self.option.lag, 1 if jax.process_count() > 1 else 0)
      entry.update(moved_to=list(self.balance.counts), applies_at=at)
      if at == self.calls:
        self._apply(front, self.balance.counts)
      else:
        self.pending[at] = self.balance.counts
    self.history.append(entry)
    self._warn(entry)

  def _entry(self, plan: Any, measured: dict, before: Balance) -> dict:
    """One history line: per kind the measured seconds per microbatch and per step, and per data position its
    measured compute under the counts in force (``fixed + micro x count``) beside the plan's prediction where
    the plan carries one and still runs its own counts."""
    predicted = (dict(getattr(plan, "predicted_per_position", ())).get("compute_seconds")
                 if plan_counts(plan) == before.counts else None)
    positions = [measured[k][1] + measured[k][0] * c if c else 0.0 for c, k in zip(before.counts, before.kinds)]
    entry = {"call": self.calls, "counts": list(before.counts),
             "measured": {k: {"microbatch_seconds": m, "step_seconds": f} for k, (m, f) in measured.items()},
             "position_seconds": positions, "measured_step_seconds": max(positions),
             "moved_to": None, "applies_at": None}
    if predicted:
      entry["predicted_position_seconds"] = list(predicted)
      entry["predicted_step_seconds"] = max(predicted)
    return entry

  def _warn(self, entry: dict) -> None:
    predicted = entry.get("predicted_step_seconds")
    if not predicted or any(h.get("warned") for h in self.history):
      return
    off = entry["measured_step_seconds"] / predicted - 1
    if abs(off) > WARN_ABOVE:
      entry["warned"] = True
      warnings.warn(f"the step's measured compute ({entry['measured_step_seconds'] * 1e3:.3g} ms on its busiest "
                    f"device) is {off:+.0%} off the plan's prediction ({predicted * 1e3:.3g} ms): the plan was made "
                    "on other speeds; rebalancing moves the microbatches, and a calibrated search "
                    "(parallelize(..., calibrate=True)) plans on measured ones", stacklevel=4)


@dataclasses.dataclass(eq=False)
class LoopClock:
  """Host callbacks a single program calls around each data position's microbatch loop
  (:attr:`hetspmd.lowering.program.Layout.clock`): the loop's seconds per position, read after the call."""

  _open: dict = dataclasses.field(default_factory=dict)
  _done: dict = dataclasses.field(default_factory=dict)
  used: bool = False  # a program has called it
  ran: tuple = ()     # the counts the last call ran
  sums: dict = dataclasses.field(default_factory=dict)  # position -> [seconds, microbatches] kept since read
  # the kinds that run no loop, last timed on a device instead, and their times (Rebalancer.looped), kept
  idle: tuple = (frozenset(), {})

  def start(self, position: Any) -> np.int32:
    self._open[int(position)] = time.perf_counter()
    self.used = True
    return np.int32(0)

  def end(self, position: Any, value: Any) -> np.int32:
    begun = self._open.pop(int(position), None)
    if begun is not None:
      self._done[int(position)] = time.perf_counter() - begun
    return np.int32(0)

  def keep(self) -> None:
    """The loops the last call's program finished, added to :attr:`sums` (a position with no microbatch says
    nothing)."""
    done, self._done = self._done, {}
    for position, seconds in done.items():
      count = self.ran[position] if position < len(self.ran) else 0
      if count:
        kept = self.sums.setdefault(position, [0.0, 0])
        kept[0] += seconds
        kept[1] += count

  def per_microbatch(self) -> dict[int, float]:
    """``{position: seconds per microbatch}`` over the loops kept."""
    return {p: seconds / count for p, (seconds, count) in self.sums.items()}


@dataclasses.dataclass(eq=False)
class GroupClock:
  """Each group program's seconds as it runs (:class:`~hetspmd.runtime.grouped.GroupedStep` hands it each
  group's call): a thread per call waits for the program's inputs, then for its outputs (blocking, not polling)."""

  _done: dict = dataclasses.field(default_factory=dict)
  _threads: list = dataclasses.field(default_factory=list)

  def watch(self, group: int, inputs: Any, outputs: Any, count: int) -> None:
    """Time ``group``'s program call, whose longest count is ``count`` microbatches."""
    arrays = lambda tree: [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    thread = threading.Thread(target=self._time, args=(group, arrays(inputs), arrays(outputs), count), daemon=True)
    thread.start()
    self._threads.append(thread)

  def _time(self, group: int, inputs: list, outputs: list, count: int) -> None:
    _wait(inputs)
    start = time.perf_counter()
    _wait(outputs)
    self._done[group] = (time.perf_counter() - start, count)

  def take(self) -> dict[int, tuple[float, int]]:
    """``{group: (seconds, its longest count)}`` of the calls watched since the last take (waiting for them to
    finish)."""
    for thread in self._threads:
      thread.join()
    self._threads = []
    done, self._done = self._done, {}
    return done


def _wait(arrays: list) -> None:
  """Blocks until every array is ready (no polling: the wait takes no compute from a device's host thread); an
  array a later program took as a donated buffer was ready when it took it."""
  for x in arrays:
    try:
      x.block_until_ready()
    except RuntimeError:  # JaxRuntimeError from XLA, RuntimeError from JAX's own check of a deleted array
      if not x.is_deleted():
        raise


def plan_counts(plan: Any) -> tuple[int, ...]:
  """The microbatch counts the controller moves: a single program's per position, a group plan's per device in
  group order."""
  if isinstance(plan, GroupPlan):
    return tuple(c for g in plan.groups for c in g.counts)
  return plan.microbatch_counts


def slots_for(plan: Any, counts: tuple[int, ...]) -> int:
  """The buffer slots a single program of ``plan`` gets for new ``counts``: the current buffers where the
  counts fit them, else the largest count and :data:`SLOT_HEADROOM` more, so that the moves after it compile
  nothing. No loop runs the slots past the longest count, not even one in lockstep."""
  if max(counts) <= plan.max_count:
    return plan.max_count
  return min(sum(counts), math.ceil(max(counts) * (1 + SLOT_HEADROOM)))


def with_group_slots(before: GroupPlan, plan: GroupPlan) -> GroupPlan:
  """``plan`` (``before`` with new counts) with each group's buffer slots (:attr:`Group.slots`): its slots
  before where its new counts fit them, else its longest count and :data:`SLOT_HEADROOM` more (at most the
  groups' examples in its microbatches), so that its programs read the counts when they run and later moves compile
  nothing. A group that shards its parameters runs its longest count in lockstep, never the slots past it."""
  examples = sum(sum(g.counts) * g.microbatch for g in plan.groups)
  groups = []
  for old, g in zip(before.groups, plan.groups):
    fits = max(g.counts) <= old.max_count
    slots = old.max_count if fits else min(examples // g.microbatch,
                                           math.ceil(max(g.counts) * (1 + SLOT_HEADROOM)))
    groups.append(dataclasses.replace(g, slots=max(slots, 1)))
  return dataclasses.replace(plan, groups=tuple(groups))


def with_counts(plan: Any, counts: tuple[int, ...]) -> Any:
  """``plan`` with ``counts`` (as :func:`plan_counts` lists them)."""
  if not isinstance(plan, GroupPlan):
    return plan.replace(microbatch_counts=counts)
  groups, at = [], 0
  for g in plan.groups:
    groups.append(dataclasses.replace(g, counts=tuple(counts[at:at + len(g.counts)])))
    at += len(g.counts)
  return dataclasses.replace(plan, groups=tuple(groups))


def _device_kinds(plan: Any) -> tuple[str, ...]:
  return plan.device_kinds or tuple(f"position {p}" for p in range(plan.mesh_shape[0]) for _ in range(
      plan.mesh_shape[1]))


def _position_kinds(plan: Any) -> tuple[str, ...]:
  """Each data position's kind (the plan's device kinds; a plan that names none: each position its own); under a
  group plan each device's group (a group runs one program, timed as a whole)."""
  if isinstance(plan, GroupPlan):
    return tuple(f"group {g}" for g, group in enumerate(plan.groups) for _ in group.counts)
  return _device_kinds(plan)[::plan.mesh_shape[1]]


def _position_sizes(plan: Any) -> tuple[int, ...]:
  """Under a group plan, each device's examples per microbatch (its group's); a single program: none (one size)."""
  if isinstance(plan, GroupPlan):
    return tuple(g.microbatch for g in plan.groups for _ in g.counts)
  return ()


def _check_plan(plan: Any, runner: Any) -> None:
  if runner.grouped:
    bad = [g for g, group in enumerate(plan.groups) if group.model > 1]
    if bad:
      raise HetSpmdError("rebalance= moves microbatches between a group plan's devices where every group runs "
                         f"one device per position (no model axis); this plan's groups {bad} do not: drop "
                         "rebalance=")
    return
  if plan.stages or plan.mesh_shape[1] != 1:
    raise HetSpmdError("rebalance= moves microbatches between the data positions of a single program whose "
                       "positions are one device each (no model axis, no pipeline stages); this plan is "
                       + ("staged" if plan.stages else f"{plan.mesh_shape[1]} devices per position")
                       + ": drop rebalance=")
