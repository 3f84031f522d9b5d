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
import inspect
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from hetspmd._pytree import leaves_with_paths
from hetspmd.hardware.cluster import Cluster
from hetspmd.errors import HetSpmdError, InvalidValueError
from hetspmd.autodiff import remat_policy
from hetspmd.passes import _jax_adapter as jx
from hetspmd.plan.value import GRAD_REDUCE_DTYPES, Plan, auto_state_specs, plan_for


class ShardedBatch(NamedTuple):
  """A step's batch on the devices: padded microbatch buffers and counts."""

  data: Any    # pytree of [positions * max_count, microbatch, ...] arrays, sharded over data
  counts: Any  # int32[positions], sharded over data


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

  def __post_init__(self):
    functools.update_wrapper(self, self.fn)

  # --- plan ------------------------------------------------------------------

  @property
  def plan(self) -> Plan:
    """The plan; an ``"auto"`` plan exists once the state has been seen."""
    return self._resolve(None)

  def _resolve(self, state: Any, search_fn: Callable[[Any, Any], Any] | None = None, batch: Any = None) -> Plan:
    if self._plan is None:
      if state is None and self.requested_plan in ("auto", "search"):
        raise HetSpmdError("the plan is made from the train state: call .shard_state(state) (or the step) first")
      requested = self.requested_plan
      if isinstance(requested, str) and requested not in ("auto", "search"):
        requested = Plan.load(requested)
      if isinstance(requested, Plan):
        plan = requested
      elif requested == "auto":
        cluster = self.cluster or Cluster.from_devices(jax.devices())
        plan = plan_for(cluster, state, global_batch=self.global_batch, microbatch=self.microbatch,
                        specs=self.specs, grad_reduce_dtype=self.grad_reduce_dtype)
      elif requested == "search":
        plan = self._search(self.cluster or Cluster.from_devices(jax.devices()), state, search_fn, batch)
      else:
        raise InvalidValueError(
            f"plan must be 'search', 'auto', a Plan or a path to a plan JSON file, got {requested!r}")
      if plan.global_batch != self.global_batch:
        raise HetSpmdError(f"the plan is for a global batch of {plan.global_batch}; parallelize() was given "
                           f"global_batch={self.global_batch}")
      self._mesh = plan.mesh()
      self._plan = plan
    if state is not None:
      self._plan.check_state(state)
    return self._plan

  def _search(self, cluster: Cluster, state: Any, search_fn: Callable[[Any, Any], Any] | None, batch: Any
              ) -> Plan:
    from hetspmd.autodiff import recording_calls
    from hetspmd.planner.ranking import SEARCHED_REMAT, plan_from, profile_step, search

    batch = self.example_batch if self.example_batch is not None else batch
    if batch is None:
      raise HetSpmdError("plan='search' traces the step on a batch: pass parallelize(..., example_batch=...) or "
                         "call the step (before shard_state) so that its first batch is used")
    with recording_calls() as calls:  # the step's remat policy can only be applied by hetspmd.value_and_grad
      profile = profile_step(search_fn or self.fn, state, batch)
    fn = search_fn or self.fn
    result = search(cluster, profile, self.global_batch, top=1,
                    remat_policies=SEARCHED_REMAT if calls else ("none",),
                    recompute=self._recompute(fn, state, batch),
                    grad_reduce_dtypes=(GRAD_REDUCE_DTYPES if self.grad_reduce_dtype == "search"
                                        else (self.grad_reduce_dtype,)),
                    fuse_overlap=not self._per_microbatch_statistics(fn, state, batch))
    plan = plan_from(result.plans[0], cluster, state, result.ideal_throughput)
    if self.specs:
      chosen = auto_state_specs(state, plan.axis_names, plan.mesh_shape, plan.zero_stage, self.specs,
                                model_specs=dict(plan.state_specs), zero_shards=plan.zero_shards)
      plan = plan.replace(state_specs=chosen)
    return plan

  def _recompute(self, fn: Callable[[Any, Any], Any], state: Any, batch: Any) -> float:
    """With exact batch statistics, the extra forward work of their loops (1.0 otherwise)."""
    if self.batch_stats != "exact":
      return 1.0
    from hetspmd.lowering import weighted as lowering

    analysis, inputs = _profile_analysis(fn, state, batch, "exact")
    return lowering.recompute_factor(analysis, inputs)

  def _per_microbatch_statistics(self, fn: Callable[[Any, Any], Any], state: Any, batch: Any) -> bool:
    """Whether the step normalises by statistics of each microbatch (BatchNorm, ``batch_stats="local"``),
    which a fused overlapped pass would compute over several microbatches at once."""
    if self.batch_stats != "local":
      return False
    analysis, _ = _profile_analysis(fn, state, batch, "local")
    return any(c.local for c in analysis.cuts)

  # --- placing data ----------------------------------------------------------------

  def shard_state(self, state: Any) -> Any:
    """Places ``state`` on the devices with the plan's shardings."""
    plan = self._resolve(state)
    return jax.device_put(state, plan.state_shardings(self._mesh, state))

  def state_shardings(self, state: Any) -> Any:
    return self._resolve(state).state_shardings(self._mesh, state)

  def shard_batch(self, batch: Any) -> ShardedBatch:
    """Host batch → padded per-device microbatch buffers and counts.

    With one process, ``batch`` is the global batch (leading axis
    ``global_batch``). With several, each process passes only the examples
    of the data positions it hosts, in position order.
    """
    plan = self._resolve(None)
    mesh = self._mesh
    positions = _local_positions(mesh, plan)
    expected = sum(plan.examples_per_position()[i] for i in positions)
    offsets = {}
    offset = 0
    for i in positions:
      offsets[i] = offset
      offset += plan.examples_per_position()[i]
    sharding = NamedSharding(mesh, P(plan.data_axis))
    grid = mesh.devices

    def buffer(path: str, leaf: Any) -> jax.Array:
      leaf = np.asarray(leaf)
      if leaf.ndim < 1 or leaf.shape[0] != expected:
        raise HetSpmdError(
            f"batch leaf {path or '<root>'!r} has shape {leaf.shape}; expected a leading axis of {expected} "
            f"({'the global batch' if expected == plan.global_batch else 'this process’s examples'}"
            f" = {[plan.examples_per_position()[i] for i in positions]} per data position)")
      rows = leaf.shape[1:]
      arrays = []
      for i in range(plan.data_size):
        if i not in offsets:
          continue
        block = np.zeros((plan.max_count, plan.microbatch) + rows, leaf.dtype)
        n = plan.examples_per_position()[i]
        block.reshape((-1,) + rows)[:n] = leaf[offsets[i]:offsets[i] + n]
        arrays += [jax.device_put(block, d) for d in grid[i].ravel() if d.process_index == jax.process_index()]
      shape = (plan.data_size * plan.max_count, plan.microbatch) + rows
      return jax.make_array_from_single_device_arrays(shape, sharding, arrays)

    leaves = leaves_with_paths(batch)
    data = jax.tree.unflatten(jax.tree.structure(batch), [buffer(p, x) for p, x in leaves])
    count_arrays = [jax.device_put(np.array([plan.microbatch_counts[i]], np.int32), d)
                    for i in range(plan.data_size) if i in offsets
                    for d in grid[i].ravel() if d.process_index == jax.process_index()]
    counts = jax.make_array_from_single_device_arrays((plan.data_size,), sharding, count_arrays)
    return ShardedBatch(data, counts)

  # --- running -------------------------------------------------------------------

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    # The hot path: split NNX objects, place the batch, run the cached program, write NNX objects back.
    call = self._bind_call(args, kwargs)
    compiled = self._executable(call)
    outputs = compiled(*call.dynamic, call.batch.counts, self._starts())
    return call.finish(outputs)

  def lower(self, *args: Any, **kwargs: Any):
    """The ``jax.stages.Lowered`` program for these arguments."""
    call = self._bind_call(args, kwargs)
    return self._executable(call).lower(*call.dynamic, call.batch.counts, self._starts())

  def explain(self) -> str:
    if self.plan.stages:
      mode = (f"pipeline stages of {list(self.plan.stages)} layers along 'stage', lockstep GPipe ticks (one "
              "ppermute each), every stage running its own layers of the step's layer scan")
    elif self._lockstep:
      mode = ("microbatch accumulation in lockstep: every position runs the largest count, padding masked "
              "(XLA placed a collective-permute or all-to-all inside the loop)")
    else:
      mode = "weighted microbatch accumulation (per-device trip counts)"
    lines = [self.plan.summary(), f"  execution: {mode}"]
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
      if self.plan.remat != "none" and not any(d is not None and d.body is not None and
                                               jx.primitive_name(e) in ("remat2", "checkpoint")
                                               for e, d in zip(analysis.jaxpr.jaxpr.eqns, analysis.decisions)):
        lines.append(f"  note: the plan's remat policy {self.plan.remat!r} did not reach the step (it applies "
                     "through hetspmd.value_and_grad)")
    return "\n".join(lines)

  def _starts(self):
    plan = self.plan
    if self._starts_array is None:
      starts = np.concatenate([[0], np.cumsum(plan.examples_per_position())[:-1]]).astype(np.int32)
      self._starts_array = _positions_array(self._mesh, plan, starts)
    return self._starts_array

  def _bind_call(self, args: tuple, kwargs: dict) -> "_Call":
    return _Call.bind(self, self.bound + args, kwargs)

  def _executable(self, call: "_Call"):
    key = call.key
    if key not in self._programs:
      self._programs[key] = self._build(call)
    return self._programs[key]

  def _build(self, call: "_Call"):
    from hetspmd.lowering import weighted as lowering
    from hetspmd.passes.batch_axis.analysis import analyse

    plan, mesh = self.plan, self._mesh
    state_shardings = plan.state_shardings(mesh, call.state)  # checks the state against the plan first
    with remat_policy(plan.remat):
      closed, out_tree = call.trace(plan.global_batch)
    analysis = analyse(closed, call.batch_inputs, plan.global_batch, batch_stats=self.batch_stats,
                             float_state_inputs=call.float_state_inputs)
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


