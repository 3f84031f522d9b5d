"""Plan search: device-weighted data parallelism under memory limits.

For a model's :class:`~hetspmd.passes.cost.StepProfile` and a cluster, the
search tries every candidate of

* device set: every device, the devices of the fastest kinds only (the
  slowest kinds left out, which wins on slow networks), and each single kind;
* microbatch size: divisors of the global batch;
* ZeRO stage 0, 1 or 3, and remat off or on;

prunes those that overflow a device's memory, and for the rest chooses the
integer microbatch count of every data position by a small MILP (HiGHS via
``scipy.optimize.milp``): minimise the slowest device's time subject to the
counts covering the global batch. Devices of one kind are interchangeable,
so the MILP has a handful of variables per kind whatever the device count.

Baselines are the same evaluation with choices pinned: ``dp_even`` (every
device, equal counts), ``dp_proportional`` (counts by peak FLOP/s),
``fastest_only`` and ``best_homogeneous`` (one kind, equal counts).

Step time = slowest device's compute + the gradient reduction (not
overlapped): a ring all-reduce within a host, hierarchical (reduce-scatter
in hosts, all-reduce between hosts, all-gather in hosts) across hosts, each
stage at the slowest link it crosses. Only the ``(data, 1)`` layouts are
searched so far; tensor-parallel strategies are not costed yet.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import numpy as np

from hetspmd.cluster import Cluster
from hetspmd.devices import DeviceSpec
from hetspmd.errors import HetSpmdError
from hetspmd.passes.cost import StepProfile

ZERO_STAGES = (0, 1, 3)
REMAT_COMPUTE = 4.0 / 3.0     # one extra forward pass
REMAT_ACTIVATIONS = 0.25      # share of activations kept with full remat
WORKSPACE = 1.10              # allocator and workspace headroom on every device
GRAD_BYTES = 4                # gradients are accumulated and reduced in float32


class PlanDoesNotFitError(HetSpmdError):
  """No candidate fits device memory."""


@dataclasses.dataclass(frozen=True)
class Evaluated:
  """One costed candidate plan."""

  name: str
  device_positions: tuple[int, ...]   # cluster device ids, host-major
  kinds: tuple[str, ...]              # per device
  microbatch: int
  counts: tuple[int, ...]             # per device
  zero_stage: int
  remat: bool
  compute_seconds: float              # slowest device
  comm_seconds: float
  memory_bytes: tuple[int, ...]       # per device
  global_batch: int

  @property
  def step_seconds(self) -> float:
    return self.compute_seconds + self.comm_seconds

  @property
  def throughput(self) -> float:
    return self.global_batch / self.step_seconds

  def to_json(self, ideal: float) -> dict[str, Any]:
    return {
        "name": self.name,
        "throughput": self.throughput,
        "predicted_step_seconds": self.step_seconds,
        "compute_seconds": self.compute_seconds,
        "communication_seconds": self.comm_seconds,
        "efficiency": self.throughput / ideal,
        "mesh": {"data": len(self.device_positions), "model": 1},
        "devices": list(self.device_positions),
        "kinds": list(self.kinds),
        "microbatch": self.microbatch,
        "microbatch_counts": list(self.counts),
        "zero_stage": self.zero_stage,
        "remat": self.remat,
        "memory_bytes": list(self.memory_bytes),
    }


@dataclasses.dataclass(frozen=True)
class SearchResult:
  plans: tuple[Evaluated, ...]
  baselines: dict[str, Evaluated]
  ideal_throughput: float
  search_seconds: float
  candidates: int


# --- cost pieces ----------------------------------------------------------------


def allreduce_seconds(cluster: Cluster, positions: Sequence[int], nbytes: float) -> float:
  """Gradient all-reduce over ``positions``: ring in a host, hierarchical across hosts."""
  p = len(positions)
  if p < 2 or nbytes <= 0:
    return 0.0
  devices = cluster.devices
  hosts: dict[int, int] = {}
  for i in positions:
    hosts[devices[i].host] = hosts.get(devices[i].host, 0) + 1
  intra = min((cluster.hosts[h].intra for h in hosts), key=lambda l: l.bandwidth)
  if len(hosts) == 1:
    return 2 * (p - 1) / p * nbytes / intra.bandwidth + 2 * (p - 1) * intra.latency
  k, n_hosts = max(hosts.values()), len(hosts)  # the busiest host bounds the in-host stages
  local = 2 * (k - 1) / k * nbytes / intra.bandwidth + 2 * (k - 1) * intra.latency if k > 1 else 0.0
  inter = cluster.inter
  between = 2 * (n_hosts - 1) / n_hosts * nbytes / inter.bandwidth + 2 * (n_hosts - 1) * inter.latency
  return local + between


def memory_per_device(profile: StepProfile, n: int, microbatch: int, zero_stage: int, remat: bool) -> int:
  params = profile.param_bytes / (n if zero_stage >= 3 else 1)
  grads = profile.param_count * GRAD_BYTES  # accumulated in full (float32) during the microbatch loop
  optimizer = profile.opt_state_bytes / (n if zero_stage >= 1 else 1)
  activations = profile.activation.at(microbatch) * (REMAT_ACTIVATIONS if remat else 1.0)
  return int((params + grads + optimizer + activations) * WORKSPACE)


def comm_seconds(cluster: Cluster, profile: StepProfile, positions: Sequence[int], zero_stage: int) -> float:
  reduce = allreduce_seconds(cluster, positions, profile.param_count * GRAD_BYTES)
  # ZeRO-3 also gathers the parameters once per step (half an all-reduce's volume).
  return reduce * (1.5 if zero_stage >= 3 else 1.0)


@dataclasses.dataclass(frozen=True)
class _KindCost:
  micro: float  # seconds per microbatch
  fixed: float  # seconds per step


def _kind_costs(profile: StepProfile, specs: dict[str, DeviceSpec], microbatch: int, remat: bool, zero: int,
                n: int) -> dict[str, _KindCost]:
  out = {}
  for kind, spec in specs.items():
    micro = profile.microbatch_seconds(spec, microbatch) * (REMAT_COMPUTE if remat else 1.0)
    fixed = profile.step_fixed_seconds(spec) / (n if zero >= 1 else 1)
    out[kind] = _KindCost(micro, fixed)
  return out


# --- counts -------------------------------------------------------------------------


def milp_counts(kinds: Sequence[str], costs: dict[str, _KindCost], total: int) -> tuple[int, ...]:
  """Per-device counts minimising the slowest device's time; ``sum == total``.

  Variables per kind ``k`` with ``n_k`` devices: base count ``c_k``, how many
  of its devices take one more ``e_k`` (``0 <= e_k <= n_k z_k``), the binary
  ``z_k``; and the makespan ``T >= fixed_k + micro_k (c_k + z_k)``.
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
    rows.append(makespan), lower.append(costs[k].fixed), upper.append(np.inf)
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


