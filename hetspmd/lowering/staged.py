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
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from hetspmd.lowering import operands
from hetspmd.errors import HetSpmdError
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.frontend import stack as layer_stack
from hetspmd.lowering.pipeline import Stages, tick_slot


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
  outputs = {v for v in prog.jaxpr.outvars if not jx.is_literal(v)}
  if outputs & {v for i in loop for v in prog.eqns[i].outvars if v in an.axes}:
    raise _refuse("the step returns per-example values")
  return Stack(f, b, fp.length, pre, mid, post, tuple(kept), found)


def _earlier_loops(prog, layout, outer, cut_outs, batch_vars, buffers, counts, starts) -> dict:
  """Runs the loops before the final one (a token count that the loss divides by) as the unstaged program does,
  every stage alike: their cuts' totals, reduced over ``data``, by cut position; feedback values put in ``outer``."""
  from hetspmd.lowering import weighted as low

  totals: dict = {}
  for s in range(prog.analysis.loops - 1):
    mine = [k for k, c in enumerate(cut_outs) if c.loop == s]
    partials, _ = low._one_loop(prog, layout, s, outer, mine, cut_outs, batch_vars, buffers, counts[0], starts[0], [])
    for k, part in zip(mine, partials):
      totals[k] = [_REDUCE[cut_outs[k].reduce](x, layout.data_axis) for x in part]
      if cut_outs[k].feedback:
        low.feed_back(prog, cut_outs[k], totals[k], outer)
    low.between_loops(prog, s, outer)
  return totals


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


@dataclasses.dataclass(frozen=True)
class _Exchange:
  """Moves layer rows between the even blocks a ``stage``-sharded stack is stored in (``length / S`` rows each)
  and each stage's own uneven layers (padded to the largest stage), with one ``ppermute`` per distance between
  a layer's owner and its user. Padding rows travel as zeros and are added, so every real row arrives exact."""

  layers: tuple[int, ...]
  axis: str

  @property
  def block(self) -> int:
    return sum(self.layers) // len(self.layers)

  def shifts(self):
    """Per distance ``d`` (owner ``t = s + d`` of rows stage ``s`` runs): rows sent, and per stage the
    owner's offset (indexed by the owner), the user's offset and count (indexed by the user)."""
    S, Q = len(self.layers), self.block
    starts = np.cumsum((0,) + self.layers[:-1])
    out = []
    for d in range(-(S - 1), S):
      src, dst, cnt = np.zeros(S, np.int32), np.zeros(S, np.int32), np.zeros(S, np.int32)
      for user in range(S):
        owner = user + d
        if not 0 <= owner < S:
          continue
        lo, hi = max(starts[user], owner * Q), min(starts[user] + self.layers[user], (owner + 1) * Q)
        if hi > lo:
          src[owner], dst[user], cnt[user] = lo - owner * Q, lo - starts[user], hi - lo
      if cnt.any():
        pairs = [(u + d, u) for u in range(S) if cnt[u]]
        out.append((d, int(cnt.max()), src, dst, cnt, pairs))
    return out

  def gather(self, block, stage):
    """This stage's layers, padded to ``max(layers)`` rows, from the blocks (``block``: this stage's)."""
    if jax.dtypes.issubdtype(block.dtype, jax.dtypes.prng_key):  # per-layer rng keys travel as their bits
      return jax.random.wrap_key_data(self.gather(jax.random.key_data(block), stage), impl=jax.random.key_impl(block))
    L = max(self.layers)
    shifts = self.shifts()
    extra = max(r for _, r, *_ in shifts)
    source = _pad_rows(block, extra)
    out = jnp.zeros((L + extra,) + block.shape[1:], block.dtype)
    for d, rows, src, dst, cnt, pairs in shifts:
      send = jax.lax.dynamic_slice_in_dim(source, jnp.asarray(src)[stage], rows, 0)
      recv = send if d == 0 else jax.lax.ppermute(send, self.axis, pairs)
      recv = _first_rows(recv, jnp.asarray(cnt)[stage])
      out = out + jax.lax.dynamic_update_slice_in_dim(jnp.zeros_like(out), recv, jnp.asarray(dst)[stage], 0)
    return out[:L]

  def scatter(self, padded, stage):
    """The inverse of :meth:`gather` for gradients: each stage's rows sent back to and added into their block."""
    Q = self.block
    shifts = self.shifts()
    extra = max(r for _, r, *_ in shifts)
    source = _pad_rows(padded, extra)
    out = jnp.zeros((Q + extra,) + padded.shape[1:], padded.dtype)
    for d, rows, src, dst, cnt, pairs in shifts:
      send = _first_rows(jax.lax.dynamic_slice_in_dim(source, jnp.asarray(dst)[stage], rows, 0), jnp.asarray(cnt)[stage])
      recv = send if d == 0 else jax.lax.ppermute(send, self.axis, [(b, a) for a, b in pairs])
      out = out + jax.lax.dynamic_update_slice_in_dim(jnp.zeros_like(out), recv, jnp.asarray(src)[stage], 0)
    return out[:Q]