def _compiler_options(plan: Plan, mesh: Any) -> dict[str, Any] | None:
  """XLA options the plan needs: on GPUs, an overlapped reduction needs the latency-hiding scheduler to move each
  gradient's all-reduce start up into the last microbatch's backward pass."""
  if plan.overlap_reduction and mesh.devices.flat[0].platform == "gpu":
    return {"xla_gpu_enable_latency_hiding_scheduler": True}
  return None


def _is_graph_node(x: Any) -> bool:
  from flax import nnx

  return nnx.graph.is_graph_node(x)


def _is_dynamic(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, bool, int, float, complex))


def _leading(tree: Any) -> list[int | None]:
  return [np.shape(x)[0] if np.ndim(x) >= 1 else None for x in jax.tree.leaves(tree) if _is_dynamic(x)]


@dataclasses.dataclass
class _Call:
  """One call's arguments, seen as ``pure(state, batch, rest)``: the train state (a functional step's state
  argument, or the NNX state of its graph objects), the batch arguments, and everything else."""

  step: "ParallelStep"
  args: tuple
  kwargs: dict
  graph_args: tuple[int, ...]
  batch_argnums: tuple[int, ...]
  state_argnum: int | None
  graphdef: Any
  state: Any
  batch: ShardedBatch
  rest: tuple
  treedef: Any = None
  static: tuple = ()
  key: Any = None

  @classmethod
  def bind(cls, step: "ParallelStep", args: tuple, kwargs: dict) -> "_Call":
    from flax import nnx

    graph_args = tuple(i for i, a in enumerate(args) if _is_graph_node(a))
    batch_argnums = step.batch_argnums if step.batch_argnums is not None else _find_batch(step, args, graph_args)
    for i in batch_argnums:
      if i >= len(args) or i in graph_args:
        raise InvalidValueError(f"batch_argnums={batch_argnums} names argument {i}, but the step got "
                                f"{len(args)} positional argument(s)" + (" and that one is an NNX object"
                                                                         if i in graph_args else ""))
    graphdef, state, state_argnum = None, None, None
    if graph_args:
      graphdef, state = nnx.split(tuple(args[i] for i in graph_args))
    else:
      candidates = [i for i in range(len(args)) if i not in batch_argnums and _leading(args[i])]
      if not candidates:
        raise HetSpmdError("the train step got no state: pass the train state (a pytree of arrays such as a "
                           "flax TrainState, or NNX objects) as an argument beside the batch")
      state_argnum = candidates[0]
      state = args[state_argnum]
    rest = tuple(a for i, a in enumerate(args) if i not in batch_argnums and i not in graph_args and i != state_argnum)
    batch_args = tuple(args[i] for i in batch_argnums)
    if step._plan is None:
      search_fn = _state_batch_function(step.fn, args, kwargs, graph_args, graphdef, batch_argnums, state_argnum)
      step._resolve(state, search_fn, batch_args[0] if len(batch_args) == 1 else batch_args)
      if graph_args:  # NNX objects are placed on the devices in place, as nnx.jit would leave them
        state = jax.device_put(state, step.plan.state_shardings(step._mesh, state))
        nnx.update(tuple(args[i] for i in graph_args), state)
    if len(batch_args) == 1 and isinstance(batch_args[0], ShardedBatch):  # placed already: one batch argument
      sharded = ShardedBatch((batch_args[0].data,), batch_args[0].counts)
    else:
      sharded = step.shard_batch(batch_args)
    call = cls(step, args, kwargs, graph_args, tuple(batch_argnums), state_argnum, graphdef, state, sharded,
               rest)
    leaves, call.treedef = jax.tree.flatten((state, sharded.data, rest, kwargs))
    call.static = tuple((i, x) for i, x in enumerate(leaves) if not _is_dynamic(x))
    call._dynamic = [x for x in leaves if _is_dynamic(x)]
    call._n_state = sum(1 for x in leaves[:len(jax.tree.leaves(state))] if _is_dynamic(x))
    call.key = (call.treedef, tuple(_aval(x) for x in call._dynamic), _hashable(call.static), graphdef)
    return call

  @property
  def dynamic(self) -> tuple[list, list]:
    return self._dynamic[:self._n_state], self._dynamic[self._n_state:]

  @property
  def batch_inputs(self) -> tuple[int, ...]:
    n_batch = len(jax.tree.leaves(self.batch.data))
    return tuple(range(self._n_state, self._n_state + n_batch))

  @property
  def float_state_inputs(self) -> tuple[int, ...]:
    return tuple(i for i, x in enumerate(self._dynamic[:self._n_state])
                 if jnp.issubdtype(_dtype(x), jnp.floating))

  def inputs(self, dynamic: tuple[list, list]) -> list:
    return list(dynamic[0]) + list(dynamic[1])

  def _pure(self):
    """``flat dynamic leaves -> outputs``: the user's step as a function of arrays."""
    from flax import nnx

    treedef, static, fn = self.treedef, dict(self.static), self.step.fn
    graph_args, batch_argnums, state_argnum, graphdef = (self.graph_args, self.batch_argnums, self.state_argnum,
                                                         self.graphdef)
    n_args = len(self.args)

    def pure(*dynamic):
      it = iter(dynamic)
      leaves = [static[i] if i in static else next(it) for i in range(treedef.num_leaves)]
      state, batch, rest, kwargs = jax.tree.unflatten(treedef, leaves)
      args: list = [None] * n_args
      for i, b in zip(batch_argnums, batch):
        args[i] = b
      others = iter(rest)
      objects = nnx.merge(graphdef, state) if graph_args else None
      for i in range(n_args):
        if i in batch_argnums:
          continue
        if i in graph_args:
          args[i] = objects[graph_args.index(i)]
        elif i == state_argnum:
          args[i] = state
        else:
          args[i] = next(others)
      out = fn(*args, **kwargs)
      if graph_args:
        return nnx.state(objects), out
      return out

    return pure

  def trace(self, global_batch: int):
    """The step's closed jaxpr at the global batch, and its output tree."""
    abstract = []
    batch_ids = set(self.batch_inputs)
    for i, x in enumerate(self._dynamic):
      shape, dtype = np.shape(x), _dtype(x)
      if i in batch_ids:  # buffers [positions * max_count, microbatch, ...] stand for [global batch, ...]
        shape = (global_batch,) + tuple(shape[2:])
      abstract.append(jax.ShapeDtypeStruct(shape, dtype, weak_type=isinstance(x, (int, float, bool, complex))))
    closed, shapes = jax.make_jaxpr(self._pure(), return_shape=True)(*abstract)
    return closed, jax.tree.structure(shapes)

  def returns_state(self, out_tree: Any, closed: Any) -> bool:
    """Whether the step hands back a new state, whose buffers may then be the old state's: NNX objects, or a
    first output shaped like the state that is not its gradient (made by the backward pass). A step returning
    only gradients (``grads, loss = apply_model(state, ...)``, then an update of its own) must leave the state
    it was given alive."""
    if self.graph_args:
      return True
    outputs = jax.tree.unflatten(out_tree, list(range(out_tree.num_leaves)))
    state = jax.tree.structure(self.state)
    if jax.tree.structure(outputs) == state:
      first = jax.tree.leaves(outputs)
    elif isinstance(outputs, tuple) and outputs and jax.tree.structure(outputs[0]) == state:
      first = jax.tree.leaves(outputs[0])
    else:
      return False
    producer = {v: e for e in closed.jaxpr.eqns for v in e.outvars}
    made = [producer.get(closed.jaxpr.outvars[i]) for i in first]
    return not all(e is not None and jx.phase(e) == "backward" for e in made)

  def constrain(self, outputs: Any, state_shardings: Any) -> Any:
    """The new state leaves of ``outputs`` held to the plan's shardings."""
    if self.graph_args:
      return jax.lax.with_sharding_constraint(outputs[0], state_shardings), outputs[1]
    if isinstance(outputs, tuple) and outputs and jax.tree.structure(outputs[0]) == jax.tree.structure(self.state):
      return (jax.lax.with_sharding_constraint(outputs[0], state_shardings),) + tuple(outputs[1:])
    return outputs

  def finish(self, outputs: Any) -> Any:
    from flax import nnx

    if self.graph_args:
      new_state, out = outputs
      nnx.update(tuple(self.args[i] for i in self.graph_args), new_state)
      return out
    return outputs


