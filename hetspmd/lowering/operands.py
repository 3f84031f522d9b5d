"""The operands of one microbatch: example-free values of batch size rebuilt at the microbatch's size, or sliced.

A broadcast constant, or a dropout mask drawn at the global batch, is read inside the loop. Rebuilding it
at the microbatch's size (a random draw as its slice of the full-batch draw) keeps every microbatch
exactly its part of the full-batch step; anything that cannot be rebuilt is sliced at the microbatch's
global offset.
"""

from __future__ import annotations

from typing import Sequence

import jax

from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.batch_axis.rules import Axis


def resize(shape: Sequence[int], axis: Axis, m: int) -> tuple[int, ...]:
  """``shape`` on a microbatch of ``m`` examples; a chunked axis (an accumulation loop's) is one chunk of ``m``."""
  out = list(shape)
  out[axis.dim] = m * axis.per_example
  if axis.chunks > 1:
    out[axis.dim - 1] = 1
  return tuple(out)


# Example-free equations a batch-sized value can be rebuilt through at the microbatch's size: those that
# keep their operands' shape (scalars and size-1 dimensions broadcast).
REBUILT_THROUGH = frozenset({
    "add", "sub", "mul", "div", "max", "min", "lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not", "xor",
    "select_n", "convert_element_type", "bitcast_convert_type", "shift_right_logical", "shift_left", "neg",
    "exp", "log", "floor", "ceil", "sign", "abs", "copy", "integer_pow", "clamp"})


def rebuilt(prog, var, axis, depth: int = 0):
  """How to make the example-free, batch-sized ``var`` at the microbatch's size inside the loop, or None.

  A tuple of ``(equation, axis of its output)`` in order, each rebuilt from the ones before: a broadcast
  that creates the batch dimension (bound at the microbatch size), a random draw (only the microbatch's
  slice of the full-batch draw: :func:`jx.random_bits_slice`), and the broadcasts, reshapes and
  elementwise work between them and ``var`` (a dropout mask, a causal mask broadcast over the batch).
  Everything else they read comes from outside the loop, unchanged.
  """
  producer = prog.producer.get(var)
  if axis is None or var in prog.analysis.axes or producer is None or depth > 24:
    return None
  eqn = prog.eqns[producer]
  name = jx.primitive_name(eqn)
  shape = jx.aval_shape(var)
  if name == "broadcast_in_dim":
    dims = tuple(eqn.params["broadcast_dimensions"])
    if axis.dim not in dims:
      return ((eqn, axis),)
    operand = eqn.invars[0]
    j = dims.index(axis.dim)
    if jx.is_literal(operand) or jx.aval_shape(operand)[j] != shape[axis.dim]:
      return None
    inner = rebuilt(prog, operand, axis.moved(j), depth + 1)
    return None if inner is None else inner + ((eqn, axis),)
  if name == "reshape" and eqn.params.get("dimensions") is None:
    operand = eqn.invars[0]
    if jx.aval_shape(operand)[:axis.dim + 1] != shape[:axis.dim + 1]:
      return None  # only reshapes that keep every dimension up to the examples'
    inner = rebuilt(prog, operand, axis, depth + 1)
    return None if inner is None else inner + ((eqn, axis),)
  if name == "random_bits" and jx.aval_shape(eqn.invars[0]) == ():
    return ((eqn, axis),)
  if name in REBUILT_THROUGH and jx.aval_shape(eqn.outvars[0]) == shape:
    chain: list = []
    for v in eqn.invars:
      operand = () if jx.is_literal(v) else jx.aval_shape(v)
      if len(operand) != len(shape) or operand[axis.dim] != shape[axis.dim]:
        continue  # a scalar, or broadcast along the examples: read as it is
      inner = rebuilt(prog, v, axis, depth + 1)
      if inner is None:
        return None
      chain += [e for e in inner if e[0] not in {c[0] for c in chain}]
    return tuple(chain) + ((eqn, axis),) if chain else None
  return None


def chain_inputs(chain) -> list:
  made = {v for e, _ in chain for v in e.outvars}
  return list(dict.fromkeys(v for e, _ in chain for v in e.invars if not jx.is_literal(v) and v not in made))


def sliceable(chain) -> bool:
  """Whether every random draw in ``chain`` can be drawn as a slice (known when tracing: the key's type)."""
  return all(jx.draw_is_sliceable(e) for e, _ in chain if jx.primitive_name(e) == "random_bits")


def rebuild(prog, chain, var, axis, env, *, offset, m):
  """Evaluates ``chain`` (from :func:`_rebuilt`) at the microbatch's size; ``var``'s value, or None."""
  local: dict = {}
  for eqn, at in chain:
    name = jx.primitive_name(eqn)
    invals = [jx.read(env, v) if jx.is_literal(v) or v not in local else local[v] for v in eqn.invars]
    if name in ("broadcast_in_dim", "reshape"):
      params = dict(eqn.params)
      key = "shape" if name == "broadcast_in_dim" else "new_sizes"
      params[key] = resize(params[key], at, m)
      out = jx.bind(eqn, invals, params)
    elif name == "random_bits":
      bits = jx.random_bits_slice(invals[0], eqn.params["bit_width"], eqn.params["shape"], at.dim,
                                  offset * at.per_example, m * at.per_example)
      if bits is None:
        return None
      out = [bits]
    else:
      out = jx.bind(eqn, invals)
    local.update(zip(eqn.outvars, out))
  return local[var]


def operand(prog, env, var, axis, offset, m):
  """The value of ``var`` in one microbatch: its own, or an example-free batch-sized value rebuilt or sliced."""
  if jx.is_literal(var):
    return var.val
  if var in prog.analysis.axes or axis is None or var in getattr(prog, "presliced", ()):
    return env[var]
  chain = prog.rebuilt(var, axis)
  if chain is not None:
    value = rebuild(prog, chain, var, axis, env, offset=offset, m=m)
    if value is not None:
      return value
  value = env[var]
  return jax.lax.dynamic_slice_in_dim(value, offset * axis.per_example, m * axis.per_example, axis.dim)
