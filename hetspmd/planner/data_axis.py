"""What a plan's data axis costs: gradient reductions, ZeRO's splits and gathers, memory per device.

Pieces of :mod:`hetspmd.planner.ranking`'s cost model that follow the runtime's
collectives over ``data`` (:mod:`hetspmd.autodiff`) and the ZeRO rule of
:func:`hetspmd.plan.state_layout.auto_state_specs`: α–β rings per link class,
hierarchical across hosts; all-reduces counted per bucket; reduce-scatter
onto ZeRO's shards; one all-gather per split parameter leaf.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from hetspmd.errors import InvalidValueError
from hetspmd.hardware.cluster import Cluster
from hetspmd.hardware.devices import Link
from hetspmd.plan.gradient_buckets import buckets
from hetspmd.passes.costing.step_cost import ACCUMULATOR_BYTES, StepProfile
from hetspmd.plan.options import GRAD_REDUCE_DTYPES, REMAT_POLICIES
from hetspmd.plan.state_layout import zero_group

# under a dots policy, besides the saved matmul outputs: the working set of recomputing one part of the
# forward pass just before its backward, as a share of a microbatch's peak
REMAT_ACTIVATIONS = 0.25
WORKSPACE = 1.10              # allocator and workspace headroom on every device
GRAD_BYTES = ACCUMULATOR_BYTES  # gradients are accumulated in float32, and by default reduced in it
REDUCE_BYTES = {d: np.dtype(jnp.dtype(d)).itemsize for d in GRAD_REDUCE_DTYPES}  # bytes per gradient element on the wire, by reduce dtype

@dataclasses.dataclass(frozen=True)
class TensorParallel:
  """One tensor-parallel choice over a ``model`` axis of size ``m`` (``m == 1``: none)."""

  m: int = 1
  choice: tuple[int, ...] = ()
  description: str = "none"
  model_dims: tuple[tuple[str, int], ...] = ()   # parameter path -> dimension split over model
  param_share: float = 1.0                       # parameter elements per device / all of them
  activation_share: float = 1.0                  # activation bytes per device / unsplit


NO_TENSOR_PARALLEL = TensorParallel()



def _host_counts(cluster: Cluster, positions: Sequence[int]) -> dict[int, int]:
  devices = cluster.devices
  hosts: dict[int, int] = {}
  for i in positions:
    hosts[devices[i].host] = hosts.get(devices[i].host, 0) + 1
  return hosts


def _ring_seconds(p: int, nbytes: float, link: Link, reductions: int = 1) -> float:
  return 2 * (p - 1) / p * nbytes / link.bandwidth + 2 * (p - 1) * link.latency * reductions if p > 1 else 0.0


def _reduce_seconds(cluster: Cluster, hosts: dict[int, int], nbytes: float, concurrent: int = 1,
                    reductions: int = 1) -> float:
  """``reductions`` all-reduces of ``nbytes`` in all among ``hosts[h]`` participants per host.

  ``concurrent`` rings share each host's network link; every all-reduce pays the links' latency.
  """
  p = sum(hosts.values())
  if p < 2 or nbytes <= 0:
    return 0.0
  intra = min((cluster.hosts[h].intra for h in hosts), key=lambda l: l.bandwidth)
  if len(hosts) == 1:
    return _ring_seconds(p, nbytes, intra, reductions)
  k = max(hosts.values())  # the busiest host bounds the in-host stages
  return (_ring_seconds(k, nbytes, intra, reductions)
          + _ring_seconds(len(hosts), nbytes * concurrent, cluster.inter, reductions))


def allreduce_seconds(cluster: Cluster, positions: Sequence[int], nbytes: float, concurrent: int = 1,
                      reductions: int = 1) -> float:
  """Gradient all-reduce over ``positions``: ring in a host, hierarchical across hosts."""
  return _reduce_seconds(cluster, _host_counts(cluster, positions), nbytes, concurrent, reductions)


@dataclasses.dataclass(frozen=True)
class ZeroSplit:
  """How ZeRO holds the parameter leaves (elements each) over ``n`` data positions."""

  split: tuple[int, ...]    # a dimension divides by n: split n ways
  shards: int               # hetspmd.plan.state_layout.zero_shards_for: the group size k for the rest (0: none)
  grouped: tuple[int, ...]  # no dimension divides by n, one by k: split k ways, whole across the n / k groups
  whole: tuple[int, ...]    # kept whole on every position

  @functools.cached_property  # the search prices thousands of plans from a few splits
  def _sums(self) -> tuple[int, int, int]:
    return sum(self.split), sum(self.grouped), sum(self.whole)

  @property
  def elements(self) -> int:
    return sum(self._sums)

  def kept(self, n: int) -> float:
    """Share of a ZeRO-split state each position holds."""
    if not self.elements:
      return 1.0 / n
    split, grouped, whole = self._sums
    return (split / n + (grouped / self.shards if self.shards else 0) + whole) / self.elements

  @property
  def gathered(self) -> float:
    """Share of the parameters' elements that are split, and so gathered."""
    split, grouped, _ = self._sums
    return (split + grouped) / self.elements if self.elements else 1.0

  def scattered(self, n: int) -> float:
    """Share of the gradients' elements a reduce-scatter onto the n-way shards leaves off each position."""
    return self._sums[0] * (1 - 1 / n) / self.elements if self.elements else 0.0


