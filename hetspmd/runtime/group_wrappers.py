"""The wrappers a group plan's programs are made of, around :mod:`hetspmd.lowering.groups`' programs.

Each group program is the lowering's loop with, from the inside out: the parameters a model axis splits
constrained to their split (:func:`constrained`), zeros standing in for the optimizer-state leaves other devices
hold (:func:`less_held`), its partial sums laid out as the exchange program's trace lays them out
(:func:`reordered`), cast to the dtype they cross devices in (:func:`narrowed`), and its rows made one per device
(:func:`spread`). The uniform and update programs donate the state leaves whose buffers their new values may
take (:func:`donating`).
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

from hetspmd.errors import InvalidValueError
from hetspmd.lowering import groups as group_lowering
from hetspmd.lowering.program import Program, is_backward
from hetspmd.plan.groups import padded_length, relay_axis
from hetspmd.passes import _jax_adapter as jx
from hetspmd._pytree import leaves_with_paths

DATA = "data"
MODEL = "model"


def new_values(state: Any, out_tree: Any) -> dict[int, int]:
  """``{flat output: flat state input}`` of the outputs that are a state leaf's new value: the step's outputs
  (or its first output) shaped like the state."""
  outputs = jax.tree.unflatten(out_tree, list(range(out_tree.num_leaves)))
  structure = jax.tree.structure(state)
  new_state = (outputs if jax.tree.structure(outputs) == structure else outputs[0]
               if isinstance(outputs, tuple) and outputs and jax.tree.structure(outputs[0]) == structure else None)
  if new_state is None:
    return {}
  return dict(zip(jax.tree.leaves(new_state), range(structure.num_leaves)))


def returns_state(prog: Program, new_value_of: dict[int, int]) -> bool:
  """Whether the state-shaped outputs are a new state, whose buffers may be the old state's, and not gradients
  made by the backward pass (for an update of the step's own after it), as
  :meth:`hetspmd.runtime.binding.Call.returns_state` tells them apart."""
  made = [prog.producer.get(prog.outvars[o]) for o in new_value_of if not jx.is_literal(prog.outvars[o])]
  return bool(new_value_of) and not all(is_backward(prog, i) for i in made)


@dataclasses.dataclass(frozen=True)
class Donating:
  """A program whose first argument (the step's flat inputs) gives its entries at ``at`` apart, donated (their
  buffers may become the outputs'); called and lowered as the program it wraps."""

  jitted: Any
  at: frozenset

  def split(self, inputs: list) -> tuple[list, list]:
    return ([x for k, x in enumerate(inputs) if k in self.at], [x for k, x in enumerate(inputs) if k not in self.at])

  def __call__(self, inputs: list, *rest: Any) -> Any:
    return self.jitted(*self.split(inputs), *rest)

  def lower(self, inputs: list, *rest: Any) -> Any:
    return self.jitted.lower(*self.split(inputs), *rest)


def donating(run: Callable[..., Any], at: list[int], **jit_kwargs: Any) -> Any:
  """``jax.jit(run)`` donating the entries ``at`` of its first argument (none: plain ``jax.jit``)."""
  if not at:
    return jax.jit(run, **jit_kwargs)
  mine = frozenset(at)

  def apart(donated, kept, *rest):
    given, others = iter(donated), iter(kept)
    return run([next(given) if k in mine else next(others) for k in range(len(donated) + len(kept))], *rest)

  return Donating(jax.jit(apart, donate_argnums=(0,), **jit_kwargs), mine)


def less_held(prog: Program, held: tuple[int, ...], run: Callable[..., Any]) -> Callable[..., Any]:
  """``run`` taking the step's flat inputs less ``held`` (leaves on other devices that it does not read)."""
  if not held:
    return run
  return lambda inputs, *rest: run(group_lowering.with_placeholders(prog, inputs, held), *rest)


def reordered(order: tuple | None, run: Callable[..., Any]) -> Callable[..., Any]:
  """``run`` with its partial sums laid out as the exchange program's trace lays them out (``order``: from
  :func:`hetspmd.lowering.groups.sums_order`; another remat policy's trace cuts the backward pass otherwise)."""
  if order is None:
    return run
  positions, sizes = order

  def reordered(*args):
    partials, examples = run(*args)
    values = [x for part in partials for x in part]
    flat = [values[i] for i in positions]
    return [flat[sum(sizes[:k]):sum(sizes[:k + 1])] for k in range(len(sizes))], examples

  return reordered


def group_mesh(devices: list, model: int) -> Mesh:
  """A group's mesh: its devices on ``data``, or ``model`` at a time (a data position each) on ``data`` x
  ``model``."""
  if model == 1:
    return Mesh(np.array(devices), (DATA,))
  return Mesh(np.array(devices).reshape(len(devices) // model, model), (DATA, MODEL))


def model_split(state: Any, group: Any, mesh: Mesh) -> dict[int, NamedSharding]:
  """``{flat state index: sharding}`` of the parameters ``group.model_dims`` splits over its model axis (a path
  names a leaf whose path ends with it); none without a model axis."""
  if group.model == 1:
    return {}
  dims, out, found = dict(group.model_dims), {}, set()
  for i, (path, leaf) in enumerate(leaves_with_paths(state)):
    key = next((k for k in sorted(dims, key=len, reverse=True) if path == k or path.endswith("/" + k)), None)
    if key is None:
      continue
    dim, shape = dims[key], np.shape(leaf)
    if dim >= len(shape) or shape[dim] % group.model:
      raise InvalidValueError(f"model_dims splits {path} (shape {shape}) along dimension {dim} over a model axis of "
                              f"{group.model}: that dimension must exist and divide by {group.model}")
    found.add(key)
    out[i] = NamedSharding(mesh, P(*(None,) * dim, MODEL))
  unknown = sorted(set(dims) - found)
  if unknown:
    raise InvalidValueError(f"model_dims names {unknown}, which no state leaf's path ends with (the state's "
                            f"parameters are named like {leaves_with_paths(state)[0][0]!r})")
  return out


def constrained(split: dict[int, NamedSharding], run: Callable[..., Any]) -> Callable[..., Any]:
  """``run`` with the parameters ``split`` names constrained to their model-axis shardings: XLA then splits the
  work that reads them, and their gradients, over the model axis."""
  if not split:
    return run
  return lambda inputs, *rest: run([jax.lax.with_sharding_constraint(x, split[i]) if i in split else x
                                    for i, x in enumerate(inputs)], *rest)


def spread(prog: Program, s: int, model: int, run: Callable[..., Any]) -> Callable[..., Any]:
  """``run`` with its rows (one per data position) made one per device, as the uniform programs take them: a
  sum's row (and a per-example output's) on the position's first device and zeros on the others, a maximum's or
  minimum's on each of them."""
  if model == 1:
    return run
  kinds = group_lowering.partial_reductions(prog, s)

  def spread(x, kind):
    rows = x[:, None]
    rest = (jnp.zeros((x.shape[0], model - 1) + x.shape[1:], x.dtype) if kind == "sum" else
            jnp.broadcast_to(rows, (x.shape[0], model - 1) + x.shape[1:]))
    return jnp.concatenate([rows, rest], axis=1).reshape((x.shape[0] * model,) + x.shape[1:])

  def spread_all(*args):
    partials, examples = run(*args)
    return ([[spread(x, k) for x, k in zip(part, ks)] for part, ks in zip(partials, kinds)],
            [spread(x, "sum") for x in examples])

  return spread_all


def narrowed(mask: tuple | None, dtype: str, run: Callable[..., Any]) -> Callable[..., Any]:
  """``run`` with the partial sums ``mask`` names (:func:`hetspmd.lowering.groups.narrowed`) cast to ``dtype``,
  the dtype they cross devices in."""
  if mask is None or not any(flag for part in mask for flag in part):
    return run

  def narrowed(*args):
    partials, examples = run(*args)
    return group_lowering.narrow(partials, mask, dtype), examples

  return narrowed


def widened(wide: dict[int, Any], run: Callable[..., Any]) -> Callable[..., Any]:
  """``run`` taking the parameters ``wide`` names (``{flat input: the dtype the step reads it as}``) as their
  narrow casts: each is cast back up before ``run`` reads it, and the step's own cast takes it back down
  unchanged (XLA folds the pair away)."""
  if not wide:
    return run
  return lambda inputs, *rest: run([x.astype(wide[i]) if i in wide and x is not None else x
                                    for i, x in enumerate(inputs)], *rest)


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
  return jax.jit(lambda x: _pad_to(x, axis, length))


def _pad_to(x, axis: int, length: int):
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
    return [jax.lax.psum_scatter(_pad_to(r[0], a, padded_length(size, n)), name, scatter_dimension=a, tiled=True)
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
