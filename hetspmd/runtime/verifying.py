"""A searched plan checked on the step before it runs: the choice timed whole, and where it misses its
prediction, the search's runners-up timed too and the fastest measured run instead.

A calibration measures each kind's compute on its own; the whole program adds what no kind's timing sees
(the reduction as it really runs, the loop's padding, XLA's fusion across the program). So after a calibrated
search the first call times the chosen plan on the call's own arguments (a copy of the state, placed as the
plan places it: nothing the caller holds is donated or written), as the median of a few runs after a warm-up:
a single program, or a group plan's programs, its exchange and updates, as a step runs them. Where it runs more than :data:`MISS` slower than its prediction, the next ranked single
programs are timed the same way, and the fastest measured runs (a runner-up only where :data:`MARGIN` faster
than the choice). The runner that runs is the one timed, its programs compiled already.

The choice is timed on the first call's arguments, or, where the plan is made before any call
(``step.shard_state`` of a ``step(state, batch)``), on the state and ``example_batch`` repeated to the global
batch. Across processes each process runs its share of each plan (its batch cut or repeated to the examples it
would feed that plan), and the slowest process's time counts, so every process makes the same choice.
"""

from __future__ import annotations

import dataclasses
import statistics
import warnings
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from hetspmd.errors import HetSpmdError
from hetspmd.hardware.devices import allocator_stats
from hetspmd.plan.groups import GroupPlan
from hetspmd.runtime.calibrating import batch_positions, everywhere, examples, now
from hetspmd.runtime.group_runner import GroupRunner
from hetspmd.runtime.single import SingleRunner

MISS = 0.25    # measured slower than predicted by more than this: the runners-up are timed too
MARGIN = 0.05  # a runner-up replaces the choice where it measured at least this much faster
REPEATS = 3    # timed runs per plan, after a warm-up run (which compiles)
PLANS = 3      # plans timed at most: the choice and its runners-up
ON_EXAMPLES = "example_batch repeated to the global batch"  # what a plan made before any call is timed on


@dataclasses.dataclass(frozen=True)
class Timed:
  """One plan timed whole: what the search predicted a step takes and what it took (median seconds)."""

  label: str
  predicted: float
  measured: float
  error: str = ""  # why it did not run (measured is then infinite)

  @property
  def off(self) -> float:
    """Measured against predicted, relative (+0.5: half again as slow)."""
    return self.measured / self.predicted - 1 if self.predicted > 0 else float("inf")


@dataclasses.dataclass(frozen=True)
class Verification:
  """The plans timed on the first call, the search's choice first, and which of them runs."""

  timed: tuple[Timed, ...]
  runs: int
  miss: float = MISS
  on: str = "the first call"  # what it was timed on

  @property
  def replanned(self) -> bool:
    return self.runs != 0

  def to_json(self) -> dict[str, Any]:
    return {"miss": self.miss, "runs": self.runs, "replanned": self.replanned, "on": self.on,
            "timed": [{"plan": t.label, "predicted_seconds": t.predicted,
                       "measured_seconds": None if t.error else t.measured, "error": t.error}
                      for t in self.timed]}

  def describe(self) -> list[str]:
    first = self.timed[0]
    if first.error:
      return [f"  not verified: the search's plan did not run beside a copy of the state on {self.on}: {first.error}"]
    said = (f"the search's plan ran a step in {first.measured * 1e3:.3g} ms, predicted {first.predicted * 1e3:.3g} ms "
            f"({first.off:+.0%}")
    if first.off <= self.miss:
      return [f"  verified on {self.on}: {said}, within the {self.miss:.0%} past which its runners-up are timed)"]
    if len(self.timed) == 1:
      return [f"  verified on {self.on}: {said}, more than {self.miss:.0%} slower; there was no other single "
              "program to time)"]
    lines = [f"  verified on {self.on}: {said}, more than {self.miss:.0%} slower), so its runners-up were timed too "
             f"and the fastest measured runs (a runner-up where {MARGIN:.0%} faster than the choice):"]
    for i, t in enumerate(self.timed):
      mark = "  <- runs" if i == self.runs else ""
      ran = f"did not run ({t.error})" if t.error else f"measured {t.measured * 1e3:.3g} ms"
      lines.append(f"    {t.label}: predicted {t.predicted * 1e3:.3g} ms, {ran}{mark}")
    return lines