@functools.lru_cache(maxsize=4096)
def _zero_split(leaves: tuple[tuple[tuple[int, ...], int], ...], n: int) -> ZeroSplit:
  """The rule of :func:`hetspmd.plan.state_layout.auto_state_specs` and :func:`hetspmd.plan.state_layout.zero_shards_for`.

  ``leaves``: (sizes of the dimensions ZeRO may split, elements on one
  device) per parameter leaf.
  """
  def divides(k, dims):
    return any(d % k == 0 for d in dims)

  split = tuple(e for dims, e in leaves if n > 1 and divides(n, dims))
  rest = [(dims, e) for dims, e in leaves if not (n > 1 and divides(n, dims))]
  best = zero_group(n, rest)
  grouped = tuple(e for dims, e in rest if best and divides(best, dims))
  whole = tuple(e for dims, e in rest if not (best and divides(best, dims)))
  return ZeroSplit(split, best, grouped, whole)


def zero_split(profile: StepProfile, n: int, tp: TensorParallel = NO_TENSOR_PARALLEL) -> ZeroSplit:
  """:func:`_zero_split` of the profile's parameter leaves (all split when their shapes are unknown).

  A dimension split over the model axis is not one ZeRO may split, and
  such a leaf holds ``1/m`` of its elements on a device.
  """
  if not profile.param_leaf_shapes:
    return ZeroSplit(tuple(profile.param_leaf_sizes) or (profile.param_count,), 0, (), ())
  key = (n, tp.m, tp.choice)
  if key not in profile.zero_splits:
    profile.zero_splits[key] = _profile_zero_split(profile, n, tp)
  return profile.zero_splits[key]


