"""A searched plan checked on the step before it runs: the choice timed whole, and where it misses its
prediction, the search's runners-up timed too and the fastest measured run instead.

A calibration measures each kind's compute on its own; the whole program adds what no kind's timing sees
(the reduction as it really runs, the loop's padding, XLA's fusion across the program). So after a calibrated
search the first call times the chosen single program on the call's own arguments (a copy of the state,
placed as the plan places it: nothing the caller holds is donated or written), as the median of a few runs
after a warm-up. Where it runs more than :data:`MISS` slower than its prediction, the next ranked single
programs are timed the same way, and the fastest measured runs. Every timed program is kept: the one chosen
is the step's, compiled already.

Across processes each process times its share of every program (they run as one), and the slowest process's
time counts, so every process makes the same choice.
"""

from __future__ import annotations

import dataclasses
import statistics
import warnings
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from hetspmd.runtime.calibrating import batch_positions, now
from hetspmd.runtime.single import SingleRunner

MISS = 0.25    # measured slower than predicted by more than this: the runners-up are timed too
REPEATS = 3    # timed runs per plan, after a warm-up run (which compiles)
PLANS = 3      # plans timed at most: the choice and its runners-up


@dataclasses.dataclass(frozen=True)
class Timed:
  """One plan timed whole: what the search predicted a step takes and what it took (median seconds)."""

  label: str
  predicted: float
  measured: float

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

  @property
  def replanned(self) -> bool:
    return self.runs != 0

  def to_json(self) -> dict[str, Any]:
    return {"miss": self.miss, "runs": self.runs, "replanned": self.replanned,
            "timed": [{"plan": t.label, "predicted_seconds": t.predicted,
                       "measured_seconds": t.measured if t.measured < float("inf") else None}  # None: did not run
                      for t in self.timed]}

  def describe(self) -> list[str]:
    first = self.timed[0]
    if first.measured == float("inf"):
      return ["  not verified: the search's plan did not run beside a copy of the state (out of memory)"]
    said = (f"the search's plan ran a step in {first.measured * 1e3:.3g} ms, predicted {first.predicted * 1e3:.3g} ms "
            f"({first.off:+.0%}")
    if first.off <= self.miss:
      return [f"  verified on the first call: {said}, within the {self.miss:.0%} past which its runners-up are timed)"]
    if len(self.timed) == 1:
      return [f"  verified on the first call: {said}, more than {self.miss:.0%} slower; the search ranked no other "
              "single program to time)"]
    lines = [f"  verified on the first call: {said}, more than {self.miss:.0%} slower), so its runners-up were timed "
             "too and the fastest measured runs:"]
    for i, t in enumerate(self.timed):
      mark = "  <- runs" if i == self.runs else ""
      ran = f"measured {t.measured * 1e3:.3g} ms" if t.measured < float("inf") else "did not run (out of memory)"
      lines.append(f"    {t.label}: predicted {t.predicted * 1e3:.3g} ms, {ran}{mark}")
    return lines


def wanted(option: Any, calibration: Any, call: tuple | None) -> bool:
  """Whether a search verifies its choice (``parallelize(..., verify=option)``): on a call's concrete arguments
  (``call``; None where the plan is made before any call, from ``example_batch``), under ``True``, or under
  ``"auto"`` where the search priced compute from a ``calibration``."""
  if option is False or call is None:
    return False
  if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(call)):  # step.resolve on abstract values
    return False
  return bool(option) if option != "auto" else calibration is not None


def label(plan: Any) -> str:
  """A plan in one line: its mesh, microbatches, ZeRO stage, remat and counts."""
  return (f"mesh {dict(zip(plan.axis_names, plan.mesh_shape))}, microbatch {plan.microbatch}, ZeRO-{plan.zero_stage}, "
          f"remat {plan.remat}, counts {list(plan.microbatch_counts)}")


def verified(front: Any, plans: Sequence[Any], args: tuple, kwargs: dict, *, miss: float = MISS,
             repeats: int = REPEATS) -> tuple[SingleRunner, Verification]:
  """The runner ``front`` runs and how it was chosen: ``plans[0]`` (the search's single program) timed whole on
  a call's arguments, and where it runs more than ``miss`` slower than predicted, ``plans[1:]`` too, the fastest
  measured kept (its programs built). ``args`` hold the global batch (across processes, each process times its
  own examples of each plan)."""
  runners, timed = [], []
  for plan in plans:
    runner = SingleRunner.of(front, plan)
    runners.append(runner)
    timed.append(Timed(label(plan), dict(plan.predicted).get("step_seconds", 0.0),
                       _slowest(_time(runner, _own_examples(front, runner, args), kwargs, repeats))))
    if len(timed) == 1 and (timed[0].off <= miss or timed[0].measured == float("inf")):
      break
  best = min(range(len(timed)), key=lambda i: timed[i].measured)
  if timed[best].off > miss and timed[best].measured < float("inf"):
    warnings.warn(f"the plan runs a step in {timed[best].measured * 1e3:.3g} ms, {timed[best].off:+.0%} slower than "
                  f"predicted ({timed[best].predicted * 1e3:.3g} ms; {len(timed)} plan(s) timed): the search priced "
                  "it from times that do not hold here (calibrate the step on this pool: step.calibrate)",
                  stacklevel=4)
  return runners[best], Verification(tuple(timed), best, miss)


def _time(runner: SingleRunner, args: tuple, kwargs: dict, repeats: int) -> float:
  """Median seconds of ``repeats`` runs of ``runner``'s program on a copy of the call's state, after a warm-up;
  infinite where it does not run here (out of memory beside the copy)."""
  try:
    run = runner.prepared(args, kwargs)
    run()
  except jax.errors.JaxRuntimeError:
    return float("inf")
  seconds = []
  for _ in range(repeats):
    start = now()
    run()
    seconds.append(now() - start)
  return statistics.median(seconds)


def _own_examples(front: Any, runner: SingleRunner, args: tuple) -> tuple:
  """The call's arguments with each batch argument cut to the examples this process feeds ``runner``'s plan
  (one process: all of them, as given)."""
  if jax.process_count() == 1:
    return args
  mine = runner.process_examples()
  at = batch_positions(front, args)
  return tuple(jax.tree.map(lambda x: np.asarray(x)[mine] if np.ndim(x) else x, a) if i in at else a
               for i, a in enumerate(args))


def _slowest(seconds: float) -> float:
  """The slowest process's ``seconds`` (every process gets the same number)."""
  if jax.process_count() == 1:
    return seconds
  return float(np.max(np.asarray(multihost_utils.process_allgather(np.array([seconds], np.float64)))))
