"""Moving values between devices for group plans: copies, two-hop relays, reduce-scatters and rows.

Every value here lives on some devices and is wanted on others (a group
that shards its parameters has its own module, :mod:`hetspmd.lowering.param_shards`). In one
process, a value held on one device reaches every device by a copy, or,
where some devices hold much more of the state than the rest
(:func:`hetspmd.plan.groups.relays`), in two hops (:func:`relayed`: split
evenly, then one all-gather program). A sum over devices that one device
needs whole is reduce-scattered first (:func:`scatter_program`) and joined
on it (:func:`assembled`). Across processes, one uniform program adds rows
that are the value on its device and zeros elsewhere (:func:`broadcast`).
Every device's row of a value becomes one global array without a copy
(:func:`global_rows`). Under ZeRO-3 a parameter reaches a group that
shards it as its parts alone (:func:`parts_on`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hetspmd.errors import HetSpmdError
from hetspmd.plan.groups import padded_length, relay_axis, relays

DATA = "data"


def relayed(values: dict, mesh: Mesh) -> dict:
  """``{key: value on one device}`` on every device of ``mesh`` (one axis), in two hops: each value split evenly
  over the devices along its :func:`hetspmd.plan.groups.relay_axis` (zero-padded there first where the device
  count does not divide it: the padded copy is transient), its device keeping one part and copying the others,
  then every part sent to every device by one program (an all-gather, each device sending only its parts; the
  padding cut off by another). A PRNG key, a scalar, an empty value or one that padding would grow by more than
  :data:`hetspmd.plan.groups.MAX_PADDING` is copied whole from its device. What reaches each device is the
  value, bit for bit."""
  n = mesh.size
  replicated = NamedSharding(mesh, P())
  split, whole, trims = {}, {}, {}
  for key, x in values.items():
    axis = None if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) else relay_axis(np.shape(x), n)
    if axis is None:  # a PRNG key, a scalar, an empty value, or one padding would grow too much
      whole[key] = jax.device_put(x, replicated)
      continue
    size = np.shape(x)[axis]
    if size % n:
      x = _padded(axis, padded_length(size, n))(x)
      trims[key] = (axis, size)
    split[key] = jax.device_put(x, NamedSharding(mesh, P(*([None] * axis), mesh.axis_names[0])))
  if split:  # an all-gather; the padding cut off by a program of its own (inside it, XLA may add the parts instead)
    gathered = dict(zip(split, _gathered_on(replicated)(list(split.values()))))
    if trims:
      gathered.update(zip(trims, _trimmed(tuple(trims.values()))([gathered[k] for k in trims])))
    whole.update(gathered)
  return whole


@functools.lru_cache(maxsize=None)
def _padded(axis: int, length: int) -> Callable[[Any], Any]:
  """A program that zero-pads its argument along ``axis`` to ``length``, where the argument is."""
  return jax.jit(lambda x: pad_to(x, axis, length))


def pad_to(x, axis: int, length: int):
  if x.shape[axis] == length:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, length - x.shape[axis])
  return jnp.pad(x, widths)


@functools.lru_cache(maxsize=None)
def _gathered_on(replicated: NamedSharding) -> Callable[[list], list]:
  """One program per mesh that makes its (split) arguments whole on every device: an all-gather."""
  return jax.jit(lambda xs: xs, out_shardings=replicated)


@functools.lru_cache(maxsize=None)
def _trimmed(trims: tuple[tuple[int, int], ...]) -> Callable[[list], list]:
  """A program that cuts each (replicated) argument to its ``(axis, size)``, on every device."""
  return jax.jit(lambda xs: [jax.lax.slice_in_dim(x, 0, size, axis=axis) for x, (axis, size) in zip(xs, trims)])


def scatter_program(mesh: Mesh, axes: tuple[tuple[int, int], ...]) -> Callable[[list], list]:
  """``program(rows) -> parts``: per value, every device's row of it (a global array ``[devices, *shape]`` over
  ``mesh``'s one axis) summed over the devices in the rows' dtype and left split evenly along its axis (``axes``:
  ``(axis, size)`` per value, zero-padded along it first where the device count does not divide ``size``): a
  reduce-scatter, each device sending and receiving ``(n - 1) / n`` of the values."""
  name, n = mesh.axis_names[0], mesh.size

  def per_device(rows):
    return [jax.lax.psum_scatter(pad_to(r[0], a, padded_length(size, n)), name, scatter_dimension=a, tiled=True)
            for r, (a, size) in zip(rows, axes)]

  return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=([P(name)] * len(axes),),
                               out_specs=[P(*([None] * a), name) for a, _ in axes], check_vma=False))


def assembled(parts: list, axes: list[tuple[int, int]], device: Any) -> list:
  """Values split evenly over devices (:func:`scatter_program`'s; ``axes``: ``(axis, size)`` of each), each whole
  on ``device`` as one row (a leading axis of one): their parts copied there, joined and cut to ``size``."""
  pieces = [[s.data for s in sorted(p.addressable_shards, key=lambda s, a=a: s.index[a].start or 0)]
            for p, (a, _) in zip(parts, axes)]
  return _joined(tuple(axes))(jax.device_put(pieces, device))


@functools.lru_cache(maxsize=None)
def _joined(axes: tuple[tuple[int, int], ...]) -> Callable[[list], list]:
  return jax.jit(lambda pieces: [jax.lax.slice_in_dim(jnp.concatenate(p, axis=a), 0, size, axis=a)[None]
                                 for p, (a, size) in zip(pieces, axes)])


def on(mesh: Mesh, x: Any) -> Any:
  """``x`` (a host value or a replicated array) replicated on ``mesh``'s devices, made from this process's
  pieces: itself where it is replicated on ``mesh`` already, else its own per-device buffers where it has them
  (no copy), a copy of one of them (or of the host value) on this process's other devices of ``mesh``. (``jax.device_put`` of a single-device array onto devices of
  several processes does not give a usable array.)"""
  sharding = NamedSharding(mesh, P())
  if isinstance(x, jax.Array) and x.sharding == sharding:
    return x  # already there (the state between steps, a one-group plan's inputs): nothing to make
  if isinstance(x, jax.Array) and not x.is_fully_replicated:
    return jax.device_put(x, sharding)  # sharded: one process holds it all
  have = {s.device: s.data for s in x.addressable_shards} if isinstance(x, jax.Array) else {}
  here = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  source = next(iter(have.values()), None) if have else np.asarray(x)
  pieces = [have[d] if d in have else jax.device_put(source, d) for d in here]
  return jax.make_array_from_single_device_arrays(np.shape(x), sharding, pieces)


def parts_on(x: Any, mesh: Mesh, axis: int) -> Any:
  """``x`` (whole on one device) zero-padded along ``axis`` to a multiple of ``mesh``'s size and split evenly over
  its one axis: cut into parts where ``x`` is, each part copied to its device (no device but ``x``'s own holds
  more than its part)."""
  n = mesh.size
  length = padded_length(np.shape(x)[axis], n)
  pieces = _cut(axis, length, n)(x)
  parts = [jax.device_put(p, d) for p, d in zip(pieces, mesh.devices.flat)]
  shape = tuple(length if a == axis else s for a, s in enumerate(np.shape(x)))
  return jax.make_array_from_single_device_arrays(shape, NamedSharding(mesh, P(*([None] * axis), mesh.axis_names[0])),
                                                  parts)


@functools.lru_cache(maxsize=None)
def _cut(axis: int, length: int, n: int) -> Callable[[Any], list]:
  """A program that zero-pads its argument along ``axis`` to ``length`` and cuts it into ``n`` parts there."""
  step = length // n
  return jax.jit(lambda x: [jax.lax.slice_in_dim(pad_to(x, axis, length), k * step, (k + 1) * step, axis=axis)
                            for k in range(n)])


def elsewhere(aval: Any, device: Any) -> Any:
  """This process's handle on an array that lives whole on ``device`` of another process."""
  return jax.make_array_from_single_device_arrays(tuple(aval.shape), jax.sharding.SingleDeviceSharding(device), [],
                                                  dtype=aval.dtype)


