"""Placing a step's batch on the devices: padded per-position microbatch buffers and counts.

A data position's examples lie in ``max_count`` slots of one microbatch
each (zeros past its count); each process places only the positions whose
devices it holds, and ``jax.make_array_from_single_device_arrays`` joins them
into one global array sharded over ``data``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from hetspmd._dtypes import traced_dtype
from hetspmd._pytree import leaves_with_paths
from hetspmd.errors import HetSpmdError, InvalidValueError
from hetspmd.plan.value import Plan


class ShardedBatch(NamedTuple):
  """A step's batch on the devices: padded microbatch buffers and counts."""

  data: Any    # pytree of [positions * max_count, microbatch, ...] arrays, sharded over data
  counts: Any  # int32[positions], sharded over data


def positions_array(mesh: Any, plan: Plan, values: np.ndarray) -> jax.Array:
  """``int32[positions]`` sharded over ``data``, one value per position."""
  grid = mesh.devices
  arrays = [jax.device_put(np.array([values[i]], np.int32), d) for i in range(plan.data_size)
            for d in grid[i].ravel() if d.process_index == jax.process_index()]
  return jax.make_array_from_single_device_arrays((plan.data_size,), NamedSharding(mesh, P(plan.data_axis)), arrays)


def local_positions(mesh: Any, plan: Plan) -> list[int]:
  me = jax.process_index()
  return [i for i in range(plan.data_size) if any(d.process_index == me for d in mesh.devices[i].ravel())]


def shard_batch(plan: Plan, mesh: Any, batch: Any) -> ShardedBatch:
  """Host batch → padded per-device microbatch buffers and counts (see :meth:`ParallelStep.shard_batch`)."""
  positions = local_positions(mesh, plan)
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


@dataclasses.dataclass(frozen=True)
class GroupedBatch:
  """A global batch placed for a group plan (``GroupedStep.shard_batch``): its shapes (``abstract``), this
  process's groups' microbatch buffers (by group) and the tail's buffers over every device. (Not a pytree: a step
  takes it whole in the batch's place.)"""

  abstract: Any
  groups: dict
  tail: list


def global_abstract(batch: Any, global_batch: int) -> Any:
  """``batch``'s arrays as abstract values leading with ``global_batch``."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct((global_batch,) + tuple(np.shape(x)[1:]), traced_dtype(x)),
                      batch)


def check_global_batch(batch: Any, global_batch: int) -> None:
  """Refuses a batch any of whose arrays does not lead with ``global_batch``."""
  for x in jax.tree.leaves(batch):
    if np.shape(x)[:1] != (global_batch,):
      raise InvalidValueError(f"every batch array must lead with the plan's global batch of {global_batch}, got "
                              f"shape {np.shape(x)}")


def check_process_batch(batch: Any, examples: int, global_batch: int) -> None:
  """Refuses a batch any of whose arrays does not lead with this process's ``examples`` (of ``global_batch``):
  a process passes only its own examples, ``step.process_examples()``."""
  for path, x in leaves_with_paths(batch):
    if np.shape(x)[:1] != (examples,):
      whole = " (the whole global batch)" if np.shape(x)[:1] == (global_batch,) else ""
      raise InvalidValueError(
          f"batch leaf {path or '<root>'!r} has shape {np.shape(x)}{whole}; this process runs {examples} of the "
          f"global batch's {global_batch} examples: pass only those, batch[step.process_examples()], in that "
          "order")


def on_mesh(values: np.ndarray, mesh: Any, spec: Any) -> jax.Array:
  """``values`` (the global array) placed over ``mesh`` as ``spec`` says, from this process's shards of it only:
  what other processes' devices hold is theirs to place (here it may be zeros)."""
  return jax.make_array_from_callback(values.shape, NamedSharding(mesh, spec), lambda index: values[index])


def group_buffers(group: Any, starts: Any, mesh: Any, batch_leaves: list) -> list:
  """A group's padded microbatch buffers ``[positions * max_count, microbatch, ...]`` of each batch array
  (``starts``: each position's first example in the arrays, None for a position another process feeds),
  sharded over its mesh's ``data`` axis."""
  out = []
  for x in batch_leaves:
    x = np.asarray(x)
    buf = np.zeros((len(group.positions) * group.max_count, group.microbatch) + x.shape[1:], x.dtype)
    for i, (c, s) in enumerate(zip(group.positions, starts)):
      if s is not None:
        buf[i * group.max_count:i * group.max_count + c] = x[s:s + c * group.microbatch].reshape(
            (c, group.microbatch) + x.shape[1:])
    out.append(on_mesh(buf, mesh, P("data")))
  return out


def tail_buffers(count: int, size: int, starts: Any, mesh: Any, batch_leaves: list) -> list:
  """The tail's microbatch buffers ``[devices * count, size, ...]`` over every device of ``mesh`` (``starts``:
  each device's first tail example in the arrays, None for a device another process feeds)."""
  out = []
  for x in batch_leaves:
    x = np.asarray(x)
    rows = [x[s:s + count * size].reshape((count, size) + x.shape[1:]) if s is not None else
            np.zeros((count, size) + x.shape[1:], x.dtype) for s in starts]
    out.append(on_mesh(np.concatenate(rows), mesh, P("data")))
  return out


def process_examples(plan: Plan, mesh: Any) -> np.ndarray:
  """The global batch's examples this process feeds a single program, in order: those of the data positions it
  hosts, in position order."""
  firsts = np.cumsum((0,) + plan.examples_per_position())
  ranges = [np.arange(firsts[i], firsts[i + 1]) for i in local_positions(mesh, plan)]
  return np.concatenate(ranges) if ranges else np.zeros((0,), np.int64)


DONATED = ("the state passed to the step was donated to an earlier call (parallelize(donate_state=True): its "
           "buffers now hold the state that call returned): pass the state the last call returned, as in "
           "`state, metrics = step(state, batch)`, or parallelize(..., donate_state=False) to keep the old one")


def check_live(state: Any, others: Any = (), devices: Any = None) -> None:
  """Refuses, before anything is dispatched, arrays that a program cannot take: a deleted one (donated to an
  earlier call; running on it would crash the process) and, given the program's ``devices``, a state placed on
  other devices (another plan's step)."""
  for x in jax.tree.leaves(others):
    if isinstance(x, jax.Array) and x.is_deleted():
      raise HetSpmdError("an array passed to the step has been deleted (donated to another program, or "
                         "x.delete()): pass live arrays")
  for x in jax.tree.leaves(state):
    if not isinstance(x, jax.Array):
      continue
    if x.is_deleted():
      raise HetSpmdError(DONATED)
    if devices is not None and x.committed and x.sharding.device_set != devices:
      held = sorted(d.id for d in x.sharding.device_set)
      raise HetSpmdError(f"the state lies on devices {held}, but this step's plan runs on devices "
                         f"{sorted(d.id for d in devices)} (a state placed by another plan's step?): place it with "
                         "step.shard_state(state) first")
