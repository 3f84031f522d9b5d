"""Timing one layer of the step on each kind: the calibration of a step that fits no one device.

A large model's step fits no one device (each would hold the whole state), so
:func:`hetspmd.runtime.calibrating.calibrate` cannot time it. One layer does fit, and this module times it on
each kind (a process's devices of the kind at once), as Cephalo times its layers:

- Where the step runs its layers as one scan over stacked parameters (``nn.scan``, ``nnx.scan``,
  ``jax.lax.scan``), the layer scan's forward and its transpose, each as it is in the step, over two stacked
  layers and over four (:class:`LayerScans`; ``part="layer"``).
- Where the step unrolls its layers (numbered blocks: ``h_0``, ``layers/3``, an ``nnx.List`` of blocks, as
  Flax's Gemma example builds them), the middle block's forward and backward: its per-example work, the
  equations remat ``"layers"`` runs again (:mod:`hetspmd.passes.remat`), and their gradients (``jax.vjp``) with
  respect to every floating input (its parameters and its input activations), as the step's backward takes
  them, in a loop of two trips and of four (:class:`LayerBlock`; ``part="unrolled"``). The step's backward
  equations are not tied to a block (NNX names no scope), so the prediction it is set against is the block's
  forward nodes scaled by the step's predicted backward over forward seconds.

Each program runs at the microbatch size, its inputs ones and zeros (a step's time does not depend on its
values); the difference between its two lengths is one layer's seconds without the program's dispatch. The
search prices a kind by scaling the cost model's prediction of the whole microbatch by the timed part's measured
over predicted seconds (:func:`hetspmd.planner.pricing.measured_timing`); the per-step seconds (the optimizer
update) stay modelled.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetspmd.errors import CannotTimeError, HetSpmdError, NoLayerStackError
from hetspmd.hardware.calibration import Calibration, KindTiming
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes import remat
from hetspmd.passes.frontend import stack
from hetspmd.passes.profile import step_fingerprint, with_batch
from hetspmd.plan.state_layout import parameter_paths
from hetspmd.runtime.calibrating import gathered, local_kind_devices, now

# stacked layers each scan is timed over: their difference over its count is one layer (never one: XLA turns a
# loop of one trip into straight-line code, which fuses across what a layer's loop keeps apart)
ROWS = (2, 4)
REPEATS = 5    # timed runs of each program, after one untimed run (which compiles)
# a block's loop runs more trips (its trip count is an input: nothing is compiled again) until the two counts'
# medians differ by this much, so a small layer is not lost in the dispatch's jitter; at most MAX_TRIPS
DIFFERENCE_SECONDS = 0.02
MAX_TRIPS = 256


@dataclasses.dataclass(frozen=True)
class LayerScans:
  """The step's layer scan traced at ``size`` examples: its forward scan and its transpose (jaxpr equations),
  and how many layers they run."""

  forward: Any
  backward: Any
  length: int
  size: int

  part = "layer"
  scalable = False  # more layers are more stacked inputs (memory) and another program: ROWS only

  def programs(self) -> tuple[tuple[str, Callable[[int], tuple]], ...]:
    """``(name, rows -> (program, inputs))`` of each scan timed."""
    return (("forward", functools.partial(scan_program, self.forward)),
            ("backward", functools.partial(scan_program, self.backward)))


@dataclasses.dataclass(frozen=True)
class LayerBlock:
  """One numbered block of a step that unrolls its layers, traced at ``size`` examples: the step's flat
  equations, the block's :class:`~hetspmd.passes.remat.Segment` (its per-example forward work) and, per input
  of the segment, whether it carries the example axis."""

  eqns: tuple
  segment: remat.Segment
  size: int
  per_example: tuple[bool, ...]

  part = "unrolled"
  scalable = True  # more trips are one input changed

  def programs(self) -> tuple[tuple[str, Callable[[int], tuple]], ...]:
    return (("forward and backward", self._trips),)

  def _trips(self, rows: int) -> tuple[Callable[..., Any], list]:
    program, inputs = self._program
    return program, [jnp.asarray(rows, jnp.int32), *inputs[1:]]

  @functools.cached_property
  def _program(self) -> tuple[Callable[..., Any], list]:
    return block_program(self.eqns, self.segment, ROWS[0], self.per_example, backward=True)


def step_layers(fn: Callable[[Any, Any], Any], state: Any, batch: Any, sizes: Sequence[int]
                ) -> dict[int, LayerScans | LayerBlock]:
  """``{size: what is timed of fn(state, batch) at size examples}``: its layer scan (:func:`layer_scans`), or
  where it has none, its middle numbered block (:func:`layer_blocks`); raises
  :class:`~hetspmd.errors.NoLayerStackError` where it has neither."""
  try:
    return layer_scans(fn, state, batch, sizes)
  except NoLayerStackError as e:
    no_scan = str(e).split(": ", 1)[-1]
  try:
    return layer_blocks(fn, state, batch, sizes)
  except NoLayerStackError as e:
    raise NoLayerStackError(f"it runs no layer scan ({no_scan}) and no numbered layers ({e})") from None


def layer_scans(fn: Callable[[Any, Any], Any], state: Any, batch: Any, sizes: Sequence[int]
                ) -> dict[int, LayerScans]:
  """``{size: the layer scan of fn(state, batch) traced with size examples}`` (``batch`` of any size: only its
  shapes are read). The scan is found once, as :func:`hetspmd.passes.frontend.stack.find_layer_stack` finds it
  for pipeline stages, then taken by its position among the step's scans at each size (one trace each);
  raises :class:`~hetspmd.errors.NoLayerStackError` where the step has none."""
  base = max(min(sizes), 2)  # at one example JAX drops some equations (a sum over one row): found at two and more
  traced = {base: jx.equations(_traced(fn, state, batch, base))}
  small, large = traced[base], jx.equations(_traced(fn, state, batch, 2 * base))
  if [jx.primitive_name(e) for e in small] != [jx.primitive_name(e) for e in large]:
    raise NoLayerStackError("the step's equations differ between its traces at two batch sizes")

  def per_example(i: int, j: int) -> bool:
    return jx.aval_shape(small[i].invars[j]) != jx.aval_shape(large[i].invars[j])

  found = stack.find_layer_stack(stack.sites_in_jaxpr(small, per_example))
  count = sum(jx.primitive_name(e) == "scan" for e in small)
  out = {}
  for size in sorted(set(sizes)):
    eqns = traced[size] if size in traced else jx.equations(_traced(fn, state, batch, size))
    scans = [e for e in eqns if jx.primitive_name(e) == "scan"]
    if len(scans) != count:
      raise NoLayerStackError(f"the step's scans differ between its traces at {size} and {base} examples "
                              f"({len(scans)} and {count})")
    out[size] = LayerScans(scans[found.forward_scan], scans[found.backward_scan], found.length, size)
  return out


def layer_blocks(fn: Callable[[Any, Any], Any], state: Any, batch: Any, sizes: Sequence[int]
                 ) -> dict[int, LayerBlock]:
  """``{size: the middle numbered block of fn(state, batch) traced with size examples}`` (two where size is
  one: at one example JAX drops some equations). The blocks are found as remat ``"layers"`` finds them
  (:func:`hetspmd.passes.remat.segments`: numbered module scopes, or for NNX the parameters' paths) at the
  smallest size, then taken by position in one trace per size; raises
  :class:`~hetspmd.errors.NoLayerStackError` where the step has none."""
  base = max(min(sizes), 2)
  small, large = _traced(fn, state, batch, base), _traced(fn, state, batch, 2 * base)
  names = [jx.primitive_name(e) for e in jx.equations(small)]
  if names != [jx.primitive_name(e) for e in jx.equations(large)]:
    raise NoLayerStackError("the step's equations differ between its traces at two batch sizes")
  per_example = {a for a, b in _matched(small, large).items() if jx.aval_shape(a) != jx.aval_shape(b)}
  invars = jx.invars(small)
  params = {invars[i]: p for i, p in parameter_paths(state).items() if i < len(invars)}
  found = remat.segments(remat.sites_of(jx.equations(small), jx.outvars(small)), per_example.__contains__, params)
  if not found:
    raise NoLayerStackError("no repeated, numbered module scope or parameter path (h_0, layers/3) reads "
                            "per-example residuals of its own")
  segment = remat.timed_segment(found)
  carried = tuple(v in per_example for v in segment.inputs)
  out = {}
  for size in sorted({max(s, 2) for s in sizes}):
    closed = small if size == base else _traced(fn, state, batch, size)
    if [jx.primitive_name(e) for e in jx.equations(closed)] != names:
      raise NoLayerStackError(f"the step's equations differ between its traces at {size} and {base} examples")
    out[size] = LayerBlock(tuple(jx.equations(closed)), remat.renamed(segment, _matched(small, closed)), size,
                           carried)
  return {size: out[max(size, 2)] for size in sizes}


def _traced(fn: Callable[[Any, Any], Any], state: Any, batch: Any, size: int) -> Any:
  """``fn(state, batch)`` at ``size`` examples as a closed jaxpr, calls inlined."""
  closed, _ = jx.trace_to_jaxpr(fn, (jx.to_abstract(state), with_batch(batch, size)), {})
  return jx.inline_calls(closed)


def _matched(a: Any, b: Any) -> dict:
  """``{value of a: the value in its place in b}`` for two traces of one structure (closed jaxprs)."""
  pairs = list(zip(jx.invars(a), jx.invars(b), strict=True)) + list(zip(jx.constvars(a), jx.constvars(b),
                                                                          strict=True))
  for x, y in zip(jx.equations(a), jx.equations(b), strict=True):
    pairs += [(u, v) for u, v in zip(x.outvars, y.outvars, strict=True) if not jx.is_dropped(u)]
  return dict(pairs)


@dataclasses.dataclass
class LayerTimer:
  """Times one layer (:class:`LayerScans` or :class:`LayerBlock`) on ``devices`` (one kind's, running the same
  layer at once, as the whole step's timing runs them: on a host whose devices share compute, a device is only
  as fast as it is beside the others): each scan over ``ROWS`` stacked layers, a block's loop over ``ROWS``
  trips or more, the programs built once and kept."""

  devices: tuple
  _programs: dict = dataclasses.field(default_factory=dict, repr=False)
  _placed: dict = dataclasses.field(default_factory=dict, repr=False)  # a block's inputs, placed once per size

  def seconds(self, layer: LayerScans | LayerBlock, size: int, repeats: int = REPEATS) -> float:
    """One layer's seconds at ``size`` examples (a scan's forward and backward, or a block's forward): per
    program, the median time over ``ROWS[1]`` layers less the median over ``ROWS[0]``, per layer, the runs
    taken in turn (ABBA) so a slow spell falls on both. A block's loop runs more trips where the difference
    is under ``DIFFERENCE_SECONDS``."""
    total = 0.0
    for which, build in layer.programs():
      rows = ROWS
      while True:
        fewer, more = self._medians((size, which), build, rows, repeats, layer.scalable)
        factor = min(math.ceil(DIFFERENCE_SECONDS / max(more - fewer, DIFFERENCE_SECONDS / 64)),
                     MAX_TRIPS // rows[1])
        if not layer.scalable or more - fewer >= DIFFERENCE_SECONDS or factor < 2:
          break
        rows = (rows[0] * factor, rows[1] * factor)
      total += max(more - fewer, 1e-3 * more) / (rows[1] - rows[0])
    return total

  def _medians(self, key: tuple, build: Callable[[int], tuple], rows: tuple[int, int], repeats: int,
               scalable: bool = False) -> tuple[float, float]:
    calls = [self._call(key, build, n, scalable) for n in rows]
    times: list[list[float]] = [[] for _ in rows]
    for r in range(repeats):
      for j in (range(len(rows)) if r % 2 == 0 else reversed(range(len(rows)))):
        start = now()
        jax.block_until_ready(calls[j]())
        times[j].append(now() - start)
    fewer, more = (statistics.median(t) for t in times)
    return fewer, more

  def _call(self, key: tuple, build: Callable[[int], tuple], rows: int, scalable: bool = False
            ) -> Callable[[], Any]:
    """The program of ``key`` over ``rows`` layers, compiled and run once. A ``scalable`` program takes its trip
    count as its first input: its other inputs are placed once, whatever the count."""
    if (key, rows) not in self._programs:
      where = self.devices[0] if len(self.devices) == 1 else NamedSharding(
          Mesh(np.array(self.devices), ("all",)), PartitionSpec())  # every device runs the layer (replicated)
      if scalable and key in self._placed:
        program, placed = self._placed[key]
      else:
        program, inputs = build(rows)
        placed = [jax.device_put(x, where) for x in inputs[1 if scalable else 0:]]
        if scalable:
          self._placed[key] = (program, placed)
      args = [jax.device_put(np.int32(rows), where), *placed] if scalable else placed
      self._programs[key, rows] = recycling(program, args)
    return self._programs[key, rows]


def recycling(program: Callable[..., Any], args: list) -> Callable[[], Any]:
  """``program(*args)`` as a call whose outputs take the buffers of the call before (donated): a layer scan's
  stacked outputs are as large as the layers it runs, and fresh buffers each call would time the host's page
  faults (on CPU a scan of four layers then measured 2.6x one of two, not 2x), which the step itself, writing
  them into buffers it reuses, never pays. Compiled and run here, twice."""
  outputs = jax.tree.leaves(jax.block_until_ready(program(*args)))  # compiles
  n = len(args)
  reused = jax.jit(lambda *given: program(*given[:n]), donate_argnums=tuple(range(n, n + len(outputs))),
                   keep_unused=True)  # the donated buffers are read by nothing: kept, so XLA may alias them
  held = [outputs]

  def call():
    held[0] = jax.tree.leaves(reused(*args, *held[0]))
    return held[0]

  jax.block_until_ready(call())  # compiles the donating program
  return call


def scan_program(eqn: Any, rows: int) -> tuple[Callable[..., Any], list]:
  """``eqn`` (a scan) as a program over ``rows`` of its scanned inputs, and zero inputs for it."""
  parts = jx.scan_parts(eqn)
  carried = parts.num_consts + parts.num_carry
  shapes = [jx.aval_shape(v) for v in eqn.invars]
  shapes = shapes[:carried] + [(rows,) + s[1:] for s in shapes[carried:]]
  inputs = [_filled(s, jx.aval_dtype(v)) for s, v in zip(shapes, eqn.invars)]
  params = {**eqn.params, "length": rows}
  return jax.jit(lambda *args: jx.bind(eqn, args, params)), inputs


def block_program(eqns: Sequence[Any], segment: remat.Segment, rows: int, moved: Sequence[bool] | None = None, *,
                  backward: bool = False) -> tuple[Callable[..., Any], list]:
  """``segment``'s equations (one block's forward, of the flat ``eqns``) run ``rows`` times in a loop, as a
  program, and filled inputs for it (the trip count first). XLA must run every trip: the trip count is an input,
  so the loop is never unrolled, and each trip's inputs that carry the example axis (``moved``, per input of the
  segment; default all), and every input that is not floating (indices, masks, keys), are offset by the
  previous trip's values times a zero that is also an input, so nothing that reads them is hoisted out of the
  loop. The parameters are read as they are (offsetting them would add a pass over them per trip). The last
  trip's values are the outputs. With ``backward``, each trip also runs the block's backward: the gradients of
  its floating outputs, given cotangents that are inputs too (ones: never a constant XLA could fold into the
  transposed work; offset as the per-example inputs are, so no work on them alone is hoisted), with respect to
  its floating inputs, which are then the trip's values."""
  body = remat.segment_body(segment, eqns)
  dtypes = [jx.aval_dtype(v) for v in segment.inputs]
  floats = [i for i, d in enumerate(dtypes) if _floating(d)]
  made = [v for v in segment.residuals if _floating(jx.aval_dtype(v))]
  if backward:
    avals = [(jx.aval_shape(segment.inputs[i]), dtypes[i]) for i in floats]
    cotangents = [_filled(jx.aval_shape(v), jx.aval_dtype(v)) for v in made]
  else:
    avals, cotangents = [(jx.aval_shape(v), jx.aval_dtype(v)) for v in segment.residuals], []
  inputs = ([np.int32(rows), np.float32(0)] + [_filled(jx.aval_shape(v), d) for v, d in zip(segment.inputs, dtypes)]
            + cotangents)
  moved = [m or not _floating(d) for m, d in zip(moved or [True] * len(dtypes), dtypes)]
  moved = moved if any(m and _floating(d) for m, d in zip(moved, dtypes)) else [True] * len(dtypes)

  def gradients(fresh: list, cts: Sequence[Any]) -> list:
    def floating_outputs(*xs):
      given = dict(zip(floats, xs))
      return [y for y in body(*(given.get(i, x) for i, x in enumerate(fresh))) if _floating(y.dtype)]

    _, pullback = jax.vjp(floating_outputs, *(fresh[i] for i in floats))
    return list(pullback(list(cts)))

  def run(trips, zero, *given):
    args, cts = given[:len(dtypes)], given[len(dtypes):]

    def trip(_, previous):
      offset = zero * sum((x.reshape(-1)[0].astype(jnp.float32) for x in previous if _floating(x.dtype)),
                          jnp.float32(0))
      fresh = [_offset(x, offset) if m else x for x, m in zip(args, moved)]
      out = gradients(fresh, [_offset(c, offset) for c in cts]) if backward else body(*fresh)
      return tuple(_as(x, dtype) for x, (_, dtype) in zip(out, avals))

    return jax.lax.fori_loop(0, trips, trip, tuple(jnp.zeros(shape, dtype) for shape, dtype in avals))

  return jax.jit(run), inputs


