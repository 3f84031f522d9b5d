"""Gathers and scatters that index a dimension by its own position, rewritten with batching dimensions.

``x[i, jnp.arange(n)]`` (Flax's ``nn.RNN`` picks each sequence's last
carry this way: ``carries[lengths - 1, jnp.arange(batch)]``) lowers to a
gather whose indices concatenate a per-example index with an ``iota``
along the same examples. Element ``b`` then reads ``x[i[b], b]``: each
example only its own row, which is what a gather with
``operand_batching_dims`` says outright (``jnp.take_along_axis`` writes it
that way). The example-axis rules (:mod:`hetspmd.passes.batch_axis.rules`)
understand the batched form and refuse the other, so this pass rewrites one
into the other before the analysis, for the gather and for the scatter-add
its transpose makes. The rewrite is exact for any values: an ``iota`` over
the whole dimension is in bounds, and the normalisation of negative indices
that ``jnp`` indexing adds (``select_n(i < 0, i, i + n)``) leaves it as it is.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from hetspmd.passes import _jax_adapter as jx

_SCATTERS = frozenset({"scatter-add", "scatter_add", "scatter", "scatter-mul", "scatter_mul", "scatter-min",
                       "scatter_min", "scatter-max", "scatter_max", "scatter-sub", "scatter_sub"})


def rewrite(closed: Any) -> Any:
  """``closed`` with every self-indexing gather or scatter at its top level in batched form (the same
  closed jaxpr if it has none). The analysis calls it on the step and on each scan or checkpoint body it
  opens."""
  eqns = jx.equations(closed)
  positions, pieces, producer = _provenance(eqns)
  plan = {}
  for eqn in eqns:
    found = _batched(eqn, positions, pieces, producer)
    if found is not None:
      plan[id(eqn)] = found
  if not plan:
    return closed

  def batched(eqn, env):
    params, parts, axis = plan[id(eqn)]
    invals = [jx.read(env, v) for v in eqn.invars]
    values = [jx.read(env, v) for v in parts]
    invals[1] = values[0] if len(values) == 1 else jax.lax.concatenate(values, axis)
    return jx.bind(eqn, invals, params)

  return jx.retraced(closed, {key: batched for key in plan})


def _provenance(eqns) -> tuple[dict, dict, dict]:
  """Per variable: the dimension whose index its every element equals (an ``iota`` and what keeps it so),
  the pieces a ``concatenate`` made it of, and its producing equation."""
  positions: dict = {}
  pieces: dict = {}
  producer: dict = {}
  for eqn in eqns:
    name = jx.primitive_name(eqn)
    out = eqn.outvars[0] if eqn.outvars else None
    for v in eqn.outvars:
      producer[v] = eqn
    first = eqn.invars[0] if eqn.invars else None
    known = first is not None and not jx.is_literal(first) and first in positions
    if name == "iota" and jnp.issubdtype(jx.aval_dtype(out), jnp.integer):
      positions[out] = eqn.params["dimension"]
    elif name == "convert_element_type" and known and _holds(jx.aval_dtype(out), jx.aval_shape(first)[positions[first]]):
      positions[out] = positions[first]
    elif name == "broadcast_in_dim" and known:
      d = positions[first]
      target = eqn.params["broadcast_dimensions"][d]
      if jx.aval_shape(out)[target] == jx.aval_shape(first)[d]:
        positions[out] = target
    elif name == "reshape" and known and eqn.params.get("dimensions") is None:
      moved = _reshaped_dim(jx.aval_shape(first), jx.aval_shape(out), positions[first])
      if moved is not None:
        positions[out] = moved
    elif name == "select_n" and len(eqn.invars) == 3 and _never_negative(eqn, producer, positions):
      positions[out] = positions[eqn.invars[1]]
    elif name == "concatenate":
      axis, offset, parts = eqn.params["dimension"], 0, []
      for v in eqn.invars:
        size = jx.aval_shape(v)[axis]
        parts.append((v, offset, size))
        offset += size
      pieces[out] = (axis, tuple(parts))
  return positions, pieces, producer


def _holds(dtype, size: int) -> bool:
  """Whether integers of ``dtype`` hold every position of a dimension of ``size`` (a narrowing cast wraps)."""
  return jnp.issubdtype(dtype, jnp.integer) and int(jnp.iinfo(dtype).max) >= size - 1


def _never_negative(eqn, producer, positions) -> bool:
  """``select_n(i < 0, i, ...)`` of a position ``i``: the normalisation of negative indices, which keeps it."""
  pred, case = eqn.invars[0], eqn.invars[1]
  if jx.is_literal(case) or case not in positions or jx.is_literal(pred) or pred not in producer:
    return False
  test = producer[pred]
  return (jx.primitive_name(test) == "lt" and test.invars[0] is case and jx.is_literal(test.invars[1])
          and jx.literal_value(test.invars[1]) == 0)


def _reshaped_dim(before: tuple, after: tuple, dim: int) -> int | None:
  """Where dimension ``dim`` lands in a reshape that only adds or drops dimensions of size 1."""
  if before[dim] == 1 or [s for s in before if s != 1] != [s for s in after if s != 1]:
    return None
  rank = sum(1 for s in before[:dim] if s != 1)
  big = [d for d, s in enumerate(after) if s != 1]
  return big[rank]


def _batched(eqn, positions, pieces, producer):
  """``(params, index pieces left, their axis)`` of the batched form of a self-indexing gather or scatter."""
  name = jx.primitive_name(eqn)
  if name != "gather" and name not in _SCATTERS:
    return None
  numbers = eqn.params["dimension_numbers"]
  indices = eqn.invars[1]
  if jx.is_literal(indices) or indices not in pieces:
    return None
  axis, parts = pieces[indices]
  vector = len(jx.aval_shape(indices)) - 1
  if axis != vector:
    return None
  operand_shape, index_shape = jx.aval_shape(eqn.invars[0]), jx.aval_shape(indices)
  gather = name == "gather"
  index_map = numbers.start_index_map if gather else numbers.scatter_dims_to_operand_dims
  dropped = numbers.collapsed_slice_dims if gather else numbers.inserted_window_dims
  operand_batching = numbers.operand_batching_dims
  index_batching = numbers.start_indices_batching_dims if gather else numbers.scatter_indices_batching_dims
  for component, dim in enumerate(index_map):
    part = next((p for p in parts if p[1] == component and p[2] == 1), None)
    if part is None or jx.is_literal(part[0]) or part[0] not in positions:
      continue
    along = positions[part[0]]
    if (along == vector or along in index_batching or dim not in dropped or dim in operand_batching
        or operand_shape[dim] != index_shape[along] or (gather and eqn.params["slice_sizes"][dim] != 1)):
      continue
    rest = [p for p in parts if p is not part]
    if not rest:
      return None
    pairs = sorted(tuple(zip(operand_batching, index_batching)) + ((dim, along),))
    changes = dict(operand_batching_dims=tuple(p[0] for p in pairs))
    if gather:
      changes.update(collapsed_slice_dims=tuple(d for d in dropped if d != dim),
                     start_index_map=tuple(d for c, d in enumerate(index_map) if c != component),
                     start_indices_batching_dims=tuple(p[1] for p in pairs))
    else:
      changes.update(inserted_window_dims=tuple(d for d in dropped if d != dim),
                     scatter_dims_to_operand_dims=tuple(d for c, d in enumerate(index_map) if c != component),
                     scatter_indices_batching_dims=tuple(p[1] for p in pairs))
    params = dict(eqn.params, dimension_numbers=numbers._replace(**changes), indices_are_sorted=False)
    return params, tuple(p[0] for p in rest), axis
  return None
