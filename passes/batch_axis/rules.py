"""The example-axis rule table: how each primitive moves the batch's example axis, or mixes examples.

A rule ``rule(eqn, input axes, global batch) -> Decision`` says, for one
equation of a train step traced at the global batch whose inputs carry the
example axis (:class:`Axis`), where its outputs carry it, along which axis
it reads each input (an example-free input of batch size is then sliced to
the microbatch), and whether it reduces over the examples (a *cut*: sum, max
or min). A rule that finds the equation mixing examples in a way that does
not decompose over microbatches raises :class:`Mixing` with the reason.

The default (:func:`default_rule`): elementwise when the primitive has no
axis-like parameter and its outputs keep the input's example dimension,
refused otherwise. :func:`register` adds rules. :mod:`hetspmd.passes.batch_axis.analysis`
runs the table over a step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from hetspmd.passes import _jax_adapter as jx


@dataclasses.dataclass(frozen=True, slots=True)
class Axis:
  """Where a value carries the example axis: dimension ``dim`` has ``B * per_example`` entries.

  ``chunks > 1``: the examples are split into ``chunks`` equal chunks along dimension ``dim - 1``, as a step's own
  gradient accumulation loop splits them (``batch.reshape(chunks, -1, ...)``); dimension ``dim`` then has
  ``B / chunks * per_example`` entries. Only a ``scan`` over the chunks reads such a value
  (:mod:`hetspmd.passes.batch_axis.analysis`); on a microbatch of ``m`` examples it is one chunk of ``m``.
  """

  dim: int
  per_example: int = 1
  chunks: int = 1

  def moved(self, dim: int) -> "Axis":
    return Axis(dim, self.per_example, self.chunks)


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
  """What a rule says of one equation.

  ``outputs``: the example axis of each output (None: example-free).
  ``inputs``: the example axis each input is read along; an example-free
  input with an axis here (a broadcast constant of batch size, a dropout
  mask) is sliced to the microbatch. ``reduce``: ``"sum"``, ``"max"`` or
  ``"min"`` for a cut. ``base``: the input a cut adds its partial sums to
  (a scatter-add's operand), added once after the reduction.
  """

  outputs: tuple[Axis | None, ...]
  inputs: tuple[Axis | None, ...]
  reduce: str | None = None
  base: int | None = None
  body: Any = None  # a microbatch.Body: a nested jaxpr evaluated per microbatch as one unit (checkpoint, scan)
  invariant: tuple[int, ...] = ()  # a body's example-free outputs that are no sums: the same every microbatch


class Mixing(Exception):
  """Raised by a rule: the equation mixes examples in a way that does not decompose."""


Rule = Callable[[Any, Sequence[Axis | None], int], Decision]
RULES: dict[str, Rule] = {}


def register(*names: str) -> Callable[[Rule], Rule]:
  """Registers ``rule(eqn, input axes, global batch) -> Decision`` for the primitives ``names``."""

  def deco(rule: Rule) -> Rule:
    for name in names:
      RULES[name] = rule
    return rule

  return deco


# --- rules --------------------------------------------------------------------------


def _shape(v) -> tuple[int, ...]:
  return jx.aval_shape(v)


def _examples(size: int, axis: Axis, batch: int) -> bool:
  return size == batch * axis.per_example


def elementwise(eqn, axes, batch) -> Decision:
  """Outputs and inputs of one shape (scalars and size-1 dimensions broadcast): the axis stays where it is."""
  carried = {a for a in axes if a is not None}
  if len(carried) > 1:
    raise Mixing(f"its operands carry the examples along different dimensions {sorted(carried, key=str)}")
  axis = carried.pop()
  out_shapes = [_shape(v) for v in eqn.outvars]
  for shape in out_shapes:
    if len(shape) <= axis.dim or not _examples(shape[axis.dim], axis, batch):
      raise Mixing(f"its output of shape {shape} does not keep the example dimension {axis.dim}")
  inputs = []
  for v, a in zip(eqn.invars, axes):
    shape = _shape(v)
    if a is None and len(shape) == len(out_shapes[0]) and shape and shape[axis.dim] != 1:
      inputs.append(axis)  # a batch-sized example-free operand: sliced with the examples
    else:
      inputs.append(a)
  return Decision(tuple(axis for _ in eqn.outvars), tuple(inputs))


_AXIS_PARAMS = ("axis", "axes", "dimension", "dimensions", "permutation", "new_sizes", "shape",
                "dimension_numbers")


def default_rule(eqn, axes, batch) -> Decision:
  """Elementwise when no parameter names an axis and the outputs keep the example dimension; else refused."""
  if any(k in eqn.params for k in _AXIS_PARAMS):
    raise Mixing("hetspmd has no rule for how it moves the example axis "
                 "(register one with hetspmd.passes.batch_axis.rules.register)")
  return elementwise(eqn, axes, batch)


def _free(eqn, axes) -> Decision:
  return Decision(tuple(None for _ in eqn.outvars), tuple(axes))


@register("broadcast_in_dim")
def _broadcast_in_dim(eqn, axes, batch):
  axis = axes[0]
  dim = eqn.params["broadcast_dimensions"][axis.dim]
  if _shape(eqn.outvars[0])[dim] != _shape(eqn.invars[0])[axis.dim]:
    raise Mixing("it broadcasts the example dimension")
  return Decision((axis.moved(dim),), (axis,) + (None,) * (len(eqn.invars) - 1))


@register("reshape")
def _reshape(eqn, axes, batch):
  axis = axes[0]
  if eqn.params.get("dimensions") is not None:
    raise Mixing("it reshapes with a transposition")
  before = _prod(_shape(eqn.invars[0])[:axis.dim])
  out = _shape(eqn.outvars[0])
  running = 1
  for dim, size in enumerate(out):
    if running == before and size == 1 and dim + 1 < len(out):
      continue  # size-1 dimensions before the examples
    if running == before:
      if size % batch == 0 and size >= batch and (size // batch) * _prod(out[dim + 1:]) == (
          axis.per_example * _prod(_shape(eqn.invars[0])[axis.dim + 1:])):
        return Decision((Axis(dim, size // batch),), (axis,) + (None,) * (len(eqn.invars) - 1))
      break
    running *= size
  shape = _shape(eqn.invars[0])
  chunks = out[axis.dim] if before == 1 and axis.dim == 0 and len(out) > len(shape) else 0
  if chunks > 1 and out[1] * chunks == shape[0] and tuple(out[2:]) == tuple(shape[1:]) and axis.per_example == 1:
    # a gradient accumulation loop's chunks: only the scan over them may read this (analysis._decide)
    return Decision((Axis(1, 1, chunks),), (axis,) + (None,) * (len(eqn.invars) - 1))
  raise Mixing(f"it reshapes {shape} to {out}, splitting or interleaving the examples")


def _prod(xs) -> int:
  out = 1
  for x in xs:
    out *= int(x)
  return out


@register("transpose")
def _transpose(eqn, axes, batch):
  return Decision((axes[0].moved(tuple(eqn.params["permutation"]).index(axes[0].dim)),), tuple(axes))


@register("squeeze")
def _squeeze(eqn, axes, batch):
  axis, dims = axes[0], tuple(eqn.params["dimensions"])
  if axis.dim in dims:
    raise Mixing("it squeezes the example dimension")
  return Decision((axis.moved(axis.dim - sum(d < axis.dim for d in dims)),), tuple(axes))


_REDUCTIONS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "reduce_or": "max",
               "reduce_and": "min"}


@register("reduce_sum", "reduce_max", "reduce_min", "reduce_or", "reduce_and", "reduce_prod", "argmax", "argmin")
def _reduce(eqn, axes, batch):
  axis = axes[0]
  reduced = tuple(eqn.params["axes"])
  name = jx.primitive_name(eqn)
  if axis.dim in reduced:
    if name not in _REDUCTIONS:
      raise Mixing(f"{name} over the examples does not decompose over microbatches")
    return Decision((None,), (axis,), reduce=_REDUCTIONS[name])
  return Decision((axis.moved(axis.dim - sum(d < axis.dim for d in reduced)),), (axis,))


@register("dot_general")
def _dot_general(eqn, axes, batch):
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs, rhs = axes[0], axes[1]
  lshape, rshape = _shape(eqn.invars[0]), _shape(eqn.invars[1])
  lfree = [d for d in range(len(lshape)) if d not in lc and d not in lb]
  rfree = [d for d in range(len(rshape)) if d not in rc and d not in rb]

  def partner(axis, own_c, own_b, other_c, other_b):
    if axis.dim in own_b:
      return "batch", Axis(other_b[list(own_b).index(axis.dim)], axis.per_example)
    if axis.dim in own_c:
      return "contract", Axis(other_c[list(own_c).index(axis.dim)], axis.per_example)
    return "free", None

  kinds = []
  if lhs is not None:
    kinds.append(("lhs",) + partner(lhs, lc, lb, rc, rb))
  if rhs is not None:
    kinds.append(("rhs",) + partner(rhs, rc, rb, lc, lb))
  if len(kinds) == 2 and {k[1] for k in kinds} != {"free"} and (kinds[0][1] != kinds[1][1] or kinds[0][2] != rhs):
    raise Mixing("it pairs the examples of one operand with another dimension of the other")
  if len(kinds) == 2 and kinds[0][1] == "free":
    raise Mixing("it multiplies every example with every other (an example-by-example product)")
  side, kind, other = kinds[0]
  inputs = (lhs if lhs is not None else other, rhs if rhs is not None else other) if kind != "free" else (lhs, rhs)
  if kind == "contract":
    return Decision((None,), inputs, reduce="sum")
  if kind == "batch":
    own_b = lb if side == "lhs" else rb
    axis = lhs if side == "lhs" else rhs
    return Decision((axis.moved(list(own_b).index(axis.dim)),), inputs)
  if side == "lhs":
    return Decision((lhs.moved(len(lb) + lfree.index(lhs.dim)),), inputs)
  return Decision((rhs.moved(len(lb) + len(lfree) + rfree.index(rhs.dim)),), inputs)


@register("conv_general_dilated")
def _conv(eqn, axes, batch):
  numbers = eqn.params["dimension_numbers"]
  lhs_spec, rhs_spec, out_spec = numbers.lhs_spec, numbers.rhs_spec, numbers.out_spec
  lhs, rhs = axes
  # a weight gradient contracts the examples whole; grouping it over the channels (a depthwise
  # convolution's batch_group_count) is fine, grouping the examples' features is not
  grouped = eqn.params["feature_group_count"] != 1
  if lhs is not None and rhs is None and lhs.dim == lhs_spec[0] and eqn.params["batch_group_count"] == 1:
    return Decision((lhs.moved(out_spec[0]),), (lhs, None))
  if (lhs is not None and rhs is not None and not grouped and lhs.dim == lhs_spec[1] and rhs.dim == rhs_spec[1]
      and lhs.per_example == rhs.per_example):
    return Decision((None,), (lhs, rhs), reduce="sum")  # a weight gradient: the batch is contracted
  raise Mixing("it convolves over the examples in a way hetspmd does not decompose")


def _gather_out_dims(eqn) -> tuple[int, ...]:
  """Output dimensions of a gather that follow the indices' dimensions (all but the index vector, in order)."""
  offset = set(eqn.params["dimension_numbers"].offset_dims)
  return tuple(d for d in range(len(_shape(eqn.outvars[0]))) if d not in offset)


@register("gather")
def _gather(eqn, axes, batch):
  numbers = eqn.params["dimension_numbers"]
  operand, indices = axes[0], axes[1]
  index_dims = _gather_out_dims(eqn)
  nidx = len(_shape(eqn.invars[1]))
  out = None
  if indices is not None:
    if indices.dim == nidx - 1:
      raise Mixing("its index vector runs along the examples")
    out = indices.moved(index_dims[indices.dim])
  if operand is not None:
    if operand.dim in numbers.operand_batching_dims:
      paired = numbers.start_indices_batching_dims[numbers.operand_batching_dims.index(operand.dim)]
      if indices is None or indices.dim != paired:
        raise Mixing("it gathers examples by the index of another")
      return Decision((out,), (operand, indices))
    if operand.dim in numbers.start_index_map or operand.dim in numbers.collapsed_slice_dims:
      raise Mixing("it indexes into the examples (write x[jnp.arange(n), i] as jnp.take_along_axis(x, i[:, None], "
                   "axis=-1) so that each example reads only itself)")
    if eqn.params["slice_sizes"][operand.dim] != _shape(eqn.invars[0])[operand.dim]:
      raise Mixing("it slices part of the examples")
    kept = [d for d in range(len(_shape(eqn.invars[0])))
            if d not in numbers.collapsed_slice_dims and d not in numbers.operand_batching_dims]
    mine = operand.moved(numbers.offset_dims[kept.index(operand.dim)])
    if out is not None and out != mine:
      raise Mixing("its operand's and indices' examples land on different dimensions")
    return Decision((mine,), (operand, indices))
  batching = list(numbers.start_indices_batching_dims)
  if indices.dim in batching:  # a batch-sized example-free operand, each example gathering from its own row
    return Decision((out,), (indices.moved(numbers.operand_batching_dims[batching.index(indices.dim)]), indices))
  return Decision((out,), (None, indices))


def _scatter_update_dims(eqn) -> tuple[int, ...]:
  window = set(eqn.params["dimension_numbers"].update_window_dims)
  return tuple(d for d in range(len(_shape(eqn.invars[2]))) if d not in window)


@register("scatter-add", "scatter_add", "scatter", "scatter-mul", "scatter_mul", "scatter-min", "scatter_min",
          "scatter-max", "scatter_max", "scatter-sub", "scatter_sub")
def _scatter(eqn, axes, batch):
  numbers = eqn.params["dimension_numbers"]
  operand, indices, updates = axes[0], axes[1], axes[2]
  nidx = len(_shape(eqn.invars[1]))
  scatter_dims = _scatter_update_dims(eqn)
  additive = jx.primitive_name(eqn) in ("scatter-add", "scatter_add")
  if indices is not None and indices.dim == nidx - 1:
    raise Mixing("its index vector runs along the examples")
  lead = indices if indices is not None else (
      Axis(scatter_dims.index(updates.dim), updates.per_example) if updates is not None and updates.dim in scatter_dims
      else None)
  if lead is not None:
    batching = list(numbers.scatter_indices_batching_dims)
    if lead.dim in batching:  # each example scatters into its own row of the operand
      target = Axis(numbers.operand_batching_dims[batching.index(lead.dim)], lead.per_example)
      if operand is not None and operand != target:
        raise Mixing("it scatters examples into other examples' rows")
      return Decision((target,), (target, lead, Axis(scatter_dims[lead.dim], lead.per_example)))
    if operand is not None:
      raise Mixing("it scatters into an operand that carries the examples")
    if not additive:
      raise Mixing("a scatter that overwrites over the examples keeps only one example's value")
    return Decision((None,), (None, lead, Axis(scatter_dims[lead.dim], lead.per_example)), reduce="sum", base=0)
  if updates is not None and updates.dim in numbers.update_window_dims:  # examples along a window dimension
    window = [d for d in range(len(_shape(eqn.invars[0]))) if d not in numbers.inserted_window_dims
              and d not in numbers.operand_batching_dims]
    target = updates.moved(window[list(numbers.update_window_dims).index(updates.dim)])
    if (operand is None or operand == target) and _shape(eqn.invars[0])[target.dim] == _shape(eqn.invars[2])[
        updates.dim]:
      return Decision((target,), (target, None, updates))
  raise Mixing("it scatters across the examples")


@register("select_n", "clamp", "add", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem", "and", "or",
          "xor", "eq", "ne", "lt", "le", "gt", "ge", "nextafter", "add_any", "integer_pow", "neg", "exp", "exp2",
          "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "sqrt", "rsqrt", "cbrt", "abs", "sign",
          "floor", "ceil", "round", "is_finite", "not", "erf", "erfc", "erf_inv", "lgamma", "digamma", "square",
          "convert_element_type", "reduce_precision", "copy", "copy_p", "stop_gradient", "real", "imag", "conj",
          "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count", "asin", "acos", "atan",
          "sinh", "cosh", "asinh", "acosh", "atanh", "random_wrap", "random_unwrap", "random_fold_in")
def _elementwise(eqn, axes, batch):
  return elementwise(eqn, axes, batch)


@register("bitcast_convert_type")
def _bitcast(eqn, axes, batch):
  return Decision((axes[0],), tuple(axes))


@register("optimization_barrier")
def _barrier(eqn, axes, batch):
  # its example-free operands pass through inside the loop: values that exist only there
  return Decision(tuple(axes), tuple(axes), invariant=tuple(j for j, a in enumerate(axes) if a is None))


@register("random_bits", "random_split")
def _random_bits(eqn, axes, batch):
  return Decision((axes[0],), tuple(axes))  # the key's dimensions lead the output


_ALONG_DIMENSION = {"concatenate": "it concatenates along the examples", "sort": "it sorts along the examples"}


@register(*_ALONG_DIMENSION)
def _along_dimension(eqn, axes, batch):
  """Operands of one shape, joined or ordered along ``dimension``: fine unless that is the examples'."""
  axis = next(a for a in axes if a is not None)
  if axis.dim == eqn.params["dimension"]:
    raise Mixing(_ALONG_DIMENSION[jx.primitive_name(eqn)])
  return elementwise(eqn, axes, batch)


@register("pad")
def _pad(eqn, axes, batch):
  axis = axes[0]
  if axis is None or tuple(eqn.params["padding_config"][axis.dim]) != (0, 0, 0):
    raise Mixing("it pads along the examples")
  return Decision((axis,), (axis, None))


@register("slice")
def _slice(eqn, axes, batch):
  axis = axes[0]
  p = eqn.params
  full = _shape(eqn.invars[0])[axis.dim]
  if p["start_indices"][axis.dim] != 0 or p["limit_indices"][axis.dim] != full or (
      p["strides"] is not None and p["strides"][axis.dim] != 1):
    raise Mixing("it slices part of the examples (x[:k] along the batch)")
  return Decision((axis,), (axis,))


@register("dynamic_slice")
def _dynamic_slice(eqn, axes, batch):
  axis = axes[0]
  if axis is None or any(a is not None for a in axes[1:]):
    raise Mixing("its start index depends on the examples")
  if eqn.params["slice_sizes"][axis.dim] != _shape(eqn.invars[0])[axis.dim]:
    raise Mixing("it slices part of the examples")
  return Decision((axis,), tuple(axes))


@register("dynamic_update_slice")
def _dynamic_update_slice(eqn, axes, batch):
  operand, update = axes[0], axes[1]
  axis = operand or update
  if any(a is not None for a in axes[2:]) or _shape(eqn.invars[1])[axis.dim] != _shape(eqn.invars[0])[axis.dim]:
    raise Mixing("it updates part of the examples")
  return Decision((axis,), (axis, axis) + tuple(axes[2:]))


@register("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def _cumulative(eqn, axes, batch):
  if axes[0].dim == eqn.params["axis"]:
    raise Mixing("it accumulates along the examples, so each result depends on the examples before it")
  return Decision((axes[0],), tuple(axes))


@register("rev")
def _rev(eqn, axes, batch):
  if axes[0].dim in tuple(eqn.params["dimensions"]):
    raise Mixing("it reverses the order of the examples")
  return Decision((axes[0],), tuple(axes))


@register("sharding_constraint", "mesh_cast", "reshard")
def _sharding(eqn, axes, batch):
  return Decision(tuple(axes), tuple(axes))  # placement only; inside the loop the data axis is hetspmd's


@register("split")
def _split(eqn, axes, batch):
  if axes[0].dim == eqn.params["axis"]:
    raise Mixing("it splits the examples")
  return Decision(tuple(axes[0] for _ in eqn.outvars), tuple(axes))


@register("top_k")
def _top_k(eqn, axes, batch):
  if axes[0].dim == eqn.params.get("axis", len(_shape(eqn.invars[0])) - 1) % len(_shape(eqn.invars[0])):
    raise Mixing("it ranks the examples")
  return Decision(tuple(axes[0] for _ in eqn.outvars), tuple(axes))


@register("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window", "select_and_scatter_add",
          "select_and_gather_add", "reduce_window_cumsum")
def _window(eqn, axes, batch):
  axis = next(a for a in axes if a is not None)
  p = eqn.params
  dim = axis.dim
  unit = (p["window_dimensions"][dim] == 1 and p["window_strides"][dim] == 1
          and tuple(p["padding"][dim]) == (0, 0) and (p.get("base_dilation") or (1,) * (dim + 1))[dim] == 1
          and (p.get("window_dilation") or (1,) * (dim + 1))[dim] == 1)
  if not unit:
    raise Mixing("its window spans several examples")
  return elementwise(eqn, axes, batch)


@register("iota", "rng_uniform", "rng_bit_generator")
def _source(eqn, axes, batch):
  return _free(eqn, axes)
