"""Microbatch counts: how many microbatches each data position runs.

The one home of the count rules: proportional to weights (``plan_for``'s
default, the ``dp_proportional`` baseline), spread evenly (``dp_even``, stage
plans), balanced to the slowest position by kind (the search: a breakpoint
walk, with a reference MILP), and the microbatch a batch and counts imply.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from hetspmd.errors import HetSpmdError, InvalidValueError


def proportional_counts(weights: Sequence[float], total: int) -> tuple[int, ...]:
  """Integer counts summing to ``total``, proportional to ``weights``.

  Largest-remainder rounding: floor each share, then give the leftover units
  to the largest remainders (ties to the earlier position).
  """
  w = np.asarray(weights, dtype=float)
  if total < 0 or len(w) == 0 or np.any(w < 0) or w.sum() <= 0:
    raise InvalidValueError(f"cannot split {total} by weights {list(weights)}")
  exact = w / w.sum() * total
  counts = np.floor(exact).astype(int)
  order = sorted(range(len(w)), key=lambda i: (-(exact[i] - counts[i]), i))
  for i in order[: total - counts.sum()]:
    counts[i] += 1
  return tuple(int(c) for c in counts)


def default_microbatch(global_batch: int, data_size: int, per_position: int = 4) -> int:
  """The largest divisor of the global batch giving every position about ``per_position`` microbatches."""
  target = max(1, global_batch // (data_size * per_position))
  return max(d for d in range(1, target + 1) if global_batch % d == 0)


def even_counts(n: int, total: int) -> tuple[int, ...]:
  """``total`` microbatches spread over ``n`` positions as evenly as they go, the first positions taking one more."""
  return tuple(total // n + (1 if i < total % n else 0) for i in range(n))


def microbatch_for(global_batch: int, positions: int, microbatch: int | None, counts: Sequence[int] | None) -> int:
  """The plan's microbatch: as given, else what ``counts`` imply, else :func:`default_microbatch`; it must divide
  the global batch (a clear error before the Plan's own checks)."""
  if microbatch is None:
    if counts is None:
      return default_microbatch(global_batch, positions)
    if sum(counts) > global_batch:
      raise InvalidValueError(f"microbatch counts {list(counts)} hold {sum(counts)} microbatches, more than the "
                              f"global batch of {global_batch} examples; give counts whose sum times the microbatch "
                              f"is {global_batch}")
    microbatch = global_batch // max(1, sum(counts))
  if microbatch < 1 or global_batch % microbatch:
    raise InvalidValueError(f"global batch {global_batch} is not divisible by the microbatch {microbatch}; "
                            f"valid microbatches: {[d for d in range(1, global_batch + 1) if global_batch % d == 0]}")
  return microbatch


@dataclasses.dataclass(frozen=True)
class KindCost:
  micro: float  # seconds per microbatch
  fixed: float  # seconds per step
  model_comm: float = 0.0  # of micro: tensor-parallel collectives
  first: float = 0.0  # seconds the first microbatch costs over a later one

  def at(self, count: int) -> float:
    """Seconds of a position with ``count`` microbatches."""
    return self.fixed + (self.first + self.micro * count if count > 0 else 0.0)


def milp_counts(kinds: Sequence[str], costs: dict[str, KindCost], total: int) -> tuple[int, ...]:
  """Per-device counts minimising the slowest device's time; ``sum == total`` (reference MILP).

  Variables per kind ``k`` with ``n_k`` devices: base count ``c_k``, how many
  of its devices take one more ``e_k`` (``0 <= e_k <= n_k z_k``), the binary
  ``z_k``; and the makespan ``T >= fixed_k + micro_k (c_k + z_k)``, where
  ``fixed_k`` includes the first microbatch's extra (:attr:`KindCost.first`).
  """
  from scipy.optimize import Bounds, LinearConstraint, milp

  order = list(dict.fromkeys(kinds))
  n = {k: kinds.count(k) for k in order}
  K = len(order)
  # x = [c_0..c_K-1, e_0.., z_0.., T]
  size = 3 * K + 1
  c_idx, e_idx, z_idx, t_idx = (lambda i: i), (lambda i: K + i), (lambda i: 2 * K + i), 3 * K
  rows, lower, upper = [], [], []
  cover = np.zeros(size)
  for i, k in enumerate(order):
    cover[c_idx(i)], cover[e_idx(i)] = n[k], 1
  rows.append(cover), lower.append(total), upper.append(total)
  for i, k in enumerate(order):
    link = np.zeros(size)
    link[e_idx(i)], link[z_idx(i)] = 1, -n[k]
    rows.append(link), lower.append(-np.inf), upper.append(0)
    makespan = np.zeros(size)
    makespan[t_idx], makespan[c_idx(i)], makespan[z_idx(i)] = 1, -costs[k].micro, -costs[k].micro
    rows.append(makespan), lower.append(costs[k].fixed + costs[k].first), upper.append(np.inf)
  objective = np.zeros(size)
  objective[t_idx] = 1
  integrality = np.ones(size)
  integrality[t_idx] = 0
  ub = np.full(size, np.inf)
  for i, k in enumerate(order):
    ub[e_idx(i)], ub[z_idx(i)] = n[k], 1
  result = milp(objective, constraints=LinearConstraint(np.array(rows), lower, upper), integrality=integrality,
                bounds=Bounds(np.zeros(size), ub))
  if not result.success:
    raise HetSpmdError(f"count MILP failed: {result.message}")
  x = np.round(result.x).astype(int)
  counts, extra_left = [], {k: x[e_idx(i)] for i, k in enumerate(order)}
  for kind in kinds:
    i = order.index(kind)
    bump = 1 if extra_left[kind] > 0 else 0
    extra_left[kind] -= bump
    counts.append(int(x[c_idx(i)] + bump))
  return tuple(counts)


def balanced_counts(kinds: Sequence[str], costs: dict[str, KindCost], total: int) -> tuple[int, ...]:
  """Per-position counts minimising the slowest position's time; ``sum == total``.

  Start from the continuous bound on the makespan ``T`` (every position busy
  until ``T``, no one below its per-step work) and step through the
  breakpoints ``fixed_k + micro_k c`` until the capacity ``sum_k n_k
  floor((T - fixed_k) / micro_k)`` covers ``total``; then take the surplus,
  one microbatch at a time, from the kind whose busiest position finishes
  last. Counts within a kind differ by at most one, the first positions of a
  kind taking the larger. ``fixed_k`` includes the first microbatch's extra.
  """
  order = list(dict.fromkeys(kinds))
  n = {k: kinds.count(k) for k in order}
  micro = {k: max(costs[k].micro, 1e-300) for k in order}
  fixed = {k: costs[k].fixed + costs[k].first for k in order}
  rate = sum(n[k] / micro[k] for k in order)
  bound = max(max(fixed.values()), (total + sum(n[k] * fixed[k] / micro[k] for k in order)) / rate)
  top = {k: max(0, math.floor((bound - fixed[k]) / micro[k] * (1 - 1e-12))) for k in order}
  capacity = sum(n[k] * top[k] for k in order)
  while capacity < total:
    kind = min(order, key=lambda k: fixed[k] + micro[k] * (top[k] + 1))
    top[kind] += 1
    capacity += n[kind]
  full = dict(n)  # positions of each kind at the top count; the rest hold one less
  surplus = capacity - total
  while surplus > 0:
    kind = max((k for k in order if top[k] > 0), key=lambda k: fixed[k] + micro[k] * top[k])
    take = min(surplus, full[kind])
    full[kind] -= take
    surplus -= take
    if full[kind] == 0:
      top[kind] -= 1
      full[kind] = n[kind]
  counts, seen = [], {k: 0 for k in order}
  for kind in kinds:
    counts.append(top[kind] if seen[kind] < full[kind] else top[kind] - 1)
    seen[kind] += 1
  return tuple(counts)