def _offset(x: Any, offset: Any) -> Any:
  """``x`` plus ``offset`` (a float32 zero made at run time), in ``x``'s own kind: a value XLA cannot prove
  equal to ``x``."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    impl = jax.random.key_impl(x)
    return jax.random.wrap_key_data(jax.random.key_data(x) + offset.astype(jnp.uint32), impl=impl)
  if x.dtype == jnp.bool_:
    return jnp.logical_xor(x, offset != 0)
  return x + offset.astype(x.dtype)


def _floating(dtype: Any) -> bool:
  return jnp.issubdtype(dtype, jnp.floating)


def _as(x: Any, dtype: Any) -> Any:
  """``x`` as a loop carry of ``dtype`` (a weakly typed value made strong)."""
  return jax.lax.convert_element_type(x, dtype) if jnp.issubdtype(dtype, jnp.number) else x


def _filled(shape: tuple, dtype: Any) -> Any:
  """An input of a timed program, in host memory (placed on the timed devices alone): ones where floating (so
  norms and the residuals they save stay finite), else zeros (indices, masks, rng keys)."""
  if jnp.issubdtype(dtype, jax.dtypes.extended):
    return jnp.zeros(shape, dtype)  # keys: NumPy has no such dtype
  return np.ones(shape, dtype) if _floating(dtype) else np.zeros(shape, dtype)


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
  every = step_layers(fn, state, batch, sizes)
  timed = {layer.size: layer for layer in every.values()}  # a block of one example is traced, and timed, at two
  for size, layer in sorted(timed.items()):
    mine = {}
    for kind, timer in timers.items():
      try:
        mine[kind] = (timer.seconds(layer, size), 0.0)
      except jax.errors.JaxRuntimeError as e:  # not even a layer fits: left out here, gathered alike
        failed = f"{kind} at microbatch {size}: {str(e).splitlines()[0][:200]}"
    for kind, (seconds, _) in gathered(kinds, mine).items():
      points[kind].append((size, seconds))
  missing = [k for k in kinds if not points[k]]
  if missing:
    raise HetSpmdError(f"no layer of the step ran on {', '.join(missing)} ({failed or 'no device of it here'})")
  part = next(iter(every.values())).part
  return Calibration(step_fingerprint(fn, state, batch), tuple(KindTiming(k, tuple(points[k]), part=part)
                                                               for k in kinds))



def step_or_layer(whole: Callable[[], Calibration | None], trace_of: Callable[[], Any], state: Any, cluster: Any,
                  sizes: Sequence[int]) -> Calibration | None:
  """``whole()`` (the step timed on each kind, each device holding the whole state); where that cannot run
  (:class:`~hetspmd.errors.CannotTimeError`: the step fits no device of some kind, or its state is split across
  processes; or out of memory), one layer of the step (its layer scan, or a numbered block) timed on each kind
  instead (:func:`layer_calibration` on ``trace_of()``, a :class:`~hetspmd.runtime.runner.Trace`). Where the
  step has no layer either, or no layer runs on some kind, the first error, saying so."""
  try:
    return whole()
  except (CannotTimeError, jax.errors.JaxRuntimeError) as e:
    first = str(e).splitlines()[0]
  trace = trace_of()
  try:
    return layer_calibration(trace.state_batch(), state, trace.batch, cluster, sizes)
  except NoLayerStackError as e:
    raise HetSpmdError(f"{first}; nor can one layer be timed alone, as {e}") from None
  except HetSpmdError as e:
    raise HetSpmdError(f"{first}; nor did one layer of it run alone: {e}") from None