def shard_on(x: Any, device: Any) -> Any:
  """``device``'s own copy of a replicated array (no copy made); None stays None."""
  if x is None:
    return None
  if not isinstance(x, jax.Array):
    return jax.device_put(x, jax.sharding.SingleDeviceSharding(device))
  for shard in x.addressable_shards:
    if shard.device == device:
      return shard.data
  return jax.device_put(x, jax.sharding.SingleDeviceSharding(device))


def held_on(x: Any, device: Any, aval: Any) -> Any:
  """``x`` whole on ``device``: as it is where it is there already, a handle with no shard here where another
  process holds it (``aval``: its shape and dtype), else copied there."""
  if isinstance(x, jax.Array) and x.sharding.device_set == {device}:
    return x
  if device.process_index != jax.process_index():
    return elsewhere(aval, device)
  return jax.device_put(x, jax.sharding.SingleDeviceSharding(device))


@functools.partial(jax.jit, static_argnums=1)
def _cast(xs: list, dtypes: tuple[str, ...]) -> list:
  """``xs`` cast to ``dtypes``, in one program (on the device that holds them)."""
  return [x.astype(d) for x, d in zip(xs, dtypes)]


def cast_where_held(values: dict, dtypes: dict) -> dict:
  """``values`` (``{key: array on one device}``) with those ``dtypes`` names cast where they live: one program
  per device."""
  out = dict(values)
  by_device: dict[Any, list] = {}
  for key, x in values.items():
    if key in dtypes:
      by_device.setdefault(next(iter(x.sharding.device_set)), []).append(key)
  for keys in by_device.values():
    out.update(zip(keys, _cast([values[k] for k in keys], tuple(dtypes[k].name for k in keys))))
  return out


