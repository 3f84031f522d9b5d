"""``@hetspmd.parallelize``: run a single-device train step under a plan.

The decorated ``train_step(state, batch) -> (state, metrics)`` is lowered
once per plan to one ``jax.jit`` program:

* state leaves carry the plan's ``NamedSharding``s (tensor parallel along
  ``model``, ZeRO along ``data``) in and out;
* the batch arrives as a padded microbatch buffer sharded over ``data`` plus
  each position's microbatch count (:meth:`ParallelStep.shard_batch`);
* every ``hetspmd.value_and_grad`` call in the step becomes the weighted
  gradient accumulation of :mod:`hetspmd.microbatch`; everything after it
  (the optimizer update) runs once, on the sharded state.

A step that uses plain ``jax.grad`` still runs correctly as ordinary data
parallelism over the whole global batch (no per-device weighting), with a
one-line warning.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from hetspmd._pytree import leaves_with_paths
from hetspmd.cluster import Cluster
from hetspmd.errors import HetSpmdError, InvalidValueError
from hetspmd.microbatch import _StepContext, step_context
from hetspmd.plan import Plan, auto_state_specs, plan_for


class ShardedBatch(NamedTuple):
  """A step's batch on the devices: padded microbatch buffers and counts."""

  data: Any    # pytree of [positions * max_count, microbatch, ...] arrays, sharded over data
  counts: Any  # int32[positions], sharded over data


class _NoMicrobatchGradient(Exception):
  """Raised while tracing a step that never called hetspmd.value_and_grad."""


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
  _run: Callable[..., Any] | None = None  # the jitted step, built once the plan exists
  _plain_grad: bool = False
  _lockstep: bool | None = None  # decided from the first compiled program

  def __post_init__(self):
    functools.update_wrapper(self, self.fn)

  # --- plan ------------------------------------------------------------------

  @property
  def plan(self) -> Plan:
    """The plan; an ``"auto"`` plan exists once the state has been seen."""
    return self._resolve(None)

  def _resolve(self, state: Any) -> Plan:
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
                        specs=self.specs)
      elif requested == "search":
        plan = self._search(self.cluster or Cluster.from_devices(jax.devices()), state)
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

  def _search(self, cluster: Cluster, state: Any) -> Plan:
    from hetspmd.search import plan_from, search_step

    result = search_step(self.fn, state, self.example_batch, cluster, global_batch=self.global_batch, top=1)
    plan = plan_from(result.plans[0], cluster, state, result.ideal_throughput)
    if self.specs:
      chosen = auto_state_specs(state, plan.axis_names, plan.mesh_shape, plan.zero_stage, self.specs,
                                model_specs=dict(plan.state_specs), zero_shards=plan.zero_shards)
      plan = plan.replace(state_specs=chosen)
    return plan

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

  def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
    # The hot path is jit's own: the state is checked against the plan when jit traces it, once per
    # structure and shapes, so a call adds no Python work over calling jax.jit directly.
    sharded = batch if isinstance(batch, ShardedBatch) else self.shard_batch(batch)
    return self._executable(state)(state, sharded.data, sharded.counts)

  def lower(self, state: Any, batch: Any):
    """The ``jax.stages.Lowered`` program for ``state`` and ``batch``."""
    sharded = batch if isinstance(batch, ShardedBatch) else self.shard_batch(batch)
    return self._executable(state).lower(state, sharded.data, sharded.counts)

  def explain(self) -> str:
    if self._plain_grad:
      mode = "plain data parallel (the step uses jax.grad)"
    elif self._lockstep:
      mode = ("microbatch accumulation in lockstep: every position runs the largest count, padding masked "
              "(XLA placed a collective-permute or all-to-all inside the loop)")
    else:
      mode = "weighted microbatch accumulation (per-device trip counts)"
    return f"{self.plan.summary()}\n  execution: {mode}"

  def _executable(self, state: Any):
    if self._run is None:
      self._resolve(state)
      self._run = self._build()
    return self._run

  def _build(self):
    plan = self.plan
    donate = (0,) if self.donate_state else ()
    weighted = {mode: jax.jit(self._weighted_step(mode), donate_argnums=donate) for mode in (False, True)}
    plain = jax.jit(self._plain_step(), donate_argnums=donate)

    def fall_back(use):
      out = use()  # a step that fails on the plain global batch too raises its own error here
      self._plain_grad = True
      warnings.warn(f"{getattr(self.fn, '__name__', 'train_step')} computes gradients with jax.grad, not "
                    "hetspmd.value_and_grad: running plain data parallelism over the global batch "
                    "(no per-device weighting, no microbatch accumulation)", stacklevel=4)
      return out

    def run(*args):
      if not self._plain_grad:
        try:
          if self._lockstep is None:
            self._lockstep = not plan.is_uniform and _loop_needs_lockstep(weighted[False].lower(*args))
          return weighted[self._lockstep](*args)
        except _NoMicrobatchGradient:
          return fall_back(lambda: plain(*args))
      return plain(*args)

    def lower(*args):
      if not self._plain_grad:
        try:
          return weighted[bool(self._lockstep)].lower(*args)
        except _NoMicrobatchGradient:
          return fall_back(lambda: plain.lower(*args))
      return plain.lower(*args)

    run.lower = lower
    return run

  def _weighted_step(self, lockstep: bool):
    plan, mesh, fn = self.plan, self._mesh, self.fn

    def step(state, data, counts):
      shardings = plan.state_shardings(mesh, state)  # checks the state against the plan, at trace time
      calls: list = []
      ctx = _StepContext(mesh, plan.data_axis, frozenset(id(x) for x in jax.tree.leaves(data)), counts,
                         plan.microbatch, plan.remat, (plan.data_size * plan.max_count, plan.microbatch),
                         lockstep,
                         plan.max_count if plan.is_uniform else None, calls, plan.global_batch,
                         plan.data_split_leaves(state))
      with step_context(ctx):
        try:
          new_state, metrics = fn(state, data)
        except Exception:
          # Before any hetspmd.value_and_grad call the step saw the microbatch buffers
          # ([positions * count, microbatch, ...]) as its batch; a plain jax.grad step may fail on them.
          if not calls:
            raise _NoMicrobatchGradient() from None
          raise
      if not calls:
        raise _NoMicrobatchGradient()
      return jax.lax.with_sharding_constraint(new_state, shardings), metrics

    return step

  def _plain_step(self):
    plan, mesh, fn = self.plan, self._mesh, self.fn
    valid = _valid_rows(plan)
    divisible = plan.global_batch % plan.data_size == 0

    def step(state, data, counts):
      del counts
      shardings = plan.state_shardings(mesh, state)

      def flatten(x):
        x = x.reshape((-1,) + x.shape[2:])
        if len(valid) != x.shape[0]:
          x = jnp.take(x, valid, axis=0)
        spec = P(plan.data_axis) if divisible else P()
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

      new_state, metrics = fn(state, jax.tree.map(flatten, data))
      return jax.lax.with_sharding_constraint(new_state, shardings), metrics

    return step