def wanted(option: Any, calibration: Any, call: tuple | None) -> bool:
  """Whether a search verifies its choice (``parallelize(..., verify=option)``): on concrete host-addressable
  arguments (``call``: a call's, or the state and ``example_batch`` repeated to the global batch; None where
  neither is at hand), under ``True``, or under ``"auto"`` where the search priced compute from a
  ``calibration``."""
  if option is False or call is None:
    return False
  if any(_unreadable(x) for x in jax.tree.leaves(call)):  # step.resolve on abstract values, or a global array
    return False
  return bool(option) if option != "auto" else calibration is not None


def _unreadable(x: Any) -> bool:
  """An argument a timing cannot cut to its examples: abstract, or an array split across processes."""
  return isinstance(x, jax.ShapeDtypeStruct) or (isinstance(x, jax.Array) and not x.is_fully_addressable)


def checked(front: Any, searched: Any, call: tuple | None, checks: bool, on: str) -> tuple[Any, Any, str]:
  """For ``front``'s search (``searched``: its plan, a group plan's runtime, runners-up and note): the runner
  :func:`verified` keeps (None where nothing was timed), the verification, and the search's note with why
  nothing was timed where ``verify=True`` asked."""
  if checks:
    runner, verification = verified(front, (searched.plan, *searched.runners_up), *call, on=on,
                                    runtime=searched.runtime)
    return runner, verification, searched.note
  why = f"not verified (verify=True): {unverified(call)}" if front.verify is True else ""
  return None, None, "; ".join(filter(None, [searched.note, why]))


def example_call(front: Any, state: Any) -> tuple | None:
  """``((state, example_batch repeated to the global batch), {})``, a call to time plans on where the plan is
  made before any call (a ``step(state, batch)``); None where no concrete example batch says what it takes."""
  batch = front.example_batch
  if (batch is None or state is None or front.bound or isinstance(batch, (tuple, list))
      or front.batch_argnums not in (None, (1,))
      or any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves((state, batch)))):
    return None
  return (state, examples(batch, front.global_batch)), {}


def unverified(call: tuple | None) -> str:
  """Why :func:`wanted` said no to ``verify=True``."""
  if call is None:
    return ("the plan was made before any call, and example_batch does not say the step's call (give a concrete "
            "example_batch of a step(state, batch), or call the step first)")
  return ("the plan was made from abstract arguments (step.resolve on shapes) or arrays split across processes; "
          "resolve it on this process's host arrays")


def label(plan: Any) -> str:
  """A plan in one line: its mesh and devices (a group plan: each group's), microbatches, ZeRO stage, remat and
  reduction dtype."""
  if isinstance(plan, GroupPlan):
    return "group plan: " + "; ".join(
        f"devices {list(g.devices)}, counts {list(g.counts)} of {g.microbatch}, remat {g.remat}"
        + (f", model {g.model}" if g.model > 1 else "") + (", FSDP" if g.shard_params else "") for g in plan.groups)
  return (f"mesh {dict(zip(plan.axis_names, plan.mesh_shape))} on devices {list(plan.device_ids)}, counts "
          f"{list(plan.microbatch_counts)} of {plan.microbatch}, ZeRO-{plan.zero_stage}, remat {plan.remat}, "
          f"reduced in {plan.grad_reduce_dtype}{', overlapped' if plan.overlap_reduction else ''}")


def verified(front: Any, plans: Sequence[Any], args: tuple, kwargs: dict, *, on: str = "the first call",
             miss: float = MISS, repeats: int = REPEATS, runtime: Any = None) -> tuple[Any, Verification]:
  """The runner ``front`` runs and how it was chosen: ``plans[0]`` (the search's choice: a single program, or a
  group plan whose ``runtime`` the search built) timed whole on
  a call's arguments (``on`` says which), and where it runs more than ``miss`` slower than predicted,
  ``plans[1:]`` too (those ``front``'s rebalancing can move, where it rebalances); a runner-up replaces the choice
  where it measured :data:`MARGIN` faster, so noise alone does not. ``args`` hold the global batch."""
  plans = [plans[0]] + [p for p in plans[1:] if front.rebalancer is None or movable(p)]
  runners, timed = [], []
  for plan in plans:
    runner = (GroupRunner.of(front, plan, runtime) if isinstance(plan, GroupPlan) else SingleRunner.of(front, plan))
    runners.append(runner)
    seconds, error = _time(front, runner, args, kwargs, repeats)
    timed.append(Timed(label(plan), dict(plan.predicted).get("step_seconds", 0.0), seconds, error))
    if len(timed) == 1 and (timed[0].off <= miss or error):
      break
  best = min(range(len(timed)), key=lambda i: timed[i].measured)
  if timed[best].measured > (1 - MARGIN) * timed[0].measured:
    best = 0
  if timed[best].off > miss and not timed[best].error:
    warnings.warn(f"the plan runs a step in {timed[best].measured * 1e3:.3g} ms, {timed[best].off:+.0%} slower than "
                  f"predicted ({timed[best].predicted * 1e3:.3g} ms; {len(timed)} plan(s) timed): the search priced "
                  "it from times that do not hold here (calibrate the step on this pool: step.calibrate)",
                  stacklevel=4)
  return runners[best], Verification(tuple(timed), best, miss, on)