def _dtype(x: Any) -> Any:
  dtype = getattr(x, "dtype", None)
  return dtype if dtype is not None else np.asarray(x).dtype


def _state_batch_function(fn, args, kwargs, graph_args, graphdef, batch_argnums, state_argnum):
  """The step as ``f(state, batch)`` for the search's trace, its other arguments as given."""
  from flax import nnx

  def f(state, batch):
    batch = (batch,) if len(batch_argnums) == 1 else batch
    call = list(args)
    for i, b in zip(batch_argnums, batch):
      call[i] = b
    if graph_args:
      objects = nnx.merge(graphdef, state)
      for k, i in enumerate(graph_args):
        call[i] = objects[k]
      out = fn(*call, **kwargs)
      return nnx.state(objects), out
    call[state_argnum] = state
    return fn(*call, **kwargs)

  return f


def _aval(x: Any) -> Any:
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return (type(x).__name__,)
  return (tuple(np.shape(x)), str(dtype), getattr(x, "weak_type", False))


def _hashable(static: tuple) -> Any:
  try:
    hash(static)
    return static
  except TypeError:
    return tuple((i, id(x)) for i, x in static)


def _find_batch(step: "ParallelStep", args: tuple, graph_args: tuple[int, ...]) -> tuple[int, ...]:
  """The positional arguments whose every array leaf leads with the batch (or are a ShardedBatch)."""
  expected = {step.global_batch}
  if step._plan is not None and jax.process_count() > 1:
    positions = _local_positions(step._mesh, step._plan)
    expected = {sum(step._plan.examples_per_position()[i] for i in positions)}
  found = []
  for i, a in enumerate(args):
    if i in graph_args:
      continue
    if isinstance(a, ShardedBatch):
      return (i,)
    leading = _leading(a)
    if leading and all(n in expected for n in leading):
      found.append(i)
  if not found:
    described = ", ".join(f"argument {i}: leading dims {sorted(set(map(str, _leading(a))))[:4]}"
                          for i, a in enumerate(args) if i not in graph_args)
    raise HetSpmdError(f"no argument of the step is a batch of {step.global_batch} examples (every array with a "
                       f"leading axis of {step.global_batch}); got {described or 'no array arguments'}. Pass "
                       "the global batch, or name it with parallelize(..., batch_argnums=(i,))")
  return tuple(found)


