"""The weighted microbatch program of a train step, built from :mod:`hetspmd.passes.batch_axis.analysis`'s analysis.

The step's flat jaxpr (traced at the global batch) runs in three parts:

* the example-free equations that need no reduction (parameter casts, RNG
  keys and dropout masks, learning rates) once, before the loop, on the
  sharded state;
* inside a ``shard_map`` manual over ``data`` only, one ``fori_loop`` per
  microbatch loop of the analysis, each device running its own count: the
  per-example equations on one microbatch slice (shapes rewritten from the
  global batch to the microbatch, constants kept), accumulating every cut's
  partial value in float32; then one reduction over ``data`` (small leaves
  bucketed; under ZeRO, gradients reduce-scattered onto their shards;
  gradients cast to ``Layout.reduce_dtype`` for the wire and back). With
  ``Layout.overlap`` the final loop stops one microbatch short and runs its
  last microbatch after it (masked where a device has none), so that no
  loop boundary stands between a gradient's last contribution and its
  reduction, and XLA's scheduler can start each reduction while the rest of
  the backward pass runs;
* everything downstream of the cuts (the optimizer update, metrics) once,
  after the loop, on the reduced values, under XLA's partitioner.

Example-free operands of batch size (broadcast constants, dropout masks
drawn at the global batch) are rebuilt at the microbatch's size or sliced at
its global offset, so a microbatch sees exactly its part of the full-batch
draw. Outputs that keep the example axis come back whole, in global order.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.sharding import PartitionSpec as P

from hetspmd.lowering.collectives import reduce_over_data
from hetspmd.passes import _jax_adapter as jx
from hetspmd.lowering import staged
from hetspmd.lowering.loop import LoopContext, LoopOperands, between_loops, combiner, feed_back, one_loop
from hetspmd.lowering.program import (Layout, Program, definition_order, is_gradient_accumulated,
                                     is_gradient_cut, low_precision, scatter_dim_of,
                                     sum_outputs, with_bases)
from hetspmd.passes.batch_axis.analysis import Analysis
from hetspmd.passes.batch_axis.rules import Axis



def build(analysis: Analysis, batch_inputs: Sequence[int], layout: Layout):
  """``program(inputs, counts, starts) -> outputs`` over the step's flat jaxpr inputs and outputs.

  ``inputs``: the flat jaxpr inputs, with each batch input replaced by its
  padded microbatch buffer ``[positions * max_count, microbatch, ...]``
  sharded over ``data``; ``counts`` and ``starts``: each position's
  microbatch count and first global example, ``int32[positions]`` sharded
  over ``data``.
  """
  prog = Program(analysis, batch_inputs, fuse=not layout.stages)  # stages sum each group on its own stage
  return lambda inputs, counts, starts: _run(prog, layout, list(inputs), counts, starts)


def _run(prog: Program, layout: Layout, inputs: list[Any], counts, starts) -> list[Any]:
  env, ops = before_loops(prog, inputs, counts, starts)
  totals, pe_buffers = (staged.loop_part if layout.stages else loop_part)(prog, layout, ops)
  if prog.accumulated:
    pe_buffers, accumulated = pe_buffers
    env.update((v, x.astype(v.aval.dtype)) for v, x in zip(prog.accumulated, accumulated))
  after_loops(prog, env, ops.cut_outs, totals)
  for v, buf in zip(ops.pe_outs, pe_buffers):
    env[v] = _global_order(buf, prog.analysis.axes[v], layout)
  return [jx.read(env, v) for v in prog.outvars]


def before_loops(prog: Program, inputs: Sequence[Any], counts, starts) -> tuple[dict, LoopOperands]:
  """The example-free work before the loops, on the step's flat inputs (batch inputs: their microbatch buffers),
  and what the loops read: the values so far and the loops' operands."""
  env: dict = dict(zip(prog.constvars, prog.consts))
  for i, (v, x) in enumerate(zip(prog.invars, inputs)):
    if i not in prog.batch_inputs:
      env[v] = x
  jx.eval_equations([prog.hoisted.get(i, prog.eqns[i]) for i in prog.pre], env)
  loop_inputs = sorted({v for s in range(prog.analysis.loops) for v in prog.outside_inputs(s)
                        if v not in prog.needs_cut and (v in prog.early or prog.producer.get(v) not in prog.cuts)}
                       | set(prog.middle_inputs()), key=definition_order(prog))
  ops = LoopOperands(
      inputs=tuple(loop_inputs), values=tuple(env[v] for v in loop_inputs),
      batch_vars=tuple(prog.invars[i] for i in prog.batch_inputs),
      buffers=tuple(inputs[i] for i in prog.batch_inputs), counts=counts, starts=starts,
      cut_outs=prog.cut_outs,
      pe_outs=tuple(v for v in prog.outvars if not jx.is_literal(v) and v in prog.analysis.axes))
  return env, ops


