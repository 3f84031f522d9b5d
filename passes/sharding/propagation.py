"""How a sharded value flows through a node: the rule tables of the strategy space.

:data:`PROPAGATION_RULES`, keyed by primitive, carries an operand sharded
along one dimension through a node (:class:`Flow`): elementwise ops keep the
dimension, transposes, broadcasts and reshapes move it, reductions and
``dot_general`` over it make a partial result (all-reduced), lookups along it
are masked and all-reduced; any other primitive all-gathers the operand
(the default). Splitting, slicing, padding or concatenating along the
sharded dimension needs a ``collective-permute``. :func:`_upstream_dims`
walks the other way, for the shardings XLA carries back from an operand
that must arrive sharded. Used by :mod:`hetspmd.passes.sharding.strategies`.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, NamedTuple, Sequence

from hetspmd.passes.ir import Node

Dim = int | None  # a sharded dimension, or None for whole


class SiteEffect(NamedTuple):
  """What a split of the parameter's operand dimension does at one site."""

  out: Dim                          # output dimension that comes out sharded
  partial: bool                     # output is a partial sum: all-reduce it
  need: tuple[int, int] | None      # (operand, dim) that must arrive sharded


def _dot_parts(node: Node, operand: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]:
  """(contracting dims, batch dims, free dims) of ``operand``, and the output offset of its free dims."""
  (lc, rc), (lb, rb) = node.param("dimension_numbers")
  contracting, batch = (tuple(lc), tuple(lb)) if operand == 0 else (tuple(rc), tuple(rb))
  rank = len(node.inputs[operand].shape)
  free = tuple(d for d in range(rank) if d not in contracting and d not in batch)
  offset = len(lb) + (0 if operand == 0 else len(node.inputs[0].shape) - len(lc) - len(lb))
  return contracting, batch, free, offset


def _gather_parts(node: Node) -> tuple[tuple[int, ...], ...]:
  offset_dims, collapsed, start_index_map, operand_batching, _ = node.param("dimension_numbers")
  return tuple(offset_dims), tuple(collapsed), tuple(start_index_map), tuple(operand_batching)


def _gather_effect(node: Node, operand: int, dim: int) -> SiteEffect | None:
  if operand != 0:
    return None
  offset_dims, collapsed, start_index_map, batching = _gather_parts(node)
  if dim in start_index_map:
    return SiteEffect(None, True, None)
  if dim in batching or dim in collapsed or node.param("slice_sizes")[dim] != node.inputs[0].shape[dim]:
    return None
  kept = [d for d in range(len(node.inputs[0].shape)) if d not in collapsed and d not in batching]
  return SiteEffect(offset_dims[kept.index(dim)], False, None)


# --- propagation rules ---------------------------------------------------------------------


class Flow(NamedTuple):
  """How a node passes on sharded operands."""

  out: tuple[Dim, ...]              # per output
  reduce: bool = False              # output 0 is a partial result: all-reduce it
  gather: tuple[int, ...] = ()      # operands all-gathered first
  permute: bool = False             # needs a collective-permute


PropagationRule = Callable[[Node, Sequence[Dim], int], Flow]


def _sharded(in_dims: Sequence[Dim]) -> tuple[int, ...]:
  return tuple(i for i, d in enumerate(in_dims) if d is not None)


def _replicate(node: Node, in_dims: Sequence[Dim], m: int) -> Flow:
  """Default: all-gather every sharded operand and compute whole."""
  return Flow((None,) * len(node.outputs), gather=_sharded(in_dims))


def _permuting(node: Node, in_dims: Sequence[Dim], m: int) -> Flow:
  return Flow((None,) * len(node.outputs), gather=_sharded(in_dims), permute=True)


def _elementwise(node: Node, in_dims: Sequence[Dim], m: int) -> Flow:
  rank = len(node.outputs[0].shape)
  dims = {d for d in in_dims if d is not None}
  if len(dims) != 1 or any(len(node.inputs[i].shape) != rank for i in _sharded(in_dims)):
    return _replicate(node, in_dims, m)
  return Flow((dims.pop(),) * len(node.outputs))