def _positions_array(mesh: Any, plan: Plan, values: np.ndarray) -> jax.Array:
  """``int32[positions]`` sharded over ``data``, one value per position."""
  grid = mesh.devices
  arrays = [jax.device_put(np.array([values[i]], np.int32), d) for i in range(plan.data_size)
            for d in grid[i].ravel() if d.process_index == jax.process_index()]
  return jax.make_array_from_single_device_arrays((plan.data_size,), NamedSharding(mesh, P(plan.data_axis)), arrays)


# Collectives whose CPU/GPU rendezvous can span every device of the program,
# not just the participating pairs: inside a loop with per-device trip counts
# they would deadlock or pair up the wrong iterations.
_GLOBAL_RENDEZVOUS = ("collective-permute", "all-to-all", "ragged-all-to-all")


def _profile_analysis(fn: Callable[[Any, Any], Any], state: Any, batch: Any, batch_stats: str):
  """The microbatch analysis of ``fn`` traced at the profile's batch size, and its batch inputs."""
  from hetspmd.passes import _jax_adapter as jx
  from hetspmd.passes.batch_axis.analysis import analyse
  from hetspmd.planner.ranking import PROFILE_BATCHES, _with_batch

  size = PROFILE_BATCHES[-1]
  closed = jax.make_jaxpr(fn)(jx.to_abstract(state), _with_batch(batch, size))
  leaves = jax.tree.leaves(state)
  inputs = range(len(leaves), len(leaves) + len(jax.tree.leaves(batch)))
  floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(_dtype(x), jnp.floating)]  # statistics live here
  return analyse(closed, inputs, size, batch_stats=batch_stats, float_state_inputs=floats), inputs