def even_counts(n: int, total: int) -> tuple[int, ...]:
  return tuple(total // n + (1 if i < total % n else 0) for i in range(n))


def proportional(weights: Sequence[float], total: int) -> tuple[int, ...]:
  from hetspmd.plan import proportional_counts

  return proportional_counts(weights, total)


# --- evaluation ------------------------------------------------------------------------


def evaluate(cluster: Cluster, profile: StepProfile, positions: Sequence[int], microbatch: int, zero: int,
             remat: bool, global_batch: int, counts_rule: Callable[[Sequence[str], dict], tuple[int, ...]],
             name: str) -> Evaluated | None:
  devices = cluster.devices
  kinds = tuple(devices[i].spec.name for i in positions)
  specs = {k: cluster.spec_of(k) for k in dict.fromkeys(kinds)}
  total = global_batch // microbatch
  costs = _kind_costs(profile, specs, microbatch, remat, zero, len(positions))
  counts = counts_rule(kinds, costs) if callable(counts_rule) else counts_rule
  if sum(counts) != total:
    return None
  compute = max(costs[k].fixed + costs[k].micro * c for k, c in zip(kinds, counts))
  memory = memory_per_device(profile, len(positions), microbatch, zero, remat)
  return Evaluated(name, tuple(positions), kinds, microbatch, tuple(counts), zero, remat, compute,
                   comm_seconds(cluster, profile, positions, zero), (memory,) * len(positions), global_batch)


def fits(cluster: Cluster, e: Evaluated) -> bool:
  devices = cluster.devices
  return all(m <= devices[i].spec.memory_bytes for i, m in zip(e.device_positions, e.memory_bytes))


def device_sets(cluster: Cluster, profile: StepProfile, microbatch: int) -> dict[str, tuple[int, ...]]:
  """Candidate device sets: all, fastest kinds only (prefixes by speed), each kind alone."""
  kinds = cluster.kinds
  speed = {k: profile.microbatch_seconds(cluster.spec_of(k), microbatch) for k in kinds}
  by_speed = sorted(kinds, key=lambda k: speed[k])
  devices = cluster.devices
  sets = {"all": tuple(d.id for d in devices)}
  for n in range(1, len(by_speed)):
    chosen = set(by_speed[:n])
    sets[f"fastest {n} kind(s)"] = tuple(d.id for d in devices if d.spec.name in chosen)
  for k in kinds:
    sets[f"only {k}"] = tuple(d.id for d in devices if d.spec.name == k)
  return sets


def microbatch_sizes(global_batch: int, limit: int = 10) -> list[int]:
  divisors = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
  if len(divisors) <= limit:
    return divisors
  picks = np.unique(np.round(np.geomspace(1, len(divisors), limit)).astype(int) - 1)
  return [divisors[i] for i in picks]


def search(cluster: Cluster, profile: StepProfile, global_batch: int, top: int = 5,
           progress: Callable[[str], None] | None = None) -> SearchResult:
  """Ranks device-weighted plans and evaluates the baselines (see module docstring)."""
  start = time.perf_counter()
  specs = {k: cluster.spec_of(k) for k in cluster.kinds}
  peak = {k: s.fp32_flops for k, s in specs.items()}
  fastest_kind = min(cluster.kinds, key=lambda k: profile.microbatch_seconds(specs[k], 1))
  plans: list[Evaluated] = []
  best: dict[str, Evaluated] = {}
  overflow: list[Evaluated] = []
  candidates = 0

  def consider(e: Evaluated | None, bucket: str | None) -> None:
    nonlocal candidates
    if e is None:
      return
    candidates += 1
    if not fits(cluster, e):
      overflow.append(e)
      return
    if bucket is None:
      plans.append(e)
    elif bucket not in best or e.step_seconds < best[bucket].step_seconds:
      best[bucket] = e

  sizes = microbatch_sizes(global_batch)
  for n_done, microbatch in enumerate(sizes):
    sets = device_sets(cluster, profile, microbatch)
    for zero in ZERO_STAGES:
      for remat in (False, True):
        milp = lambda kinds, costs: milp_counts(kinds, costs, global_batch // microbatch)
        for set_name, positions in sets.items():
          consider(evaluate(cluster, profile, positions, microbatch, zero, remat, global_batch, milp,
                            f"weighted, {set_name}"), None)
        everyone = sets["all"]
        even = lambda kinds, costs: even_counts(len(kinds), global_batch // microbatch)
        consider(evaluate(cluster, profile, everyone, microbatch, zero, remat, global_batch, even, "dp_even"),
                 "dp_even")
        prop = lambda kinds, costs: proportional([peak[k] for k in kinds], global_batch // microbatch)
        consider(evaluate(cluster, profile, everyone, microbatch, zero, remat, global_batch, prop,
                          "dp_proportional"), "dp_proportional")
        consider(evaluate(cluster, profile, sets[f"only {fastest_kind}"], microbatch, zero, remat, global_batch,
                          even, "fastest_only"), "fastest_only")
        for kind in cluster.kinds:
          consider(evaluate(cluster, profile, sets[f"only {kind}"], microbatch, zero, remat, global_batch, even,
                            f"only {kind}"), "best_homogeneous")
    if progress:
      progress(f"microbatch {microbatch} ({n_done + 1}/{len(sizes)}), {candidates} candidates costed")
  if not plans:
    raise PlanDoesNotFitError(_overflow_message(cluster, overflow))
  plans.sort(key=lambda e: e.step_seconds)
  unique: list[Evaluated] = []
  for e in plans:
    if not any(e.device_positions == u.device_positions and e.counts == u.counts and
               e.microbatch == u.microbatch for u in unique):
      unique.append(e)
  share = max(1, global_batch // cluster.num_devices)
  ideal = sum(share / profile.microbatch_seconds(d.spec, share) for d in cluster.devices)
  return SearchResult(tuple(unique[:top]), best, ideal, time.perf_counter() - start, candidates)


def _overflow_message(cluster: Cluster, overflow: Sequence[Evaluated]) -> str:
  smallest = min(overflow, key=lambda e: max(m - cluster.devices[i].spec.memory_bytes
                                             for i, m in zip(e.device_positions, e.memory_bytes)))
  worst = max(zip(smallest.device_positions, smallest.memory_bytes),
              key=lambda im: im[1] - cluster.devices[im[0]].spec.memory_bytes)
  spec = cluster.devices[worst[0]].spec
  over = worst[1] - spec.memory_bytes
  return (f"no plan fits: even the smallest candidate (microbatch {smallest.microbatch}, ZeRO-{smallest.zero_stage}, "
          f"remat {'on' if smallest.remat else 'off'}) needs {worst[1] / 2**30:.2f} GiB on a {spec.name} with "
          f"{spec.memory_bytes / 2**30:.2f} GiB, {over / 2**30:.2f} GiB ({over:,} bytes) too much. "
          "What would fit: more devices (ZeRO-3 splits parameters and optimizer state over them), "
          "a smaller global batch or sequence, or devices with more memory.")


BASELINES = ("dp_even", "dp_proportional", "fastest_only", "best_homogeneous")


# --- from a step function --------------------------------------------------------------

PROFILE_BATCHES = (2, 4)


def _with_batch(batch: Any, size: int) -> Any:
  import jax

  def resize(x):
    shape = tuple(np.shape(x))
    if not shape:
      raise HetSpmdError("every batch leaf needs a leading batch axis; got a scalar")
    return jax.ShapeDtypeStruct((size,) + shape[1:], x.dtype)

  return jax.tree.map(resize, batch)


def profile_step(fn: Callable[..., Any], state: Any, batch: Any) -> StepProfile:
  """Traces ``fn(state, batch)`` at two batch sizes and fits the per-node costs."""
  from hetspmd.passes import cost, trace

  small, large = PROFILE_BATCHES
  graphs = [trace(fn, state, _with_batch(batch, b)) for b in PROFILE_BATCHES]
  return cost.step_profile(graphs[0], graphs[1], small, large)


def plan_from(evaluated: Evaluated, cluster: Cluster, state: Any, ideal: float | None = None):
  """The runnable :class:`~hetspmd.plan.Plan` of one search result."""
  from hetspmd.plan import Plan, auto_state_specs

  ids = cluster.jax_device_ids
  device_ids = tuple(ids[i] if ids is not None else i for i in evaluated.device_positions)
  predicted = {"step_seconds": evaluated.step_seconds, "throughput": evaluated.throughput,
               "compute_seconds": evaluated.compute_seconds, "communication_seconds": evaluated.comm_seconds,
               "memory_bytes_per_device": float(max(evaluated.memory_bytes))}
  if ideal:
    predicted["efficiency"] = evaluated.throughput / ideal
  axes, shape = ("data", "model"), (len(device_ids), 1)
  return Plan(axis_names=axes, mesh_shape=shape, device_ids=device_ids, global_batch=evaluated.global_batch,
              microbatch=evaluated.microbatch, microbatch_counts=evaluated.counts,
              state_specs=auto_state_specs(state, axes, shape, evaluated.zero_stage),
              zero_stage=evaluated.zero_stage, remat="full" if evaluated.remat else "none",
              device_kinds=evaluated.kinds, predicted=tuple(predicted.items()))


def search_step(fn: Callable[..., Any], state: Any, batch: Any, cluster: Cluster, *, global_batch: int,
                top: int = 5, progress: Callable[[str], None] | None = None) -> SearchResult:
  """``hetspmd.search``: trace ``fn(state, batch)``, cost it, and rank plans for ``cluster``."""
  if not isinstance(global_batch, int) or global_batch < 1:
    from hetspmd.errors import InvalidValueError

    raise InvalidValueError(f"global_batch must be a positive integer, got {global_batch!r}")
  if progress:
    progress("tracing the step at two batch sizes")
  return search(cluster, profile_step(fn, state, batch), global_batch, top, progress)
