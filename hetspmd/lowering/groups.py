"""Group programs: each device group's own microbatch loop, joined by one uniform program over every device.

A group plan (:class:`hetspmd.plan.groups.GroupPlan`) runs a step as two
kinds of programs built from the same microbatch analysis:

* :func:`group_program`, one per group, over a mesh of the group's devices:
  the example-free work before the loop, then, inside a ``shard_map`` over
  the group, each device's loop over its own microbatches (the group's
  microbatch size, the device's count) giving that device's partial value of
  every cut, in float32, with a leading axis of one per device. Nothing
  crosses devices, so groups with different shapes run side by side.
* :func:`exchange_program`, over every device: each cut's partials
  (a global array with one row per device, assembled from the groups' rows
  without a copy) combined over the devices, then the rest of the step
  (the optimizer update, metrics) once, as the single program runs it.

The partials are the same shape on every device (a gradient is parameter
shaped whatever the microbatch), so the exchange program is uniform.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from hetspmd.errors import HetSpmdError
from hetspmd.lowering.loop import LoopContext, one_loop
from hetspmd.lowering.program import Layout, Program, sum_outputs
from hetspmd.lowering.weighted import after_loops, before_loops, loop_part
from hetspmd.passes import _jax_adapter as jx

_COMBINE = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}


def check(prog: Program) -> None:
  """Refuses, with the reason, what group programs do not run yet."""
  if prog.analysis.loops > 1:
    raise HetSpmdError(f"group programs run steps with one microbatch loop; this step needs "
                       f"{prog.analysis.loops} (a reduction over the batch feeds later per-example work: exact batch "
                       "statistics, a token count that scales the loss): run it as one program")
  if prog.region or any(c.local for c in prog.analysis.cuts):
    raise HetSpmdError("group programs do not yet run steps with per-microbatch statistics (BatchNorm under "
                       "batch_stats='local'): run it as one program")
  outvars = [v for v in prog.outvars if v in prog.analysis.axes]
  if outvars:
    raise HetSpmdError(f"group programs do not yet return per-example outputs ({len(outvars)} of the step's "
                       "outputs keep the batch axis, such as logits in the metrics): run it as one program")


def group_program(prog: Program, layout: Layout):
  """``program(inputs, counts, starts) -> partials``: the group's loop. ``inputs``: the step's flat jaxpr inputs on
  the group's devices, each batch input its padded microbatch buffer ``[devices * max_count, microbatch, ...]``
  sharded over ``layout.data_axis``; ``counts`` and ``starts``: each device's count and first global example.
  ``partials``: per cut, then per value the loop adds into (``Program.accumulated``: a gradient's transpose or a
  sum of two gradients, fused into the loop), its values with a leading axis of one row per device, sharded over
  the group."""
  axis = layout.data_axis

  def run(inputs, counts, starts):
    _, ops = before_loops(prog, inputs, counts, starts)

    def per_device(values, buffers, counts, starts):
      ctx = LoopContext(prog, layout, ops.cut_outs, ops.batch_vars, tuple(buffers), counts[0], starts[0])
      partials, _ = one_loop(ctx, 0, dict(zip(ops.inputs, values)), range(len(ops.cut_outs)))
      return [[x[None] for x in part] for part in partials]  # the cuts', then the sums the loop adds into

    return jax.shard_map(per_device, mesh=layout.mesh, in_specs=(P(), P(axis), P(axis), P(axis)),
                         out_specs=P(axis), axis_names={axis}, check_vma=False)(
                             list(ops.values), list(ops.buffers), counts, starts)

  return run


def exchange_program(prog: Program, tail: Layout | None = None):
  """``program(inputs, partials, counts, starts) -> outputs``: every cut's partials combined over the devices
  (their leading axis), then the example-free rest of the step. ``inputs``: the step's flat jaxpr inputs.

  Without ``tail`` the batch inputs are unread (``counts``, ``starts`` too). With ``tail`` (a layout over every
  device, each running the same count of the same microbatch, its last one peeled so the reduction overlaps
  it), each batch input is the tail's microbatch buffer: every device runs the tail's microbatches, adds the
  groups' partials into their sums and reduces them (:func:`hetspmd.lowering.weighted.loop_part`)."""

  def run(inputs: Sequence[Any], partials: Sequence[Sequence[Any]], counts=None, starts=None) -> list[Any]:
    env, ops = before_loops(prog, inputs, counts, starts)
    if tail is not None:
      totals, accumulated = _with_tail(prog, tail, dataclasses.replace(ops, extra=tuple(partials)))
    else:
      totals = []
      for cut, part in zip(ops.cut_outs, partials):
        outvars = [prog.eqns[cut.index].outvars[j] for j in sum_outputs(prog.analysis.decisions[cut.index])]
        totals.append([_COMBINE[cut.reduce](x, axis=0).astype(v.aval.dtype) for x, v in zip(part, outvars)])
      accumulated = [jnp.sum(x, axis=0) for (x,) in partials[len(ops.cut_outs):]]
    env.update((v, x.astype(v.aval.dtype)) for v, x in zip(prog.accumulated, accumulated))
    after_loops(prog, env, ops.cut_outs, totals)
    return [jx.read(env, v) for v in prog.outvars]

  return run


def _with_tail(prog: Program, tail: Layout, ops):
  """The tail's loop on every device, the groups' partials added into its sums before they are reduced: the
  cuts' totals and the accumulated values."""
  totals, rest = loop_part(prog, tail, ops)
  return totals, (rest[1] if prog.accumulated else [])