def after_loops(prog: Program, env: dict, cut_outs: Sequence[Any], totals: Sequence[Sequence[Any]]) -> None:
  """Every cut's total (with its base) into ``env``, then the example-free work after the loops."""
  for cut, values in zip(cut_outs, totals):
    eqn = prog.eqns[cut.index]
    decision = prog.analysis.decisions[cut.index]
    env.update(zip([eqn.outvars[j] for j in sum_outputs(decision)], with_bases(eqn, decision, values, env)))
  jx.eval_equations([prog.eqns[i] for i in prog.post], env)


def _global_order(buf, axis: Axis, layout: Layout):
  """``[positions * max_count, *microbatch shape]`` → the global-batch value, examples in global order."""
  valid = np.array([p * layout.max_count + i for p, c in enumerate(layout.counts) for i in range(c)], np.int32)
  if len(valid) != buf.shape[0]:
    buf = jnp.take(buf, valid, axis=0)
  moved = jnp.moveaxis(buf, 0, axis.dim)
  shape = moved.shape
  return moved.reshape(shape[:axis.dim] + (shape[axis.dim] * shape[axis.dim + 1],) + shape[axis.dim + 2:])


def _scatter_dims(prog: Program, layout: Layout, cut_outs: Sequence[Any]) -> tuple[dict[int, int], list]:
  """Where gradients of ZeRO-split state leave the loop reduce-scattered onto their shards: ``{cut position: dim}``
  for the final loop's sums, and a dim (or ``None``) per accumulated value."""
  axis = layout.data_axis
  split = layout.mesh.size == layout.mesh.shape[axis] and layout.mesh.shape[axis] > 1 and not prog.region
  final = prog.analysis.loops - 1
  scatter = {}
  for k, cut in enumerate(cut_outs):
    if split and cut.reduce == "sum" and cut.loop == final and not cut.feedback:
      if cut.base is None and prog.analysis.decisions[cut.index].body is None:
        dim = scatter_dim_of(prog, prog.eqns[cut.index].outvars[0], layout.data_split)
        if dim is not None:
          scatter[k] = dim
  return scatter, [scatter_dim_of(prog, v, layout.data_split) if split else None for v in prog.accumulated]


def _clock_start(layout: Layout, count: Any) -> Any:
  """``count`` made to wait for ``layout.clock.start(position)`` (which returns 0), so the loop starts after it."""
  position = jax.lax.axis_index(layout.data_axis)
  return count + io_callback(layout.clock.start, jax.ShapeDtypeStruct((), jnp.int32), position)


def _clock_end(layout: Layout, partials: list) -> list:
  """``partials`` with their first array made to wait for ``layout.clock.end(position, value)`` (called with one
  element of it, so after the loop has made it, and before the reduction over data that waits for every
  position)."""
  first = next(((i, j) for i, part in enumerate(partials) for j, x in enumerate(part) if jnp.size(x)), None)
  if first is None:
    return partials
  i, j = first
  x = partials[i][j]
  position = jax.lax.axis_index(layout.data_axis)
  zero = io_callback(layout.clock.end, jax.ShapeDtypeStruct((), jnp.int32), position, jnp.ravel(x)[0])
  partials = [list(part) for part in partials]
  partials[i][j] = x + zero.astype(x.dtype)
  return partials


