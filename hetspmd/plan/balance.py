"""Rebalancing while training: a damped controller over measured per-kind times (pure; no JAX).

Each measurement gives every kind's seconds per microbatch and per step. The controller keeps a running
estimate (exponential smoothing: ``estimate += smoothing x (measured - estimate)``), finds the counts that
balance the estimate (:func:`~hetspmd.plan.counts.balanced_counts`), and moves to them only when

* the estimate prices the current counts at least ``threshold`` plus the measurements' own spread slower than
  the balanced ones (hysteresis that grows with the noise: a split near balance stays, and of two splits that
  tie, the one in force stays), and
* it has held for ``confirm`` measurements in a row (one noisy measurement moves nothing); the estimate then
  restarts from those measurements' mean (the smoothed one lags a real change), and the counts move to its
  balance.

The decision depends only on the measurements, so processes that gather the same times take the same decision.
Moving counts never changes the step's result: the decomposition does not depend on them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from hetspmd.errors import InvalidValueError
from hetspmd.plan.counts import KindCost, balanced_counts, milp_counts

# A single measurement's pull on the spread: a kind that really changes speed (a 1.8x slowdown) is a large
# deviation once, which must not raise the margin that its own move has to clear
SPREAD_CAP = 0.15


@dataclasses.dataclass(frozen=True)
class Rebalance:
  """``parallelize(..., rebalance=Rebalance(...))``: how a step rebalances its microbatches while training.

  Attributes:
    every: calls between measurements. A single program measures by timing each kind's share of the step on
      one of its devices (a few microbatches), so this is its overhead's period; a group plan's
      programs are timed as they run.
    threshold: move only when the estimate prices the step at least this much faster (``0.05``: 5%).
    smoothing: weight of a new measurement in the running estimate (1: no smoothing).
    confirm: measurements in a row that must find the counts in force off balance before they move.
    lag: calls between the decision and the call that runs the new counts; a data loader that reads ahead
      learns each process's new examples this many calls early (``step.process_examples(ahead=k)``).
    measure: ``"loop"``: each position's microbatch loop is timed inside the step (a host callback before
      and after it: no extra work, but a host round trip per device each call); ``"device"``: each kind's
      share of the step is timed on one of its devices between calls (a few of its microbatches each
      measurement); ``"auto"``: ``"loop"`` on CPU, ``"device"`` elsewhere.
  """

  every: int = 8
  threshold: float = 0.05
  smoothing: float = 0.3
  confirm: int = 3
  lag: int = 0
  measure: str = "auto"

  def __post_init__(self):
    checks = {"every": isinstance(self.every, int) and self.every >= 1,
              "threshold": isinstance(self.threshold, (int, float)) and 0 <= self.threshold < 1,
              "smoothing": isinstance(self.smoothing, (int, float)) and 0 < self.smoothing <= 1,
              "confirm": isinstance(self.confirm, int) and self.confirm >= 1,
              "lag": isinstance(self.lag, int) and self.lag >= 0,
              "measure": self.measure in ("auto", "loop", "device")}
    wanted = {"every": "an int >= 1", "threshold": "a number in [0, 1)", "smoothing": "a number in (0, 1]",
              "confirm": "an int >= 1", "lag": "an int >= 0", "measure": "'auto', 'loop' or 'device'"}
    for name, ok in checks.items():
      if not ok:
        raise InvalidValueError(f"Rebalance.{name} must be {wanted[name]}, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class Balance:
  """The controller's state: the counts in force per data position (``kinds``: each position's kind), the
  smoothed per-kind estimate ``{kind: (seconds per microbatch, seconds per step)}``, and the counts proposed by
  the last measurements (``proposal``, seen ``agreed`` times in a row)."""

  counts: tuple[int, ...]
  kinds: tuple[str, ...]
  estimate: tuple[tuple[str, float, float], ...] = ()
  proposal: tuple[int, ...] | None = None
  agreed: int = 0
  recent: tuple = ()  # (proposed counts, kinds, times) of the measurements that found the counts off balance, in a row
  sizes: tuple[int, ...] = ()  # per position: examples per microbatch, where kinds run different sizes

  def costs(self) -> dict[str, KindCost]:
    return {k: KindCost(micro, fixed) for k, micro, fixed, _ in self.estimate}

  @property
  def spread(self) -> float:
    """The measurements' noise: the largest running mean, over kinds, of how far a kind's new time falls from
    its estimate (relative). A move must gain this much more than the threshold."""
    return max((spread for *_, spread in self.estimate), default=0.0)

  def balanced(self, costs: dict[str, KindCost]) -> tuple[int, ...]:
    """The counts that balance ``costs`` and keep the step's examples: as many microbatches as now, or where
    kinds run microbatches of different sizes (:attr:`sizes`), as many examples (a small MILP, HiGHS). A kind
    ``costs`` lacks (one running no microbatch, so never timed) keeps none."""
    at = [p for p, k in enumerate(self.kinds) if k in costs]
    kinds = [self.kinds[p] for p in at]
    if len(set(self.sizes)) < 2:
      found = balanced_counts(kinds, costs, sum(self.counts))
    else:
      sizes = dict(zip(self.kinds, self.sizes))
      found = milp_counts(kinds, costs, sum(c * m for c, m in zip(self.counts, self.sizes)), sizes)
    counts = [0] * len(self.kinds)
    for p, c in zip(at, found):
      counts[p] = c
    return tuple(counts)

  def seconds(self, counts: Sequence[int]) -> float:
    """The estimate's step compute: its busiest position's seconds under ``counts`` (a kind it has no
    estimate of runs nothing)."""
    costs = self.costs()
    return max((costs[k].at(c) for k, c in zip(self.kinds, counts) if k in costs), default=0.0)

  def idle(self) -> frozenset:
    """The kinds that run no microbatch under the counts in force: nothing of theirs is timed."""
    running = {k for k, c in zip(self.kinds, self.counts) if c}
    return frozenset(k for k in self.kinds if k not in running)


def update(balance: Balance, measured: Mapping[str, tuple[float, float]], option: Rebalance) -> Balance:
  """``balance`` after one measurement ``{kind: (seconds per microbatch, seconds per step)}`` (every kind of
  ``balance.kinds`` that runs microbatches; a kind running none may be left out, and then keeps none): the
  estimate smoothed, and the counts moved when the rule says so."""
  idle = balance.idle()
  missing = [k for k in dict.fromkeys(balance.kinds) if k not in measured and k not in idle]
  if missing:
    raise InvalidValueError(f"a measurement needs every kind of the plan that runs microbatches; {missing} missing")
  a, estimate = option.smoothing, []
  old = {k: rest for k, *rest in balance.estimate}
  for k in dict.fromkeys(k for k in balance.kinds if k in measured):
    micro, fixed = measured[k]
    if k not in old:
      estimate.append((k, micro, fixed, 0.0))
      continue
    was_micro, was_fixed, spread = old[k]
    off = min(abs(micro / was_micro - 1), SPREAD_CAP) if was_micro > 0 else 0.0
    estimate.append((k, (1 - a) * was_micro + a * micro, (1 - a) * was_fixed + a * fixed,
                     (1 - a) * spread + a * off))
  kinds = tuple(k for k in dict.fromkeys(balance.kinds) if k in measured)
  now = dataclasses.replace(balance, estimate=tuple(estimate))
  if not kinds:  # every kind idle (a tail runs the batch): nothing to balance
    return dataclasses.replace(now, proposal=None, agreed=0, recent=())
  # each measurement judges the counts on its own times (the smoothed estimate would creep past a real change in
  # steps each below the threshold); noise is answered by the spread margin and by ``confirm``
  raw = dataclasses.replace(now, estimate=tuple((k, *measured[k], 0.0) for k in kinds))
  target = raw.balanced(raw.costs())
  if target == now.counts or raw.seconds(now.counts) < (1 + option.threshold + now.spread) * raw.seconds(target):
    return dataclasses.replace(now, proposal=None, agreed=0, recent=())
  # the measurements in a row that agree, over the same kinds (one that made a kind idle times it no more)
  times = tuple(x for k in kinds for x in measured[k])
  recent = tuple(r for r in now.recent if r[1] == kinds) + ((target, kinds, times),)
  if len(recent) < option.confirm:
    return dataclasses.replace(now, proposal=target, agreed=len(recent), recent=recent)
  # the imbalance held: the estimate starts again from the mean of these measurements that propose what the
  # latest does (one taken as a change began proposes other counts), and the counts balance it
  mean = np.mean(np.array([row for proposed, _, row in recent if proposed == target]), axis=0)
  fresh = tuple((k, float(mean[2 * i]), float(mean[2 * i + 1]), spread)
                for i, (k, *_, spread) in enumerate(now.estimate))
  moved = dataclasses.replace(now, estimate=fresh, proposal=None, agreed=0, recent=())
  return dataclasses.replace(moved, counts=moved.balanced(moved.costs()))


def as_option(rebalance: Any) -> Rebalance | None:
  """``parallelize``'s ``rebalance``: None/False (off), True (the defaults) or a :class:`Rebalance`."""
  if rebalance is None or rebalance is False:
    return None
  if rebalance is True:
    return Rebalance()
  if isinstance(rebalance, Rebalance):
    return rebalance
  raise InvalidValueError(f"rebalance must be True, False, None or a hetspmd.Rebalance(...), got {rebalance!r}")
