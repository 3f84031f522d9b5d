"""``@hetspmd.parallelize``: run a single-device train step, unchanged, under a plan.

The decorated step is any function a Flax user writes: functional
``train_step(state, batch, ...) -> (state, metrics)`` (a Linen
``TrainState``, ``jax.value_and_grad`` over a closure of the batch, already
wrapped in ``jax.jit`` or not) or NNX in place ``train_step(model,
optimizer, metrics, batch, rngs)``, whose graph objects are updated after
each call as ``nnx.jit`` does. The batch is the argument whose arrays lead
with ``global_batch`` examples (or ``batch_argnums=``).

Each argument structure is lowered once to one ``jax.jit`` program:

* the step is traced at the global batch, and :mod:`hetspmd.passes.batch_axis.analysis`
  finds which equations are per-example and where they reduce over the batch;
* :mod:`hetspmd.lowering.weighted` builds the weighted program: per device a loop over
  its own microbatch count, one reduction over ``data``, the rest once;
* state leaves carry the plan's ``NamedSharding``s (tensor parallel along
  ``model``, ZeRO along ``data``) in and out; the batch arrives as a padded
  microbatch buffer sharded over ``data`` plus each position's count
  (:meth:`ParallelStep.shard_batch`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from typing import Any, Callable

import jax
import numpy as np

from hetspmd import lowering
from hetspmd.autodiff import remat_policy
from hetspmd.errors import HetSpmdError, InvalidValueError, TraceError, closest
from hetspmd.hardware.cluster import Cluster
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.batch_axis.analysis import analyse
from hetspmd.passes.frontend import named_axes
from hetspmd.plan.groups import GroupPlan, is_group_plan_file, split_by_process
from hetspmd.plan.value import Plan
from hetspmd.planner.building import plan_for
from hetspmd.runtime.binding import (Arguments, Call, StaticArgs, distinct_leaves, positional_function,
                                     static_bound, unbound)
from hetspmd.runtime.grouped import GroupedStep
from hetspmd.runtime.searching import global_abstract, searched_plan, step_traced
from hetspmd.runtime.placement import GroupedBatch, ShardedBatch, check_live, positions_array, shard_batch


@dataclasses.dataclass(frozen=True)
class _Trace:
  """What the plan is made from: the step as ``f(state, batch, rest, kwargs)``
  (:func:`~hetspmd.runtime.binding.positional_function`), one call's batch arguments (a tuple) and the rest
  (``(rest, kwargs)``); ``graphdef``: the NNX objects' whose state the state is."""

  f: Callable[..., Any]
  batch: tuple
  rest: tuple
  graphdef: Any = None
  static: Any = ()  # a key for the values bound into f

  @classmethod
  def of(cls, step: "ParallelStep", f: Callable[..., Any], batch: tuple, rest: tuple, graphdef: Any = None
         ) -> "_Trace":
    """``f`` as ``step`` traces it, the leaves of ``rest`` that are not arrays (a config, a schedule) bound into
    it first (:func:`~hetspmd.runtime.binding.static_bound`), as the single program binds them."""
    f, rest, static = static_bound(f, rest)
    return cls(step.traced(f), batch, rest, graphdef, static)

  def state_batch(self) -> Callable[[Any, Any], Any]:
    """The step as ``f(state, batch)`` for the search's profile, ``batch`` the tuple of batch arguments."""
    return lambda state, batch: self.f(state, batch, *self.rest)