# Collectives whose CPU/GPU rendezvous can span every device of the program,
# not just the participating pairs: inside a loop with per-device trip counts
# they would deadlock or pair up the wrong iterations.
_GLOBAL_RENDEZVOUS = ("collective-permute", "all-to-all", "ragged-all-to-all")


def _loop_needs_lockstep(lowered: Any) -> bool:
  """Whether the compiled microbatch loop holds a collective that needs lockstep."""
  text = lowered.compile().as_text()
  return any(op in line and "while/body" in line for line in text.splitlines() for op in _GLOBAL_RENDEZVOUS)


def _valid_rows(plan: Plan) -> np.ndarray:
  """Rows of the flattened buffer that hold real examples, in global order."""
  rows = []
  per_position = plan.max_count * plan.microbatch
  for i, count in enumerate(plan.microbatch_counts):
    rows.append(np.arange(i * per_position, i * per_position + count * plan.microbatch))
  return np.concatenate(rows).astype(np.int32)


def _local_positions(mesh: Any, plan: Plan) -> list[int]:
  me = jax.process_index()
  return [i for i in range(plan.data_size) if any(d.process_index == me for d in mesh.devices[i].ravel())]


def parallelize(fn: Callable[..., Any] | None = None, *, cluster: Cluster | None = None, plan: Any = "auto",
                global_batch: int, microbatch: int | None = None, donate_state: bool = True,
                specs: Any = None, example_batch: Any = None):
  """Runs ``train_step(state, batch) -> (state, metrics)`` on a (mixed) cluster.

  Usable as ``@hetspmd.parallelize(cluster=..., global_batch=256)``.

  Args:
    fn: the single-device step; compute gradients with
      :func:`hetspmd.value_and_grad` (or :func:`hetspmd.grad`) and pass the
      batch to the loss function as an argument.
    cluster: the devices, bound to JAX (``Cluster.from_devices`` or
      ``Cluster.emulate``); default ``Cluster.from_devices(jax.devices())``.
    plan: ``"search"``, ``"auto"``, a :class:`Plan`, or a path to a plan
      JSON file. ``"search"`` runs :func:`hetspmd.search` on the state and
      ``example_batch`` when the state is first seen and takes the best plan.
      ``"auto"`` skips the search: every device on the data axis, each with
      a number of microbatches proportional to its peak FLOP/s.
    global_batch: examples per step.
    microbatch: examples per microbatch (``"auto"`` plans only).
    donate_state: let XLA reuse the input state's buffers for the output.
    specs: ``{path suffix: PartitionSpec}`` to keep for the leaves they match
      (``"auto"`` and ``"search"`` plans), e.g. ``hetspmd.annotated_specs(params,
      rules)`` to respect a model's own sharding annotations.
    example_batch: for ``plan="search"``: the batch's structure, as arrays or
      ``jax.ShapeDtypeStruct``s with any leading batch size.
  """
  if not isinstance(global_batch, int) or global_batch < 1:
    raise InvalidValueError(f"global_batch must be a positive integer, got {global_batch!r}")
  if microbatch is not None and (not isinstance(microbatch, int) or microbatch < 1 or global_batch % microbatch):
    raise InvalidValueError(f"microbatch must be a positive divisor of the global batch {global_batch}, "
                            f"got {microbatch!r}")

  if plan == "search" and example_batch is None:
    raise InvalidValueError("plan='search' needs example_batch=: the batch's structure (arrays or "
                            "jax.ShapeDtypeStructs, any leading batch size)")

  def wrap(f: Callable[..., Any]) -> ParallelStep:
    if not callable(f):
      raise InvalidValueError(f"parallelize() needs a callable train step, got {f!r}")
    return ParallelStep(f, cluster, plan, global_batch, microbatch, donate_state, specs, example_batch)

  return wrap if fn is None else wrap(fn)