def _pad_rows(x, extra: int):
  return jnp.concatenate([x, jnp.zeros((extra,) + x.shape[1:], x.dtype)])


def _first_rows(x, count):
  keep = (jnp.arange(x.shape[0]) < count).reshape((-1,) + (1,) * (x.ndim - 1))
  return jnp.where(keep, x, jnp.zeros_like(x))


def _reduce(op, x, axes, layout=None):
  """``op(x, axes)``; a gradient (``layout`` given) crosses in ``layout.reduce_dtype`` where
  :func:`hetspmd.lowering.weighted._low_precision` says so, and comes back in its own dtype. The staged program is
  manual over every axis, so XLA's CPU compiler takes the narrow all-reduce."""
  from hetspmd.lowering import weighted as low

  if layout is None or not low._low_precision(layout, x):
    return op(x, axes)
  return op(x.astype(layout.reduce_dtype), axes).astype(x.dtype)


def loop_part(prog, layout, loop_values, loop_inputs, batch_vars, buffers, counts, starts, cut_outs, pe_outs):
  """:func:`hetspmd.lowering.weighted._loop_part` for a layout with ``stages``: the cuts' totals, reduced everywhere."""
  from hetspmd.lowering import weighted as low

  stack = find_stack(prog)
  layers = tuple(layout.stages)
  S, L, M, m = len(layers), max(layers), layout.max_count, layout.microbatch
  if sum(layers) != stack.length:
    raise HetSpmdError(f"the stages hold {sum(layers)} layers ({layers}); the step's layer scan has {stack.length}")
  st, da = layout.stage_axis, layout.data_axis
  axes = (st, da)
  rows = np.zeros((S, L), np.int32)
  first_row = np.cumsum((0,) + layers[:-1])
  for s, n in enumerate(layers):
    rows[s, :n] = first_row[s] + np.arange(n)
  fe, be = prog.eqns[stack.forward], prog.eqns[stack.backward]
  fd, bd = prog.analysis.decisions[stack.forward], prog.analysis.decisions[stack.backward]
  fp, bp = jx.scan_parts(fe), jx.scan_parts(be)
  f_body, b_body = low._Body(fd.body), low._Body(bd.body)
  kept = dict(stack.kept)  # B input position -> F output position
  slices = {k: bd.inputs[j] for j, k in stack.kept  # F outputs B slices to the microbatch (not per-example)
            if bd.inputs[j] is not None and fe.outvars[k] not in prog.analysis.axes}
  final = prog.analysis.loops - 1
  group_of = {i: g for g, members in (("pre", stack.pre), ("mid", stack.mid), ("post", stack.post)) for i in members}
  cut_group = [("stack" if c.index == stack.backward else group_of.get(c.index)) if c.loop == final else "earlier"
               for c in cut_outs]
  if None in cut_group:
    raise _refuse("a sum over the examples is made by the layer scan itself")
  stack_cut = cut_group.index("stack") if "stack" in cut_group else None
  summed_b = low._sum_outputs(bd)
  # stacked loop inputs only the scans read are taken as even blocks over stage (ZeRO-like: the state's stacked
  # leaves stay there) and exchanged into each stage's layers; their gradients go back the same way
  even = stack.length % S == 0
  f_stacked = {v for v in fe.invars[fp.num_consts + 1:] if not jx.is_literal(v)}
  b_stacked = {v for j, v in enumerate(be.invars) if j > bp.num_consts and j not in kept and not jx.is_literal(v)}
  elsewhere = set(stack.pre + stack.mid + stack.post)  # and earlier loops, and the work between loops
  elsewhere |= {i for t in range(final) for i in prog.loop_eqns[t]}
  elsewhere |= {i for t in range(final + 1) for i in prog.middle[t]}
  others = {v for i in elsewhere for v in prog.eqns[i].invars if not jx.is_literal(v)}
  sharded = {v for v in loop_inputs if even and v in (f_stacked | b_stacked) - others
             and jx.aval_shape(v)[:1] == (stack.length,)}
  exchange = _Exchange(layers, st)
  blocked_grads = even and stack_cut is not None
  forward_pairs = [(s, s + 1) for s in range(S - 1)]
  backward_pairs = [(s + 1, s) for s in range(S - 1)]

  def per_device(values, buffers, counts, starts):
    s = jax.lax.axis_index(st)
    mine, first, last = jnp.asarray(layers, jnp.int32)[s], s == 0, s == S - 1
    count = counts[0]  # this data position's microbatches: its row of stages skips the ticks past them

    def slot(t, lag):
      valid, ii = tick_slot(t, lag, M)
      return valid & (ii < count), ii
    my_rows = jnp.asarray(rows)[s]
    outer = dict(zip(loop_inputs, values))
    padded = {v: exchange.gather(outer[v], s) for v in loop_inputs if v in sharded}
    totals = _earlier_loops(prog, layout, outer, cut_outs, batch_vars, buffers, counts, starts)
    outer.update(zip(prog.jaxpr.constvars, prog.analysis.jaxpr.consts))

    def microbatch_env(i):
      env = dict(outer)
      for v, buf in zip(batch_vars, buffers):
        env[v] = jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)
      return env, starts[0] + i * m

    def run_group(indices, env, offset):
      """Runs equations on one microbatch; the partial values of the cuts among them, by cut position."""
      partial = {}
      for index in indices:
        eqn, decision = prog.eqns[index], prog.analysis.decisions[index]
        if decision is None:
          jx.eval_equations([eqn], env)
          continue
        cut = prog.cuts.get(index)
        out = low._apply(prog, eqn, decision, env, offset, m, zero_base=cut is not None and cut.base is not None)
        summed = low._sum_outputs(decision)
        env.update((eqn.outvars[j], x) for j, x in enumerate(out) if j not in summed)
        if cut is not None:
          partial[cut_position[index]] = [low._wide(out[j]) for j in summed]
      return partial

    cut_position = {c.index: k for k, c in enumerate(cut_outs)}

    def scan_inputs(eqn, decision, env, offset):
      return [operands.operand(prog, env, v, a, offset, m) for v, a in zip(eqn.invars, decision.inputs)]

    def b_operands(env, offset):  # B's inputs but its cotangent and what F keeps
      return {j: operands.operand(prog, env, v, a, offset, m) for j, (v, a) in enumerate(zip(be.invars, bd.inputs))
              if j not in kept and j != bp.num_consts}

    def local(x):  # this stage's rows of an example-free stacked value, padded to L
      return jnp.take(x, my_rows, axis=0)

    # shapes of one microbatch's group partials and of what F keeps per layer
    def shapes():
      env, offset = microbatch_env(0)
      pre = run_group(stack.pre, env, offset)
      fin = scan_inputs(fe, fd, env, offset)
      consts, carry, xs = fin[:fp.num_consts], fin[fp.num_consts:fp.num_consts + 1], fin[fp.num_consts + 1:]
      fout = f_body.run(list(consts) + list(carry) + [x[0] for x in xs], offset, m)
      env.update({fe.outvars[0]: fout[0]})
      mid = run_group(stack.mid, env, offset)
      g = operands.operand(prog, env, be.invars[bp.num_consts], bd.inputs[bp.num_consts], offset, m)
      env[be.outvars[0]] = g
      post = run_group(stack.post, env, offset)
      return {**pre, **mid, **post}, fout[1:], fout[0], g

    part_shapes, kept_shapes, h_shape, g_shape = jax.eval_shape(shapes)
    kinds = {k: cut_outs[k].reduce for k in part_shapes}
    zero_parts = {k: [low._identity(kinds[k], x.shape, x.dtype) for x in v] for k, v in part_shapes.items()}

    def masked(parts, keep):
      return {k: [jnp.where(keep, x, low._identity(kinds[k], x.shape, x.dtype)) for x in v] for k, v in parts.items()}

    def combine(acc, parts):
      return {**acc, **{k: [low._combine(kinds[k])(a, x) for a, x in zip(acc[k], v)] for k, v in parts.items()}}

    def keep(k, y, offset):
      """What F's output ``k`` keeps of one layer: an example-free value of batch size (a dropout mask drawn at
      the global batch) only its microbatch's slice, as B's scan would read it."""
      a = slices.get(k)
      return y if a is None else jax.lax.dynamic_slice_in_dim(y, offset * a.per_example, m * a.per_example, a.dim - 1)

    read = set(kept.values())  # F's outputs B reads: only those are kept, per microbatch and layer
    saved = {k: jnp.zeros((M, L) + y.shape, y.dtype) for k, y in (
        (k, jax.eval_shape(lambda y, k=k: keep(k, y, 0), x)) for k, x in enumerate(kept_shapes, fp.num_carry))
             if k in read}
    h_zero = jnp.zeros(h_shape.shape, h_shape.dtype)
    g_zero = jnp.zeros(g_shape.shape, g_shape.dtype)

    def forward_tick(t, carry):
      send, saved, acc, top = carry
      recv = jax.lax.ppermute(send, st, forward_pairs) if S > 1 else send
      valid, ii = slot(t, s)
      env, offset = microbatch_env(ii)
      acc = combine(acc, masked(run_group(stack.pre, env, offset), valid & first))
      fin = scan_inputs(fe, fd, env, offset)
      consts = fin[:fp.num_consts]
      xs = [padded[v] if v in padded else local(x) for v, x in zip(fe.invars[fp.num_consts + 1:], fin[fp.num_consts + 1:])]
      h = jnp.where(first, fin[fp.num_consts], recv)

      def layer(l, c):
        h, saved = c
        out = f_body.run(list(consts) + [h] + [x[l] for x in xs], offset, m)
        saved = {k: buf.at[ii, l].set(keep(k, out[k], offset)) for k, buf in saved.items()}
        return out[0], saved

      h, saved = jax.lax.fori_loop(0, jnp.where(valid, mine, 0), layer, (h, saved))

      def head(args):
        acc, top = args
        local_env = {**env, fe.outvars[0]: h}
        parts = run_group(stack.mid, local_env, offset)
        g = operands.operand(prog, local_env, be.invars[bp.num_consts], bd.inputs[bp.num_consts], offset, m)
        return combine(acc, parts), jax.lax.dynamic_update_index_in_dim(top, g, ii, 0)

      acc, top = jax.lax.cond(valid & last, head, lambda args: args, (acc, top))
      return h, saved, acc, top

    top = jnp.zeros((M,) + g_shape.shape, g_shape.dtype)
    _, saved, acc, top = jax.lax.fori_loop(0, M + S - 1, forward_tick, (h_zero, saved, zero_parts, top))

    grads = [jnp.zeros((L,) + x.shape[1:], jnp.float32) for x in (be.outvars[j].aval for j in summed_b)]

    def backward_tick(t, carry):
      send, grads, acc = carry
      recv = jax.lax.ppermute(send, st, backward_pairs) if S > 1 else send
      valid, ii = slot(t, S - 1 - s)
      env, offset = microbatch_env(ii)
      run_group(stack.pre, env, offset)  # B reads its values (masks); its sums were taken in the forward tick
      given = b_operands(env, offset)
      consts, g = [given[j] for j in range(bp.num_consts)], jnp.where(last, top[ii], recv)
      xs = {j: padded[be.invars[j]] if be.invars[j] in padded else local(x)
            for j, x in given.items() if j >= bp.num_consts + 1}
      n = jnp.where(valid, mine, 0)

      def layer(r, c):
        g, grads = c
        l = n - 1 - r
        x = [saved[kept[j]][ii, l] if j in kept else xs[j][l]
             for j in range(bp.num_consts + 1, len(be.invars))]
        out = b_body.run(list(consts) + [g] + x, offset, m)
        grads = [jax.lax.dynamic_update_index_in_dim(a, a[l] + low._wide(out[j]), l, 0)
                 for a, j in zip(grads, summed_b)]
        return out[0], grads

      g, grads = jax.lax.fori_loop(0, n, layer, (g, grads))

      def tail(acc):
        return combine(acc, run_group(stack.post, {**env, be.outvars[0]: g}, offset))

      acc = jax.lax.cond(valid & first, tail, lambda a: a, acc)
      return g, grads, acc

    _, grads, acc = jax.lax.fori_loop(0, M + S - 1, backward_tick, (g_zero, grads, acc))
    for k, parts in acc.items():
      c = cut_outs[k]
      narrow = kinds[k] == "sum" and not c.feedback and not c.local and low._backward(prog, c.index)
      totals[k] = [_reduce(_REDUCE[kinds[k]], x, axes, layout if narrow else None) for x in parts]
    if blocked_grads:
      grads = [exchange.scatter(x, s) for x in grads]
    grads = [_reduce(jax.lax.psum, x, da, layout) for x in grads]
    return [totals[k] for k in order], grads

  order = sorted(k for k in range(len(cut_outs)) if k != stack_cut)  # the others are reduced inside
  out_specs = ([[P() for _ in low._sum_outputs(prog.analysis.decisions[cut_outs[k].index])] for k in order],
               [P(st) for _ in summed_b])
  value_specs = [P(st) if v in sharded else P() for v in loop_inputs]
  mapped = jax.shard_map(per_device, mesh=layout.mesh, in_specs=(value_specs, P(da), P(da), P(da)),
                         out_specs=out_specs, axis_names=set(axes), check_vma=False)
  totals, grads = mapped(loop_values, buffers, counts, starts)
  flat_rows = Stages(layers, M).rows()  # layer order in the padded [S * L]
  result = dict(zip(order, totals))
  if stack_cut is not None:
    result[stack_cut] = grads if blocked_grads else [g[flat_rows] for g in grads]
  if pe_outs:
    raise _refuse("the step returns per-example values")
  return [[t.astype(prog.eqns[c.index].outvars[j].aval.dtype)
           for t, j in zip(result[k], low._sum_outputs(prog.analysis.decisions[c.index]))]
          for k, c in enumerate(cut_outs)], []