@dataclasses.dataclass
class ParallelStep:
  """A train step bound to a plan; call it like the original step.

  Build with :func:`parallelize`. ``plan`` is resolved on first use from
  the state (``plan="auto"``), or given up front.
  """

  fn: Callable[..., Any]
  cluster: Cluster | None
  requested_plan: Any
  global_batch: int
  microbatch: int | None
  donate_state: bool
  specs: Any = None
  example_batch: Any = None
  _plan: Plan | None = None
  _mesh: Any = None
  batch_argnums: tuple[int, ...] | None = None
  batch_stats: str = "local"
  grad_reduce_dtype: str = "float32"
  _programs: dict = dataclasses.field(default_factory=dict)  # one jitted program per argument structure
  _analysis: Any = None
  _starts_array: Any = None
  _lockstep: bool | None = None  # decided from the first compiled program
  bound: tuple = ()  # NNX objects bound ahead of each call's arguments (an nnx.cached_partial's)
  axis_name: tuple[str, ...] | None = None  # the step's collective axis names (pmap style); None: found on trace
  group_plans: bool = True  # plan="search" also prices group plans and runs one priced well ahead
  _grouped: GroupedStep | None = None  # under a group plan: its runtime
  _group_note: str = ""  # why the plan is (or is not) a group plan the search priced
  _devices: frozenset | None = None  # the single program's devices (the state must lie on them)
  static: StaticArgs = StaticArgs()  # the arguments bound as jax.jit binds static ones

  def __post_init__(self):
    functools.update_wrapper(self, self.fn)

  def traced(self, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (the step, or the step as a function of arrays) as hetspmd traces it: collectives over the step's
    axis names (``lax.pmean(grads, 'batch')``) bound as the one replica of the global batch
    (:mod:`hetspmd.passes.frontend.named_axes`)."""
    return named_axes.binding(fn, self.axis_name, self._found_axis_names)

  def _found_axis_names(self, names: tuple[str, ...]) -> None:
    self.axis_name = names

  # --- plan ------------------------------------------------------------------

  @property
  def plan(self) -> Plan | GroupPlan:
    """The plan; an ``"auto"`` plan exists once the state has been seen."""
    return self._resolve(None)

  @property
  def grouped(self) -> bool:
    """Whether the step runs under a :class:`~hetspmd.plan.groups.GroupPlan` (one program per device group:
    :mod:`hetspmd.runtime.grouped`)."""
    return self._grouped is not None

  def _resolve(self, state: Any, trace: "_Trace | None" = None) -> Plan | GroupPlan:
    if self._plan is None:
      if state is None and self.requested_plan in ("auto", "search"):
        raise HetSpmdError("the plan is made from the train state: call .shard_state(state) (or the step) first")
      requested, runtime = self.requested_plan, None
      if isinstance(requested, (str, os.PathLike)) and requested not in ("auto", "search"):
        requested = GroupPlan.load(requested) if is_group_plan_file(requested) else Plan.load(requested)
      if isinstance(requested, (Plan, GroupPlan)):
        plan = requested
      elif requested == "auto":
        cluster = self.cluster or Cluster.from_devices(jax.devices())
        plan = plan_for(cluster, state, global_batch=self.global_batch, microbatch=self.microbatch,
                        specs=self.specs, grad_reduce_dtype=self.grad_reduce_dtype)
      elif requested == "search":
        searched = searched_plan(self, self.cluster or Cluster.from_devices(jax.devices()), state,
                                 self._search_trace(trace))
        plan, runtime, self._group_note = searched.plan, searched.runtime, searched.note
      else:
        raise InvalidValueError(
            f"plan must be 'search', 'auto', a Plan, a GroupPlan or a path to a plan JSON file, got {requested!r}")
      if plan.global_batch != self.global_batch:
        raise HetSpmdError(f"the plan is for a global batch of {plan.global_batch}; parallelize() was given "
                           f"global_batch={self.global_batch}")
      _check_plan_kinds(plan, self.cluster)
      self._adopt(plan, runtime)
    if state is not None and not self.grouped:
      self._plan.check_state(state)
    return self._plan

  def _adopt(self, plan: Plan | GroupPlan, runtime: GroupedStep | None = None) -> None:
    """Binds the step to ``plan``; ``runtime``: the group plan's programs, already built by the search's probe."""
    if isinstance(plan, GroupPlan):
      self._grouped = runtime or self.group_runtime(plan)
      plan = self._grouped.plan
    else:
      self._grouped = None
      self._mesh, self._devices = plan.mesh(), None
    self._plan = plan

  def group_runtime(self, plan: GroupPlan) -> GroupedStep:
    """``plan``'s runtime; each group's program runs in one process, so a group spanning several is cut."""
    process_of = {d.id: d.process_index for d in jax.devices()}
    if all(d in process_of for d in plan.devices):  # else GroupedStep says which devices JAX lacks
      plan = split_by_process(plan, process_of)
    return GroupedStep(self.fn, plan, batch_stats=self.batch_stats, donate_state=self.donate_state)

  def _resolve_call(self, parts: Arguments, args: tuple, kwargs: dict) -> Any:
    """The plan resolved on a call's arguments (the search traces the step on them); returns the state to run
    with: NNX objects are placed on a single program's devices in place, as ``nnx.jit`` would leave them."""
    from flax import nnx

    self._resolve(parts.state, _Trace.of(self, parts.function(self.fn, len(args)), parts.batch, (parts.rest, kwargs),
                                         parts.graphdef))
    state = parts.state
    if parts.graph_args and not self.grouped:
      state = jax.device_put(state, self._plan.state_shardings(self._mesh, state))
      nnx.update(tuple(args[i] for i in parts.graph_args), state)
    return state

  def _search_trace(self, trace: "_Trace | None") -> "_Trace":
    """What the search traces: the call's step on ``example_batch`` where given, else on the call's batch (none:
    ``step(state, example_batch)``)."""
    if trace is None:
      if self.example_batch is None:
        raise HetSpmdError("plan='search' traces the step on a batch: pass parallelize(..., example_batch=...) or "
                           "call the step (before shard_state) so that its first batch is used")
      return self._example_trace()
    if self.example_batch is not None:
      return dataclasses.replace(trace, batch=(self.example_batch,) if len(trace.batch) == 1
                                 else tuple(self.example_batch))
    return trace

  def _example_trace(self) -> "_Trace":
    """The step traced as ``step(state, example_batch)``, before any call."""
    f = positional_function(self.fn, 2, graph_args=(), graphdef=None, batch_argnums=(1,), state_argnum=0)
    return _Trace(self.traced(f), (self.example_batch,), ((), {}))

  # --- placing data ----------------------------------------------------------------

  def shard_state(self, state: Any) -> Any:
    """Places ``state`` on the devices with the plan's shardings."""
    plan = self._resolve(state)
    if self.grouped:
      if plan.hybrid:  # split before the first call where example_batch tells which leaves
        self._trace_for_state(plan, state)
      return self._grouped.shard_state(state)
    return jax.device_put(state, plan.state_shardings(self._mesh, state))

  def state_shardings(self, state: Any) -> Any:
    """Where the state lives between steps (to restore a checkpoint into). Under a group plan with state
    shares, or a hybrid one, it comes from the step's trace (which leaves are optimizer state, which are held
    split): of its first call, or of ``example_batch`` for a ``step(state, batch)``."""
    plan = self._resolve(state)
    if self.grouped:
      self._trace_for_state(plan, state)
      return self._grouped.state_shardings(state)
    return plan.state_shardings(self._mesh, state)

  def _trace_for_state(self, plan: Any, state: Any) -> None:
    """Under a group plan whose state layout comes from the step's trace (state shares, or hybrid), that trace
    from ``example_batch`` where the step has not been traced yet."""
    if ((plan.state_shares or plan.hybrid) and self.example_batch is not None and not self._grouped.traced
        and self.batch_argnums in (None, (1,))):
      self._trace_groups(state)

  def _trace_groups(self, state: Any) -> None:
    """The group programs built from ``example_batch`` at the global batch, the step called as
    ``step(state, batch)``: which state leaves are optimizer state, and so where each one is held."""
    trace = self._example_trace()
    try:
      self._grouped.prepare(trace.f, state, global_abstract(trace.batch, self.global_batch), trace.rest, static=trace.static)
    except HetSpmdError:
      raise
    except TypeError as e:
      if jx.is_concreteness_error(e):
        raise
      raise HetSpmdError(f"example_batch traces the step as step(state, batch), which this step is not ({e}): call "
                         "the step once first, then ask for state_shardings") from None

  def shard_batch(self, batch: Any) -> ShardedBatch:
    """Host batch → padded per-device microbatch buffers and counts.

    With one process, ``batch`` is the global batch (leading axis
    ``global_batch``). With several, each process passes only the examples
    of the data positions it hosts, in position order.
    """
    plan = self._resolve(None)
    if self.grouped:  # the groups' microbatch buffers and the tail's, for the step's one batch argument
      return self._grouped.shard_batch((batch,))
    return shard_batch(plan, self._mesh, batch)

  # --- running -------------------------------------------------------------------

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return self._with_static(self._call, args, kwargs)

  def _with_static(self, run: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``run(args, kwargs)`` on the call's arguments (``nnx.cached_partial``'s objects first), the static ones
    wrapped (:class:`~hetspmd.runtime.binding.StaticArgs`); where the trace needs a top-level Python ``int`` or
    ``bool`` of an unjitted step as a Python value (a shape, a branch), again with that argument static."""
    args = self.bound + args
    while True:
      try:
        return run(*self.static.mark(args, kwargs))
      except Exception as e:  # noqa: BLE001 (re-raised unless a scalar made static lets the trace through)
        if isinstance(e, HetSpmdError) and type(e) is not TraceError or not jx.is_concreteness_error(e):
          raise  # hetspmd's own message (a TraceError only wraps JAX's), or not a value needed concrete
        scalars = self.static.scalars(args, kwargs)
        if self.static.jitted or not scalars:
          raise _concreteness_error(self.static, scalars, args, kwargs, e) from e
        self.static = self.static.inferring(scalars[0])

  def _call(self, args: tuple, kwargs: dict) -> Any:
    # The hot path: split NNX objects, place the batch, run the cached program, write NNX objects back.
    if self._plan is None or self.grouped:
      parts = Arguments.of(self, args)
      if self._plan is None:
        self._resolve_call(parts, args, kwargs)
      if self.grouped:
        return self._call_grouped(parts, args, kwargs)
    call = Call.bind(self, args, kwargs)
    compiled = self._executable(call)
    state, others = call.dynamic
    check_live(state, others, self._mesh_devices())
    outputs = compiled(distinct_leaves(state) if self.donate_state else state, others, call.batch.counts,
                       self._starts())
    return call.finish(outputs)

  def _mesh_devices(self) -> frozenset:
    if self._devices is None:
      self._devices = frozenset(self._mesh.devices.flat)
    return self._devices

  def _call_grouped(self, parts: Arguments, args: tuple, kwargs: dict) -> Any:
    """One step under the group plan: the step as ``f(state, batch, rest, kwargs)``, with the batch arguments (or
    the one placed by :meth:`shard_batch`)."""
    from flax import nnx

    check_live(parts.state, parts.batch)
    placed = len(parts.batch) == 1 and isinstance(parts.batch[0], GroupedBatch)
    trace = _Trace.of(self, parts.function(self.fn, len(args)), parts.batch, (parts.rest, kwargs), parts.graphdef)
    out = self._grouped.run(trace.f, parts.state, parts.batch[0] if placed else parts.batch, trace.rest,
                            graphdef=parts.graphdef, static=trace.static)
    if parts.graph_args:
      new_state, out = out
      nnx.update(tuple(args[i] for i in parts.graph_args), new_state)
    return out

  def lower(self, *args: Any, **kwargs: Any):
    """The ``jax.stages.Lowered`` program for these arguments."""
    if self.grouped:
      raise HetSpmdError("under a group plan the step runs as several programs (one per group, the exchange, the "
                         "updates): there is no one program to lower; step.explain() describes them")

    def lowered(args: tuple, kwargs: dict):
      call = Call.bind(self, args, kwargs)
      return self._executable(call).lower(*call.dynamic, call.batch.counts, self._starts())

    return self._with_static(lowered, args, kwargs)

  def explain(self) -> str:
    if self.grouped:
      return "\n".join([self._grouped.explain()] + self._call_notes() + (
          [f"  {self._group_note}"] if self._group_note else []))
    if self.plan.stages:
      mode = (f"pipeline stages of {list(self.plan.stages)} layers along 'stage', lockstep GPipe ticks (one "
              "ppermute each), every stage running its own layers of the step's layer scan")
    elif self._lockstep:
      mode = ("microbatch accumulation in lockstep: every position runs the largest count, padding masked "
              "(XLA placed a collective-permute or all-to-all inside the loop)")
    else:
      mode = "weighted microbatch accumulation (per-device trip counts)"
    wire = (lowering.program.wire_dtypes(self._analysis, self.plan.grad_reduce_dtype)
            if self._analysis is not None else [])
    lines = [self.plan.summary(" and ".join(wire) or None), f"  execution: {mode}"] + self._call_notes()
    if self._group_note:
      lines.append(f"  note: {self._group_note}")
    if self._analysis is not None:
      analysis = self._analysis
      lines.append(f"  derived from the step's jaxpr: {len(analysis.cuts)} reduction(s) over the batch, "
                   f"{analysis.loops} microbatch loop(s)")
      local = analysis.local_statistics
      if local:
        lines.append(f"  batch statistics per microbatch of {self.plan.microbatch} (as per-device BatchNorm; "
                     "batch_stats='exact' makes them exact):")
        lines += [f"    {line}" for line in analysis.describe() if "per-microbatch" in line]
      if analysis.loops > 1:
        lines.append("  exact reductions that feed per-example work, each computed in an earlier loop:")
        lines += [f"    {line}" for line in analysis.describe() if "feeds later" in line]
      lines += [f"  note: {note}" for note in analysis.notes]
      if self.plan.remat not in ("none", "layers") and not any(d is not None and d.body is not None and
                                               jx.primitive_name(e) in ("remat2", "checkpoint")
                                               for e, d in zip(jx.equations(analysis.jaxpr), analysis.decisions)):
        lines.append(f"  note: the plan's remat policy {self.plan.remat!r} did not reach the step (it applies "
                     "through hetspmd.value_and_grad)")
    return "\n".join(lines)

  def _call_notes(self) -> list[str]:
    notes = [f"  argument {self.static.describe(k)}, a Python value the step uses as a shape or a branch, is bound "
             "static (as jax.jit's static_argnums): each new value builds programs of its own"
             for k in self.static.inferred]
    if not self.axis_name:
      return notes
    names = ", ".join(repr(n) for n in self.axis_name)
    return notes + [f"  collectives over {names} (pmap style) run as the one replica of the global batch"]

  def _starts(self):
    plan = self.plan
    if self._starts_array is None:
      starts = np.concatenate([[0], np.cumsum(plan.examples_per_position())[:-1]]).astype(np.int32)
      self._starts_array = positions_array(self._mesh, plan, starts)
    return self._starts_array

  def _executable(self, call: Call):
    key = call.key
    if key not in self._programs:
      self._programs[key] = self._build(call)
    return self._programs[key]

  def _build(self, call: Call):
    plan, mesh = self.plan, self._mesh
    state_shardings = plan.state_shardings(mesh, call.state)  # checks the state against the plan first
    with remat_policy(plan.remat):
      closed, out_tree = step_traced(lambda: call.trace(plan.global_batch), call.batch.data, leading=2,
                                      global_batch=plan.global_batch)
    analysis = analyse(closed, call.batch_inputs, plan.global_batch, batch_stats=self.batch_stats,
                       float_state_inputs=call.float_state_inputs, remat=plan.remat, param_paths=call.param_paths)
    self._analysis = analysis
    layout = lowering.Layout(mesh, plan.data_axis, plan.microbatch, plan.max_count, plan.microbatch_counts,
                             data_split=plan.data_split_leaves(call.state), reduce_dtype=plan.grad_reduce_dtype,
                             overlap=plan.overlap_reduction, overlap_microbatches=plan.overlap_microbatches,
                             stages=plan.stages)

    def make(lockstep: bool):
      program = lowering.build(analysis, call.batch_inputs, dataclasses.replace(layout, lockstep=lockstep))

      def run(state, others, counts, starts):  # only the state's buffers may be donated
        outputs = program(call.inputs((state, others)), counts, starts)
        return call.constrain(jax.tree.unflatten(out_tree, outputs), state_shardings)

      donate = (0,) if self.donate_state and call.returns_state(out_tree, analysis.jaxpr) else ()
      return jax.jit(run, donate_argnums=donate, compiler_options=_compiler_options(plan, mesh))

    programs: dict = {}

    def program(lockstep: bool):
      if lockstep not in programs:
        programs[lockstep] = make(lockstep)
      return programs[lockstep]

    def run(state, others, counts, starts):
      if self._lockstep is None:
        # a stage plan's ticks are lockstep by construction: its positions' counts only mask work
        self._lockstep = not plan.is_uniform and not plan.stages and _loop_needs_lockstep(
            program(False).lower(state, others, counts, starts))
      return program(bool(self._lockstep))(state, others, counts, starts)

    run.lower = lambda *a: program(bool(self._lockstep)).lower(*a)
    return run


def _concreteness_error(static: StaticArgs, scalars: list, args: tuple, kwargs: dict,
                        error: BaseException) -> TraceError:
  """The error for a trace that needed a Python value where it had a traced one, and no argument left to bind
  static: the call's Python ``int``/``bool`` arguments that are not static, and how to make one static."""
  named = ", ".join(f"argument {static.describe(k)} = {args[k] if isinstance(k, int) else kwargs[k]!r}"
                    for k in scalars)
  if static.jitted:
    fix = ("name the argument it comes from in the step's jax.jit (or nnx.jit) static_argnums/static_argnames, as "
           "jax.jit alone would need")
  else:
    fix = "name the argument it comes from in parallelize(..., static_argnums=..., static_argnames=...)"
  while error.__cause__ is not None:
    error = error.__cause__
  said = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
  return TraceError("the step uses a traced value as a Python value (a shape or a Python branch)"
                    + (f"; its Python int/bool arguments that are traced: {named}" if named else "")
                    + f". To bind an argument as a hashable Python value, {fix}. JAX: {said}")


def _compiler_options(plan: Plan, mesh: Any) -> dict[str, Any] | None:
  """XLA options the plan needs: on GPUs, an overlapped reduction needs the latency-hiding scheduler to move each
  gradient's all-reduce start up into the last microbatch's backward pass."""
  if plan.overlap_reduction and mesh.devices.flat[0].platform == "gpu":
    return {"xla_gpu_enable_latency_hiding_scheduler": True}
  return None


# Collectives whose CPU/GPU rendezvous can span every device of the program,
# not just the participating pairs: inside a loop with per-device trip counts
# they would deadlock or pair up the wrong iterations.
_GLOBAL_RENDEZVOUS = ("collective-permute", "all-to-all", "ragged-all-to-all")


def _loop_needs_lockstep(lowered: Any) -> bool:
  """Whether the compiled microbatch loop holds a collective that needs lockstep."""
  return jx.loop_body_holds(lowered, _GLOBAL_RENDEZVOUS)


def parallelize(fn: Callable[..., Any] | None = None, *, cluster: Cluster | None = None, plan: Any = "auto",
                global_batch: int, microbatch: int | None = None, donate_state: bool = True,
                specs: Any = None, example_batch: Any = None, batch_argnums: Any = None,
                batch_stats: str = "local", grad_reduce_dtype: str = "float32", axis_name: Any = None,
                group_plans: bool = True, static_argnums: Any = None, static_argnames: Any = None):
  """Runs a single-device train step, unchanged, on a (mixed) cluster.

  Usable as ``@hetspmd.parallelize(cluster=..., global_batch=256)``. The
  step is written as for one device: functional ``train_step(state, batch,
  ...) -> (state, metrics)`` (a Linen ``TrainState``, ``jax.value_and_grad``
  or ``jax.grad`` over a closure of the batch, ``functools.partial``-bound
  configuration, already ``jax.jit``-ed or not), or NNX in place
  ``train_step(model, optimizer, metrics, batch, ...)`` (``nnx.jit``-ed or
  not, or bound by ``nnx.cached_partial``), its objects updated after each
  call. Call it with the global batch; the microbatch program is derived
  from its jaxpr (:mod:`hetspmd.passes.batch_axis.analysis`). A step that
  mixes examples in a way that does not split into microbatches (a sort
  along the batch) is refused, naming the primitive and the Flax module.

  Arguments go as under ``jax.jit``: the state (NNX objects, or the first argument beside the batch with
  arrays) and the batch (``batch_argnums``, or the arguments whose arrays lead with ``global_batch``) are
  placed; other arrays and Python numbers are traced; static arguments (the step's own ``jax.jit``/``nnx.jit``
  ones, ``static_argnums``/``static_argnames``, an unjitted step's ``int``/``bool`` its trace needs as a value:
  ``explain()``) and other non-array leaves (a config) are bound in: a new value, new programs.

  Args:
    fn: the single-device step.
    cluster: the devices, bound to JAX (``Cluster.from_devices``, ``.emulate``), or a preset, TOML file or
      spec string for ``jax.devices()`` in order; default ``Cluster.from_devices(jax.devices())``.
    plan: ``"search"``, ``"auto"``, a :class:`Plan`, a :class:`GroupPlan`
      (:mod:`hetspmd.runtime.grouped`: the global batch on every process), or
      a path to either's JSON file. ``"search"`` runs :func:`hetspmd.search`
      on the state and ``example_batch`` (or the first call's batch) and takes
      the best plan, or the best group plan where it is priced at least
      :data:`~hetspmd.planner.ranking.GROUP_PLAN_MARGIN` times faster and runs
      the step (``explain()`` says which). ``"auto"`` skips the search: every
      device on the data axis, microbatches in proportion to peak FLOP/s.
    global_batch: examples per step.
    microbatch: examples per microbatch (``"auto"`` plans only).
    donate_state: let XLA reuse the input state's buffers for the new state
      the step returns (none if it returns none; under group state shares,
      only the optimizer state's).
    specs: ``{path suffix: PartitionSpec}`` to keep for the leaves they match
      (``"auto"`` and ``"search"`` plans), e.g. ``hetspmd.annotated_specs(params,
      rules)`` to respect a model's own sharding annotations.
    example_batch: for ``plan="search"``: the batch's structure, as arrays or
      ``jax.ShapeDtypeStruct``s with any leading batch size.
    batch_argnums: the positional argument(s) holding the batch (counted
      among the call's own arguments, after any ``nnx.cached_partial``
      binds); default every argument all of whose arrays lead with
      ``global_batch``.
    batch_stats: ``"local"``: statistics over the batch that normalise
      activations (BatchNorm in training) are each microbatch's own, as
      per-device BatchNorm in data-parallel training, and the new running
      averages the mean of the microbatches'; ``"exact"``: the global
      batch's, each computed in an extra loop over the microbatches.
    grad_reduce_dtype: the dtype gradients cross the data axis in (``"auto"``
      and ``"search"`` plans; a given plan carries its own): ``"float32"``
      (exact), ``"bfloat16"`` (half the bytes; each element within a few
      units of bfloat16's roundoff of the sum of the positions' magnitudes),
      or ``"search"`` (``plan="search"`` only: the search picks float32 or
      bfloat16 per plan, by cost). Accumulation over microbatches stays
      float32 either way. ``"search"`` plans overlap the reduction with each
      position's last microbatch.
    axis_name: a ``jax.pmap``-style step's collective axis name(s)
      (``lax.pmean(grads, 'batch')``); default: found from the step. It runs
      as the one replica of the global batch, so its collectives mean "over
      the global batch" under any plan (``lax.axis_index`` is 0; see
      :mod:`hetspmd.passes.frontend.named_axes`).
    group_plans: ``False``: ``plan="search"`` takes single programs only.
    static_argnums, static_argnames: as ``jax.jit``'s (counted as ``batch_argnums``).
  """
  _check_options(plan, global_batch, microbatch, batch_stats, grad_reduce_dtype)
  _check_flags(donate_state=donate_state, group_plans=group_plans)
  wrap = functools.partial(_parallel_step, batch_argnums, (static_argnums, static_argnames), dict(
      cluster=_bound_cluster(cluster), requested_plan=plan, global_batch=global_batch, microbatch=microbatch,
      donate_state=donate_state, specs=specs, example_batch=example_batch, batch_stats=batch_stats,
      grad_reduce_dtype=grad_reduce_dtype, axis_name=named_axes.axis_names(axis_name), group_plans=group_plans))
  return wrap if fn is None else wrap(fn)


def _parallel_step(batch_argnums: Any, static: tuple, options: dict, f: Callable[..., Any]) -> ParallelStep:
  """``f`` bound to ``parallelize``'s ``options``: an ``nnx.cached_partial``'s objects unbound, the batch and
  static arguments' positions counted after them."""
  if not callable(f):
    raise InvalidValueError(f"parallelize() needs a callable train step, got {f!r}")
  f, bound = unbound(f)
  return ParallelStep(f, **options, batch_argnums=_batch_argnums(batch_argnums, len(bound)), bound=bound,
                      static=StaticArgs.of(f, *static, len(bound)))


def _batch_argnums(batch_argnums: Any, bound: int) -> tuple[int, ...] | None:
  """``batch_argnums`` (an int, a sequence, or None) as a tuple counted among all the step's arguments, after
  the ``bound`` ones ``nnx.cached_partial`` binds."""
  if batch_argnums is None:
    return None
  return tuple(i + bound for i in ((batch_argnums,) if isinstance(batch_argnums, int) else batch_argnums))


def _check_flags(**flags: Any) -> None:
  for name, value in flags.items():
    if not isinstance(value, (bool, np.bool_)):
      raise InvalidValueError(f"{name} must be True or False, got {value!r}")


def _bound_cluster(cluster: Any) -> Cluster | None:
  """``parallelize``'s ``cluster``: a :class:`Cluster`, or a preset name, cluster TOML file or spec
  (:meth:`Cluster.resolve`) standing for JAX's devices in order, as :meth:`Cluster.emulate` binds them."""
  if cluster is None or isinstance(cluster, Cluster):
    return cluster
  if not isinstance(cluster, str):
    raise InvalidValueError(f"cluster must be a Cluster, or a preset name, cluster TOML file or spec such as "
                            f"'4xV100-32GB+4xP100-16GB', got {cluster!r}")
  virtual = Cluster.resolve(cluster)
  if virtual.jax_device_ids is not None:  # a measured cluster file: its own devices
    return virtual
  devices = jax.devices()
  if virtual.num_devices != len(devices):
    raise InvalidValueError(f"cluster {cluster!r} has {virtual.num_devices} devices but JAX sees {len(devices)}: "
                            f"give one with {len(devices)}, or a Cluster.emulate(devices, kinds) of some of them")
  return virtual.replace(jax_device_ids=tuple(d.id for d in devices))


def _check_plan_kinds(plan: Plan | GroupPlan, cluster: Cluster | None) -> None:
  """Refuses a plan made for other device kinds than ``cluster``'s at the plan's devices."""
  if not isinstance(plan, Plan) or not plan.device_kinds or cluster is None or cluster.jax_device_ids is None:
    return
  kind_of = dict(zip(cluster.jax_device_ids, (d.spec.name for d in cluster.devices)))
  here = tuple(kind_of.get(i, "absent") for i in plan.device_ids)
  if here != plan.device_kinds:
    count = lambda kinds: ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))
    raise HetSpmdError(f"the plan was made for devices {count(plan.device_kinds)}, but the cluster's devices "
                       f"{list(plan.device_ids)} are {count(here)}: make a plan for this cluster (plan='search' or "
                       "hetspmd search --cluster ...), or pass the cluster the plan was made for")


