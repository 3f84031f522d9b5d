"""Per-primitive cost rules: FLOPs, transcendentals and bytes of one equation.

Rules live in ``COST_RULES``, keyed by primitive name. A rule receives the
input and output types and the equation's plain params, and returns a
:class:`Cost` for one execution. The conventions follow XLA's
``HloCostAnalysis`` so totals can be checked against
``compiled.cost_analysis()``:

* ``dot_general``: ``2 * output elements * contracted elements``.
* ``conv_general_dilated``: ``2 * batch * output features * input
  features per group * valid taps``, taps on padding not counted.
* elementwise arithmetic, comparisons, selects and dtype conversions: one FLOP
  per output element; data movement (reshape, transpose, slice, gather, pad,
  broadcast, ...) none.
* transcendental functions (exp, log, tanh, sqrt, rsqrt, erf, ...): one
  transcendental per element, no FLOPs; ``logistic`` adds the three FLOPs of
  ``1 / (1 + exp(-x))`` that XLA expands it into, and ``erfc`` the 60 FLOPs
  of its rational approximation.
* reductions: ``input elements - output elements``; ``argmax``/``argmin``
  nine per input element (XLA's variadic comparator).
* ``integer_pow``: the multiplies of binary exponentiation, plus one divide
  for a negative exponent.
* cumulative ops: ``elements * ceil(log2(axis length))`` (a parallel scan).
* gathers and dynamic slices read only what they return plus the indices.

**Default rule** for a primitive not in the table: one FLOP per output
element and the bytes of all operands and results. The trace pass lists such
primitives in ``Graph.unknown_primitives``; add a rule here with
:func:`register` to make the count exact.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from hetspmd.passes.ir import TensorType


@dataclasses.dataclass(frozen=True, slots=True)
class Cost:
  flops: float = 0.0
  transcendentals: float = 0.0
  bytes_read: int = 0
  bytes_written: int = 0


Rule = Callable[[Sequence[TensorType], Sequence[TensorType], Mapping[str, Any]], Cost]
COST_RULES: dict[str, Rule] = {}


def register(*primitives: str) -> Callable[[Rule], Rule]:
  """Registers ``rule`` for each primitive name; returns it unchanged."""

  def wrap(rule: Rule) -> Rule:
    for name in primitives:
      COST_RULES[name] = rule
    return rule

  return wrap


def _io_bytes(inputs: Sequence[TensorType], outputs: Sequence[TensorType]) -> tuple[int, int]:
  return sum(t.nbytes for t in inputs), sum(t.nbytes for t in outputs)


def _out_elements(outputs: Sequence[TensorType]) -> int:
  return sum(t.size for t in outputs)


def default_rule(inputs, outputs, params) -> Cost:
  """One FLOP per output element; all operands read, all results written."""
  r, w = _io_bytes(inputs, outputs)
  return Cost(float(_out_elements(outputs)), 0.0, r, w)


def cost_of(primitive: str, inputs, outputs, params: Mapping[str, Any]) -> tuple[Cost, bool]:
  """(cost, known): the rule's cost, and whether a rule existed."""
  rule = COST_RULES.get(primitive)
  if rule is None:
    return default_rule(inputs, outputs, params), False
  return rule(inputs, outputs, params), True


# --- data movement -----------------------------------------------------------

_MOVEMENT = (
    "reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "slice",
    "concatenate", "pad", "copy", "copy_p", "rev", "iota", "stop_gradient",
    "device_put", "sharding_constraint", "mesh_cast", "reshard", "empty", "empty2",
    "zeros_like", "broadcast", "bitcast_convert_type", "reduce_precision", "optimization_barrier",
    "random_seed", "random_wrap", "random_unwrap", "random_fold_in", "pvary", "pcast",
    "psum", "psum2", "pmax", "pmin", "all_gather", "reduce_scatter", "ppermute", "all_to_all",
    "axis_index", "split", "platform_index", "name",
)


@register(*_MOVEMENT)
def movement_rule(inputs, outputs, params) -> Cost:
  r, w = _io_bytes(inputs, outputs)
  return Cost(0.0, 0.0, r, w)


@register("gather", "dynamic_slice")
def gather_rule(inputs, outputs, params) -> Cost:
  """Reads the selected elements and the indices, not the whole operand."""
  _, w = _io_bytes(inputs, outputs)
  indices = sum(t.nbytes for t in inputs[1:])
  return Cost(0.0, 0.0, w + indices, w)