def loop_part(prog: Program, layout: Layout, ops: LoopOperands):
  """The weighted loops inside a ``shard_map`` manual over ``data``: every cut's total, reduced over ``data``, and
  the per-example outputs' padded buffers (with the accumulated values, when the program has any)."""
  axis = layout.data_axis
  single = layout.mesh.shape[axis] == 1
  data_only = layout.mesh.size == layout.mesh.shape[axis]
  final = prog.analysis.loops - 1
  cut_outs = ops.cut_outs
  scatter, acc_scatter = _scatter_dims(prog, layout, cut_outs)
  reduce = functools.partial(reduce_over_data, axis=axis, single=single, data_only=data_only,
                             dtype=layout.reduce_dtype)

  # JAX calls back from a shard_map only where every mesh axis is manual: a mesh of the data axis alone
  clocked = layout.clock is not None and not single and data_only and prog.analysis.loops == 1

  def per_device(values, buffers, counts, starts, extra):
    outer = dict(zip(ops.inputs, values))
    count = _clock_start(layout, counts[0]) if clocked else counts[0]
    ctx = LoopContext(prog, layout, cut_outs, ops.batch_vars, tuple(buffers), count, starts[0])
    totals: dict[int, list] = {}
    pe_result = []
    for s in range(prog.analysis.loops):
      mine = [k for k, c in enumerate(cut_outs) if c.loop == s]
      partials, outs = one_loop(ctx, s, outer, mine, ops.pe_outs if s == final else ())
      if clocked:
        partials = _clock_end(layout, partials)
      if s == final and extra:  # other programs' partial values of the same sums
        kinds = [cut_outs[k].reduce for k in mine] + ["sum"] * (len(partials) - len(mine))
        partials = [[combiner(r)(p, e[0]) for p, e in zip(part, rows)]
                    for r, part, rows in zip(kinds, partials, extra)]
      if s == final and prog.accumulated:
        extra = partials[len(mine):]
        partials = partials[:len(mine)]
        low = [[is_gradient_accumulated(prog, v) and low_precision(layout, x[0])]
               for v, x in zip(prog.accumulated, extra)]
        accumulated = reduce(extra, ["sum"] * len(extra), acc_scatter, low=low)
      low = [[s == final and is_gradient_cut(prog, cut_outs[k]) and low_precision(layout, x) for x in part]
             for k, part in zip(mine, partials)]
      reduced = reduce(partials, [cut_outs[k].reduce for k in mine], [scatter.get(k) for k in mine], low=low)
      for k, values_k in zip(mine, reduced):
        totals[k] = values_k
        if cut_outs[k].feedback:
          feed_back(prog, cut_outs[k], values_k, outer)
      if s < final:
        between_loops(prog, s, outer)
      pe_result = outs
    if prog.accumulated:
      pe_result = (pe_result, [x[0] for x in accumulated])
    return [totals[k] for k in range(len(cut_outs))], pe_result

  out_specs = ([[P(*([None] * scatter[k]), axis) if k in scatter else P()
                 for _ in sum_outputs(prog.analysis.decisions[c.index])]
                for k, c in enumerate(cut_outs)], [P(axis) for _ in ops.pe_outs])
  if prog.accumulated:
    out_specs = (out_specs[0], (out_specs[1], [P() if d is None else P(*([None] * d), axis) for d in acc_scatter]))
  if single:
    return per_device(list(ops.values), list(ops.buffers), ops.counts, ops.starts, ops.extra)
  mapped = jax.shard_map(per_device, mesh=layout.mesh, in_specs=(P(), P(axis), P(axis), P(axis), P(axis)),
                         out_specs=out_specs, axis_names=set(layout.mesh.axis_names) if clocked else {axis},
                         check_vma=False)
  totals, pe = mapped(list(ops.values), list(ops.buffers), ops.counts, ops.starts, [list(e) for e in ops.extra])
  return [[t.astype(prog.eqns[c.index].outvars[j].aval.dtype)
           for t, j in zip(tt, sum_outputs(prog.analysis.decisions[c.index]))]
          for tt, c in zip(totals, cut_outs)], pe
