"""Timing one layer of the step's layer scan on each kind: the calibration of a step that fits no one device.

A large model's step fits no one device (each would hold the whole state), so
:func:`hetspmd.runtime.calibrating.calibrate` cannot time it. Where the step runs its layers as one scan over
stacked parameters (``nn.scan``, ``jax.lax.scan``), one layer does fit: this module times the layer scan's
forward and its transpose on each kind (a process's devices of the kind at once), as Cephalo times its
layers. Each scan is run as it is in
the step, at the microbatch size, over two stacked layers and over four (its inputs ones and zeros: a step's time
does not depend on its values), so the difference is one layer's seconds without the program's dispatch.

The result is a :class:`~hetspmd.hardware.calibration.KindTiming` with ``part="layer"``: per microbatch size,
one layer's forward and backward seconds. The search prices a kind from it by scaling the cost model's
prediction of the whole microbatch by the layer's measured over predicted seconds
(:func:`hetspmd.planner.pricing.measured_timing`); the per-step seconds (the optimizer update) stay modelled.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetspmd.errors import CannotTimeError, HetSpmdError, NoLayerStackError
from hetspmd.hardware.calibration import Calibration, KindTiming
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.frontend import stack
from hetspmd.passes.profile import step_fingerprint, with_batch
from hetspmd.runtime.calibrating import gathered, local_kind_devices, now

# stacked layers each scan is timed over: their difference over its count is one layer (never one: XLA turns a
# loop of one trip into straight-line code, which fuses across what a layer's loop keeps apart)
ROWS = (2, 4)
REPEATS = 5    # timed runs of each program, after one untimed run (which compiles)


@dataclasses.dataclass(frozen=True)
class LayerScans:
  """The step's layer scan traced at one microbatch size: its forward scan and its transpose (jaxpr
  equations), and how many layers they run."""

  forward: Any
  backward: Any
  length: int


def layer_scans(fn: Callable[[Any, Any], Any], state: Any, batch: Any, sizes: Sequence[int]
                ) -> dict[int, LayerScans]:
  """``{size: the layer scan of fn(state, batch) traced with size examples}`` (``batch`` of any size: only its
  shapes are read). The scan is found once, as :func:`hetspmd.passes.frontend.stack.find_layer_stack` finds it
  for pipeline stages, then taken by its position among the step's scans at each size (one trace each);
  raises :class:`~hetspmd.errors.NoLayerStackError` where the step has none."""
  base = max(min(sizes), 2)  # at one example JAX drops some equations (a sum over one row): found at two and more
  traced = {base: _flat(fn, state, batch, base)}
  small, large = traced[base], _flat(fn, state, batch, 2 * base)
  if [jx.primitive_name(e) for e in small] != [jx.primitive_name(e) for e in large]:
    raise NoLayerStackError("the step's equations differ between its traces at two batch sizes")

  def per_example(i: int, j: int) -> bool:
    return jx.aval_shape(small[i].invars[j]) != jx.aval_shape(large[i].invars[j])

  found = stack.find_layer_stack(stack.sites_in_jaxpr(small, per_example))
  count = sum(jx.primitive_name(e) == "scan" for e in small)
  out = {}
  for size in sorted(set(sizes)):
    eqns = traced[size] if size in traced else _flat(fn, state, batch, size)
    scans = [e for e in eqns if jx.primitive_name(e) == "scan"]
    if len(scans) != count:
      raise NoLayerStackError(f"the step's scans differ between its traces at {size} and {base} examples "
                              f"({len(scans)} and {count})")
    out[size] = LayerScans(scans[found.forward_scan], scans[found.backward_scan], found.length)
  return out


def _flat(fn: Callable[[Any, Any], Any], state: Any, batch: Any, size: int) -> list:
  """The equations of ``fn(state, batch)`` at ``size`` examples, calls inlined."""
  closed, _ = jx.trace_to_jaxpr(fn, (jx.to_abstract(state), with_batch(batch, size)), {})
  return jx.equations(jx.inline_calls(closed))


@dataclasses.dataclass
class LayerTimer:
  """Times one layer of :class:`LayerScans` on ``devices`` (one kind's, running the same layer at once, as the
  whole step's timing runs them: on a host whose devices share compute, a device is only as fast as it is
  beside the others): each scan run over ``ROWS`` stacked layers, the programs built once and kept."""

  devices: tuple
  _programs: dict = dataclasses.field(default_factory=dict, repr=False)

  def seconds(self, scans: LayerScans, size: int, repeats: int = REPEATS) -> float:
    """One layer's forward and backward seconds at ``size`` examples: per scan, the median time over ``ROWS[1]``
    stacked layers less the median over ``ROWS[0]``, per layer, the runs taken in turn (ABBA) so a slow spell
    falls on both."""
    total = 0.0
    for which, eqn in (("forward", scans.forward), ("backward", scans.backward)):
      calls = [self._call((size, which, rows), eqn, rows) for rows in ROWS]
      times: list[list[float]] = [[] for _ in ROWS]
      for r in range(repeats):
        for j in (range(len(ROWS)) if r % 2 == 0 else reversed(range(len(ROWS)))):
          start = now()
          jax.block_until_ready(calls[j]())
          times[j].append(now() - start)
      fewer, more = (statistics.median(t) for t in times)
      total += max(more - fewer, 1e-3 * more) / (ROWS[1] - ROWS[0])
    return total

  def _call(self, key: tuple, eqn: Any, rows: int) -> Callable[[], Any]:
    if key not in self._programs:
      program, inputs = scan_program(eqn, rows)
      where = self.devices[0] if len(self.devices) == 1 else NamedSharding(
          Mesh(np.array(self.devices), ("all",)), PartitionSpec())  # every device runs the layer (replicated)
      placed = [jax.device_put(x, where) for x in inputs]
      jax.block_until_ready(program(*placed))  # compiles
      self._programs[key] = lambda: program(*placed)
    return self._programs[key]


def scan_program(eqn: Any, rows: int) -> tuple[Callable[..., Any], list]:
  """``eqn`` (a scan) as a program over ``rows`` of its scanned inputs, and zero inputs for it."""
  parts = jx.scan_parts(eqn)
  carried = parts.num_consts + parts.num_carry
  shapes = [jx.aval_shape(v) for v in eqn.invars]
  shapes = shapes[:carried] + [(rows,) + s[1:] for s in shapes[carried:]]
  inputs = [_filled(s, jx.aval_dtype(v)) for s, v in zip(shapes, eqn.invars)]
  params = {**eqn.params, "length": rows}
  return jax.jit(lambda *args: jx.bind(eqn, args, params)), inputs


def _filled(shape: tuple, dtype: Any) -> Any:
  """An input of the timed scan: ones where floating (so norms and the residuals they save stay finite), else
  zeros (indices, masks, rng keys)."""
  return jnp.ones(shape, dtype) if jnp.issubdtype(dtype, jnp.floating) else jnp.zeros(shape, dtype)


def layer_calibration(fn: Callable[[Any, Any], Any], state: Any, batch: Any, cluster: Any,
                      sizes: Sequence[int]) -> Calibration:
  """One layer's seconds per microbatch size in ``sizes`` on each kind of ``cluster`` (bound to JAX devices):
  this process times each of its kinds on all its devices of that kind at once, and every process gathers
  every kind's times."""
  if cluster.jax_device_ids is None:
    raise HetSpmdError("timing a layer runs it on the cluster's devices: give a cluster bound to JAX devices")
  kinds = tuple(cluster.kinds)
  timers = {kind: LayerTimer(tuple(devices)) for kind, devices in
            local_kind_devices(cluster.jax_device_ids, [d.spec.name for d in cluster.devices], every=True).items()}
  points: dict[str, list[tuple[int, float]]] = {k: [] for k in kinds}
  failed = ""
  every = layer_scans(fn, state, batch, sizes)
  for size, scans in every.items():
    mine = {}
    for kind, timer in timers.items():
      try:
        mine[kind] = (timer.seconds(scans, size), 0.0)
      except jax.errors.JaxRuntimeError as e:  # not even a layer fits: left out here, gathered alike
        failed = f"{kind} at microbatch {size}: {str(e).splitlines()[0][:200]}"
    for kind, (seconds, _) in gathered(kinds, mine).items():
      points[kind].append((size, seconds))
  missing = [k for k in kinds if not points[k]]
  if missing:
    raise HetSpmdError(f"no layer of the step ran on {', '.join(missing)} ({failed or 'no device of it here'})")
  return Calibration(step_fingerprint(fn, state, batch), tuple(KindTiming(k, tuple(points[k]), part="layer")
                                                               for k in kinds))



def step_or_layer(whole: Callable[[], Calibration | None], trace_of: Callable[[], Any], state: Any, cluster: Any,
                  sizes: Sequence[int]) -> Calibration | None:
  """``whole()`` (the step timed on each kind, each device holding the whole state); where that cannot run
  (:class:`~hetspmd.errors.CannotTimeError`: the step fits no device of some kind, or its state is split across
  processes; or out of memory), one layer of the step's layer scan
  timed on each kind instead (:func:`layer_calibration` on ``trace_of()``, a
  :class:`~hetspmd.runtime.runner.Trace`). Where the step has no layer scan either, the first error, saying so."""
  try:
    return whole()
  except (CannotTimeError, jax.errors.JaxRuntimeError) as e:
    first = str(e).splitlines()[0]
  trace = trace_of()
  try:
    return layer_calibration(trace.state_batch(), state, trace.batch, cluster, sizes)
  except NoLayerStackError as e:
    why = str(e).split(": ", 1)[-1]
    raise HetSpmdError(f"{first}; nor can one layer be timed alone, as the step runs no layer scan ({why})") from None
