"""A searched plan checked on the step before it runs: the choice timed whole, and where it misses its
prediction, the search's runners-up timed too and the fastest measured run instead.

A calibration measures each kind's compute on its own; the whole program adds what no kind's timing sees
(the reduction as it really runs, the loop's padding, XLA's fusion across the program). So after a calibrated
search the first call times the chosen single program on the call's own arguments (a copy of the state,
placed as the plan places it: nothing the caller holds is donated or written), as the median of a few runs
after a warm-up. Where it runs more than :data:`MISS` slower than its prediction, the next ranked single
programs are timed the same way, and the fastest measured runs. Every timed program is kept: the one chosen
is the step's, compiled already.

The choice is verified in one process: on the first call's arguments, or, where the plan is made before any
call (``step.shard_state`` of a ``step(state, batch)``), on the state and ``example_batch`` repeated to the
global batch.
"""

from __future__ import annotations

import dataclasses
import statistics
import warnings
from typing import Any, Sequence

import jax

from hetspmd.runtime.calibrating import now
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
  """Whether a search verifies its choice (``parallelize(..., verify=option)``): in one process, on concrete
  arguments (``call``: a call's, or the state and ``example_batch`` repeated to the global batch; None where
  neither is at hand), under ``True``, or under ``"auto"`` where the search priced compute from a
  ``calibration``. Across processes the choice is not timed: each process would time another share of each
  runner-up, from examples it does not hold."""
  if option is False or call is None or jax.process_count() > 1:
    return False
  if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(call)):  # step.resolve on abstract values
    return False
  return bool(option) if option != "auto" else calibration is not None


def label(plan: Any) -> str:
  """A plan in one line: its mesh and devices, microbatches, ZeRO stage, remat and reduction dtype."""
  return (f"mesh {dict(zip(plan.axis_names, plan.mesh_shape))} on devices {list(plan.device_ids)}, counts "
          f"{list(plan.microbatch_counts)} of {plan.microbatch}, ZeRO-{plan.zero_stage}, remat {plan.remat}, "
          f"reduced in {plan.grad_reduce_dtype}{', overlapped' if plan.overlap_reduction else ''}")


def verified(front: Any, plans: Sequence[Any], args: tuple, kwargs: dict, *, miss: float = MISS,
             repeats: int = REPEATS) -> tuple[SingleRunner, Verification]:
  """The runner ``front`` runs and how it was chosen: ``plans[0]`` (the search's single program) timed whole on
  a call's arguments, and where it runs more than ``miss`` slower than predicted, ``plans[1:]`` too, the fastest
  measured kept (its programs built). ``args`` hold the global batch."""
  runners, timed = [], []
  for plan in plans:
    runner = SingleRunner.of(front, plan)
    runners.append(runner)
    timed.append(Timed(label(plan), dict(plan.predicted).get("step_seconds", 0.0),
                       _time(runner, args, kwargs, repeats)))
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