@register("dynamic_update_slice")
def update_slice_rule(inputs, outputs, params) -> Cost:
  update = inputs[1].nbytes
  return Cost(0.0, 0.0, update + sum(t.nbytes for t in inputs[2:]), update)


@register("scatter")
def scatter_rule(inputs, outputs, params) -> Cost:
  updates = inputs[-1]
  return Cost(0.0, 0.0, updates.nbytes + inputs[1].nbytes, updates.nbytes)


@register("scatter_add", "scatter-add", "scatter_sub", "scatter_mul", "scatter_min", "scatter_max")
def scatter_combine_rule(inputs, outputs, params) -> Cost:
  """One combine per update element."""
  updates = inputs[-1]
  return Cost(float(updates.size), 0.0, 2 * updates.nbytes + inputs[1].nbytes, updates.nbytes)


# --- elementwise ---------------------------------------------------------------

_ELEMENTWISE = (
    "add", "add_any", "sub", "mul", "div", "rem", "max", "min", "neg", "abs", "sign",
    "floor", "ceil", "round", "is_finite", "eq", "ne", "lt", "le", "gt", "ge", "and", "or",
    "not", "xor", "select_n", "convert_element_type", "clamp", "square", "nextafter",
    "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count",
    "clz", "real", "imag", "conj", "complex", "copysign", "reciprocal",
)


@register(*_ELEMENTWISE)
def elementwise_rule(inputs, outputs, params) -> Cost:
  r, w = _io_bytes(inputs, outputs)
  return Cost(float(_out_elements(outputs)), 0.0, r, w)


_TRANSCENDENTAL = (
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "sin", "cos", "tan", "sqrt", "rsqrt",
    "cbrt", "pow", "atan2", "erf", "erf_inv", "lgamma", "digamma", "asin", "acos",
    "atan", "sinh", "cosh", "asinh", "acosh", "atanh",
)


@register(*_TRANSCENDENTAL)
def transcendental_rule(inputs, outputs, params) -> Cost:
  r, w = _io_bytes(inputs, outputs)
  return Cost(0.0, float(_out_elements(outputs)), r, w)


@register("logistic")
def logistic_rule(inputs, outputs, params) -> Cost:
  r, w = _io_bytes(inputs, outputs)
  n = _out_elements(outputs)
  return Cost(3.0 * n, float(n), r, w)


# Every primitive costed here as elementwise (one result element per input element).
ELEMENTWISE_PRIMITIVES = frozenset(_ELEMENTWISE + _TRANSCENDENTAL + ("logistic", "erfc", "integer_pow"))

# XLA expands erfc (jax.nn.gelu(approximate=False) computes through it) into a
# rational approximation: 60 FLOPs and one exp per element in cost_analysis.
ERFC_FLOPS = 60


@register("erfc")
def erfc_rule(inputs, outputs, params) -> Cost:
  r, w = _io_bytes(inputs, outputs)
  n = _out_elements(outputs)
  return Cost(float(ERFC_FLOPS * n), float(n), r, w)


@register("reduce_window_max", "reduce_window_min", "reduce_window_sum")
def reduce_window_rule(inputs, outputs, params) -> Cost:
  """Pooling: ``window - 1`` reductions per output element."""
  r, w = _io_bytes(inputs, outputs)
  return Cost(float(_out_elements(outputs) * (math.prod(params["window_dimensions"]) - 1)), 0.0, r, w)


@register("select_and_scatter_add")
def select_and_scatter_add_rule(inputs, outputs, params) -> Cost:
  """Max-pooling's gradient: XLA counts ``11 × window - 10`` FLOPs per source element.

  (Measured with ``cost_analysis`` for windows of 1 to 9 elements: the
  window's comparisons and selects plus the scatter's adds.)
  """
  r, w = _io_bytes(inputs, outputs)
  source = math.prod(inputs[0].shape)
  return Cost(float(source * (11 * math.prod(params["window_dimensions"]) - 10)), 0.0, r, w)


def integer_pow_multiplies(exponent: int) -> int:
  """Multiplies (and one divide if negative) of binary exponentiation."""
  e = abs(int(exponent))
  if e == 0:
    return 0
  ops = e.bit_length() - 1 + bin(e).count("1") - 1
  return ops + (1 if exponent < 0 else 0)


@register("integer_pow")
def integer_pow_rule(inputs, outputs, params) -> Cost:
  r, w = _io_bytes(inputs, outputs)
  return Cost(float(_out_elements(outputs) * integer_pow_multiplies(params.get("y", 2))), 0.0, r, w)


# --- reductions and scans ------------------------------------------------------