def cast_value(x: Any, dtype: Any) -> Any:
  """``x`` (a device array, or a host value) cast to ``dtype`` where it lives."""
  return x.astype(dtype) if isinstance(x, jax.Array) else np.asarray(x).astype(dtype)


def global_rows(parts: list, mesh: Mesh) -> Any:
  """One global array over ``mesh``'s devices (one axis) from each of this process's pieces' rows (one per
  device, the same shape), no copy: the piece itself where it is one laid out so already (one group of every
  device)."""
  devices = list(mesh.devices.flat)
  wanted = NamedSharding(mesh, P(DATA))
  if len(parts) == 1 and parts[0].shape[0] == len(devices) and _equivalent(parts[0].sharding, wanted, parts[0].ndim):
    return parts[0]
  shards = [s for part in parts for s in sorted(part.addressable_shards, key=lambda s: s.index[0].start or 0)]
  by_device = {s.device: s.data for s in shards}
  row = shards[0].data.shape
  return jax.make_array_from_single_device_arrays((len(devices),) + tuple(row[1:]), wanted,
                                                  [by_device[d] for d in devices if d in by_device])


@dataclasses.dataclass(frozen=True)
class Pieces:
  """A sum of the last loop that groups sharding their parameters hand over as parts: per group, its rows as one
  array over the group's devices (a leading axis of one row per device), each row the whole value's ``shape``, or,
  from a group that keeps the sum as parts (:attr:`ParamShards.kept`), each device's part (zero-padded along the
  one axis where its shape differs). The owner that reads it joins each such group's parts into one row
  (:meth:`rows_on`); no device of the group holds the sum whole."""

  groups: tuple
  shape: tuple

  def rows_on(self, device: Any) -> list:
    """The value's rows on ``device`` (each ``[1, *shape]``): every whole-shaped row copied there, and per group of
    parts its parts copied there and joined (the padding cut off)."""
    out = []
    for x in self.groups:
      here = jax.device_put(_rows(x), device)
      row = tuple(x.shape[1:])
      if row == tuple(self.shape):
        out += here
        continue
      axis = part_axis(row, self.shape)
      out.append(_joined_parts(axis + 1, self.shape[axis])(here))
    return out


def part_axis(part: tuple, shape: tuple) -> int:
  """The axis along which a part (zero-padded, split over a group) differs from its value's whole ``shape``."""
  return next(a for a, (m, n) in enumerate(zip(part, shape)) if m != n)


def _rows(x: Any) -> list:
  """This process's rows of ``x`` (a global array, a leading axis of one row per device), in order."""
  return [s.data for s in sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)]


@functools.lru_cache(maxsize=None)
def _joined_parts(axis: int, size: int) -> Callable[[list], Any]:
  """A program joining a group's parts (rows) along ``axis``, cut to ``size`` there."""
  return jax.jit(lambda parts: jax.lax.slice_in_dim(jnp.concatenate(parts, axis=axis), 0, size, axis=axis))


def part_rows(pieces: list, mesh: Mesh, shape: tuple) -> Any:
  """A hybrid plan's sum from its groups' parts (``pieces``: this process's groups' rows of it, each a global array
  over its group's devices, ``[g, *part]``, the part zero-padded along the one axis where it differs from the
  value's ``shape``) as one global array ``[groups, *padded]`` over ``mesh`` (:attr:`GroupMeshes.parts`): split
  over each group's devices along that axis, one row per group; no copy. None where the rows are whole-shaped
  (a value no group splits)."""
  row = tuple(pieces[0].shape[1:])
  if row == tuple(shape):
    return None
  if any(tuple(x.shape[1:]) != row for x in pieces):
    raise HetSpmdError(f"the groups split a sum of shape {tuple(shape)} into parts of different shapes "
                       f"({sorted({tuple(x.shape[1:]) for x in pieces})}): give every group the same remat policy")
  axis = part_axis(row, shape)
  g = mesh.shape[mesh.axis_names[1]]
  padded = row[:axis] + (row[axis] * g,) + row[axis + 1:]
  sharding = NamedSharding(mesh, P(mesh.axis_names[0], *([None] * axis), mesh.axis_names[1]))
  return jax.make_array_from_single_device_arrays((mesh.shape[mesh.axis_names[0]],) + padded, sharding,
                                                  [s.data for x in pieces for s in x.addressable_shards])


