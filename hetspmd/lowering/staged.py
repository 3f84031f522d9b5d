"""The microbatch loop of a train step run as uneven pipeline stages: the step's own layer scan, cut across ``stage``.

A step whose model runs its layers as one scan over stacked parameters (Linen ``nn.scan``, NNX
``nnx.scan``, ``lax.scan`` over a stacked tree) has, in its microbatch loop (see
:mod:`hetspmd.lowering.weighted`), one forward scan ``F`` over the layers and its transpose ``B``, a reversed scan
that hands the activation's cotangent down the layers and makes each layer's parameter gradients.
Around them the loop's other equations fall into three groups:

* ``pre``: everything that does not read ``F``'s results (the embedding, masks, one-hot labels);
* ``mid``: what reads ``F``'s results up to ``B`` (the head, the loss and its gradient, which makes
  ``B``'s incoming cotangent);
* ``post``: what reads ``B``'s results (the embedding's gradient).

The loop runs the schedule of :mod:`hetspmd.lowering.pipeline` with these pieces instead of a layer function and
a head: in forward tick ``t`` stage ``s`` takes microbatch ``t - s``, runs ``pre`` (every stage: ``F``
and ``B`` read its values, and it is cheap), then ``F``'s body for its own layers, one iteration per
layer from its rows of the stack, keeping each iteration's outputs for ``B``; the last stage then runs
``mid``. In backward tick ``t`` stage ``s`` takes microbatch ``t - (S - 1 - s)``, runs ``pre`` again,
then ``B``'s body for its own layers in reverse, reading what ``F`` kept, adding each layer's gradient
into its row; the first stage then runs ``post``. Activations and their cotangents cross stages by
one ``ppermute`` per tick. A data position with fewer microbatches than the most (a batch the positions do
not divide, or counts given) runs the same ticks, and its row of stages skips the work of those past its count.
Every sum over examples a group makes is kept on the one stage that runs
the group, and reduced over ``stage`` and ``data`` after the ticks; the stacked gradients are reduced
over ``data`` only and unpacked from the stages' rows.

The same equations run on the same microbatches as in the unpipelined loop, so the result is the
single-device step's up to the order of float sums. Steps outside this shape are refused with the
reason.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from hetspmd.errors import HetSpmdError
from hetspmd.lowering.exchange import Exchange
from hetspmd.lowering.loop import Body, LoopContext, LoopOperands, between_loops, feed_back, one_loop
from hetspmd.lowering.pipeline import Stages
from hetspmd.lowering.program import Layout, Program, is_backward, low_precision, sum_outputs
from hetspmd.lowering.ticks import StageDevice
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.frontend import stack as layer_stack


_REDUCE = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}


@dataclasses.dataclass(frozen=True)
class Stack:
  """Where the layer stack is in a program's microbatch loop, and how the loop's other equations group."""

  forward: int   # equation index of F
  backward: int  # equation index of B
  length: int    # layers
  pre: tuple[int, ...]
  mid: tuple[int, ...]
  post: tuple[int, ...]
  kept: tuple[tuple[int, int], ...]  # (B's input position, F's output position): what F keeps for B
  scans: layer_stack.LayerStack | None = None  # F and B as the one finder found them (the planner's too)


def _refuse(reason: str) -> HetSpmdError:
  return HetSpmdError(f"pipeline stages need the step's layers as one scan over stacked parameters: {reason}")


def find_stack(prog) -> Stack:
  """The layer stack of ``prog``'s final microbatch loop, or a :class:`HetSpmdError` that says what differs."""
  an = prog.analysis
  if prog.region or prog.accumulated or prog.absorbed:
    raise _refuse("the step keeps per-microbatch statistics (BatchNorm) or fused sums, which stages do not split")
  loop = list(prog.loop_eqns[an.loops - 1])
  found = layer_stack.find_layer_stack(layer_stack.sites_in_jaxpr(prog.eqns, lambda i, j: _per_example(an, i, j)))
  f, b = found.forward, found.backward
  if f not in loop or b not in loop:
    raise _refuse("the layer scans are not in the microbatch loop that runs the layers")
  f_out = set(prog.eqns[f].outvars)
  fe, be = prog.eqns[f], prog.eqns[b]
  fp, bp = jx.scan_parts(fe), jx.scan_parts(be)
  if an.decisions[f].body.accumulators or an.decisions[b].body.accumulators:
    raise _refuse("a scan over the layers sums over the examples in its carry")

  after_f = _descendants(prog, loop, fe.outvars)
  after_b = _descendants(prog, loop, be.outvars)
  pre = tuple(i for i in loop if i not in after_f and i != f)
  mid = tuple(i for i in loop if i in after_f and i != b and i not in after_b)
  post = tuple(i for i in loop if i in after_b)
  if f in after_f:
    raise _refuse("the forward scan reads its own results")
  made_mid = {v for i in mid for v in prog.eqns[i].outvars}
  made_post_inputs = {v for i in post for v in prog.eqns[i].invars if not jx.is_literal(v)}
  if made_post_inputs & (made_mid | set(fe.outvars)):
    raise _refuse("work after the reversed scan (the embedding's gradient) reads the head's results or the "
                  "forward scan's, which live on another stage")
  mid_inputs = {v for i in mid for v in prog.eqns[i].invars if not jx.is_literal(v)}
  if mid_inputs & set(fe.outvars[1:]):
    raise _refuse("the head reads what the forward scan keeps per layer, not only its last activation")
  carry_in = be.invars[bp.num_consts]
  if carry_in not in made_mid:
    raise _refuse("the reversed scan's cotangent does not come from the head")
  kept = []
  for j, v in enumerate(be.invars):
    if jx.is_literal(v):
      continue
    if v in made_mid and j != bp.num_consts:
      raise _refuse("the reversed scan reads the head's results beyond its cotangent")
    if v in f_out:
      k = fe.outvars.index(v)
      if k < fp.num_carry or j < bp.num_consts + bp.num_carry:
        raise _refuse("the reversed scan reads the forward scan's final activation, not per-layer values")
      kept.append((j, k))
  decision = an.decisions[b]
  for j in range(bp.num_consts + bp.num_carry, len(be.invars)):
    if decision.inputs[j] is not None and j not in dict(kept):
      raise _refuse("the reversed scan reads per-example stacked values that the forward scan did not make")
  if any(a is not None for a in decision.outputs[bp.num_carry:]):
    raise _refuse("the reversed scan hands back per-example values per layer")
  outputs = {v for v in prog.outvars if not jx.is_literal(v)}
  if outputs & {v for i in loop for v in prog.eqns[i].outvars if v in an.axes}:
    raise _refuse("the step returns per-example values")
  return Stack(f, b, fp.length, pre, mid, post, tuple(kept), found)