def _check_plan_value(plan: Any) -> None:
  """``plan`` is 'auto', 'search', a Plan, a GroupPlan or a path to an existing plan file."""
  if isinstance(plan, (Plan, GroupPlan)) or (isinstance(plan, str) and plan in ("auto", "search")):
    return
  valid = "'auto', 'search', a Plan, a GroupPlan, or the path of an existing plan JSON file"
  if not isinstance(plan, (str, os.PathLike)):
    raise InvalidValueError(f"plan must be {valid}, got {plan!r}")
  path = pathlib.Path(plan)
  if not path.is_file():
    close = closest(plan, ("auto", "search"))
    what = "a directory" if path.is_dir() else "no such file"
    raise InvalidValueError(f"plan={str(plan)!r} is not a plan value and {what}: plan must be {valid}"
                            + (f"; did you mean plan={close!r}?" if close else ""))


def _check_options(plan: Any, global_batch: int, microbatch: int | None, batch_stats: str,
                   grad_reduce_dtype: str) -> None:
  """``parallelize``'s options, each checked before any trace: what was given and what would be valid."""
  if not isinstance(global_batch, int) or global_batch < 1:
    raise InvalidValueError(f"global_batch must be a positive integer, got {global_batch!r}")
  _check_plan_value(plan)
  if microbatch is not None and (not isinstance(microbatch, int) or microbatch < 1 or global_batch % microbatch):
    raise InvalidValueError(f"microbatch must be a positive divisor of the global batch {global_batch}, "
                            f"got {microbatch!r}")
  if grad_reduce_dtype not in ("float32", "bfloat16", "search"):
    raise InvalidValueError(f"grad_reduce_dtype must be 'float32', 'bfloat16' or 'search', got {grad_reduce_dtype!r}")
  if grad_reduce_dtype == "search" and plan != "search":
    raise InvalidValueError("grad_reduce_dtype='search' lets the search choose: it needs plan='search'")
  if grad_reduce_dtype != "float32" and not (isinstance(plan, str) and plan in ("auto", "search")):
    raise InvalidValueError(f"grad_reduce_dtype={grad_reduce_dtype!r} applies to plan='auto' or 'search'; a given "
                            "plan carries its own (Plan.replace(grad_reduce_dtype=...))")
  if batch_stats not in ("local", "exact"):
    raise InvalidValueError(f"batch_stats must be 'local' (each microbatch normalises with its own statistics, "
                            f"as per-device BatchNorm) or 'exact' (the global batch's), got {batch_stats!r}")