def split_on(x: Any, sharding: NamedSharding) -> Any:
  """``x`` (a host value, an array every process has whole, or one split otherwise) split as ``sharding`` says:
  each process making its own devices' pieces of a whole value, a split one resharded."""
  if isinstance(x, jax.Array) and x.sharding == sharding:
    return x
  local = isinstance(x, jax.Array) and x.is_fully_addressable and sharding.is_fully_addressable
  if isinstance(x, jax.Array) and (local or not x.is_fully_replicated):
    return jax.device_put(x, sharding)  # device to device (split otherwise: a program moves the pieces)
  value = np.asarray(x) if not isinstance(x, jax.Array) or x.is_fully_addressable else None
  if value is None:  # replicated across processes: this process's own copy
    value = np.asarray(x.addressable_shards[0].data)
  return jax.make_array_from_callback(np.shape(x), sharding, lambda index: value[index])


def group_part(x: Any, mesh: Mesh, axis: int) -> Any:
  """A hybrid plan's held leaf (split along ``axis`` over each group's devices, each group its own copy) as one
  group's program takes it: the same shards, as a global array over the group's ``mesh``; no copy. Where that is
  how ``x`` is laid out already (one group: plain FSDP), ``x`` itself."""
  sharding = NamedSharding(mesh, P(*([None] * axis), mesh.axis_names[0]))
  if _equivalent(x.sharding, sharding, x.ndim):
    return x
  mine = {s.device: s.data for s in x.addressable_shards}
  return jax.make_array_from_single_device_arrays(
      x.shape, sharding,
      [mine[d] for d in mesh.devices.flat if d.process_index == jax.process_index()])  # a group over processes: ours


@functools.lru_cache(maxsize=4096)
def _equivalent(held: Any, wanted: NamedSharding, ndim: int) -> bool:
  """Whether an array laid out as ``held`` is laid out as ``wanted`` (the same devices, each the same piece)."""
  return held.is_equivalent_to(wanted, ndim)


def without_pieces(partials: list) -> list:
  """``partials`` (per partial sum, its values) with each :class:`Pieces` None: what the exchange program takes
  (it reads none of them: :func:`hetspmd.lowering.groups.exchange_program`)."""
  return [[None if isinstance(x, Pieces) else x for x in part] for part in partials]


def rows_on(device: Any, needed: tuple[int, ...], flat: list, reduced: dict, axes: dict) -> list:
  """Per value of ``flat`` (global arrays, one row per device, or :class:`Pieces`) that ``device`` reads
  (``needed``), else None: every device's row of it copied there (a group's parts joined into one), or, for a
  value ``reduced`` holds (its sum split along ``axes[j]``), that sum made whole there, one row."""
  rows = {j: _rows(flat[j]) for j in needed if j not in reduced and not isinstance(flat[j], Pieces)}
  moved = jax.device_put(rows, device)
  moved.update({j: flat[j].rows_on(device) for j in needed if isinstance(flat[j], Pieces)})
  summed = [j for j in needed if j in reduced]
  moved.update(zip(summed, ([x] for x in assembled([reduced[j] for j in summed], [axes[j] for j in summed],
                                                  device))))
  return [moved.get(j) for j in range(len(flat))]


@functools.lru_cache(maxsize=None)
def _sum_rows(replicated: NamedSharding) -> Callable[[list], list]:
  return jax.jit(lambda rows: [r.sum(axis=0) for r in rows], out_shardings=replicated)


def broadcast(owner: dict, local: dict, avals: dict, mesh: Mesh, shares: tuple, call: Callable[..., Any], *,
              one_process: bool) -> dict:
  """``{key: value}`` on every device of ``mesh``, for each ``key`` of ``owner`` whose value lives on
  ``owner[key]`` (``local``: this process's values; ``avals``: every value's shape and dtype). In one process each
  is copied from its device, or where some devices hold much more than the rest (``shares``:
  :func:`hetspmd.plan.groups.relays`) sent in two hops (:func:`relayed`); across processes, one uniform program
  adds rows that are the value on its device and zeros on every other (run by ``call(program, rows)``)."""
  replicated = NamedSharding(mesh, P())
  if one_process:  # the plan's devices are one process's (Execution.one_process)
    if relays(shares):
      return relayed(local, mesh)
    return {k: jax.device_put(x, replicated) for k, x in local.items()}
  devices = list(mesh.devices.flat)
  order = sorted(owner)
  rows = []
  for k in order:
    aval = avals[k]
    pieces = [local[k] if owner[k] == d else jnp.zeros(aval.shape, aval.dtype, device=d) for d in devices
              if d.process_index == jax.process_index()]
    rows.append(jax.make_array_from_single_device_arrays((len(devices),) + tuple(aval.shape),
                                                         NamedSharding(mesh, P(DATA)), [x[None] for x in pieces]))
  return dict(zip(order, call(_sum_rows(replicated), rows))) if order else {}