def _per_example(an, index: int, operand: int) -> bool:
  """Whether operand ``operand`` of equation ``index`` carries the example axis."""
  decision = an.decisions[index]
  return decision is not None and decision.inputs[operand] is not None


def _descendants(prog, loop, roots) -> set[int]:
  made = set(roots)
  out = set()
  for i in loop:
    if any(v in made for v in prog.eqns[i].invars if not jx.is_literal(v)):
      out.add(i)
      made.update(prog.eqns[i].outvars)
  return out


def _reduce(op, x, axes, layout=None):
  """``op(x, axes)``; a gradient (``layout`` given) crosses in ``layout.reduce_dtype`` where
  :func:`hetspmd.lowering.program.low_precision` says so, and comes back in its own dtype. The staged program is
  manual over every axis, so XLA's CPU compiler takes the narrow all-reduce."""
  if layout is None or not low_precision(layout, x):
    return op(x, axes)
  return op(x.astype(layout.reduce_dtype), axes).astype(x.dtype)


def loop_part(prog: Program, layout: Layout, ops: LoopOperands):
  """:func:`hetspmd.lowering.weighted.loop_part` for a layout with ``stages``: the cuts' totals, reduced everywhere."""
  loop = StagedLoop.of(prog, layout, ops, find_stack(prog))
  if ops.pe_outs:
    raise _refuse("the step returns per-example values")
  st, da = layout.stage_axis, layout.data_axis
  out_specs = ([[P() for _ in sum_outputs(prog.analysis.decisions[ops.cut_outs[k].index])] for k in loop.order],
               [P(st) for _ in loop.summed_b])
  value_specs = [P(st) if v in loop.sharded else P() for v in ops.inputs]
  mapped = jax.shard_map(loop.per_device, mesh=layout.mesh, in_specs=(value_specs, P(da), P(da), P(da)),
                         out_specs=out_specs, axis_names={st, da}, check_vma=False)
  totals, grads = mapped(list(ops.values), list(ops.buffers), ops.counts, ops.starts)
  result = dict(zip(loop.order, totals))
  if loop.stack_cut is not None:
    flat_rows = Stages(loop.layers, layout.max_count).rows()  # layer order in the padded [S * L]
    result[loop.stack_cut] = grads if loop.blocked_grads else [g[flat_rows] for g in grads]
  return [[t.astype(prog.eqns[c.index].outvars[j].aval.dtype)
           for t, j in zip(result[k], sum_outputs(prog.analysis.decisions[c.index]))]
          for k, c in enumerate(ops.cut_outs)], []