def _loop_needs_lockstep(lowered: Any) -> bool:
  """Whether the compiled microbatch loop holds a collective that needs lockstep."""
  text = lowered.compile().as_text()
  return any(op in line and "while/body" in line for line in text.splitlines() for op in _GLOBAL_RENDEZVOUS)


def _local_positions(mesh: Any, plan: Plan) -> list[int]:
  me = jax.process_index()
  return [i for i in range(plan.data_size) if any(d.process_index == me for d in mesh.devices[i].ravel())]


def _unbound(fn: Callable[..., Any]) -> tuple[Callable[..., Any], tuple]:
  """``(f, objects)`` of ``nnx.cached_partial(f, *objects)``; ``(fn, ())`` for any other callable.

  The partial's objects are clones that hold the caller's ``Variable``s, so
  the step's updates to them reach the caller's model and optimizer.
  """
  code = getattr(fn, "__code__", None)
  if code is None or code.co_name != "cache_args_wrapper" or "flax" not in (getattr(fn, "__globals__", {})
                                                                          .get("__name__") or ""):
    return fn, ()
  free = inspect.getclosurevars(fn).nonlocals
  if "f" not in free or "cached_args" not in free:
    raise HetSpmdError("this flax version's nnx.cached_partial keeps its function and objects where hetspmd does "
                       "not look; parallelize the step itself and call it with the model and optimizer")
  return free["f"], tuple(free["cached_args"])