def _profile_zero_split(profile: StepProfile, n: int, tp: TensorParallel) -> ZeroSplit:
  model_dims = dict(tp.model_dims) if tp.m > 1 else {}
  paths = profile.param_leaf_paths or ("",) * len(profile.param_leaf_shapes)
  leaves = []
  for path, shape in zip(paths, profile.param_leaf_shapes):
    dim = model_dims.get(path)
    if dim is None or dim >= len(shape) or shape[dim] % tp.m:
      leaves.append((tuple(shape), math.prod(shape)))
    else:
      leaves.append((tuple(shape[:dim]) + tuple(shape[dim + 1:]), math.prod(shape) // tp.m))
  return _zero_split(tuple(leaves), n)


def _first_hosts(hosts: dict[int, int], k: int) -> dict[int, int]:
  """Hosts of the first ``k`` data positions (positions are in host order)."""
  out: dict[int, int] = {}
  for h, count in hosts.items():
    take = min(count, k - sum(out.values()))
    if take <= 0:
      break
    out[h] = take
  return out


def gather_seconds(cluster: Cluster, hosts: dict[int, int], profile: StepProfile, tp: TensorParallel) -> float:
  """ZeRO's all-gather of the parameters over ``data``, once per step: one per split parameter leaf.

  With ZeRO-1 each position updates its shard of the parameters and the
  updated shards are gathered; with ZeRO-3 the stored shards are gathered
  for the forward pass. A ring all-gather moves half an all-reduce's bytes
  and pays half its latency. Leaves split over groups of ``k`` positions
  are gathered within a group.
  """
  n = sum(hosts.values())
  zs = zero_split(profile, n, tp)
  per_element = profile.param_bytes * tp.param_share / zs.elements if zs.elements else 0.0
  seconds = _reduce_seconds(cluster, hosts, sum(zs.split) * per_element, tp.m, max(1, len(zs.split))) / 2
  if zs.grouped:
    seconds += _reduce_seconds(cluster, _first_hosts(hosts, zs.shards), sum(zs.grouped) * per_element, tp.m,
                               len(zs.grouped)) / 2
  return seconds


def whole_gather_seconds(cluster: Cluster, hosts: dict[int, int], profile: StepProfile) -> float:
  """Every parameter leaf sent whole to every position (as a group plan sends the parameters its update
  programs make), priced as ring all-gathers of all of them: half an all-reduce's bytes and latency, one per
  leaf."""
  return _reduce_seconds(cluster, hosts, profile.param_bytes, 1, max(1, len(profile.param_leaf_sizes))) / 2


def gradient_seconds(cluster: Cluster, hosts: dict[int, int], profile: StepProfile, tp: TensorParallel,
                     zero: int, grad_bytes: int = GRAD_BYTES) -> float:
  """Reducing the gradients over ``data`` once per step, as the runtime does.

  Data parallel only (``tp.m == 1``), small leaves share buckets
  (:func:`hetspmd.lowering.collectives.bucketed_psum`); with ZeRO-1/3 the leaves that
  ZeRO splits over all positions are reduce-scattered onto their shards
  (half a ring all-reduce, in buckets of their own) and the rest (leaves
  split over groups, or whole), with the loss's sum and weight,
  all-reduced. With a model axis every leaf is all-reduced on its own,
  whatever the ZeRO stage. ``grad_bytes``: bytes per gradient element on
  the wire (:data:`REDUCE_BYTES`); the loss's sum and weight stay float32.
  """
  n = sum(hosts.values())
  grads = profile.param_count * tp.param_share * grad_bytes
  if tp.m > 1 or not profile.param_leaf_sizes:
    return _reduce_seconds(cluster, hosts, grads, tp.m, gradient_reductions(profile, tp.m))
  if zero >= 1:
    zs = zero_split(profile, n)
    split, rest = zs.split, zs.grouped + zs.whole
  else:
    split, rest = (), tuple(profile.param_leaf_sizes)
  return (_reduce_seconds(cluster, hosts, sum(split) * grad_bytes, 1, _bucket_count(split)) / 2
          + _reduce_seconds(cluster, hosts, sum(rest) * grad_bytes + 2 * GRAD_BYTES, 1, _bucket_count(rest + (1, 1))))


@functools.lru_cache(maxsize=256)  # the search asks again for the same leaves, thousands of times
def _bucket_count(sizes: tuple[int, ...]) -> int:
  """Collectives :func:`hetspmd.plan.gradient_buckets.buckets` makes of float32 leaves of ``sizes`` elements."""
  return len(buckets([(np.float32, n * GRAD_BYTES) for n in sizes]))


def gradient_reductions(profile: StepProfile, model: int) -> int:
  """All-reduces the runtime issues for the gradients (and the loss's sum and weight) without ZeRO, per step.

  Data parallel only, small leaves share buckets (:func:`hetspmd.lowering.collectives.bucketed_psum`);
  with a model axis every leaf is reduced on its own.
  """
  if not profile.param_leaf_sizes:
    return 1
  if model > 1:
    return len(profile.param_leaf_sizes) + 2
  return _bucket_count(tuple(profile.param_leaf_sizes) + (1, 1))


def microbatch_bytes(profile: StepProfile, microbatch: int, remat: str,
                     tp: TensorParallel = NO_TENSOR_PARALLEL) -> float:
  """Peak bytes of one microbatch's forward and backward pass on a device, under a remat policy.

  The runtime checkpoints the whole loss function
  (:func:`hetspmd.autodiff._rematted`): ``full`` then keeps the traced
  peak, as the backward pass runs the forward again, storing every
  residual, before it needs the first. ``dots`` and ``all_dots`` keep the
  matmul outputs they save (``profile.saved_bytes``); each other residual
  is recomputed from them within its layer, a working set of
  ``REMAT_ACTIVATIONS`` of the peak, if XLA schedules the recomputation there.
  ``layers`` rewrites the traced step (:mod:`hetspmd.passes.remat`):
  its peak is the liveness of that program, every layer's inputs saved and
  one layer's recomputation at a time (``profile.layer_activation``).
  """
  if remat not in REMAT_POLICIES:
    raise InvalidValueError(f"remat policy must be one of {REMAT_POLICIES}, got {remat!r}")
  peak = profile.activation.at(microbatch)
  if remat == "layers" and profile.layer_activation is not None:  # each layer recomputed (passes.frontend.remat)
    peak = min(peak, profile.layer_activation.at(microbatch))
  if remat in ("dots", "all_dots"):
    peak = min(peak, profile.saved_bytes(remat, microbatch) + REMAT_ACTIVATIONS * peak)
  return peak * tp.activation_share


def memory_per_device(profile: StepProfile, n: int, microbatch: int, zero_stage: int, remat: str,
                      tp: TensorParallel = NO_TENSOR_PARALLEL, *, optimizer_share: float | None = None,
                      reduced_share: float | None = None) -> int:
  """Bytes on every device of a plan with ``n`` data positions.

  The state as held between steps (ZeRO-1/3 keep shards of what they
  split), the float32 gradient accumulator, and the larger of one
  microbatch's peak (:func:`microbatch_bytes`) and, after the loop, the
  reduced gradients (reduce-scattered onto ZeRO's shards where the runtime
  does so). ZeRO-3 gathers its split parameters whole for the loop, beside
  their shards: it lowers the state between steps, not a step's peak.
  ``optimizer_share``: the fraction of the optimizer state the device holds
  (a group plan's state shares), in place of ZeRO's; ``reduced_share``: the
  gradients' bytes after the loop, as a fraction of one full copy (a group
  plan whose devices reduce their own shares receives every device's rows of
  them), in place of the reduced gradients.
  """
  zs = zero_split(profile, n, tp) if zero_stage >= 1 else None  # only ZeRO splits the state
  sharded = zs.kept(n) if zs else 1.0  # what ZeRO keeps of a split state
  params = profile.param_bytes * tp.param_share * (sharded + zs.gathered if zero_stage >= 3 else 1)
  grads = profile.param_count * tp.param_share * GRAD_BYTES  # accumulated in full (float32) during the loop
  optimizer = profile.opt_state_bytes * tp.param_share * (optimizer_share if optimizer_share is not None else sharded)
  scattered = zs.scattered(n) if zs and tp.m == 1 and n > 1 else 0.0
  after = grads * (reduced_share if reduced_share is not None else 1 - scattered)
  working = max(microbatch_bytes(profile, microbatch, remat, tp), after)  # in the loop, after it
  return int((params + grads + optimizer + working) * WORKSPACE)