@dataclasses.dataclass(frozen=True)
class StagedLoop:
  """What every device of a staged loop shares: the stack's scans and bodies, the stages' layer rows, which cuts
  each group makes, which stacked loop inputs the stages hold in even blocks. :meth:`per_device` runs one device."""

  prog: Program
  layout: Layout
  ops: LoopOperands
  stack: Stack
  layers: tuple[int, ...]
  rows: np.ndarray            # [S, L]: the stack rows each stage runs, padded with zeros
  f_body: Body
  b_body: Body
  kept: dict                  # B input position -> F output position
  slices: dict                # F outputs B slices to the microbatch (example-free values of batch size)
  stack_cut: int | None       # the cut position of B's summed gradients
  summed_b: tuple
  sharded: frozenset          # stacked loop inputs held as even blocks over stage
  blocked_grads: bool
  order: tuple                # the cut positions reduced inside (all but the stack's)

  @classmethod
  def of(cls, prog: Program, layout: Layout, ops: LoopOperands, stack: Stack) -> "StagedLoop":
    layers = tuple(layout.stages)
    S, L = len(layers), max(layers)
    if sum(layers) != stack.length:
      raise HetSpmdError(f"the stages hold {sum(layers)} layers ({layers}); the step's layer scan has {stack.length}")
    rows = np.zeros((S, L), np.int32)
    first_row = np.cumsum((0,) + layers[:-1])
    for s, n in enumerate(layers):
      rows[s, :n] = first_row[s] + np.arange(n)
    fe = prog.eqns[stack.forward]
    fd, bd = prog.analysis.decisions[stack.forward], prog.analysis.decisions[stack.backward]
    stack_cut = _stack_cut(prog, stack, ops.cut_outs)
    return cls(
        prog=prog, layout=layout, ops=ops, stack=stack, layers=layers, rows=rows,
        f_body=Body(fd.body), b_body=Body(bd.body), kept=dict(stack.kept),
        slices={k: bd.inputs[j] for j, k in stack.kept
                if bd.inputs[j] is not None and fe.outvars[k] not in prog.analysis.axes},
        stack_cut=stack_cut, summed_b=tuple(sum_outputs(bd)),
        sharded=frozenset(_sharded_inputs(prog, stack, ops.inputs, S)),
        blocked_grads=stack.length % S == 0 and stack_cut is not None,
        order=tuple(k for k in range(len(ops.cut_outs)) if k != stack_cut))

  def per_device(self, values, buffers, counts, starts):
    """One device's part: the earlier loops, the forward ticks, the backward ticks, the reductions."""
    layout, ops = self.layout, self.ops
    dev = StageDevice.of(self, values, buffers, counts, starts)
    totals = _earlier_loops(self.prog, layout, dev.outer, LoopContext(
        self.prog, layout, ops.cut_outs, ops.batch_vars, tuple(buffers), counts[0], starts[0]))
    dev.outer.update(zip(self.prog.constvars, self.prog.consts))
    acc, top, saved = dev.forward()
    grads, acc = dev.backward(acc, top, saved)
    axes = (layout.stage_axis, layout.data_axis)
    for k, parts in acc.items():
      c = ops.cut_outs[k]
      narrow = c.reduce == "sum" and not c.feedback and not c.local and is_backward(self.prog, c.index)
      totals[k] = [_reduce(_REDUCE[c.reduce], x, axes, layout if narrow else None) for x in parts]
    if self.blocked_grads:
      exchange = Exchange(self.layers, layout.stage_axis)
      grads = [exchange.scatter(x, dev.stage) for x in grads]
    grads = [_reduce(jax.lax.psum, x, layout.data_axis, layout) for x in grads]
    return [totals[k] for k in self.order], grads