def _reduction(node: Node, in_dims: Sequence[Dim], m: int) -> Flow:
  (dim,) = [d for d in in_dims if d is not None][:1] or [None]
  axes = tuple(node.param("axes", ()))
  if dim in axes:
    return Flow((None,) * len(node.outputs), reduce=True)
  return Flow((dim - sum(1 for a in axes if a < dim),) * len(node.outputs))


def _transpose(node: Node, in_dims: Sequence[Dim], m: int) -> Flow:
  return Flow((tuple(node.param("permutation")).index(in_dims[0]),))


def _broadcast(node: Node, in_dims: Sequence[Dim], m: int) -> Flow:
  dims = tuple(node.param("broadcast_dimensions"))
  out = dims[in_dims[0]]
  if node.outputs[0].shape[out] != node.inputs[0].shape[in_dims[0]]:
    return _replicate(node, in_dims, m)
  return Flow((out,))


def reshape_dim(in_shape: Sequence[int], out_shape: Sequence[int], dim: int, m: int) -> Dim:
  """Where a contiguous ``m``-way split of ``in_shape[dim]`` lands after a reshape, if anywhere."""
  before, size, acc = math.prod(in_shape[:dim]), in_shape[dim], 1
  for j, s in enumerate(out_shape):
    if acc == before and s != 1:
      split_major = size % s == 0 and s % m == 0
      merge_major = s % size == 0 and size % m == 0
      return j if s == size or split_major or merge_major else None
    acc *= s
    if acc > before:
      return None
  return None


def _reshape(node: Node, in_dims: Sequence[Dim], m: int) -> Flow:
  out = reshape_dim(node.inputs[0].shape, node.outputs[0].shape, in_dims[0], m)
  return _replicate(node, in_dims, m) if out is None else Flow((out,))


def _squeeze(node: Node, in_dims: Sequence[Dim], m: int) -> Flow:
  dims = tuple(node.param("dimensions", ()))
  return Flow((in_dims[0] - sum(1 for d in dims if d < in_dims[0]),))


def _dot(node: Node, in_dims: Sequence[Dim], m: int) -> Flow:
  """A dot_general between activations (attention, weight gradients)."""
  out: Dim = None
  reduce = False
  for operand, dim in enumerate(in_dims[:2]):
    if dim is None:
      continue
    contracting, batch, free, offset = _dot_parts(node, operand)
    other_dim = in_dims[1 - operand]
    other_contracting, other_batch, _, _ = _dot_parts(node, 1 - operand)
    if dim in contracting:
      paired = other_contracting[contracting.index(dim)]
      if other_dim not in (None, paired):
        return _replicate(node, in_dims, m)
      reduce = True
    elif dim in batch:
      paired = other_batch[batch.index(dim)]
      if other_dim not in (None, paired):
        return _replicate(node, in_dims, m)
      out = batch.index(dim)
    else:
      if other_dim is not None and other_dim not in other_contracting and other_dim not in other_batch:
        return _replicate(node, in_dims, m)  # both free: the output would be sharded twice
      out = offset + free.index(dim)
  if reduce and out is not None:
    return _replicate(node, in_dims, m)
  return Flow((out,), reduce=reduce)


def _gather(node: Node, in_dims: Sequence[Dim], m: int) -> Flow:
  dim = in_dims[0]
  if dim is None or any(d is not None for d in in_dims[1:]):
    return _replicate(node, in_dims, m)
  effect = _gather_effect(node, 0, dim)
  if effect is None:
    offset_dims, collapsed, start_index_map, batching = _gather_parts(node)
    if dim not in batching:
      return _replicate(node, in_dims, m)
    # an operand batching dimension comes out where its indices batching dimension does
    indices_batching = node.param("dimension_numbers")[4]
    non_offset = [d for d in range(len(node.outputs[0].shape)) if d not in offset_dims]
    return Flow((non_offset[indices_batching[batching.index(dim)]],))
  return Flow((effect.out,), reduce=effect.partial)


def _scatter(node: Node, in_dims: Sequence[Dim], m: int) -> Flow:
  """Updates scattered into a sharded operand land on the device that holds them."""
  if in_dims[0] is None or any(d is not None for d in in_dims[1:]):
    return _replicate(node, in_dims, m)
  return Flow((in_dims[0],))


