"""A step run as a schedule of group programs (:class:`hetspmd.plan.groups.GroupPlan`).

Per call: each group's program (:func:`hetspmd.lowering.groups.group_program`,
``jax.jit`` over a mesh of the group's devices, its own microbatch size and
counts) is dispatched in turn; JAX runs them asynchronously, so the groups
compute at the same time. Their per-device partial sums are assembled into
global arrays over every device without a copy
(``jax.make_array_from_single_device_arrays``: every device's row has the
same shape), and one uniform program over every device
(:func:`hetspmd.lowering.groups.exchange_program`) combines them and runs the
rest of the step: the optimizer update on the state, replicated on every
device, and the metrics.

This first form takes functional steps, ``step(state, batch, *rest) ->
outputs`` (a Linen ``TrainState``), and NNX steps that update their objects
in place, ``step(model, optimizer, ..., batch)``; the state is replicated
(ZeRO-0) and the step has one microbatch loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hetspmd import lowering
from hetspmd.errors import HetSpmdError, InvalidValueError
from hetspmd.lowering import groups as group_lowering
from hetspmd.lowering.program import Program
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.batch_axis.analysis import analyse
from hetspmd.plan.groups import GroupPlan
from hetspmd.runtime.binding import is_graph_node

DATA = "data"


@dataclasses.dataclass
class GroupedStep:
  """A functional train step bound to a :class:`GroupPlan`; call it as ``step(state, batch, *rest)`` with the
  global batch (host arrays leading with ``plan.global_batch``)."""

  fn: Callable[..., Any]
  plan: GroupPlan
  _built: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    by_id = {d.id: d for d in jax.devices()}
    missing = [d for d in self.plan.devices if d not in by_id]
    if missing:
      raise InvalidValueError(f"the group plan names devices {missing} that JAX does not have (it has ids "
                              f"{sorted(by_id)})")
    self.devices = [by_id[d] for d in self.plan.devices]
    self.mesh = Mesh(np.array(self.devices), (DATA,))
    self.group_meshes = [Mesh(np.array([by_id[d] for d in g.devices]), (DATA,)) for g in self.plan.groups]
    # each loop's counts and first examples, placed once: (group meshes'..., the tail's over every device)
    on = lambda mesh, values: jax.device_put(np.asarray(values, np.int32), NamedSharding(mesh, P(DATA)))
    self._loops = [(on(mesh, g.counts), on(mesh, starts))
                   for g, mesh, starts in zip(self.plan.groups, self.group_meshes, self.plan.starts())]
    self._tail = (on(self.mesh, [self.plan.tail_count] * len(self.devices)), on(self.mesh, self.plan.tail_starts()))

  def state_shardings(self, state: Any) -> Any:
    """The shardings the state lives in between steps: replicated on every device of the plan (to restore a
    checkpoint into, as ``ParallelStep.state_shardings``)."""
    return jax.tree.map(lambda _: NamedSharding(self.mesh, P()), state)

  def shard_state(self, state: Any) -> Any:
    """``state`` replicated on every device of the plan."""
    return jax.device_put(state, self.state_shardings(state))

  def explain(self) -> str:
    return self.plan.summary() + ("\n  state replicated on every device (ZeRO-0); each group's program runs its "
                                  "loop, one uniform program over every device reduces and updates")

  def __call__(self, *args: Any) -> Any:
    """``step(state, batch, *rest)`` for a functional step; for NNX in place, ``step(*objects and batch)``: the
    objects' state is split out (as ``nnx.jit`` does), and updated in place after the step."""
    from flax import nnx

    graph = [i for i, a in enumerate(args) if is_graph_node(a)]
    if not graph:
      if len(args) < 2:
        raise InvalidValueError("a functional step is called as step(state, batch, *rest)")
      return self._run(self.fn, None, args[0], args[1], args[2:])
    batch_at = next((i for i, a in enumerate(args) if i not in graph and jax.tree.leaves(a)
                     and all(np.shape(x)[:1] == (self.plan.global_batch,) for x in jax.tree.leaves(a))), None)
    if batch_at is None:
      raise InvalidValueError(f"no argument of the step is a batch of {self.plan.global_batch} examples")
    objects = tuple(args[i] for i in graph)
    graphdef, state = nnx.split(objects)
    rest_at = [i for i in range(len(args)) if i not in graph and i != batch_at]

    def pure(state, batch, *rest):
      merged = nnx.merge(graphdef, state)
      call = list(args)
      for i, o in zip(graph, merged):
        call[i] = o
      call[batch_at] = batch
      for i, r in zip(rest_at, rest):
        call[i] = r
      out = self.fn(*call)
      return nnx.state(merged), out

    new_state, out = self._run(pure, graphdef, state, args[batch_at], tuple(args[i] for i in rest_at))
    nnx.update(objects, new_state)
    return out

  def _run(self, fn: Callable[..., Any], graphdef: Any, state: Any, batch: Any, rest: tuple) -> Any:
    leaves, tree = jax.tree.flatten((state, batch, rest))
    n_state, n_batch = len(jax.tree.leaves(state)), len(jax.tree.leaves(batch))
    for x in jax.tree.leaves(batch):
      if np.shape(x)[:1] != (self.plan.global_batch,):
        raise InvalidValueError(f"every batch array must lead with the plan's global batch of "
                                f"{self.plan.global_batch}, got shape {np.shape(x)}")
    key = (tree, graphdef, tuple((np.shape(x), str(_traced_dtype(x))) for x in leaves))
    if key not in self._built:
      self._built[key] = self._build(fn, tree, leaves, range(n_state, n_state + n_batch))
    programs, exchange, out_tree = self._built[key]
    state_leaves = leaves[:n_state]
    others = leaves[n_state + n_batch:]
    partials = []
    for g, (mesh, program, (counts, starts)) in enumerate(zip(self.group_meshes, programs, self._loops)):
      inputs = [_on(mesh, x) for x in state_leaves] + self._buffers(g, leaves[n_state:n_state + n_batch]) + [
          _on(mesh, x) for x in others]
      partials.append(program(inputs, counts, starts))
    joined = [[self._rows([p[k][j] for p in partials]) for j in range(len(partials[0][k]))]
              for k in range(len(partials[0]))]
    tail = self._tail_buffers(leaves[n_state:n_state + n_batch]) if self.plan.tail_count else [None] * n_batch
    outputs = exchange([_on(self.mesh, x) for x in state_leaves], tail, [_on(self.mesh, x) for x in others], joined,
                       *self._tail)
    return jax.tree.unflatten(out_tree, outputs)

  def _build(self, fn, tree, leaves, batch_inputs):
    avals = [jax.ShapeDtypeStruct(np.shape(x), _traced_dtype(x)) for x in leaves]

    def flat(*xs):
      state, batch, rest = jax.tree.unflatten(tree, xs)
      return fn(state, batch, *rest)

    closed, shapes = jx.make_closed_jaxpr(flat, *avals, return_shape=True)
    analysis = analyse(closed, tuple(batch_inputs), self.plan.global_batch)
    prog = Program(analysis, tuple(batch_inputs))
    group_lowering.check(prog)
    programs = []
    for group, mesh in zip(self.plan.groups, self.group_meshes):
      layout = lowering.Layout(mesh, DATA, group.microbatch, group.max_count, group.counts)
      programs.append(jax.jit(group_lowering.group_program(prog, layout)))
    tail = None
    if self.plan.tail_count:
      count = self.plan.tail_count
      tail = lowering.Layout(self.mesh, DATA, self.plan.tail_microbatch, count, (count,) * len(self.devices),
                             overlap=True)
    run = group_lowering.exchange_program(prog, tail)
    exchange = jax.jit(lambda state, batch, others, partials, counts, starts: run(
        list(state) + list(batch) + list(others), partials, counts, starts))
    return programs, exchange, jax.tree.structure(shapes)

  def _buffers(self, g: int, batch_leaves):
    """Group ``g``'s padded microbatch buffers ``[devices * max_count, microbatch, ...]`` of each batch array."""
    group, mesh = self.plan.groups[g], self.group_meshes[g]
    starts = self.plan.starts()[g]
    out = []
    for x in batch_leaves:
      x = np.asarray(x)
      buf = np.zeros((len(group.devices) * group.max_count, group.microbatch) + x.shape[1:], x.dtype)
      for i, (c, s) in enumerate(zip(group.counts, starts)):
        rows = x[s:s + c * group.microbatch].reshape((c, group.microbatch) + x.shape[1:])
        buf[i * group.max_count:i * group.max_count + c] = rows
      out.append(jax.device_put(buf, NamedSharding(mesh, P(DATA))))
    return out

  def _tail_buffers(self, batch_leaves):
    """The tail's microbatch buffers ``[devices * tail_count, tail_microbatch, ...]`` over every device."""
    plan, count, size = self.plan, self.plan.tail_count, self.plan.tail_microbatch
    out = []
    for x in batch_leaves:
      x = np.asarray(x)
      rows = [x[s:s + count * size].reshape((count, size) + x.shape[1:]) for s in plan.tail_starts()]
      out.append(jax.device_put(np.concatenate(rows), NamedSharding(self.mesh, P(DATA))))
    return out

  def _rows(self, parts):
    """One global array over every device from each group's rows (one per device, the same shape), no copy."""
    shards = [s for part in parts for s in sorted(part.addressable_shards, key=lambda s: s.index[0].start or 0)]
    by_device = {s.device: s.data for s in shards}
    row = shards[0].data.shape
    return jax.make_array_from_single_device_arrays((len(self.devices),) + tuple(row[1:]),
                                                    NamedSharding(self.mesh, P(DATA)),
                                                    [by_device[d] for d in self.devices])


def _traced_dtype(x: Any) -> Any:
  """The dtype ``x`` is traced with (a Python scalar: JAX's default for it)."""
  return x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype


def _on(mesh: Mesh, x: Any) -> Any:
  """``x`` replicated on ``mesh``'s devices: its own per-device buffers where it has them (no copy)."""
  sharding = NamedSharding(mesh, P())
  if isinstance(x, jax.Array):
    have = {s.device: s.data for s in x.addressable_shards}
    if x.is_fully_replicated and all(d in have for d in mesh.devices.flat):
      return jax.make_array_from_single_device_arrays(x.shape, sharding, [have[d] for d in mesh.devices.flat])
  return jax.device_put(x, sharding)


def run_groups(fn: Callable[..., Any], plan: GroupPlan) -> GroupedStep:
  """``fn`` (a functional step) run under ``plan``'s group programs."""
  if not isinstance(plan, GroupPlan):
    raise HetSpmdError(f"run_groups needs a GroupPlan, got {type(plan).__name__}")
  return GroupedStep(fn, plan)