def movable(plan: Any) -> bool:
  """Whether rebalancing can move ``plan``'s microbatches: one device per data position, no stages."""
  return not plan.stages and plan.mesh_shape[1] == 1


def _time(front: Any, runner: Any, args: tuple, kwargs: dict, repeats: int) -> tuple[float, str]:
  """Median seconds of ``repeats`` runs of ``runner``'s program on a copy of the call's state, after a warm-up,
  and ``""``; ``(inf, why)`` where it does not run here (out of memory beside the copy, or arguments it cannot
  take). Each process runs its share (the call's batch cut, or repeated, to the examples it feeds ``runner``'s
  plan: values do not change a step's time), and the slowest process's seconds count. The processes agree that
  every one of them has its share, and that it fits (:func:`short_of_memory`), before any prepares the plan
  (placing it may gather across processes); one that fails later, out of memory all the same, stops the others
  in the plan's collectives, as the step itself would."""
  before = front.batch_argnums
  try:
    return _timed_share(front, runner, args, kwargs, repeats)
  finally:
    front.batch_argnums = before


def _timed_share(front: Any, runner: Any, args: tuple, kwargs: dict, repeats: int) -> tuple[float, str]:
  """:func:`_time`, ``front.batch_argnums`` left set to this process's share of the batch."""
  cut, error, seconds = None, "", [float("inf")]
  try:
    at = batch_positions(front, args)
    cut = tuple(examples(a, len(runner.process_examples())) if i in at else a for i, a in enumerate(args))
    front.batch_argnums = at  # this share is the batch, whatever its size
    error = short_of_memory(runner, cut, kwargs)
  except Exception as e:  # noqa: BLE001 (every process must reach the agreement below, whatever failed here)
    error = _first_line(e)
  if not everywhere(not error):
    return float("inf"), error or "it did not run on another process"
  try:
    run = runner.prepared(cut, kwargs)
    run()
    seconds = []
    for _ in range(repeats):
      start = now()
      run()
      seconds.append(now() - start)
  except (jax.errors.JaxRuntimeError, HetSpmdError) as e:
    seconds, error = [float("inf")], _first_line(e)
  slowest = _slowest(statistics.median(seconds))
  return slowest, error or ("" if slowest < float("inf") else "it did not run on another process")


def free_bytes(device: Any) -> int | None:
  """The bytes ``device``'s allocator can still hand out (its limit less what is in use), where its backend says
  (None on CPU)."""
  stats = allocator_stats(device)
  if not stats.get("bytes_limit"):
    return None
  return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def short_of_memory(runner: Any, args: tuple, kwargs: dict) -> str:
  """Why ``runner``'s step on ``args`` would not fit beside what this process's devices hold now (the caller's
  state among it), or ``""``: where its priced peak on a device (:meth:`Runner.needed_bytes`: one state, the
  copy timed, among it) is more than the device has free. Asked before the state's copy is placed or anything
  runs, so that a process that would run out of memory says so while every process can still agree not to run
  the plan (one that failed inside the plan's collectives would leave the others waiting)."""
  free = {d: free_bytes(d) for d in jax.local_devices()}
  if all(f is None for f in free.values()):
    return ""
  for device, need in runner.needed_bytes(args, kwargs).items():
    if free.get(device) is not None and need > free[device]:
      return (f"it needs {need / 2**30:.3g} GiB on device {device.id}, which has {free[device] / 2**30:.3g} GiB "
              "free beside the state")
  return ""


def _first_line(error: BaseException) -> str:
  return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def _slowest(seconds: float) -> float:
  """The slowest process's ``seconds`` (every process gets the same number, so the same choice)."""
  if jax.process_count() == 1:
    return seconds
  return float(np.max(np.asarray(multihost_utils.process_allgather(np.array([seconds], np.float64)))))
