"""The ILP over tensor-parallel strategies (see :mod:`hetspmd.passes.sharding.strategies`).

:func:`choose` picks one option per decision of a
:class:`~hetspmd.passes.sharding.strategies.StrategySpace` with HiGHS
(``scipy.optimize.milp``): a binary per (decision, option), shared by the
decisions of layers that are ``repeat_of`` another; a continuous
``y >= x_a + x_b - 1`` per resharding pair with a cost and
``x_a + x_b <= 1`` per conflict; optionally a bound on parameter elements per
device. It minimises the microbatch's compute plus communication.
:func:`frontier` returns the time/memory Pareto choices a search picks from,
:func:`assess` costs a given choice, :func:`param_dims` gives the split
dimension per parameter path and :func:`describe` a one-line summary.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from hetspmd.passes.sharding.strategies import NO_TRAFFIC, LinkLike, StrategySpace


@dataclasses.dataclass(frozen=True)
class Solution:
  """One option per decision and what it costs per microbatch."""

  choice: tuple[int, ...]
  compute_seconds: float     # the microbatch's compute with these splits
  comm_seconds: float        # collectives over model per microbatch
  param_elements: int        # parameter elements per device
  permute: bool = False      # needs a collective-permute or all-to-all (lockstep execution)

  @property
  def seconds(self) -> float:
    return self.compute_seconds + self.comm_seconds


def assess(space: StrategySpace, choice: Sequence[int], node_seconds: np.ndarray, link: LinkLike, batch: float
           ) -> Solution:
  """Cost of ``choice`` given per-node seconds of one microbatch (per-step nodes zeroed)."""
  m = space.m
  saved, traffic, split, permute = 0.0, NO_TRAFFIC, 0, False
  for decision, o in zip(space.decisions, choice):
    option = decision.options[o]
    saved += float(node_seconds[option.scaled].sum()) * (1 - 1 / m)
    traffic += option.traffic
    split += option.split_elements
    permute |= option.permute
  for r in space.reshardings:
    for pair in r.pairs:
      if choice[r.src] == pair.src and choice[r.dst] == pair.dst:
        traffic += pair.traffic
        permute |= pair.permute
  compute = float(node_seconds.sum()) - saved
  elements = space.param_elements - split + math.ceil(split / m)
  return Solution(tuple(choice), compute, traffic.seconds(link, m, batch), elements, permute)


def choose(space: StrategySpace, node_seconds: np.ndarray, link: LinkLike, batch: float,
           max_param_elements: float | None = None, allow_permutes: bool = False) -> Solution | None:
  """The fastest choice (ILP); ``None`` when no choice fits ``max_param_elements``."""
  from scipy.optimize import Bounds, LinearConstraint, milp

  m = space.m
  columns: dict[tuple[int, int], int] = {}
  cost: list[float] = []
  memory: list[float] = []
  for d, decision in enumerate(space.decisions):
    for o, option in enumerate(decision.options):
      if option.permute and not allow_permutes:
        continue
      columns[(d, o)] = len(cost)
      cost.append(option.traffic.seconds(link, m, batch) - float(node_seconds[option.scaled].sum()) * (1 - 1 / m))
      memory.append(-option.split_elements * (1 - 1 / m))
  pair_columns, exclusions = [], []
  for r in space.reshardings:
    for pair in r.pairs:
      a, b = columns.get((r.src, pair.src)), columns.get((r.dst, pair.dst))
      if a is None or b is None:
        continue
      if pair.permute and not allow_permutes:
        exclusions.append((a, b))
      elif pair.traffic != NO_TRAFFIC:
        pair_columns.append((a, b))
        cost.append(pair.traffic.seconds(link, m, batch))
        memory.append(0.0)
  n = len(cost)
  if n == 0:
    return assess(space, (), node_seconds, link, batch) if max_param_elements is None or (
        space.param_elements <= max_param_elements) else None
  rows, lower, upper = [], [], []
  for d in range(len(space.decisions)):
    row = np.zeros(n)
    for (dd, o), c in columns.items():
      if dd == d:
        row[c] = 1
    rows.append(row), lower.append(1), upper.append(1)
  for k, (a, b) in enumerate(pair_columns):
    row = np.zeros(n)
    row[len(columns) + k], row[a], row[b] = 1, -1, -1
    rows.append(row), lower.append(-1), upper.append(np.inf)
  for a, b in exclusions:
    row = np.zeros(n)
    row[a], row[b] = 1, 1
    rows.append(row), lower.append(-np.inf), upper.append(1)
  if max_param_elements is not None:
    rows.append(np.array(memory)), lower.append(-np.inf), upper.append(max_param_elements - space.param_elements)
  scale = max(1e-12, max(abs(c) for c in cost))
  integrality = np.array([1] * len(columns) + [0] * len(pair_columns))
  result = milp(np.array(cost) / scale, constraints=LinearConstraint(np.array(rows), lower, upper),
                integrality=integrality, bounds=Bounds(np.zeros(n), np.ones(n)))
  if result.x is None:
    return None
  chosen = [0] * len(space.decisions)
  for (d, o), c in columns.items():
    if result.x[c] > 0.5:
      chosen[d] = o
  return assess(space, chosen, node_seconds, link, batch)


def frontier(space: StrategySpace, node_seconds: np.ndarray, link: LinkLike, batch: float, points: int = 4,
             allow_permutes: bool = False) -> tuple[Solution, ...]:
  """Fastest choices under shrinking parameter budgets, from unconstrained to the fewest elements per device."""
  fastest = choose(space, node_seconds, link, batch, allow_permutes=allow_permutes)
  fewest = space.param_elements - sum(
      max((o.split_elements for o in d.options if allow_permutes or not o.permute), default=0)
      for d in space.decisions) * (1 - 1 / space.m)
  out = [fastest]
  top = fastest.param_elements
  for k in range(points - 1, -1, -1):
    budget = fewest + (top - fewest) * k / points
    if budget >= out[-1].param_elements:
      continue
    found = choose(space, node_seconds, link, batch, budget + 0.5, allow_permutes)
    if found is not None and found.choice not in [s.choice for s in out]:
      out.append(found)
  return tuple(out)


def param_dims(space: StrategySpace, choice: Sequence[int]) -> dict[str, int]:
  """Parameter path (inside the step's first argument) -> dimension split over ``model``."""
  dims: dict[str, int] = {}
  for decision, o in zip(space.decisions, choice):
    for param, dim in decision.options[o].splits:
      dims.setdefault(space.param_paths[param], dim)
  return dims


def describe(space: StrategySpace, choice: Sequence[int]) -> str:
  """``params/h/0/mlp/c_fc/kernel x24 column, ...`` for the decisions that are not replicated."""
  parts = [f"{d.name.split('/', 1)[-1]}{f' x{len(d.params)}' if len(d.params) > 1 else ''} "
           f"{d.options[o].strategy.name}" for d, o in zip(space.decisions, choice) if o]
  return ", ".join(parts) or "all replicated"
