"""Timing the step's own work on each device kind: the measurements behind a
:class:`~hetspmd.hardware.calibration.Calibration` and behind rebalancing while training.

A kind is timed on one of its devices, the step run there alone as the plan runs it: the same microbatch loop,
microbatch size, remat policy and dtypes, compiled for one device (a one-device
:class:`~hetspmd.plan.value.Plan`). Each size is run at two microbatch counts, each the median of a few runs
after a warm-up run the first time, so the difference is one microbatch's seconds and the rest the step's per-step seconds
(:func:`~hetspmd.hardware.calibration.fit_points`). Nothing is written back to the state or to NNX objects. The
state is read where it lies: a device holding a whole replica (data parallelism) is timed on it without a copy;
where the step donates its state, the timed programs donate one copy of it instead, each taking the new state
the call before made (:meth:`~hetspmd.runtime.single.SingleRunner.prepared`).

Across processes each process times the kinds of its own devices, and the times are gathered so every process
holds the same numbers (:func:`gathered`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetspmd.errors import CannotTimeError, HetSpmdError, InvalidValueError
from hetspmd.hardware.calibration import Calibration, KindTiming, fit_points
from hetspmd.hardware.cluster import Cluster
from hetspmd.planner.building import plan_for
from hetspmd.plan.options import REMAT_POLICIES
from hetspmd.runtime import calibration_store
from hetspmd.runtime.binding import Arguments, batch_arguments, is_graph_node, leading_sizes
from hetspmd.runtime.runner import Trace
from hetspmd.runtime.single import SingleRunner
from hetspmd.passes.profile import step_fingerprint
from hetspmd.planner.ranking import microbatch_sizes

COUNTS = (2, 3)   # microbatch counts each size is timed at (one microbatch runs without a loop: another program)
REPEATS = 2       # timed runs per (size, count), after one warm-up the first time (which compiles)


@dataclasses.dataclass
class KindTimer:
  """Times a device's share of the step for ``front`` (a :class:`~hetspmd.runtime.step.ParallelStep`): one
  runner per (microbatch, count), built once and kept, so a later timing compiles nothing. ``together``: more
  devices of the kind that run the same share at the same time, as a uniform data-parallel program (every
  device ``count`` microbatches): on a host whose devices share compute (emulated CPU devices) a device is only
  as fast as it is beside the others, and the reduction the program ends with falls in the per-step seconds."""

  front: Any
  device: Any
  remat: str = "none"
  together: tuple = ()
  _runners: dict = dataclasses.field(default_factory=dict, repr=False)
  _placed: dict = dataclasses.field(default_factory=dict, repr=False)  # (position, shape, dtype) -> copy here

  def runs(self, args: tuple, kwargs: dict, sizes: Sequence[int], counts: Sequence[int] = COUNTS,
           repeats: int = REPEATS) -> list[tuple[int, int, float]]:
    """``(microbatch, count, median seconds)`` for each size and count, the step run on this device alone on the
    call's arguments (``args`` as the front binds them: static ones marked), its batch cut (or repeated) to
    ``count x microbatch`` examples. A size's counts are timed in turn, round after round (each program run once
    untimed the first time, which compiles): a slow spell on a shared host then falls on every count alike
    instead of on the one timed during it, and the difference between counts (a microbatch's seconds) keeps."""
    at = batch_positions(self.front, args)
    found = []
    for size in sizes:
      calls, held = [], []  # held: the state a donating step's timed programs take in turn (one copy)
      for count in counts:
        first = (size, count) not in self._runners
        runner = self._runner(size, count, at, args)
        cut = tuple(examples(a, count * size * self.width) if i in at else a for i, a in enumerate(args))
        calls.append(runner.prepared(cut, kwargs, self._here, held))
        if first:
          calls[-1]()
      seconds = [[] for _ in counts]
      for r in range(repeats):
        order = range(len(counts)) if r % 2 == 0 else reversed(range(len(counts)))  # ABBA: a trend cancels
        for j in order:
          start = now()
          calls[j]()
          seconds[j].append(now() - start)
      found.extend((size, count, statistics.median(s)) for count, s in zip(counts, seconds))
    return found

  def timing(self, kind: str, args: tuple, kwargs: dict, sizes: Sequence[int], **options: Any) -> KindTiming:
    points, fixed = fit_points(self.runs(args, kwargs, sizes, **options))
    return KindTiming(kind, points, fixed, self.remat)

  def _runner(self, size: int, count: int, batch_argnums: tuple[int, ...], args: tuple) -> Any:
    key = (size, count)
    if key not in self._runners:
      state = Arguments.of(dataclasses.replace(self.front, batch_argnums=batch_argnums), args).state
      devices = [self.device, *self.together]
      plan = plan_for(Cluster.emulate(devices, kinds=["cpu"] * len(devices)), state,
                      global_batch=size * count * len(devices), microbatch=size, counts=(count,) * len(devices),
                      remat=self.remat)
      front = dataclasses.replace(self.front, requested_plan=plan, global_batch=plan.global_batch, bound=(),
                                  example_batch=None, batch_argnums=batch_argnums, cluster=None,
                                  rebalancer=None, _runner=None, _note="")
      self._runners[key] = SingleRunner(front, plan)
    return self._runners[key]

  @property
  def width(self) -> int:
    return 1 + len(self.together)

  def _here(self, leaves: Sequence[Any]) -> list:
    """The call's leaves on the timed devices: on one device, a whole replica already there as it is; else a
    copy (replicated over the devices). Copies are kept by position and shape and reused at the next timing
    (values do not change a step's time), so a state that is not replicated there is copied once."""
    out = []
    for k, x in enumerate(leaves):
      if not isinstance(x, jax.Array):
        out.append(x)
        continue
      whole = _replica_on(x, self.device) if not self.together else None
      if whole is not None:
        out.append(whole)
        continue
      key = (k, x.shape, str(x.dtype))
      if key not in self._placed:
        if not x.is_fully_addressable:
          raise CannotTimeError(f"timing device {self.device} needs each state leaf whole on it, but a leaf of shape "
                             f"{x.shape} is split across processes: time a data-parallel plan (ZeRO-0), or "
                             "calibrate before sharding the state (ParallelStep.calibrate)")
        self._placed[key] = jax.device_put(x, self.device if not self.together else NamedSharding(
            Mesh(np.array([self.device, *self.together]), ("all",)), PartitionSpec()))
      out.append(self._placed[key])
    return out


def state_bytes(front: Any, args: tuple) -> int:
  """Bytes of the train state among a call's arguments (as ``front`` binds them, its batch of any size)."""
  state = Arguments.of(dataclasses.replace(front, batch_argnums=batch_positions(front, args)), args).state
  return sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(state))


