"""Microbatch counts: how many microbatches each data position runs.

The one home of the count rules: proportional to weights (``plan_for``'s
default, the ``dp_proportional`` baseline), spread evenly (``dp_even``, stage
plans), balanced to the slowest position by kind (the search: a breakpoint
walk, with a reference MILP), and the microbatch a batch and counts imply.
"""

from __future__ import annotations

import dataclasses
import functools
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
  order = np.argsort(-(exact - counts), kind="stable")  # the largest remainders, ties to the earlier position
  counts[order[: total - counts.sum()]] += 1
  return tuple(counts.tolist())


def divisors(n: int) -> list[int]:
  """Every divisor of the positive integer ``n``, ascending, from its prime factors (:func:`prime_factors`):
  a batch of 10**9 has 100, found without a loop to ``n``."""
  if not isinstance(n, int) or n < 1:
    raise InvalidValueError(f"divisors are of a positive integer, got {n!r}")
  found = [1]
  for p, power in prime_factors(n).items():
    found = [d * p**e for d in found for e in range(power + 1)]
  return sorted(found)


def prime_factors(n: int) -> dict[int, int]:
  """``n``'s prime factorisation ``{prime: power}``: trial division by the primes below ``_TRIAL``, then what
  is left split by Pollard's rho (Brent's cycle finding) and checked by Miller-Rabin."""
  factors: dict[int, int] = {}
  for p in _SMALL_PRIMES:
    while n % p == 0:
      factors[p] = factors.get(p, 0) + 1
      n //= p
  pending = [n] if n > 1 else []
  while pending:
    m = pending.pop()
    if _is_prime(m):
      factors[m] = factors.get(m, 0) + 1
    else:
      d = _rho(m)
      pending += [d, m // d]
  return dict(sorted(factors.items()))


_TRIAL = 1000
_SMALL_PRIMES = tuple(p for p in range(2, _TRIAL) if all(p % q for q in range(2, math.isqrt(p) + 1)))
# these bases decide primality for every n < 3.3e24 (Sorenson and Webster); above, a composite passes with
# probability under 4**-12
_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def _is_prime(n: int) -> bool:
  """Miller-Rabin for ``n`` with no factor below ``_TRIAL`` (``n > 1``)."""
  if n < _TRIAL * _TRIAL:
    return True
  d, s = n - 1, 0
  while d % 2 == 0:
    d, s = d // 2, s + 1
  for a in _WITNESSES:
    x = pow(a, d, n)
    if x in (1, n - 1):
      continue
    for _ in range(s - 1):
      x = x * x % n
      if x == n - 1:
        break
    else:
      return False
  return True


def _rho(n: int) -> int:
  """A proper factor of the odd composite ``n`` (Pollard's rho with Brent's cycle finding)."""
  for c in range(1, n):
    x = y = 2
    d = 1
    power = lam = 1
    while d == 1:
      if power == lam:
        x, power, lam = y, power * 2, 0
      y = (y * y + c) % n
      lam += 1
      d = math.gcd(abs(x - y), n)
    if d != n:
      return d
  raise HetSpmdError(f"no factor found for {n}")


def default_microbatch(global_batch: int, data_size: int, per_position: int = 4) -> int:
  """The largest divisor of the global batch giving every position about ``per_position`` microbatches."""
  target = max(1, global_batch // (data_size * per_position))
  return max(d for d in divisors(global_batch) if d <= target)


def even_counts(n: int, total: int) -> tuple[int, ...]:
  """``total`` microbatches spread over ``n`` positions as evenly as they go, the first positions taking one more."""
  return (total // n + 1,) * (total % n) + (total // n,) * (n - total % n)


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
                            f"valid microbatches: {divisors(global_batch)}")
  return microbatch


@dataclasses.dataclass(frozen=True)
class KindCost:
  micro: float  # seconds per microbatch
  fixed: float  # seconds per step
  model_comm: float = 0.0  # of micro: tensor-parallel collectives
  first: float = 0.0  # seconds the first microbatch costs over a later one

  def with_fixed(self, fixed: float) -> "KindCost":
    """The same microbatch costs with ``fixed`` seconds per step (``dataclasses.replace``, without its cost)."""
    return KindCost(self.micro, fixed, self.model_comm, self.first)

  def at(self, count: int) -> float:
    """Seconds of a position with ``count`` microbatches."""
    return self.fixed + (self.first + self.micro * count if count > 0 else 0.0)


def milp_counts(kinds: Sequence[str], costs: dict[str, KindCost], total: int,
                sizes: dict[str, int] | None = None) -> tuple[int, ...]:
  """Per-device counts minimising the slowest device's time; ``sum == total`` (reference MILP). With ``sizes``
  (``{kind: examples per microbatch}``, kinds whose microbatches differ): ``sum(count x size) == total``, the
  examples, each kind's ``micro`` its own microbatch's seconds.

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
    weight = sizes[k] if sizes else 1
    cover[c_idx(i)], cover[e_idx(i)] = n[k] * weight, weight
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
  index, rank = kind_ranks(tuple(kinds))
  top_of, full_of = np.array([top[k] for k in order]), np.array([full[k] for k in order])
  return tuple(np.where(rank < full_of[index], top_of[index], top_of[index] - 1).tolist())


@functools.lru_cache(maxsize=64)
def kind_ranks(kinds: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
  """Per position: its kind's index among the kinds in order of first appearance, and how many positions of
  its kind come before it."""
  at: dict[str, int] = {}
  seen: dict[str, int] = {}
  index, rank = [], []
  for k in kinds:
    index.append(at.setdefault(k, len(at)))
    rank.append(seen.get(k, 0))
    seen[k] = rank[-1] + 1
  return np.array(index, dtype=np.intp), np.array(rank, dtype=np.intp)
