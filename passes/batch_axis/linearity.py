"""Which example-free equations keep a sum over the examples a sum: the rule table nested bodies are checked by.

Inside a body that runs once per microbatch as one unit (a ``scan`` step, a
checkpointed block, a counted loop over chunks of the batch), a value that
sums over the examples holds only the microbatch's part of the sum, and the
parts are added after the loop. Work on such a partial sum is exact only
where it is linear in it, ``f(a + b) = f(a) + f(b)``, so that the parts of
``f``'s result add up to ``f`` of the whole sum: the split of a gradient
accumulated over microbatches is the split of the whole gradient, its square
is not the square of the whole.

A rule ``rule(eqn, summed, is_zero) -> reason | None`` reads one equation
with a sum among its operands (``summed``: per operand, whether it carries
one; ``is_zero(var)``: whether an operand is known to be zero) and returns
why the equation is not linear in them (a phrase after "its scan body ..."),
or None. Every output of an accepted equation is a sum (``split`` keeps each
piece one). The operand positions matter: ``dynamic_slice`` is linear in its
operand, not its indices; ``add`` only when every operand is a sum or zero
(a sum plus a constant adds the constant once per microbatch); ``mul`` when
one factor is a sum. A checkpointed block is linear when its body is
(:func:`nonlinear_use` over it). A primitive without a rule is not linear:
"applies <primitive> to a sum over the examples" (a ``max``, a square, a
``while`` or ``cond`` over a sum).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax.numpy as jnp
import numpy as np

from hetspmd.passes import _jax_adapter as jx

Rule = Callable[[Any, Sequence[bool], Callable[[Any], bool]], "str | None"]
LINEAR: dict[str, Rule] = {}


def register(*names: str) -> Callable[[Rule], Rule]:
  """Registers ``rule(eqn, summed, is_zero) -> reason | None`` for the primitives ``names``."""

  def deco(rule: Rule) -> Rule:
    for name in names:
      LINEAR[name] = rule
    return rule

  return deco


def _only_first(eqn, summed, is_zero) -> str | None:
  """Linear in operand 0; the other operands (indices, sizes) must not be sums."""
  if any(summed[1:]):
    return f"indexes or sizes {jx.primitive_name(eqn)} by a sum over the examples"
  return None


# structural and unary: a value moved, copied, negated, summed over its own axes, split into pieces, or viewed
# as its real or imaginary part
register("neg", "transpose", "reshape", "squeeze", "broadcast_in_dim", "rev", "copy", "copy_p", "reduce_sum",
         "slice", "split", "dynamic_slice", "reduce_precision", "real", "imag", "conj", "cumsum",
         "reduce_window_sum", "fft", "sharding_constraint")(_only_first)


def _additive(eqn, summed, is_zero, fixed: frozenset = frozenset()) -> str | None:
  """Linear in the operands outside ``fixed`` together, where each of them is a sum or zero; ``fixed`` operands
  (a predicate, indices) must not be sums."""
  if any(summed[j] for j in fixed):
    return f"selects or indexes by a sum over the examples ({jx.primitive_name(eqn)})"
  if any(not s and j not in fixed and not is_zero(v) for j, (v, s) in enumerate(zip(eqn.invars, summed))):
    return "adds a sum over the examples to a value that is not one"
  return None


register("add", "sub", "add_any", "concatenate", "complex")(_additive)


@register("pad")
def _pad(eqn, summed, is_zero) -> str | None:
  if not summed[1] and not is_zero(eqn.invars[1]):
    return "pads a sum over the examples with a value that is not zero"
  return _additive(eqn, summed, is_zero)


@register("select_n")
def _select_n(eqn, summed, is_zero) -> str | None:
  return _additive(eqn, summed, is_zero, frozenset({0}))


@register("dynamic_update_slice")
def _dynamic_update_slice(eqn, summed, is_zero) -> str | None:
  return _additive(eqn, summed, is_zero, frozenset(range(2, len(summed))))


@register("scatter-add")
def _scatter_add(eqn, summed, is_zero) -> str | None:
  return _additive(eqn, summed, is_zero, frozenset({1}))


@register("gather")
def _gather(eqn, summed, is_zero) -> str | None:
  mode = getattr(eqn.params.get("mode"), "name", str(eqn.params.get("mode")))
  if "FILL" in mode and eqn.params.get("fill_value") != 0:  # out of bounds: the fill once per microbatch
    return "gathers from a sum over the examples with a fill value that is not zero"
  return _only_first(eqn, summed, is_zero)


@register("mul", "dot_general", "conv_general_dilated")
def _product(eqn, summed, is_zero) -> str | None:
  if sum(summed) != 1:
    return "multiplies two sums over the examples"
  return None


@register("div")
def _div(eqn, summed, is_zero) -> str | None:
  if summed[1]:
    return "divides by a sum over the examples"
  return None


@register("select_and_scatter_add", "select_and_gather_add")
def _pooling_transpose(eqn, summed, is_zero) -> str | None:
  """A max pool's transpose and tangent: linear in the values they route (operand 0), not in the operand that
  picks where (operand 1)."""
  if summed[1]:
    return f"picks positions by a sum over the examples ({jx.primitive_name(eqn)})"
  return None


def _inexact(dtype) -> bool:
  return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)  # bfloat16 too


@register("convert_element_type")
def _convert(eqn, summed, is_zero) -> str | None:
  """A cast between floating-point types rounds as the single-device step does; one to an integer or a boolean
  of a floating-point sum is a floor or a test, not linear."""
  new = eqn.params.get("new_dtype")
  if np.dtype(new) == np.bool_ or (_inexact(jx.aval_dtype(eqn.invars[0])) and not _inexact(new)):
    return f"converts a sum over the examples to {np.dtype(new).name}"
  return None


@register(*jx.CHECKPOINTS)
def _checkpoint(eqn, summed, is_zero) -> str | None:
  body = jx.inline_calls(jx.call_body(eqn))  # its nested calls inlined, its inputs in the same order
  return nonlinear_use(body, [v for v, s in zip(jx.invars(body), summed) if s])


def is_zero(var, producers: dict, eqns) -> bool:
  """Whether ``var`` is zero: a zero literal, or a broadcast or cast of one (``producers``: var -> index into
  ``eqns``)."""
  if jx.is_literal(var):
    return bool(np.all(np.asarray(jx.literal_value(var)) == 0))
  i = producers.get(var)
  if i is None:
    return False
  eqn = eqns[i]
  return jx.primitive_name(eqn) in ("broadcast_in_dim", "convert_element_type") and is_zero(
      eqn.invars[0], producers, eqns)


def reason(eqn, summed: Sequence[bool], is_zero_: Callable[[Any], bool]) -> str | None:
  """Why the example-free ``eqn`` is not linear in its ``summed`` operands, or None when it is."""
  rule = LINEAR.get(jx.primitive_name(eqn))
  if rule is None:
    return f"applies {jx.primitive_name(eqn)} to a sum over the examples"
  return rule(eqn, summed, is_zero_)


def nonlinear_use(closed: Any, sums: Sequence[Any]) -> str | None:
  """Why the closed jaxpr ``closed`` is not linear in its inputs ``sums`` (every value computed from one is a
  sum, checked equation by equation), or None."""
  eqns = jx.equations(closed)
  producers = {v: i for i, e in enumerate(eqns) for v in e.outvars}
  summed_vars = set(sums)
  for e in eqns:
    summed = [not jx.is_literal(v) and v in summed_vars for v in e.invars]
    if not any(summed):
      continue
    why = reason(e, summed, lambda v: is_zero(v, producers, eqns))
    if why is not None:
      return why
    summed_vars.update(e.outvars)
  return None