@register("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor")
def reduce_rule(inputs, outputs, params) -> Cost:
  r, w = _io_bytes(inputs, outputs)
  return Cost(float(max(0, inputs[0].size - outputs[0].size)), 0.0, r, w)


@register("argmax", "argmin")
def arg_reduce_rule(inputs, outputs, params) -> Cost:
  r, w = _io_bytes(inputs, outputs)
  return Cost(9.0 * inputs[0].size, 0.0, r, w)


@register("cumsum", "cumprod", "cummax", "cummin")
def cumulative_rule(inputs, outputs, params) -> Cost:
  r, w = _io_bytes(inputs, outputs)
  x = inputs[0]
  axis = int(params.get("axis", 0))
  length = x.shape[axis] if x.shape else 1
  steps = math.ceil(math.log2(length)) if length > 1 else 0
  return Cost(float(x.size * steps), 0.0, r, w)


@register("cumlogsumexp")
def cumlogsumexp_rule(inputs, outputs, params) -> Cost:
  """A parallel scan whose combine is ``log(exp(a) + exp(b))``."""
  scan = cumulative_rule(inputs, outputs, params)
  return dataclasses.replace(scan, transcendentals=3 * scan.flops)


@register("sort")
def sort_rule(inputs, outputs, params) -> Cost:
  r, w = _io_bytes(inputs, outputs)
  x = inputs[0]
  dim = int(params.get("dimension", len(x.shape) - 1)) if x.shape else 0
  length = x.shape[dim] if x.shape else 1
  return Cost(float(x.size * max(1, math.ceil(math.log2(max(length, 2))))), 0.0, r, w)


# --- contractions --------------------------------------------------------------


@register("dot_general")
def dot_general_rule(inputs, outputs, params) -> Cost:
  (lhs_contract, _), _ = params["dimension_numbers"]
  lhs = inputs[0]
  contracted = math.prod(lhs.shape[d] for d in lhs_contract)
  r, w = _io_bytes(inputs, outputs)
  return Cost(2.0 * outputs[0].size * contracted, 0.0, r, w)


def _valid_taps(in_size: int, kernel: int, out_size: int, *, stride: int, pad_lo: int, lhs_dilation: int,
                rhs_dilation: int) -> int:
  """(output position, kernel tap) pairs of one spatial dimension that read real input, not padding."""
  pos = (np.arange(out_size)[:, None] * stride + np.arange(kernel)[None, :] * rhs_dilation - pad_lo)
  dilated = (in_size - 1) * lhs_dilation + 1
  return int(np.count_nonzero((pos >= 0) & (pos < dilated) & (pos % lhs_dilation == 0)))


@register("conv_general_dilated")
def conv_rule(inputs, outputs, params) -> Cost:
  """``2 × batch × output features × input features per group × valid taps``.

  As XLA counts it: taps that fall on padding (or on the holes of a dilated
  input, as in the input gradient of a strided convolution) are not counted.
  """
  lhs, rhs = inputs[0], inputs[1]
  lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
  out = outputs[0]
  spatial = len(rhs_spec) - 2
  strides = params.get("window_strides") or (1,) * spatial
  padding = params.get("padding") or ((0, 0),) * spatial
  lhs_dil = params.get("lhs_dilation") or (1,) * spatial
  rhs_dil = params.get("rhs_dilation") or (1,) * spatial
  taps = 1
  for i in range(spatial):
    taps *= _valid_taps(lhs.shape[lhs_spec[2 + i]], rhs.shape[rhs_spec[2 + i]], out.shape[out_spec[2 + i]],
                        stride=strides[i], pad_lo=padding[i][0], lhs_dilation=lhs_dil[i],
                        rhs_dilation=rhs_dil[i])
  flops = 2.0 * out.shape[out_spec[0]] * out.shape[out_spec[1]] * rhs.shape[rhs_spec[1]] * taps
  r, w = _io_bytes(inputs, outputs)
  return Cost(flops, 0.0, r, w)


# --- random numbers ---------------------------------------------------------------


@register("threefry2x32")
def threefry_rule(inputs, outputs, params) -> Cost:
  """20 rounds of add, rotate (shift, shift, or) and xor on two words."""
  r, w = _io_bytes(inputs, outputs)
  return Cost(float(outputs[0].size * 20 * 5 * 2), 0.0, r, w)


@register("random_bits")
def random_bits_rule(inputs, outputs, params) -> Cost:
  r, w = _io_bytes(inputs, outputs)
  return Cost(float(_out_elements(outputs) * 20 * 5), 0.0, r, w)