def _earlier_loops(prog: Program, layout: Layout, outer: dict, ctx: LoopContext) -> dict:
  """Runs the loops before the final one (a token count that the loss divides by) as the unstaged program does,
  every stage alike: their cuts' totals, reduced over ``data``, by cut position; feedback values put in ``outer``."""
  totals: dict = {}
  for s in range(prog.analysis.loops - 1):
    mine = [k for k, c in enumerate(ctx.cut_outs) if c.loop == s]
    partials, _ = one_loop(ctx, s, outer, mine)
    for k, part in zip(mine, partials):
      totals[k] = [_REDUCE[ctx.cut_outs[k].reduce](x, layout.data_axis) for x in part]
      if ctx.cut_outs[k].feedback:
        feed_back(prog, ctx.cut_outs[k], totals[k], outer)
    between_loops(prog, s, outer)
  return totals


def _stack_cut(prog: Program, stack: Stack, cut_outs) -> int | None:
  """The cut position of B's gradients; every final-loop cut must belong to one group (pre, mid, post) or B."""
  final = prog.analysis.loops - 1
  group_of = {i: g for g, members in (("pre", stack.pre), ("mid", stack.mid), ("post", stack.post)) for i in members}
  cut_group = [("stack" if c.index == stack.backward else group_of.get(c.index)) if c.loop == final else "earlier"
               for c in cut_outs]
  if None in cut_group:
    raise _refuse("a sum over the examples is made by the layer scan itself")
  return cut_group.index("stack") if "stack" in cut_group else None


def _sharded_inputs(prog: Program, stack: Stack, loop_inputs, stages: int) -> set:
  """Stacked loop inputs only the scans read, taken as even blocks over stage (ZeRO-like: the state's stacked
  leaves stay there) and exchanged into each stage's layers; their gradients go back the same way."""
  if stack.length % stages:
    return set()
  fe, be = prog.eqns[stack.forward], prog.eqns[stack.backward]
  fp, bp = jx.scan_parts(fe), jx.scan_parts(be)
  kept = dict(stack.kept)
  final = prog.analysis.loops - 1
  f_stacked = {v for v in fe.invars[fp.num_consts + 1:] if not jx.is_literal(v)}
  b_stacked = {v for j, v in enumerate(be.invars) if j > bp.num_consts and j not in kept and not jx.is_literal(v)}
  elsewhere = set(stack.pre + stack.mid + stack.post)  # and earlier loops, and the work between loops
  elsewhere |= {i for t in range(final) for i in prog.loop_eqns[t]}
  elsewhere |= {i for t in range(final + 1) for i in prog.middle[t]}
  others = {v for i in elsewhere for v in prog.eqns[i].invars if not jx.is_literal(v)}
  return {v for v in loop_inputs if v in (f_stacked | b_stacked) - others and jx.aval_shape(v)[:1] == (stack.length,)}
