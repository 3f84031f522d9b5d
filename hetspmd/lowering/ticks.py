"""One device's forward and backward ticks over its stage's layers (see :mod:`hetspmd.lowering.staged`).

In forward tick ``t`` stage ``s`` takes microbatch ``t - s``: ``pre`` (every
stage), ``F``'s body for its own layers (keeping what ``B`` reads), ``mid`` on
the last stage. In backward tick ``t`` it takes microbatch ``t - (S - 1 - s)``:
``pre`` again, ``B``'s body for its layers in reverse, ``post`` on the first
stage. Activations and their cotangents cross stages by one ``ppermute`` per
tick; a data position past its count skips the ticks' work.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from hetspmd.lowering import operands
from hetspmd.lowering.exchange import Exchange
from hetspmd._dtypes import wide
from hetspmd.lowering.loop import combiner, identity, run_equation
from hetspmd.lowering.pipeline import tick_slot
from hetspmd.passes import _jax_adapter as jx


@dataclasses.dataclass(frozen=True)
class StageDevice:
  """One device of a staged loop (``loop``: a :class:`hetspmd.lowering.staged.StagedLoop`), while it is traced:
  its stage, its layer count and rows, its data position's count, the values its loops read (``outer``, which
  the earlier loops extend) and its stage's rows of the stacked inputs held in blocks (``padded``)."""

  loop: Any
  stage: Any
  layers: Any
  count: Any
  rows: Any
  outer: dict
  padded: dict
  buffers: tuple
  start: Any

  @classmethod
  def of(cls, loop, values, buffers, counts, starts) -> "StageDevice":
    layout = loop.layout
    s = jax.lax.axis_index(layout.stage_axis)
    outer = dict(zip(loop.ops.inputs, values))
    exchange = Exchange(loop.layers, layout.stage_axis)
    padded = {v: exchange.gather(outer[v], s) for v in loop.ops.inputs if v in loop.sharded}
    return cls(loop, s, jnp.asarray(loop.layers, jnp.int32)[s], counts[0], jnp.asarray(loop.rows)[s], outer, padded,
               tuple(buffers), starts[0])

  # --- the pieces of one microbatch ------------------------------------------------------------

  @property
  def num_stages(self) -> int:
    return len(self.loop.layers)

  @property
  def first(self):
    return self.stage == 0

  @property
  def last(self):
    return self.stage == self.num_stages - 1

  def slot(self, t, lag):
    """Whether tick ``t`` of a stage ``lag`` ticks behind runs a microbatch of this position, and which."""
    valid, ii = tick_slot(t, lag, self.loop.layout.max_count)
    return valid & (ii < self.count), ii

  def microbatch_env(self, i):
    env = dict(self.outer)
    for v, buf in zip(self.loop.ops.batch_vars, self.buffers):
      env[v] = jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)
    return env, self.start + i * self.loop.layout.microbatch

  def run_group(self, indices, env, offset):
    """Runs equations on one microbatch; the partial values of the cuts among them, by cut position."""
    prog, m = self.loop.prog, self.loop.layout.microbatch
    position = {c.index: k for k, c in enumerate(self.loop.ops.cut_outs)}
    partial = {}
    for index in indices:
      ran = run_equation(prog, index, env, offset, m)
      if ran is None:
        continue
      out, summed = ran
      if prog.cuts.get(index) is not None:
        partial[position[index]] = [wide(out[j]) for j in summed]
    return partial

  def operands_of(self, index: int, env, offset, skip=()) -> dict:
    """Equation ``index``'s inputs on one microbatch, by position (but those in ``skip``)."""
    prog, m = self.loop.prog, self.loop.layout.microbatch
    eqn, decision = prog.eqns[index], prog.analysis.decisions[index]
    return {j: operands.operand(prog, env, v, a, offset, m)
            for j, (v, a) in enumerate(zip(eqn.invars, decision.inputs)) if j not in skip}

  def cotangent(self, env, offset):
    """B's incoming cotangent on one microbatch (made by ``mid``)."""
    loop = self.loop
    be, bd = loop.prog.eqns[loop.stack.backward], loop.prog.analysis.decisions[loop.stack.backward]
    nc = jx.scan_parts(be).num_consts
    return operands.operand(loop.prog, env, be.invars[nc], bd.inputs[nc], offset, loop.layout.microbatch)

  def local(self, x):
    """This stage's rows of an example-free stacked value, padded to the largest stage."""
    return jnp.take(x, self.rows, axis=0)

  def keep(self, k, y, offset):
    """What F's output ``k`` keeps of one layer: an example-free value of batch size (a dropout mask drawn at
    the global batch) only its microbatch's slice, as B's scan would read it."""
    a, m = self.loop.slices.get(k), self.loop.layout.microbatch
    return y if a is None else jax.lax.dynamic_slice_in_dim(y, offset * a.per_example, m * a.per_example, a.dim - 1)

  def masked(self, parts, keep):
    kinds = self.loop.ops.cut_outs
    return {k: [jnp.where(keep, x, identity(kinds[k].reduce, x.shape, x.dtype)) for x in v] for k, v in parts.items()}

  def combine(self, acc, parts):
    kinds = self.loop.ops.cut_outs
    return {**acc, **{k: [combiner(kinds[k].reduce)(a, x) for a, x in zip(acc[k], v)] for k, v in parts.items()}}

  def shapes(self):
    """One microbatch's group partials, what F keeps per layer, F's output and B's incoming cotangent."""
    loop = self.loop
    stack, fe = loop.stack, loop.prog.eqns[loop.stack.forward]
    nc = jx.scan_parts(fe).num_consts
    env, offset = self.microbatch_env(0)
    pre = self.run_group(stack.pre, env, offset)
    fin = self.operands_of(stack.forward, env, offset)
    xs = [fin[j][0] for j in range(nc + 1, len(fin))]
    fout = loop.f_body.run([fin[j] for j in range(nc + 1)] + xs, offset, loop.layout.microbatch)
    env.update({fe.outvars[0]: fout[0]})
    mid = self.run_group(stack.mid, env, offset)
    g = self.cotangent(env, offset)
    env[loop.prog.eqns[stack.backward].outvars[0]] = g
    post = self.run_group(stack.post, env, offset)
    return {**pre, **mid, **post}, fout[1:], fout[0], g

  # --- the ticks -----------------------------------------------------------------------------------

  def forward(self):
    """The forward ticks: the group sums so far, B's incoming cotangent per microbatch (``top``, made on the last
    stage) and what F kept per microbatch and layer (``saved``)."""
    loop, layout = self.loop, self.loop.layout
    M, L = layout.max_count, max(loop.layers)
    part_shapes, kept_shapes, h_shape, g_shape = jax.eval_shape(self.shapes)
    kinds = loop.ops.cut_outs
    zero_parts = {k: [identity(kinds[k].reduce, x.shape, x.dtype) for x in v] for k, v in part_shapes.items()}
    read = set(loop.kept.values())  # F's outputs B reads: only those are kept, per microbatch and layer
    num_carry = jx.scan_parts(loop.prog.eqns[loop.stack.forward]).num_carry
    saved = {k: jnp.zeros((M, L) + y.shape, y.dtype) for k, y in (
        (k, jax.eval_shape(lambda y, k=k: self.keep(k, y, 0), x)) for k, x in enumerate(kept_shapes, num_carry))
             if k in read}
    top = jnp.zeros((M,) + g_shape.shape, g_shape.dtype)
    h_zero = jnp.zeros(h_shape.shape, h_shape.dtype)
    _, saved, acc, top = jax.lax.fori_loop(0, M + self.num_stages - 1, self.forward_tick,
                                           (h_zero, saved, zero_parts, top))
    return acc, top, saved

  def forward_tick(self, t, carry):
    loop = self.loop
    stack, fe, m = loop.stack, loop.prog.eqns[loop.stack.forward], loop.layout.microbatch
    nc = jx.scan_parts(fe).num_consts
    send, saved, acc, top = carry
    recv = self._shift(send, [(s, s + 1) for s in range(self.num_stages - 1)])
    valid, ii = self.slot(t, self.stage)
    env, offset = self.microbatch_env(ii)
    acc = self.combine(acc, self.masked(self.run_group(stack.pre, env, offset), valid & self.first))
    fin = self.operands_of(stack.forward, env, offset)
    consts = [fin[j] for j in range(nc)]
    xs = [self.padded[v] if v in self.padded else self.local(fin[j])
          for j, v in enumerate(fe.invars) if j >= nc + 1]
    h = jnp.where(self.first, fin[nc], recv)

    def layer(l, c):
      h, saved = c
      out = loop.f_body.run(consts + [h] + [x[l] for x in xs], offset, m)
      saved = {k: buf.at[ii, l].set(self.keep(k, out[k], offset)) for k, buf in saved.items()}
      return out[0], saved

    h, saved = jax.lax.fori_loop(0, jnp.where(valid, self.layers, 0), layer, (h, saved))

    def head(args):
      acc, top = args
      local_env = {**env, fe.outvars[0]: h}
      parts = self.run_group(stack.mid, local_env, offset)
      return self.combine(acc, parts), jax.lax.dynamic_update_index_in_dim(top, self.cotangent(local_env, offset),
                                                                           ii, 0)

    acc, top = jax.lax.cond(valid & self.last, head, lambda args: args, (acc, top))
    return h, saved, acc, top

  def backward(self, acc, top, saved):
    """The backward ticks: the stage's stacked gradients (its rows, padded to the largest stage) and the group
    sums with ``post``'s added."""
    loop, layout = self.loop, self.loop.layout
    be = loop.prog.eqns[loop.stack.backward]
    grads = [jnp.zeros((max(loop.layers),) + x.shape[1:], jnp.float32)
             for x in (be.outvars[j].aval for j in loop.summed_b)]
    g_zero = jnp.zeros(top.shape[1:], top.dtype)
    tick = lambda t, carry: self.backward_tick(t, carry, top, saved)
    _, grads, acc = jax.lax.fori_loop(0, layout.max_count + self.num_stages - 1, tick, (g_zero, grads, acc))
    return grads, acc

  def backward_tick(self, t, carry, top, saved):
    loop = self.loop
    stack, be, m = loop.stack, loop.prog.eqns[loop.stack.backward], loop.layout.microbatch
    nc, kept = jx.scan_parts(be).num_consts, loop.kept
    send, grads, acc = carry
    recv = self._shift(send, [(s + 1, s) for s in range(self.num_stages - 1)])
    valid, ii = self.slot(t, self.num_stages - 1 - self.stage)
    env, offset = self.microbatch_env(ii)
    self.run_group(stack.pre, env, offset)  # B reads its values (masks); its sums were taken in the forward tick
    given = self.operands_of(stack.backward, env, offset, skip=set(kept) | {nc})  # but its cotangent, F's keeps
    consts, g = [given[j] for j in range(nc)], jnp.where(self.last, top[ii], recv)
    xs = {j: self.padded[be.invars[j]] if be.invars[j] in self.padded else self.local(x)
          for j, x in given.items() if j >= nc + 1}
    n = jnp.where(valid, self.layers, 0)

    def layer(r, c):
      g, grads = c
      l = n - 1 - r
      x = [saved[kept[j]][ii, l] if j in kept else xs[j][l] for j in range(nc + 1, len(be.invars))]
      out = loop.b_body.run(consts + [g] + x, offset, m)
      grads = [jax.lax.dynamic_update_index_in_dim(a, a[l] + wide(out[j]), l, 0)
               for a, j in zip(grads, loop.summed_b)]
      return out[0], grads

    g, grads = jax.lax.fori_loop(0, n, layer, (g, grads))

    def tail(acc):
      return self.combine(acc, self.run_group(stack.post, {**env, be.outvars[0]: g}, offset))

    acc = jax.lax.cond(valid & self.first, tail, lambda a: a, acc)
    return g, grads, acc

  def _shift(self, x, pairs):
    """``x`` from the neighbouring stage (one ``ppermute``), or itself with a single stage."""
    return jax.lax.ppermute(x, self.loop.layout.stage_axis, pairs) if self.num_stages > 1 else x