def batch_positions(front: Any, args: tuple) -> tuple[int, ...]:
  """The call's batch arguments, whatever their size: ``batch_argnums``, the global batch, or else the
  arguments whose arrays all lead with one size (the smallest such size that some argument has)."""
  if front.batch_argnums is not None:
    return front.batch_argnums
  graph = tuple(i for i, a in enumerate(args) if is_graph_node(a))
  try:
    return batch_arguments(args, graph, front.global_batch)
  except HetSpmdError:
    sizes = sorted({n for i, a in enumerate(args) if i not in graph for n in leading_sizes(a) if n is not None})
    for n in sizes:
      try:
        return batch_arguments(args, graph, n)
      except HetSpmdError:
        continue
    raise


def _replica_on(x: jax.Array, device: Any) -> jax.Array | None:
  """``x`` whole on ``device`` without a copy, where a replica lies there (else None)."""
  if x.is_fully_replicated:
    replica = x.addressable_data(0)
    if replica.devices() == {device}:
      return replica
  try:
    return next((s.data for s in x.addressable_shards if s.device == device and s.data.shape == x.shape), None)
  except ValueError:  # a global array whose local pieces JAX cannot list one by one
    return None


def examples(batch: Any, n: int) -> Any:
  """``batch``'s first ``n`` examples (repeated from the start where it has fewer)."""

  def cut(x):
    if not hasattr(x, "shape") or not np.ndim(x):
      return x
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      raise CannotTimeError("timing the step needs this process's batch as host arrays (or arrays it holds whole), "
                         "not a global array split across processes")
    rows = np.arange(n) % x.shape[0]
    return np.asarray(x)[rows]

  return jax.tree.map(cut, batch)


def local_kind_devices(device_ids: Sequence[int], kinds: Sequence[str], every: bool = False) -> dict[str, Any]:
  """``{kind: the first of this process's devices of that kind}`` among a plan's devices (``every``: a list of
  all of them)."""
  local = {d.id: d for d in jax.local_devices()}
  found: dict[str, list] = {}
  for i, kind in zip(device_ids, kinds):
    if i in local:
      found.setdefault(kind, []).append(local[i])
  return found if every else {kind: devices[0] for kind, devices in found.items()}


