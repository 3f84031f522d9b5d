"""``@hetspmd.parallelize``: run a single-device train step, unchanged, under a plan.

The decorated step is any function a Flax user writes: functional
``train_step(state, batch, ...) -> (state, metrics)`` (a Linen
``TrainState``, ``jax.value_and_grad`` over a closure of the batch, already
wrapped in ``jax.jit`` or not) or NNX in place ``train_step(model,
optimizer, metrics, batch, rngs)``, whose graph objects are updated after
each call as ``nnx.jit`` does. The batch is the argument whose arrays lead
with ``global_batch`` examples (or ``batch_argnums=``).

The front (:class:`ParallelStep`) binds each call and resolves the plan
(``"auto"``, ``"search"``, a given one). The plan form's runner does the rest
through one interface (:class:`~hetspmd.runtime.runner.Runner`): the single
program (:mod:`hetspmd.runtime.single`) or the group programs
(:mod:`hetspmd.runtime.group_runner`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from typing import Any, Callable

import jax
import numpy as np

from hetspmd.errors import HetSpmdError, InvalidValueError, TraceError, closest
from hetspmd.hardware.calibration import Calibration
from hetspmd.hardware.cluster import Cluster
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.frontend import named_axes
from hetspmd.plan.groups import GroupPlan, is_group_plan_file
from hetspmd.plan.value import Plan
from hetspmd.planner.building import plan_for
from hetspmd.runtime.binding import Arguments, StaticArgs, positional_function, unbound
from hetspmd.runtime.group_runner import GroupRunner
from hetspmd.plan.balance import as_option
from hetspmd.runtime.placement import GroupedBatch, ShardedBatch
from hetspmd.runtime import calibrating, calibration_store
from hetspmd.runtime.layer_timing import step_or_layer
from hetspmd.runtime.rebalancing import Rebalancer
from hetspmd.runtime.runner import Runner, Trace
from hetspmd.runtime.searching import Priced, price_step, searched_plan
from hetspmd.runtime.single import SingleRunner
from hetspmd.runtime import verifying
from hetspmd.runtime.verifying import Verification


@dataclasses.dataclass
class ParallelStep:
  """A train step bound to a plan; call it like the original step.

  Build with :func:`parallelize`. ``plan`` is resolved on first use from
  the state (``plan="auto"``), or given up front. The front binds each call
  and resolves the plan; the plan form's runner (:mod:`hetspmd.runtime.runner`)
  places, runs, lowers and explains it.
  """

  fn: Callable[..., Any]
  cluster: Cluster | None
  requested_plan: Any
  global_batch: int
  microbatch: int | None
  donate_state: bool
  specs: Any = None
  example_batch: Any = None
  batch_argnums: tuple[int, ...] | None = None
  batch_stats: str = "local"
  grad_reduce_dtype: str = "float32"
  bound: tuple = ()  # NNX objects bound ahead of each call's arguments (an nnx.cached_partial's)
  axis_name: tuple[str, ...] | None = None  # the step's collective axis names (pmap style); None: found on trace
  group_plans: bool = True  # plan="search" also prices group plans and runs one priced well ahead
  static: StaticArgs = StaticArgs()  # the arguments bound as jax.jit binds static ones
  rebalancer: Rebalancer | None = None  # parallelize(..., rebalance=...): microbatches moved while training
  calibrating: Any = "auto"  # parallelize(..., calibrate=...): True, False, "auto" or a directory (calibrating.wanted)
  calibration: Calibration | None = None  # the step's measured times the search prices on (given, or measured)
  verify: Any = "auto"  # parallelize(..., verify=...): time the searched plan on its first call (verifying.wanted)
  verification: Verification | None = None  # the plans timed whole on the first call, and which runs
  _runner: Runner | None = None  # the plan form's runner, once the plan is resolved
  _note: str = ""  # the search's word on why the plan is (or is not) a group plan
  _pricing: tuple[str, ...] = ()  # what the search priced each kind's compute from (Cluster.pricing)
  _uncalibrated: str = ""  # why calibrate="auto" timed nothing (the step fits no one device, ...)

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
    return self._resolve(None).plan

  @property
  def grouped(self) -> bool:
    """Whether the step runs under a :class:`~hetspmd.plan.groups.GroupPlan` (one program per device group:
    :mod:`hetspmd.runtime.grouped`); False before the plan is resolved."""
    return self._runner is not None and self._runner.grouped

  def _resolve(self, state: Any, trace: Trace | None = None, call: tuple | None = None) -> Runner:
    """The plan form's runner, the plan resolved on ``state`` (and for ``"search"``, the step traced as
    ``trace``, and its choice timed on ``call``'s ``(args, kwargs)`` where it verifies) the first time."""
    if self._runner is None:
      runner = None
      if state is None and self.requested_plan in ("auto", "search"):
        raise HetSpmdError("the plan is made from the train state: call .shard_state(state) (or the step) first")
      requested, runtime = self.requested_plan, None
      if isinstance(requested, (str, os.PathLike)) and requested not in ("auto", "search"):
        requested = GroupPlan.load(requested) if is_group_plan_file(requested) else Plan.load(requested)
      if isinstance(requested, dict):  # a plan's to_json(), as a checkpoint (orbax's JsonRestore) gives it back
        requested = GroupPlan.from_json(requested) if "groups" in requested else Plan.from_json(requested)
      if isinstance(requested, (Plan, GroupPlan)):
        plan = requested
      elif requested == "auto":
        cluster = self.cluster or Cluster.from_devices(jax.devices())
        plan = plan_for(cluster, state, global_batch=self.global_batch, microbatch=self.microbatch,
                        specs=self.specs, grad_reduce_dtype=self.grad_reduce_dtype)
      elif requested == "search":
        cluster = self.cluster or Cluster.from_devices(jax.devices())
        if self.calibration is None and not self._uncalibrated and calibrating.wanted(self.calibrating, cluster):
          self.calibration, self._uncalibrated = calibrating.where_it_runs(self.calibrating, lambda: step_or_layer(
              lambda: calibrating.on_example(self, state, cluster), lambda: self._search_trace(trace), state, cluster,
              calibrating.sizes_for(self, cluster)))
        priced = cluster.calibrated(self.calibration)
        on, call = ("the first call", call) if call else (verifying.ON_EXAMPLES, verifying.example_call(self, state))
        checks = verifying.wanted(self.verify, self.calibration, call)
        search = lambda c: searched_plan(self, c, state, self._search_trace(trace), top=verifying.PLANS if checks else 1)
        self.calibration, searched = calibrating.searched_on_remats(self, search, call, cluster)
        priced = cluster.calibrated(self.calibration)
        self._pricing = tuple(priced.pricing())
        runtime = searched.runtime
        runner, self.verification, self._note = verifying.checked(self, searched, call, checks, on)
        plan = runner.plan if runner is not None else searched.plan
      else:
        raise InvalidValueError(
            f"plan must be 'search', 'auto', a Plan, a GroupPlan or a path to a plan JSON file, got {requested!r}")
      if plan.global_batch != self.global_batch:
        raise HetSpmdError(f"the plan is for a global batch of {plan.global_batch}; parallelize() was given "
                           f"global_batch={self.global_batch}")
      _check_plan_kinds(plan, self.cluster)
      self._runner = runner or next(r for form, r in RUNNERS.items() if isinstance(plan, form)).of(self, plan, runtime)
    if state is not None:
      self._runner.check_state(state)
    return self._runner

  def _resolve_call(self, parts: Arguments, args: tuple, kwargs: dict) -> None:
    """The plan resolved on a call's arguments (the search traces the step on them, and where calibrating,
    times it on them first); NNX objects are then placed in place, as ``nnx.jit`` would leave them."""
    from flax import nnx

    trace = Trace.of(self, parts.function(self.fn, len(args)), parts.batch, (parts.rest, kwargs), parts.graphdef)
    if self.requested_plan == "search" and self.calibration is None:
      cluster = self.cluster or Cluster.from_devices(jax.devices())
      if calibrating.wanted(self.calibrating, cluster):
        self.calibration, self._uncalibrated = calibrating.where_it_runs(self.calibrating, lambda: step_or_layer(
            lambda: calibrating.timed_whole(self, args, kwargs, cluster), lambda: self._search_trace(trace),
            parts.state, cluster, calibrating.sizes_for(self, cluster)))
    runner = self._resolve(parts.state, trace, (args, kwargs))
    if parts.graph_args:
      nnx.update(tuple(args[i] for i in parts.graph_args), runner.placed_objects(parts.state))

  def calibrate(self, *args: Any, cluster: Cluster | None = None, sizes: Any = None, remats: Any = ("none",),
                **kwargs: Any) -> Calibration:
    """The step's own times on each kind of ``cluster`` (default the step's, or JAX's devices), measured on
    these arguments (a call's: the state and a batch of any size, repeated where it has fewer examples): per
    kind and remat policy of ``remats`` (a policy timed is priced from its own times, one not timed from the
    first's and what it recomputes), seconds per microbatch at ``sizes`` (default up to three the search would
    try) and per step; where ``parallelize``'s ``calibrate`` names a directory, the one kept there for this step
    and pool where it covers them, timing nothing. Pass the result
    to ``parallelize(..., calibrate=...)`` or ``Cluster.calibrated``, or ``save`` it. Nothing is run on the
    state in place. Where the step fits no one device of a kind, one layer is timed instead (of its layer scan, or
    the forward of a numbered block where it unrolls its layers: :mod:`hetspmd.runtime.layer_timing`)."""
    cluster = cluster or self.cluster or Cluster.from_devices(jax.devices())
    sizes, remats = sizes or calibrating.sizes_for(self, cluster), calibrating.policies(remats)

    def measured(args: tuple, kwargs: dict) -> Calibration:
      parts, trace = calibrating.call_trace(self, args, kwargs)
      return step_or_layer(lambda: calibrating.timed_whole(self, args, kwargs, cluster, sizes, remats), lambda: trace,
                           parts.state, cluster, sizes)

    return self._with_static(measured, args, kwargs)

  def _search_trace(self, trace: Trace | None) -> Trace:
    """What the search traces: the call's step on ``example_batch`` where given, else on the call's batch (none:
    ``step(state, example_batch)``)."""
    if trace is None:
      if self.example_batch is None:
        raise HetSpmdError("plan='search' traces the step on a batch: pass parallelize(..., example_batch=...) or "
                           "call the step (before shard_state) so that its first batch is used")
      return self.example_trace()
    if self.example_batch is not None:
      return dataclasses.replace(trace, batch=(self.example_batch,) if len(trace.batch) == 1
                                 else tuple(self.example_batch))
    return trace

  def example_trace(self) -> Trace:
    """The step traced as ``step(state, example_batch)``, before any call."""
    f = positional_function(self.fn, 2, graph_args=(), graphdef=None, batch_argnums=(1,), state_argnum=0)
    return Trace(self.traced(f), (self.example_batch,), ((), {}))

  # --- placing data ----------------------------------------------------------------

  def shard_state(self, state: Any) -> Any:
    """Places ``state`` on the devices with the plan's shardings."""
    return self._resolve(state).shard_state(state)

  def state_shardings(self, state: Any) -> Any:
    """Where the state lives between steps (to restore a checkpoint into). Under a group plan with state
    shares, or a hybrid one, it comes from the step's trace (which leaves are optimizer state, which are held
    split): of its first call, or of ``example_batch`` for a ``step(state, batch)``."""
    return self._resolve(state).state_shardings(state)

  def shard_batch(self, batch: Any) -> ShardedBatch | GroupedBatch:
    """Host batch → padded per-device microbatch buffers and counts.

    With one process, ``batch`` is the global batch (leading axis
    ``global_batch``). With several, each process passes only its own
    examples, ``batch[step.process_examples()]``, under either plan form.
    """
    return self._resolve(None).shard_batch(batch)

  def resolve(self, *args: Any, **kwargs: Any) -> Plan | GroupPlan:
    """Makes the plan from a call's arguments without running the step, and returns it: what the first call
    would do before it runs (NNX objects are placed, as ``nnx.jit`` leaves them). The batch may be abstract
    (``jax.ShapeDtypeStruct``s leading with ``global_batch``). Across processes, a step whose plan is made from
    its call (``plan="search"`` on an NNX step) is resolved so, then fed ``batch[step.process_examples()]``."""

    def resolved(args: tuple, kwargs: dict) -> Any:
      if self._runner is None:
        self._resolve_call(Arguments.of(self, args), args, kwargs)
      return self._runner.plan

    return self._with_static(resolved, args, kwargs)

  def process_examples(self, ahead: int = 0) -> np.ndarray:
    """The global batch's examples this process passes, in the order it passes them: indices into the global
    batch, so that a loader feeds ``batch[step.process_examples()]`` (one process: every example, in order).
    The plan must be resolved: a given plan, or ``"auto"``/``"search"`` after :meth:`shard_state` (a search
    traces ``example_batch``) or :meth:`resolve`. ``ahead``: for the call that many calls after the next one
    (with ``rebalance=``, new counts are known ``lag`` calls before they run)."""
    runner = self._resolve(None)
    if self.rebalancer is None:
      return runner.process_examples()
    return self.rebalancer.process_examples(runner, ahead)

  def batch_sizes(self) -> set[int]:
    """The leading sizes this process's batch arguments may have (a plan made from the state: the global batch
    until it is made)."""
    if self._runner is None and isinstance(self.requested_plan, str) and self.requested_plan in ("auto", "search"):
      return {self.global_batch}
    return self._resolve(None).batch_sizes()

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
    if self._runner is None:
      self._resolve_call(Arguments.of(self, args), args, kwargs)
    if self.rebalancer is not None:
      self.rebalancer.before_call(self, args, kwargs)
    return self._runner.call(args, kwargs)

  @property
  def history(self) -> list[dict]:
    """With ``rebalance=``: one dict per measurement (the call, the counts in force, each kind's measured
    seconds per microbatch and per step, each position's measured compute beside the plan's prediction, and the
    counts moved to and from which call); ``[]`` without. :meth:`write_history` writes them as JSON lines."""
    return list(self.rebalancer.history) if self.rebalancer is not None else []

  def write_history(self, path: Any) -> None:
    """:attr:`history` as JSON lines (one measurement a line), for plotting."""
    if self.rebalancer is None:
      raise HetSpmdError("write_history records rebalancing: parallelize(..., rebalance=True) keeps a history")
    self.rebalancer.write_history(path)

  def price(self, cluster: Cluster, args: tuple, kwargs: dict, **options: Any) -> tuple[Priced, Any]:
    """The search over one call's arguments (arrays or abstract values: nothing is placed or run), bound as a
    call binds them, with every plan form priced (``hetspmd.search``); and the call's train state.
    ``options``: :func:`~hetspmd.runtime.searching.price_step`'s."""

    def priced(args: tuple, kwargs: dict) -> tuple[Priced, Any]:
      parts = Arguments.of(self, args)
      trace = Trace.of(self, parts.function(self.fn, len(args)), parts.batch, (parts.rest, kwargs), parts.graphdef)
      trace = dataclasses.replace(trace, rest=jax.tree.map(_placeholder, trace.rest))
      return price_step(self, cluster, parts.state, trace, every_form=True, **options), parts.state

    return self._with_static(priced, args, kwargs)

  def lower(self, *args: Any, **kwargs: Any):
    """The ``jax.stages.Lowered`` program for these arguments (a single program's plan)."""

    def lowered(args: tuple, kwargs: dict):
      if self._runner is None:
        self._resolve_call(Arguments.of(self, args), args, kwargs)
      return self._runner.lower(args, kwargs)

    return self._with_static(lowered, args, kwargs)

  def memory_analysis(self) -> dict[str, Any]:
    """Each program of the last call, by name (``program`` for a single program; ``group 0``, ``exchange``,
    ``update on device 3`` under a group plan), and XLA's ``Compiled.memory_analysis()`` of it."""
    return self._resolve(None).memory_analysis()

  def explain(self) -> str:
    notes = [f"  argument {self.static.describe(k)}, a Python value the step uses as a shape or a branch, is bound "
             "static (as jax.jit's static_argnums): each new value builds programs of its own"
             for k in self.static.inferred]
    if self.axis_name:
      names = ", ".join(repr(n) for n in self.axis_name)
      notes.append(f"  collectives over {names} (pmap style) run as the one replica of the global batch")
    if self._note:
      notes.append(f"  note: {self._note}")
    if self._uncalibrated:
      notes.append(f"  not calibrated (calibrate='auto'): {self._uncalibrated}")
    if self._pricing:
      notes += ["  the search priced compute from:"] + [f"    {line}" for line in self._pricing]
    if self.verification is not None:
      notes += self.verification.describe()
    if self.rebalancer is not None:
      notes += self.rebalancer.describe()
    return self._resolve(None).explain(notes)


