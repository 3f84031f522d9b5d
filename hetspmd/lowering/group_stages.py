"""The stages a group plan's programs are made of, around :mod:`hetspmd.lowering.groups`' programs.

A group program is a named chain of stages (:func:`chain`, as optax chains
transforms), innermost first:

1. ``loop``: the group's microbatch loop (:func:`hetspmd.lowering.groups.group_program`);
2. ``constrain``: the parameters a model axis splits constrained to their split (:func:`constrained`);
3. ``widen``: parameters taken as their narrow casts, cast back up (:func:`widened`);
4. ``hold``: zeros for the optimizer-state leaves other devices hold (:func:`less_held`);
5. ``reorder``: the partial sums laid out as the exchange program's trace lays them out (:func:`reordered`);
6. ``narrow``: the partial sums cast to the dtype they cross devices in (:func:`narrowed`);
7. ``spread``: the rows (one per data position) made one per device (:func:`spread`).

An *inputs* stage wraps ``run(inputs, *rest)``, where ``inputs`` is the step's
flat inputs (state, batch, the rest), and changes only ``inputs``. An
*outputs* stage wraps ``run(*args) -> (partials, examples)`` and changes
only what it returns. The exchange and update programs are chains of the
inputs stages ``widen`` and ``hold`` around their own programs, made to
donate the state leaves whose buffers their new values may take
(:func:`donating`).
"""


from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hetspmd.errors import InvalidValueError
from hetspmd.lowering import groups as group_lowering
from hetspmd.lowering.program import Program, is_backward
from hetspmd.passes import _jax_adapter as jx
from hetspmd._pytree import leaves_with_paths

DATA = "data"
MODEL = "model"


def returns_state(prog: Program, new_value_of: dict[int, int]) -> bool:
  """Whether the state-shaped outputs (``new_value_of``: :func:`hetspmd._pytree.new_state_leaves`) are a new state,
  whose buffers may be the old state's, and not gradients made by the backward pass (for an update of the step's
  own after it), as :meth:`hetspmd.runtime.binding.Call.returns_state` tells them apart."""
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



Stage = tuple  # (name, wrap): ``wrap(run) -> run``; a wrap that returns ``run`` itself does nothing here


def chain(run: Callable[..., Any], *stages: Stage) -> tuple[Callable[..., Any], tuple[str, ...]]:
  """``run`` wrapped by each ``(name, wrap)`` stage in turn, the first innermost, and the names of the stages that
  changed it (a stage with nothing to do for this program returns ``run`` as it is)."""
  names = []
  for name, wrap in stages:
    wrapped = wrap(run)
    if wrapped is not run:
      names.append(name)
    run = wrapped
  return run, tuple(names)