def _along(axes_of: Callable[[Node], Iterable[int]]) -> PropagationRule:
  """A rule for ops that keep every dimension but rearrange some (``axes_of``)."""

  def rule(node: Node, in_dims: Sequence[Dim], m: int) -> Flow:
    dims = {d for d in in_dims if d is not None}
    if len(dims) != 1 or dims & set(axes_of(node)):
      return _permuting(node, in_dims, m)
    return Flow((dims.pop(),) * len(node.outputs))

  return rule


def _sliced_axes(node: Node) -> list[int]:
  shape = node.inputs[0].shape
  starts, limits = node.param("start_indices"), node.param("limit_indices")
  strides = node.param("strides") or (1,) * len(shape)
  return [d for d in range(len(shape)) if starts[d] != 0 or limits[d] != shape[d] or strides[d] != 1]


ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil",
    "clamp", "convert_element_type", "copy", "copy_p", "cos", "cosh", "div", "eq", "erf", "erf_inv", "erfc", "exp",
    "exp2", "expm1", "floor", "ge", "gt", "imag", "integer_pow", "is_finite", "le", "lgamma", "digamma", "log",
    "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not", "or", "pow", "real",
    "reduce_precision", "rem", "round", "rsqrt", "select_n", "sign", "sin", "sinh", "sqrt", "square",
    "stop_gradient", "sub", "tan", "tanh", "xor", "optimization_barrier",
})

# How a sharded operand flows through a node. Default (_replicate): all-gather, go on whole.
PROPAGATION_RULES: dict[str, PropagationRule] = {
    **{p: _elementwise for p in ELEMENTWISE},
    **{p: _reduction for p in ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                               "argmax", "argmin")},
    "transpose": _transpose,
    "broadcast_in_dim": _broadcast,
    "reshape": _reshape,
    "squeeze": _squeeze,
    "dot_general": _dot,
    "gather": _gather,
    "scatter-add": _scatter,
    "scatter_add": _scatter,
    "split": _along(lambda n: (n.param("axis"),)),
    "concatenate": _along(lambda n: (n.param("dimension"),)),
    "slice": _along(_sliced_axes),
    "pad": _along(lambda n: [d for d, (lo, hi, mid) in enumerate(n.param("padding_config")) if lo or hi or mid]),
    "dynamic_slice": _along(lambda n: [d for d, s in enumerate(n.param("slice_sizes")) if s != n.inputs[0].shape[d]]),
    "cumsum": _along(lambda n: (n.param("axis"),)),
    "cumlogsumexp": _along(lambda n: (n.param("axis"),)),
    "cummax": _along(lambda n: (n.param("axis"),)),
}

# Ops that keep every dimension but rearrange some: a sharding along those needs a permute.
_REARRANGED_AXES: dict[str, Callable[[Node], Iterable[int]]] = {
    "split": lambda n: (n.param("axis"),),
    "concatenate": lambda n: (n.param("dimension"),),
    "slice": _sliced_axes,
    "pad": lambda n: [d for d, (lo, hi, mid) in enumerate(n.param("padding_config")) if lo or hi or mid],
}


def _upstream_dims(node: Node, dim: int, m: int) -> list[tuple[int, int]]:
  """(operand, dimension) that output dimension ``dim`` of ``node`` comes from, for a backward walk."""
  p = node.primitive
  if p in ELEMENTWISE:
    rank = len(node.outputs[0].shape)
    return [(j, dim) for j, t in enumerate(node.inputs) if len(t.shape) == rank and t.shape[dim] > 1]
  if p == "transpose":
    return [(0, tuple(node.param("permutation"))[dim])]
  if p == "reshape":
    d = reshape_dim(node.outputs[0].shape, node.inputs[0].shape, dim, m)
    return [] if d is None else [(0, d)]
  if p == "broadcast_in_dim":
    dims = tuple(node.param("broadcast_dimensions"))
    return [(0, dims.index(dim))] if dim in dims and node.inputs[0].shape[dims.index(dim)] > 1 else []
  if p == "dot_general":
    out = []
    for operand in (0, 1):
      contracting, batch, free, offset = _dot_parts(node, operand)
      if dim < len(batch):
        out.append((operand, batch[dim]))
      elif offset <= dim < offset + len(free):
        out.append((operand, free[dim - offset]))
    return out
  return []


_VIEWS = frozenset({"transpose", "convert_element_type", "copy", "copy_p", "reshape", "broadcast_in_dim"})