RUNNERS = {Plan: SingleRunner, GroupPlan: GroupRunner}  # a plan's type -> its form's runner


def _placeholder(x: Any) -> Any:
  """An abstract argument beside the state and batch (a key, a rate) as zeros, for the search's trace to close
  over: the search reads shapes, never these values."""
  return jax.numpy.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x


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


def parallelize(fn: Callable[..., Any] | None = None, *, cluster: Cluster | None = None, plan: Any = "auto",
                global_batch: int, microbatch: int | None = None, donate_state: bool = True,
                specs: Any = None, example_batch: Any = None, batch_argnums: Any = None,
                batch_stats: str = "local", grad_reduce_dtype: str = "float32", axis_name: Any = None,
                group_plans: bool = True, static_argnums: Any = None, static_argnames: Any = None,
                rebalance: Any = None, calibrate: Any = "auto", verify: Any = "auto"):
  """Runs a single-device train step, unchanged, on a (mixed) cluster.

  Usable as ``@hetspmd.parallelize(cluster=..., global_batch=256)``. The step is written as for one device:
  functional ``train_step(state, batch, ...) -> (state, metrics)`` (a Linen ``TrainState``,
  ``jax.value_and_grad`` or ``jax.grad`` over a closure of the batch, ``functools.partial``-bound
  configuration, already ``jax.jit``-ed or not), or NNX in place ``train_step(model, optimizer, metrics, batch,
  ...)`` (``nnx.jit``-ed or not, or bound by ``nnx.cached_partial``), its objects updated after each call. Call
  it with the global batch; the microbatch program is derived from its jaxpr
  (:mod:`hetspmd.passes.batch_axis.analysis`). A step that mixes examples in a way that does not split into
  microbatches (a sort along the batch) is refused, naming the primitive and the Flax module.

  Arguments go as under ``jax.jit``: the state (NNX objects, or the first argument beside the batch with
  arrays) and the batch (``batch_argnums``, or the arguments whose arrays lead with ``global_batch``) are
  placed; other arrays and Python numbers are traced; static arguments (the step's own ``jax.jit``/``nnx.jit``
  ones, ``static_argnums``/``static_argnames``, an unjitted step's ``int``/``bool`` its trace needs as a value:
  ``explain()``) and other non-array leaves (a config) are bound in: a new value, new programs.

  Args:
    fn: the single-device step.
    cluster: the devices, bound to JAX (``Cluster.from_devices``, ``.emulate``), or a preset, TOML file or
      spec string for ``jax.devices()`` in order; default ``Cluster.from_devices(jax.devices())``.
    plan: ``"search"``, ``"auto"``, a :class:`Plan`, a :class:`GroupPlan` (:mod:`hetspmd.runtime.grouped`),
      either's JSON object (``step.plan.to_json()``, as saved beside an orbax checkpoint), or a path to either's
      JSON file. ``"search"`` runs :func:`hetspmd.search` on the state and ``example_batch`` (or the first call's
      batch) and takes the best plan, or the best group plan where it is priced at least
      :data:`~hetspmd.planner.ranking.GROUP_PLAN_MARGIN` times faster and runs the step (``explain()`` says
      which). ``"auto"`` skips the search: every device on the data axis, microbatches in proportion to peak FLOP/s.
    global_batch: examples per step.
    microbatch: examples per microbatch (``"auto"`` plans only).
    donate_state: let XLA reuse the input state's buffers for the new state the step returns (none if it
      returns none; under group state shares, only the optimizer state's).
    specs: ``{path suffix: PartitionSpec}`` to keep for the leaves they match (``"auto"`` and ``"search"``
      plans), e.g. ``hetspmd.annotated_specs(params, rules)`` to respect a model's own sharding annotations.
    example_batch: for ``plan="search"``: the batch's structure, arrays or ``ShapeDtypeStruct``s, any leading size.
    batch_argnums: the positional argument(s) holding the batch (counted among the call's own arguments, after
      any ``nnx.cached_partial`` binds); default every argument all of whose arrays lead with ``global_batch``.
    batch_stats: ``"local"``: statistics over the batch that normalise
      activations (BatchNorm in training) are each microbatch's own, as
      per-device BatchNorm in data-parallel training, and the new running
      averages the mean of the microbatches'; ``"exact"``: the global
      batch's, each computed in an extra loop over the microbatches.
    grad_reduce_dtype: the dtype gradients cross the data axis in (``"auto"`` and ``"search"`` plans; a given
      plan carries its own): ``"float32"`` (exact), ``"bfloat16"`` (half the bytes; each element within a few
      units of bfloat16's roundoff of the sum of the positions' magnitudes), or ``"search"`` (the search picks
      per plan, by cost, and overlaps the reduction with each position's last microbatch). Accumulation over
      microbatches stays float32 either way.
    axis_name: a ``jax.pmap``-style step's collective axis name(s)
      (``lax.pmean(grads, 'batch')``); default: found from the step. It runs
      as the one replica of the global batch, so its collectives mean "over
      the global batch" under any plan (``lax.axis_index`` is 0; see
      :mod:`hetspmd.passes.frontend.named_axes`).
    group_plans: ``False``: ``plan="search"`` takes single programs only. static_argnums, static_argnames: as
      ``jax.jit``'s (counted as ``batch_argnums``).
    rebalance: ``True`` or a :class:`hetspmd.Rebalance`: move a single program's microbatches while training,
      from each kind's measured time (:mod:`hetspmd.runtime.rebalancing`; ``step.history``).
    calibrate: for ``plan="search"``: time the step on each kind first and search on those times
      (:meth:`ParallelStep.calibrate`): ``True``, ``False``, ``"auto"`` (on accelerators, not CPU devices), a
      saved :class:`~hetspmd.hardware.calibration.Calibration` (or its file), or a directory: ``True``, kept
      there per step and pool and reused (:mod:`hetspmd.runtime.calibration_store`).
    verify: ``plan="search"``'s choice timed whole before it runs, its runners-up too where it misses its
      prediction by 25%, the fastest measured run (:mod:`hetspmd.runtime.verifying`, ``step.verification``):
      ``True``, ``False``, or ``"auto"``: where the search priced compute from a calibration.
  """
  _check_options(plan, global_batch, microbatch, batch_stats, grad_reduce_dtype)
  _check_flags(donate_state=donate_state, group_plans=group_plans, verify=verify)
  option = as_option(rebalance)
  given = _calibration(calibrate)
  wrap = functools.partial(_parallel_step, batch_argnums, (static_argnums, static_argnames), dict(
      rebalancer=Rebalancer(option) if option is not None else None, cluster=_bound_cluster(cluster),
      calibrating=calibrate if given is None else False, calibration=given, verify=verify,
      requested_plan=plan, global_batch=global_batch, microbatch=microbatch, donate_state=donate_state,
      specs=specs, example_batch=example_batch, batch_stats=batch_stats, grad_reduce_dtype=grad_reduce_dtype, axis_name=named_axes.axis_names(axis_name), group_plans=group_plans))
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