def parallelize(fn: Callable[..., Any] | None = None, *, cluster: Cluster | None = None, plan: Any = "auto",
                global_batch: int, microbatch: int | None = None, donate_state: bool = True,
                specs: Any = None, example_batch: Any = None, batch_argnums: Any = None,
                batch_stats: str = "local", grad_reduce_dtype: str = "float32"):
  """Runs a single-device train step, unchanged, on a (mixed) cluster.

  Usable as ``@hetspmd.parallelize(cluster=..., global_batch=256)``. The
  step is written as for one device: functional ``train_step(state, batch,
  ...) -> (state, metrics)`` (a Linen ``TrainState``, ``jax.value_and_grad``
  or ``jax.grad`` over a closure of the batch, ``functools.partial``-bound
  configuration, already ``jax.jit``-ed or not), or NNX in place
  ``train_step(model, optimizer, metrics, batch, ...)`` (``nnx.jit``-ed or
  not, or bound to its objects by ``nnx.cached_partial``), whose objects
  are updated after each call. Call it with the global
  batch; the microbatch program is derived from its jaxpr
  (:mod:`hetspmd.passes.batch_axis.analysis`). A step that mixes examples in a way
  that does not split into microbatches (a sort along the batch) is refused
  with :class:`HetSpmdError` naming the primitive and the Flax module.

  Args:
    fn: the single-device step.
    cluster: the devices, bound to JAX (``Cluster.from_devices`` or
      ``Cluster.emulate``); default ``Cluster.from_devices(jax.devices())``.
    plan: ``"search"``, ``"auto"``, a :class:`Plan`, or a path to a plan
      JSON file. ``"search"`` runs :func:`hetspmd.search` on the state and
      ``example_batch`` (or the first call's batch) when the state is first
      seen and takes the best plan. ``"auto"`` skips the search: every device
      on the data axis, each with a number of microbatches proportional to
      its peak FLOP/s.
    global_batch: examples per step.
    microbatch: examples per microbatch (``"auto"`` plans only).
    donate_state: let XLA reuse the input state's buffers for the new state
      the step returns (a step that returns no new state donates nothing).
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
      bfloat16 per plan, by cost).
      Accumulation over microbatches stays float32 either way. ``"search"``
      plans overlap the reduction with each position's last microbatch.
  """
  if not isinstance(global_batch, int) or global_batch < 1:
    raise InvalidValueError(f"global_batch must be a positive integer, got {global_batch!r}")
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

  def wrap(f: Callable[..., Any]) -> ParallelStep:
    if not callable(f):
      raise InvalidValueError(f"parallelize() needs a callable train step, got {f!r}")
    f, bound = _unbound(f)
    argnums = (batch_argnums,) if isinstance(batch_argnums, int) else (
        None if batch_argnums is None else tuple(batch_argnums))
    if argnums is not None:  # counted among the call's own arguments
      argnums = tuple(i + len(bound) for i in argnums)
    return ParallelStep(f, cluster, plan, global_batch, microbatch, donate_state, specs, example_batch,
                        batch_argnums=argnums, batch_stats=batch_stats, grad_reduce_dtype=grad_reduce_dtype,
                        bound=bound)

  return wrap if fn is None else wrap(fn)