def gathered(kinds: Sequence[str], mine: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
  """``{kind: (seconds per microbatch, seconds per step)}`` over every process: each process's own kinds'
  times gathered, the slowest process's taken for a kind several processes time (every process gets the same
  numbers, so decisions made from them agree)."""
  rows = np.array([[*mine[k], 1.0] if k in mine else [0.0, 0.0, 0.0] for k in kinds], np.float64)
  if jax.process_count() > 1:
    every = np.asarray(multihost_utils.process_allgather(rows)).reshape(-1, len(kinds), 3)
  else:
    every = rows[None]
  out = {}
  for j, kind in enumerate(kinds):
    timed = every[:, j, 2] > 0
    if timed.any():
      out[kind] = (float(every[timed, j, 0].max()), float(every[timed, j, 1].max()))
  return out


def everywhere(flag: bool) -> bool:
  """Whether ``flag`` holds on every process (each process must ask, at the same point)."""
  if jax.process_count() == 1:
    return flag
  return bool(np.asarray(multihost_utils.process_allgather(np.array([int(flag)], np.int32))).min())


def now() -> float:
  return time.perf_counter()


def calibrate(front: Any, args: tuple, kwargs: dict, cluster: Any, sizes: Sequence[int], *, fingerprint: str,
              counts: Sequence[int] = (2, 4), repeats: int = 5, remats: Sequence[str] = ("none",)) -> Calibration:
  """The step's own times on each kind of ``cluster`` (a cluster bound to JAX devices): this process times each
  of its kinds on all its devices of that kind at once (:class:`KindTimer` ``together``), at every microbatch
  size in ``sizes`` (a size that fails there, out of memory, is left out) and under every remat policy in
  ``remats`` (one :class:`KindTiming` each), and every process gathers every kind's points. A kind whose devices
  cannot hold the state (by their specs' memory) is not tried. Raises where some kind has no point at all under
  the first policy: a search would then price it from its spec beside measured kinds, the error a calibration is
  for (:func:`hetspmd.runtime.layer_timing.step_or_layer` then times one layer of every kind); a later policy
  with no point is left out (priced from the first's timing and a model of what it recomputes).
  ``fingerprint``: the step's (:func:`step_fingerprint`)."""
  if cluster.jax_device_ids is None:
    raise HetSpmdError("calibrating times the step on the cluster's devices: give a cluster bound to JAX devices "
                       "(Cluster.from_devices, Cluster.emulate)")
  remats = policies(remats)
  kinds = tuple(cluster.kinds)
  every = local_kind_devices(cluster.jax_device_ids, [d.spec.name for d in cluster.devices], every=True)
  failed, held = "", state_bytes(front, args)
  memory = {k: min(d.spec.memory_bytes for d in cluster.devices if d.spec.name == k) for k in kinds}
  for kind in [k for k in every if held > memory[k]]:
    failed = (f"{kind}: the state alone ({held / 2**30:.3g} GiB) is more than a device's memory "
              f"({memory[kind] / 2**30:.3g} GiB)")
    del every[kind]
  width = {k: len(every[k]) if k in every else 0 for k in kinds}
  widths = np.asarray(multihost_utils.process_allgather(np.array([width[k] for k in kinds]))).reshape(-1, len(kinds)) \
      if jax.process_count() > 1 else np.array([[width[k] for k in kinds]])
  timings = []
  for remat in remats:
    timers = {kind: KindTimer(front, devices[0], remat, tuple(devices[1:])) for kind, devices in every.items()}
    points, fixed, failed = _timed_sizes(timers, kinds, sorted(set(sizes)), (args, kwargs, counts, repeats),
                                         failed)
    missing = [k for k in kinds if not points[k]]
    if missing and remat == remats[0]:
      raise CannotTimeError(f"no microbatch size of {sorted(set(sizes))} ran on {', '.join(missing)}, each device "
                            f"holding the whole state ({failed or 'no device of the cluster here'}): a step that "
                            "fits no one device is priced from its devices' specs (calibrate=False)")
    timings.extend(KindTiming(k, tuple(points[k]), statistics.median(fixed[k]), remat, int(widths[:, j].max()))
                   for j, k in enumerate(kinds) if points[k])
  return Calibration(fingerprint, tuple(timings))


def policies(remats: Any) -> tuple[str, ...]:
  """``remats`` (a remat policy or several) as a tuple without repeats, checked."""
  found = (remats,) if isinstance(remats, str) else tuple(dict.fromkeys(remats))
  if not found or any(r not in REMAT_POLICIES for r in found):
    raise InvalidValueError(f"remats: one or more of {REMAT_POLICIES}, got {remats!r}")
  return found


def _timed_sizes(timers: dict[str, KindTimer], kinds: Sequence[str], sizes: Sequence[int], call: tuple,
                 failed: str) -> tuple[dict, dict, str]:
  """``(points, fixed, failed)``: per kind, ``(size, seconds per microbatch)`` and seconds per step at each size
  of ``sizes`` that ran (gathered over processes), timed by ``timers`` on ``call`` (``(args, kwargs, counts,
  repeats)``); ``failed``, the last failure's words (a size that does not fit a device)."""
  args, kwargs, counts, repeats = call
  points: dict[str, list[tuple[int, float]]] = {k: [] for k in kinds}
  fixed: dict[str, list[float]] = {k: [] for k in kinds}
  for size in sizes:
    mine, raised = {}, None
    for kind, timer in timers.items():
      try:
        (point,), step_seconds = fit_points(timer.runs(args, kwargs, [size], counts, repeats))
      except jax.errors.JaxRuntimeError as e:  # this size does not fit the device
        failed = f"{kind} at microbatch {size}: {str(e).splitlines()[0][:200]}"
        continue
      except HetSpmdError as e:  # it cannot be timed here: every process hears of it before the gather below
        raised = e
        break
      mine[kind] = (point[1], step_seconds)
    if raised is not None and jax.process_count() == 1:
      raise raised
    if not everywhere(raised is None):
      # one error type on every process, so each takes the same way on (step_or_layer: one layer timed instead)
      raise CannotTimeError(str(raised) if raised else "the step could not be timed on another process (its error "
                            "is raised there)") from raised
    for kind, (micro, step_seconds) in gathered(kinds, mine).items():
      points[kind].append((size, micro))
      fixed[kind].append(step_seconds)
  return points, fixed, failed


def on_example(front: Any, state: Any, cluster: Any) -> Calibration | None:
  """A calibration on ``step(state, example_batch)`` where ``front``'s plan is made before any call; None where
  no example batch says what the step takes."""
  if front.example_batch is None or front.bound or isinstance(front.example_batch, (tuple, list)):
    if front.calibrating is True or calibration_store.directory_of(front.calibrating) is not None:
      raise HetSpmdError(f"calibrate={front.calibrating!r} times the step on a call's arguments: call the step first (or "
                         "step.resolve(...)), or pass example_batch= for a step(state, batch)")
    return None
  front = dataclasses.replace(front, batch_argnums=(1,), rebalancer=None, _runner=None)
  return timed_whole(front, (state, front.example_batch), {}, cluster)


def call_trace(front: Any, args: tuple, kwargs: dict) -> tuple[Arguments, Trace]:
  """A call's arguments as ``front`` (a :class:`~hetspmd.runtime.step.ParallelStep`) binds them, its batch of any
  size, and the step as the search traces it."""
  named = dataclasses.replace(front, batch_argnums=batch_positions(front, args))
  parts = Arguments.of(named, args)
  return parts, Trace.of(named, parts.function(named.fn, len(args)), parts.batch, (parts.rest, kwargs),
                         parts.graphdef)


def timed_whole(front: Any, args: tuple, kwargs: dict, cluster: Any, sizes: Sequence[int] | None = None,
                remats: Sequence[str] = ("none",)) -> Calibration:
  """:func:`calibrate` on a call's arguments at ``sizes`` (default :func:`sizes_for`) under ``remats``, carrying
  the step's fingerprint; where ``front``'s ``calibrate`` option names a directory, the calibration kept there for
  this step and pool instead, where it covers those sizes and policies (:mod:`calibration_store`), else the new
  timing, written there."""
  parts, trace = call_trace(front, args, kwargs)
  fingerprint = step_fingerprint(trace.state_batch(), parts.state, trace.batch)
  sizes, remats = sizes or sizes_for(front, cluster), policies(remats)
  directory = calibration_store.directory_of(front.calibrating)
  if directory is None or cluster.jax_device_ids is None:  # (unbound: calibrate says what to give)
    return calibrate(front, args, kwargs, cluster, sizes, fingerprint=fingerprint, remats=remats)
  usable, kept = calibration_store.load(directory, fingerprint, cluster, sizes, remats)
  if usable is not None:
    return usable
  timed = calibrate(front, args, kwargs, cluster, sizes, fingerprint=fingerprint, remats=remats)
  calibration_store.save(directory, timed, kept, cluster, sizes)
  return timed


def untimed_remats(plan: Any, calibration: Calibration | None) -> tuple[str, ...]:
  """The remat policies ``plan`` (a plan or a group plan) runs under that ``calibration`` timed no kind under,
  where it timed the step's microbatches (one layer's timing is under no policy: none then)."""
  if calibration is None or any(t.part != "step" for t in calibration.kinds):
    return ()
  runs = (plan.remat,) if hasattr(plan, "remat") else tuple(g.remat for g in plan.groups)
  timed = {t.remat for t in calibration.kinds}
  return tuple(r for r in dict.fromkeys(runs) if r not in timed)


def with_remats(front: Any, calibration: Calibration | None, plan: Any, call: tuple | None, cluster: Any
                ) -> Calibration | None:
  """``calibration`` with the remat policies ``plan`` runs under that it did not time (:func:`untimed_remats`),
  timed on ``call`` (``(args, kwargs)``) at the sizes it was timed at: the search then prices the policy its
  choice runs from the step's own times, not from a model of what the policy recomputes (on CPU devices that
  model priced GPT-2 tiny's recomputation at a fifth to a half of what it measured). None where there is no such
  policy, no call to time on, or the policy does not run on some kind (it stays priced from the model)."""
  remats = untimed_remats(plan, calibration)
  if not remats or call is None or not wanted(front.calibrating, cluster):  # given, not measured here: kept as is
    return None
  sizes = sorted({m for t in calibration.kinds for m, _ in t.points})
  try:
    return calibration.merged(timed_whole(front, *call, cluster, sizes, remats))
  except (HetSpmdError, jax.errors.JaxRuntimeError):
    return None


def searched_on_remats(front: Any, search: Callable[[Any], Any], call: tuple | None, cluster: Any
                       ) -> tuple[Calibration | None, Any]:
  """``(calibration, searched)``: ``search(cluster priced on front.calibration)``, and while its choice runs a
  remat policy the calibration did not time, that policy timed (:func:`with_remats`) and the search run again on
  it (a policy priced from its model is usually priced below its measured cost, so a second choice may run
  another), at most once per policy."""
  calibration = front.calibration
  searched = search(cluster.calibrated(calibration))
  for _ in REMAT_POLICIES:
    more = with_remats(front, calibration, searched.plan, call, cluster)
    if more is None:
      break
    calibration = more
    searched = search(cluster.calibrated(calibration))
  return calibration, searched


def sizes_for(front: Any, cluster: Any) -> tuple[int, ...]:
  """The microbatch sizes ``front``'s search would calibrate at on ``cluster`` (:func:`calibration_sizes`)."""
  return calibration_sizes(front.global_batch, cluster.num_devices, microbatch_sizes(front.global_batch))


def calibration_sizes(global_batch: int, devices: int, candidates: Sequence[int]) -> tuple[int, ...]:
  """Up to three microbatch sizes to calibrate at: the largest candidate within an even share of the batch, the
  largest within a quarter of it, and the smallest candidate, which the search may choose too (a microbatch's
  seconds are interpolated between the sizes timed; below them a line extrapolates a small microbatch's
  per-iteration cost badly: GPT-2 tiny's plan at microbatch 1 ran 1.9x its price calibrated at 4 and 16)."""
  share = max(1, global_batch // max(1, devices))
  within = [m for m in sorted(candidates) if m <= share] or [min(candidates)]
  top = within[-1]
  low = [m for m in within if m <= max(1, top // 4)] or [within[0]]
  return tuple(sorted({within[0], low[-1], top}))


def where_it_runs(option: Any, measure: Callable[[], Calibration | None]) -> tuple[Calibration | None, str]:
  """``(measure(), "")``; under ``calibrate="auto"`` (``option``), ``(None, why)`` where the step cannot be timed
  here (it fits no one device of a kind, or its state is split across processes): the search then prices
  compute from the devices' specs, and ``explain()`` says why. ``calibrate=True`` (or a directory) raises
  instead."""
  try:
    return measure(), ""
  except (HetSpmdError, jax.errors.JaxRuntimeError) as e:
    if option is True or calibration_store.directory_of(option) is not None:
      raise
    return None, str(e).splitlines()[0]


def wanted(option: Any, cluster: Any) -> bool:
  """Whether ``parallelize(..., calibrate=option)`` times the step before its search: ``True``/``False``, or
  ``"auto"``: on accelerators. Not on CPU devices, which share the host's cores (emulated kinds are labels, and
  a measured CPU pool is one kind): there ``plan="search"`` takes the plan ``hetspmd search`` prints, unless
  ``calibrate=True``. A directory (:mod:`calibration_store`) counts as ``True``."""
  if option in (True, False) or calibration_store.directory_of(option) is not None:
    return option is not False
  if cluster.jax_device_ids is None:
    return False
  ids = set(cluster.jax_device_ids)
  return any(d.platform != "cpu" for d in jax.devices() if d.id in ids)