def _calibration(calibrate: Any) -> Calibration | None:
  """``parallelize``'s ``calibrate``: a given calibration (a value or its JSON file), else None after checking the
  option."""
  if isinstance(calibrate, Calibration):
    return calibrate
  if isinstance(calibrate, (bool, np.bool_)) or calibrate == "auto":
    return None
  if isinstance(calibrate, (str, os.PathLike)) and pathlib.Path(calibrate).expanduser().is_file():
    return Calibration.load(pathlib.Path(calibrate).expanduser())
  if calibration_store.directory_of(calibrate) is not None:
    return None
  raise InvalidValueError(f"calibrate must be True, False, 'auto', a Calibration, the path of a saved one or an "
                          f"existing directory to keep calibrations in, got {calibrate!r}")


def _check_flags(**flags: Any) -> None:
  for name, value in flags.items():
    if name == "verify" and not (isinstance(value, (bool, np.bool_)) or value == "auto"):
      raise InvalidValueError(f"verify must be True, False or 'auto' (where the search is calibrated), got {value!r}")
    if name != "verify" and not isinstance(value, (bool, np.bool_)):
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
  """Refuses a plan made for other device kinds than ``cluster``'s at the plan's devices (a plan that names its
  devices' kinds: a group plan names none)."""
  if not getattr(plan, "device_kinds", ()) or cluster is None or cluster.jax_device_ids is None:
    return
  kind_of = dict(zip(cluster.jax_device_ids, (d.spec.name for d in cluster.devices)))
  here = tuple(kind_of.get(i, "absent") for i in plan.device_ids)
  if here != plan.device_kinds:
    count = lambda kinds: ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))
    raise HetSpmdError(f"the plan was made for devices {count(plan.device_kinds)}, but the cluster's devices "
                       f"{list(plan.device_ids)} are {count(here)}: make a plan for this cluster (plan='search' or "
                       "hetspmd search --cluster ...), or pass the cluster the plan was made for")


def _check_plan_value(plan: Any) -> None:
  """``plan`` is 'auto', 'search', a Plan, a GroupPlan, a plan's JSON object or a path to an existing plan file."""
  if isinstance(plan, (Plan, GroupPlan)) or (isinstance(plan, str) and plan in ("auto", "search")):
    return
  if isinstance(plan, dict):
    try:
      GroupPlan.from_json(plan) if "groups" in plan else Plan.from_json(plan)
    except (KeyError, TypeError, ValueError) as e:
      raise InvalidValueError(f"plan is a dict but not a plan's JSON object (what step.plan.to_json() gives): "
                              f"{type(e).__name__}: {e}") from None
    return
  valid = ("'auto', 'search', a Plan, a GroupPlan, a plan's JSON object (step.plan.to_json()), or the path of an "
           "existing plan JSON file")
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
