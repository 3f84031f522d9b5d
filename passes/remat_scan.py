"""Remat ``"layers"`` for a layer scan: the forward scan saves each layer's input, its transpose recomputes.

A model that scans its layers (Linen ``nn.scan``, ``nnx.scan``, ``lax.scan`` over stacked parameters) traces,
once differentiated, to two scans (:mod:`hetspmd.passes.frontend.stack` finds them): ``F``, the forward scan,
whose scanned outputs stack every layer's residuals, and ``B``, its transpose, which reads them a layer at a
time. This pass rewrites both bodies:

* ``F`` stops emitting the per-example residuals ``B`` reads; it stacks its carry's value as each layer began
  (the layer's input) instead, beside what else it emits;
* ``B`` takes those inputs, ``F``'s stacked parameters and ``F``'s constants, and at each iteration first
  recomputes that layer's residuals from them (``F``'s body in a checkpointed call, whose inputs XLA sees
  through an optimization barrier), then runs its own body on them.

Only the layer inputs (``layers x microbatch x ...``) stay live between the two scans. The recomputation runs
``F``'s whole body once more per layer (its dropout draws from the same keys, so the same bits); what it
makes beyond the residuals is dead and XLA removes it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from hetspmd.errors import NoLayerStackError
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.frontend import stack


@dataclasses.dataclass(frozen=True)
class _Pair:
  """The layer scan's two equations, their parts, and the positions (among ``F``'s scanned outputs) of the
  residuals ``B`` recomputes."""

  f_eqn: Any
  b_eqn: Any
  f: jx.ScanParts
  b: jx.ScanParts
  remade: tuple[int, ...]

  @property
  def f_ys(self) -> list:
    return list(self.f_eqn.outvars[self.f.num_carry:])


def rematerialize_scan(flat: jx.ClosedJaxpr, per_example: Callable[[Any], bool]) -> tuple[jx.ClosedJaxpr, int]:
  """``flat`` with its layer scan's residuals recomputed in its transpose, and the layer count (0: no layer scan
  whose transpose reads per-example residuals; ``flat`` as it is)."""
  eqns = jx.equations(flat)
  sites = stack.sites_in_jaxpr(eqns, lambda i, j: not jx.is_literal(eqns[i].invars[j])
                               and per_example(eqns[i].invars[j]))
  try:
    found = stack.find_layer_stack(sites)
  except NoLayerStackError:
    return flat, 0
  f_eqn, b_eqn = eqns[found.forward], eqns[found.backward]
  f, b = jx.scan_parts(f_eqn), jx.scan_parts(b_eqn)
  b_xs = b_eqn.invars[b.num_consts + b.num_carry:]
  readers = [v for e in eqns if e is not b_eqn for v in e.invars] + list(jx.outvars(flat))
  remade = tuple(k for k, y in enumerate(f_eqn.outvars[f.num_carry:])
                 if y in b_xs and per_example(y) and not any(y is v for v in readers))
  if not remade:
    return flat, 0
  pair = _Pair(f_eqn, b_eqn, f, b, remade)
  stacked: dict = {}

  def forward(eqn, env):
    return _forward(pair, [jx.read(env, v) for v in eqn.invars], stacked)

  def backward(eqn, env):
    f_operands = [jx.read(env, v) for v in f_eqn.invars]
    return _backward(pair, [jx.read(env, v) for v in eqn.invars], f_operands, stacked["inputs"])

  return jx.retraced(flat, {id(f_eqn): forward, id(b_eqn): backward}), found.length


def _forward(pair: _Pair, operands: list, stacked: dict) -> list:
  """``F`` with the residuals left out and each layer's carry input stacked (into ``stacked["inputs"]``); its
  other results as they were, the left-out ones ``None`` (only ``B`` read them, and ``B`` is rewritten too)."""
  f = pair.f
  consts, init, xs = (operands[:f.num_consts], operands[f.num_consts:f.num_consts + f.num_carry],
                      operands[f.num_consts + f.num_carry:])
  kept = [k for k in range(len(pair.f_ys)) if k not in pair.remade]

  def body(carry, x):
    out = jx.eval_closed(f.body, [*consts, *carry, *x])
    return out[:f.num_carry], ([carry[0]], [out[f.num_carry + k] for k in kept])

  carry, (inputs, kept_ys) = jx.scan_as(pair.f_eqn, body, init, xs, length=f.length, reverse=False)
  stacked["inputs"] = inputs[0]
  ys: list = [None] * len(pair.f_ys)
  for k, y in zip(kept, kept_ys):
    ys[k] = y
  return list(carry) + ys


def _backward(pair: _Pair, operands: list, f_operands: list, stacked: Any) -> list:
  """``B`` reading, for each of ``F``'s residuals, its recomputation from the layer's input (``stacked``), ``F``'s
  scanned parameters and ``F``'s constants (``f_operands``: ``F``'s operands)."""
  f, b = pair.f, pair.b
  consts, init = operands[:b.num_consts], operands[b.num_consts:b.num_consts + b.num_carry]
  xs = operands[b.num_consts + b.num_carry:]
  f_ys = pair.f_ys
  b_xs = pair.b_eqn.invars[b.num_consts + b.num_carry:]
  residual_at = {j: pair.remade.index(f_ys.index(v)) for j, v in enumerate(b_xs)
                 if v in f_ys and f_ys.index(v) in pair.remade}
  others = [x for j, x in enumerate(xs) if j not in residual_at]
  f_consts, f_xs = f_operands[:f.num_consts], f_operands[f.num_consts + f.num_carry:]

  def recompute(*args):
    n = len(f_consts)
    out = jx.eval_closed(f.body, [*args[:n], args[n], *args[n + 1:]])
    return [out[f.num_carry + k] for k in pair.remade]

  def body(carry, x):
    rest, layer_input, layer_xs = x
    residuals = jx.recomputed_call(recompute, [*f_consts, layer_input, *layer_xs], like=pair.b_eqn)
    it = iter(rest)
    sliced = [residuals[residual_at[j]] if j in residual_at else next(it) for j in range(len(xs))]
    out = jx.eval_closed(b.body, [*consts, *carry, *sliced])
    return out[:b.num_carry], out[b.num_carry:]

  carry, ys = jx.scan_as(pair.b_eqn, body, init, (others, stacked, f_xs), length=b.length, reverse=True)
  return list(carry) + list(ys)
