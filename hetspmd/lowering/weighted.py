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

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from hetspmd.lowering import operands
from hetspmd.errors import HetSpmdError
from hetspmd.autodiff import reduce_over_data
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.batch_axis.analysis import Analysis, Axis


@dataclasses.dataclass(frozen=True)
class Layout:
  """How the batch lies on the devices."""

  mesh: Any
  data_axis: str
  microbatch: int
  max_count: int
  counts: tuple[int, ...]
  lockstep: bool = False
  # (path, shape, dim) of the state leaves split along data (ZeRO): a gradient of that shape is reduce-scattered
  data_split: tuple[tuple[str, tuple[int, ...], int], ...] = ()
  # gradients (final sums made by the backward pass, see _low_precision) cross data in this dtype
  reduce_dtype: str = "float32"
  # the final loop's last microbatch runs after the loop, so its gradients' reductions can overlap it
  overlap: bool = False
  # the peeled pass runs this many microbatches as one batch (every position has at least this many)
  overlap_microbatches: int = 1
  # layers per pipeline stage (hetspmd.lowering.staged): the mesh's ``stage_axis`` cuts the step's layer scan
  stages: tuple[int, ...] = ()
  stage_axis: str = "stage"

  @property
  def positions(self) -> int:
    return len(self.counts)

  @property
  def uniform_count(self) -> int | None:
    return self.counts[0] if len(set(self.counts)) == 1 else None


# --- rewriting one equation from the global batch to a microbatch ---------------------


def _microbatch_params(eqn, decision, m: int) -> dict[str, Any]:
  name = jx.primitive_name(eqn)
  params = dict(eqn.params)
  out = decision.outputs[0] if decision.outputs else None
  if name == "broadcast_in_dim" and out is not None:
    params["shape"] = operands.resize(params["shape"], out, m)
  elif name == "reshape" and out is not None:
    params["new_sizes"] = operands.resize(params["new_sizes"], out, m)
  elif name in ("gather", "dynamic_slice") and decision.inputs[0] is not None:
    axis = decision.inputs[0]
    if params["slice_sizes"][axis.dim] == jx.aval_shape(eqn.invars[0])[axis.dim]:  # a whole window of examples
      params["slice_sizes"] = operands.resize(params["slice_sizes"], axis, m)
  elif name == "slice" and out is not None:
    params["limit_indices"] = operands.resize(params["limit_indices"], out, m)
  return params


class _Program:
  """The parts of the analysis the lowering needs, computed once."""

  def __init__(self, analysis: Analysis, batch_inputs: Sequence[int], fuse: bool = True):
    self.analysis = analysis
    jaxpr = analysis.jaxpr.jaxpr
    self.jaxpr = jaxpr
    self.eqns = jaxpr.eqns
    self.batch_inputs = tuple(batch_inputs)
    self.batch = analysis.global_batch
    self.cuts = {c.index: c for c in analysis.cuts}
    self.producer = {v: i for i, e in enumerate(self.eqns) for v in e.outvars}
    local = {c.index for c in analysis.cuts if c.local}
    # which equations depend on a local (per-microbatch) statistic: those run inside the loop
    self.after_local = set()
    tainted: set = set()
    for i, eqn in enumerate(self.eqns):
      if i in local or any(v in tainted for v in eqn.invars if not jx.is_literal(v)):
        if analysis.decisions[i] is None or i in local:
          tainted.update(eqn.outvars)
          self.after_local.add(i)
    # With per-microbatch statistics the step differentiates the sum of the microbatches' losses, each
    # normalised with its own statistics: the example-free work inside the differentiated function that
    # reads a statistic (BatchNorm's scale gradient: a sum over the examples times the microbatch's
    # 1/sqrt(var); its running averages) runs per microbatch too. Where its results leave that region
    # (into the optimizer update, the new batch_stats), the loop averages them over microbatches, as
    # data parallel training with per-device BatchNorm averages its devices' gradients and statistics.
    self.region: set[int] = set()
    self.fused: set[int] = set()
    self.accumulated: list = []
    if local:
      for i in sorted(self.after_local):
        if analysis.decisions[i] is None and jx.phase(self.eqns[i]) in ("forward", "backward"):
          self.region.add(i)
      made = {v for i in self.region for v in self.eqns[i].outvars} | {
          v for c in analysis.cuts if c.local for v in self.eqns[c.index].outvars}
      consumers = {v for i, e in enumerate(self.eqns) if i not in self.region and analysis.decisions[i] is None
                   for v in e.invars if not jx.is_literal(v)} | {v for v in self.jaxpr.outvars
                                                               if not jx.is_literal(v)}
      self.accumulated = [v for v in sorted(made & consumers, key=_order(self))]
    self.hoisted = self._hoisted()
    self.early = {v for copy in self.hoisted.values() for v in copy.outvars}  # made before the loop too
    self.loop_only = self._loop_only()
    # example-free work on values that exist only inside the loop (a scan's saved parameters) runs there
    for i, eqn in enumerate(self.eqns):
      if analysis.decisions[i] is None and any(v in self.loop_only for v in eqn.outvars):
        self.after_local.add(i)
    for v in self.jaxpr.outvars:
      if not jx.is_literal(v) and v in self.loop_only:
        raise HetSpmdError(f"the step returns {v.aval.str_short()}, which hetspmd computes inside the microbatch "
                           "loop only (a value a scan body saves for the backward pass); return it from outside "
                           "the scan")
    # free equations that need no cut run before the loop; the others after a reduction
    needs_cut: set = set()
    self.pre = []
    self.post = []
    for i, eqn in enumerate(self.eqns):
      if i in self.hoisted:
        self.pre.append(i)
      if analysis.decisions[i] is None and any(v in self.loop_only for v in eqn.outvars):
        continue
      if analysis.decisions[i] is not None:
        if i in self.cuts:
          needs_cut.update(v for v in eqn.outvars if v not in self.early)
        continue
      if any(v in needs_cut for v in eqn.invars if not jx.is_literal(v)):
        needs_cut.update(eqn.outvars)
        if i not in self.region:
          self.post.append(i)
      else:
        self.pre.append(i)
    self.needs_cut = needs_cut
    self.absorbed: set[int] = set()
    if not local and fuse:
      self._fuse_sums()
    self.loop_eqns = [self._loop_equations(s) for s in range(analysis.loops)]
    # example-free work between loops (1/weight_sum): the post-cut equations later loops need
    self.middle = [self._middle(s) for s in range(analysis.loops)]

  def _hoisted(self) -> dict[int, Any]:
    """Copies of in-loop equations, pruned to the example-free values read outside them, to run before the loop.

    A scan over layers can make, besides its per-example work, values that
    read no example: the stacked parameters an NNX ``nnx.scan`` hands back
    as the blocks' new state (which the optimizer update then reads), the
    rng-stream counters it advances per layer. The loop makes them on every
    microbatch; the work outside it needs them once. Each scan (or
    checkpoint) with such outputs that example-free work or the step's
    result reads also runs before the loop, pruned by JAX's dead-code
    elimination to those outputs. Keyed by equation index.
    """
    decisions, axes = self.analysis.decisions, self.analysis.axes
    need = {v for i, e in enumerate(self.eqns) if decisions[i] is None for v in e.invars
            if not jx.is_literal(v)} | {v for v in self.jaxpr.outvars if not jx.is_literal(v)}
    copies: dict[int, Any] = {}  # what each equation would run before the loop, and what those copies read
    for i in reversed(range(len(self.eqns))):
      decision = decisions[i]
      wanted = [j for j in decision.invariant if self.eqns[i].outvars[j] in need] if decision is not None else []
      copy = jx.pruned(self.eqns[i], wanted) if wanted else None
      if copy is not None:
        copies[i] = copy
        need.update(v for v in copy.invars if not jx.is_literal(v))
    hoisted: dict[int, Any] = {}
    late: set = set()  # values not ready before the loop: made only inside it, or from a sum over the batch
    for i, eqn in enumerate(self.eqns):
      decision = decisions[i]
      reads_late = any(v in late for v in eqn.invars if not jx.is_literal(v))
      if decision is None:
        if reads_late:
          late.update(eqn.outvars)
        continue
      if i in self.cuts or reads_late:
        late.update(eqn.outvars)
      invariant = [eqn.outvars[j] for j in decision.invariant]
      copy = copies.get(i)
      if copy is not None and not any(v in axes or v in late for v in copy.invars if not jx.is_literal(v)):
        hoisted[i] = copy
        late.difference_update(copy.outvars)
        late.update(v for v in invariant if v not in copy.outvars)
      else:
        late.update(invariant)
    return hoisted

  def _loop_only(self) -> set:
    """Example-free values that exist only inside the loop: in-loop equations' outputs that read no example
    and are not made before the loop too (:meth:`_hoisted`), and the example-free work on them."""
    early = self.early
    loop_only: set = set()
    for i, eqn in enumerate(self.eqns):
      decision = self.analysis.decisions[i]
      if decision is not None:
        loop_only.update(eqn.outvars[j] for j in decision.invariant if eqn.outvars[j] not in early)
      elif any(v in loop_only for v in eqn.invars if not jx.is_literal(v)):
        loop_only.update(eqn.outvars)
    return loop_only

  def _fuse_sums(self) -> None:
    """Gradients that the step adds together (a tied embedding's lookup and output projection) are added in
    the loop: one accumulator, one reduction of its bytes."""
    final = self.analysis.loops - 1
    uses: dict = {}
    for e in self.eqns:
      for v in e.invars:
        if not jx.is_literal(v):
          uses[v] = uses.get(v, 0) + 1
    for v in self.jaxpr.outvars:
      if not jx.is_literal(v):
        uses[v] = uses.get(v, 0) + 2
    sums: dict = {}
    for c in self.analysis.cuts:
      d = self.analysis.decisions[c.index]
      zero_base = c.base is None or _is_zero_broadcast(self, self.eqns[c.index].invars[c.base])
      if c.reduce == "sum" and c.loop == final and not c.feedback and d.body is None and zero_base:
        sums[self.eqns[c.index].outvars[0]] = c.index
    made: dict = {}
    for i in list(self.post):
      eqn = self.eqns[i]
      ins = [v for v in eqn.invars if not jx.is_literal(v)]
      summed = all((v in sums or v in made) and uses.get(v) == 1 for v in ins)
      added = (jx.primitive_name(eqn) in ("add", "add_any") and len(ins) == 2 and ins[0] is not ins[1]
               and jx.aval_shape(ins[0]) == jx.aval_shape(ins[1]) == jx.aval_shape(eqn.outvars[0]))
      moved = jx.primitive_name(eqn) in ("transpose", "reshape", "convert_element_type", "neg") and len(
          eqn.invars) == 1 and (jx.aval_dtype(eqn.outvars[0]) == jx.aval_dtype(eqn.invars[0]))
      if ins and summed and (added or moved):
        for v in ins:
          if v in sums:
            self.absorbed.add(sums[v])
          made.pop(v, None)
        made[eqn.outvars[0]] = i
        self.fused.add(i)
    for i in self.fused:
      self.post.remove(i)
      self.after_local.add(i)
    self.accumulated = sorted(made, key=_order(self))

  def _middle(self, s: int) -> list[int]:
    """Post-cut equations to evaluate after loop ``s - 1``, for loop ``s`` and the ones after it."""
    if s == 0:
      return []
    need = {v for t in range(s, self.analysis.loops) for v in self.outside_inputs(t) if v in self.needs_cut}
    chosen = []
    for i in reversed(self.post):
      eqn = self.eqns[i]
      if any(v in need for v in eqn.outvars):
        chosen.append(i)
        need.update(v for v in eqn.invars if not jx.is_literal(v))
    return sorted(chosen)

  def middle_inputs(self) -> list[Any]:
    """Pre-loop values that the work between loops reads."""
    made = {v for s in range(self.analysis.loops) for i in self.middle[s] for v in self.eqns[i].outvars}
    cut_out = {v for i in self.cuts for v in self.eqns[i].outvars}
    return [v for s in range(self.analysis.loops) for i in self.middle[s] for v in self.eqns[i].invars
            if not jx.is_literal(v) and v not in made and v not in cut_out and v not in self.needs_cut]

  def rebuilt(self, var: Any, axis: Axis | None) -> Any:
    """The broadcast that makes example-free ``var`` batch-sized along ``axis``, to rebuild at the microbatch size."""
    return operands.rebuilt(self, var, axis)

  def _loop_equations(self, s: int) -> list[int]:
    """Equations loop ``s`` evaluates: the in-loop ancestors of its cuts (and, last, of per-example outputs)."""
    targets = [c.index for c in self.analysis.cuts if c.loop == s]
    wanted: set = set()
    for c in targets:
      wanted.update(v for v in self.eqns[c].invars if not jx.is_literal(v))
    if s == self.analysis.loops - 1:
      wanted.update(v for v in self.jaxpr.outvars if not jx.is_literal(v) and v in self.analysis.axes)
      wanted.update(self.accumulated)
    chosen = set(targets)
    for i in reversed(range(len(self.eqns))):
      eqn = self.eqns[i]
      if i in chosen or any(v in wanted for v in eqn.outvars):
        inside = self.analysis.decisions[i] is not None or i in self.after_local
        if not inside:
          continue
        if i in self.cuts and not self.cuts[i].local and i not in targets:
          continue  # an exact cut of an earlier loop: its reduced value comes in from outside the loop
        chosen.add(i)
        wanted.update(v for v in eqn.invars if not jx.is_literal(v))
    return sorted(chosen)

  def outside_inputs(self, s: int) -> list[Any]:
    """Example-free variables loop ``s`` reads from outside it."""
    inside_out = {v for i in self.loop_eqns[s] for v in self.eqns[i].outvars}
    batch_vars = {self.jaxpr.invars[i] for i in self.batch_inputs}
    out = []
    seen = set()
    for i in self.loop_eqns[s]:
      eqn = self.eqns[i]
      decision = self.analysis.decisions[i]
      for j, v in enumerate(eqn.invars):
        if jx.is_literal(v) or v in inside_out or v in batch_vars:
          continue
        chain = self.rebuilt(v, decision.inputs[j]) if decision is not None else None
        needs = [v] if chain is None else operands.chain_inputs(chain)
        if chain is not None and not operands.sliceable(chain):
          needs = [v]
        for u in needs:
          if u not in seen:
            seen.add(u)
            out.append(u)
    return out


def recompute_factor(analysis: Analysis, batch_inputs: Sequence[int]) -> float:
  """The per-example work of all the program's loops over that of one pass (1 with a single loop).

  Work is FLOPs plus bytes written per equation (:mod:`hetspmd.passes.costing.flops`), bodies counted per step;
  exact batch statistics make it > 1: each earlier loop runs the forward pass up to its statistic.
  """
  prog = _Program(analysis, batch_inputs)
  if analysis.loops == 1:
    return 1.0
  work = [_work(e) for e in prog.eqns]
  union = set().union(*map(set, prog.loop_eqns))
  total = sum(work[i] for i in union)
  return sum(work[i] for loop in prog.loop_eqns for i in loop) / total if total else 1.0


def _work(eqn) -> float:
  from hetspmd.passes.costing import flops
  from hetspmd.passes.frontend.tracing import _tensor_type

  body = jx.call_body(eqn) or (jx.scan_parts(eqn).body if jx.primitive_name(eqn) == "scan" else None)
  if body is not None:
    repeat = jx.scan_parts(eqn).length if jx.primitive_name(eqn) == "scan" else 1
    return repeat * sum(_work(e) for e in body.jaxpr.eqns)
  cost, _ = flops.cost_of(jx.primitive_name(eqn), [_tensor_type(v) for v in eqn.invars],
                          [_tensor_type(v) for v in eqn.outvars], eqn.params)
  return cost.flops + cost.bytes_written


def build(analysis: Analysis, batch_inputs: Sequence[int], layout: Layout):
  """``program(inputs, counts, starts) -> outputs`` over the step's flat jaxpr inputs and outputs.

  ``inputs``: the flat jaxpr inputs, with each batch input replaced by its
  padded microbatch buffer ``[positions * max_count, microbatch, ...]``
  sharded over ``data``; ``counts`` and ``starts``: each position's
  microbatch count and first global example, ``int32[positions]`` sharded
  over ``data``.
  """
  prog = _Program(analysis, batch_inputs, fuse=not layout.stages)  # stages sum each group on its own stage
  return lambda inputs, counts, starts: _run(prog, layout, list(inputs), counts, starts)


def _run(prog: _Program, layout: Layout, inputs: list[Any], counts, starts) -> list[Any]:
  jaxpr = prog.jaxpr
  env: dict = dict(zip(jaxpr.constvars, prog.analysis.jaxpr.consts))
  batch_vars = [jaxpr.invars[i] for i in prog.batch_inputs]
  buffers = [inputs[i] for i in prog.batch_inputs]
  for i, (v, x) in enumerate(zip(jaxpr.invars, inputs)):
    if i not in prog.batch_inputs:
      env[v] = x
  jx.eval_equations([prog.hoisted.get(i, prog.eqns[i]) for i in prog.pre], env)
  loop_inputs = sorted({v for s in range(prog.analysis.loops) for v in prog.outside_inputs(s)
                        if v not in prog.needs_cut and (v in prog.early or prog.producer.get(v) not in prog.cuts)}
                       | set(prog.middle_inputs()), key=_order(prog))
  cut_outs = [c for c in prog.analysis.cuts if c.index not in prog.absorbed]
  pe_outs = [v for v in jaxpr.outvars if not jx.is_literal(v) and v in prog.analysis.axes]
  loop_part = _loop_part
  if layout.stages:
    from hetspmd.lowering import staged
    loop_part = staged.loop_part
  totals, pe_buffers = loop_part(prog, layout, [env[v] for v in loop_inputs], loop_inputs, batch_vars, buffers,
                                 counts, starts, cut_outs, pe_outs)
  if prog.accumulated:
    pe_buffers, accumulated = pe_buffers
    env.update((v, x.astype(v.aval.dtype)) for v, x in zip(prog.accumulated, accumulated))
  for cut, values in zip(cut_outs, totals):
    eqn = prog.eqns[cut.index]
    decision = prog.analysis.decisions[cut.index]
    env.update(zip([eqn.outvars[j] for j in _sum_outputs(decision)], _with_bases(eqn, decision, values, env)))
  jx.eval_equations([prog.eqns[i] for i in prog.post], env)
  for v, buf in zip(pe_outs, pe_buffers):
    env[v] = _global_order(buf, prog.analysis.axes[v], layout)
  return [jx.read(env, v) for v in jaxpr.outvars]


def _with_bases(eqn, decision, values, env) -> list[Any]:
  """Reduced partial sums plus what they were started from: a scatter-add's operand, a scan's initial carries."""
  summed = _sum_outputs(decision)
  values = list(values)
  bases = {0: decision.base} if decision.base is not None else {}
  if decision.body is not None and decision.body.accumulators:
    nc = jx.scan_parts(eqn).num_consts
    bases = {k: nc + k for k in decision.body.accumulators}
  for j, i in bases.items():
    if j in summed:
      base = jx.read(env, eqn.invars[i])
      values[summed.index(j)] = base + values[summed.index(j)].astype(base.dtype)
  return values


def _order(prog: _Program):
  index = {}
  for i, v in enumerate(prog.jaxpr.invars):
    index[v] = (-1, i)
  for i, eqn in enumerate(prog.eqns):
    for j, v in enumerate(eqn.outvars):
      index[v] = (i, j)
  return lambda v: index.get(v, (-2, 0))


def _global_order(buf, axis: Axis, layout: Layout):
  """``[positions * max_count, *microbatch shape]`` → the global-batch value, examples in global order."""
  valid = np.array([p * layout.max_count + i for p, c in enumerate(layout.counts) for i in range(c)], np.int32)
  if len(valid) != buf.shape[0]:
    buf = jnp.take(buf, valid, axis=0)
  moved = jnp.moveaxis(buf, 0, axis.dim)
  shape = moved.shape
  return moved.reshape(shape[:axis.dim] + (shape[axis.dim] * shape[axis.dim + 1],) + shape[axis.dim + 2:])


def _identity(reduce: str, shape, dtype):
  if reduce == "sum":
    return jnp.zeros(shape, dtype)
  if jnp.issubdtype(dtype, jnp.bool_):
    return jnp.full(shape, reduce == "min", dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.full(shape, -jnp.inf if reduce == "max" else jnp.inf, dtype)
  info = jnp.iinfo(dtype)
  return jnp.full(shape, info.min if reduce == "max" else info.max, dtype)


def _combine(reduce: str):
  return {"sum": jnp.add, "max": jnp.maximum, "min": jnp.minimum}[reduce]


def _wide(x):
  return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32 else x


def _loop_part(prog, layout, loop_values, loop_inputs, batch_vars, buffers, counts, starts, cut_outs, pe_outs):
  axis = layout.data_axis
  single = layout.mesh.shape[axis] == 1
  data_only = layout.mesh.size == layout.mesh.shape[axis]
  final = prog.analysis.loops - 1
  # gradients of ZeRO-split state leave the loop reduce-scattered onto their shards
  scatter = {}
  for k, cut in enumerate(cut_outs):
    if cut.reduce == "sum" and cut.loop == final and not cut.feedback and data_only and not single:
      decision = prog.analysis.decisions[cut.index]
      if cut.base is None and decision.body is None and not prog.region:
        dim = _scatter_dim(prog, prog.eqns[cut.index].outvars[0], layout.data_split)
        if dim is not None:
          scatter[k] = dim

  acc_scatter = [_scatter_dim(prog, v, layout.data_split) if data_only and not single and not prog.region else None
                 for v in prog.accumulated]

  def per_device(values, buffers, counts, starts):
    outer = dict(zip(loop_inputs, values))
    totals: dict[int, list] = {}
    pe_result = []
    for s in range(prog.analysis.loops):
      mine = [k for k, c in enumerate(cut_outs) if c.loop == s]
      partials, outs = _one_loop(prog, layout, s, outer, mine, cut_outs, batch_vars, buffers, counts[0], starts[0],
                                 pe_outs if s == final else [])
      if s == final and prog.accumulated:
        extra = partials[len(mine):]
        partials = partials[:len(mine)]
        low = [[not prog.region and _backward(prog, prog.producer.get(v)) and _low_precision(layout, x[0])]
               for v, x in zip(prog.accumulated, extra)]
        accumulated = reduce_over_data(extra, ["sum"] * len(extra), acc_scatter, axis, single, data_only, low,
                                        layout.reduce_dtype)
      low = [[s == final and cut_outs[k].reduce == "sum" and not cut_outs[k].feedback and not cut_outs[k].local
              and _backward(prog, cut_outs[k].index) and _low_precision(layout, x) for x in part]
             for k, part in zip(mine, partials)]
      reduced = reduce_over_data(partials, [cut_outs[k].reduce for k in mine], [scatter.get(k) for k in mine],
                                  axis, single, data_only, low, layout.reduce_dtype)
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
                 for _ in _sum_outputs(prog.analysis.decisions[c.index])]
                for k, c in enumerate(cut_outs)], [P(axis) for _ in pe_outs])
  if prog.accumulated:
    out_specs = (out_specs[0], (out_specs[1], [P() if d is None else P(*([None] * d), axis) for d in acc_scatter]))
  if single:
    return per_device(loop_values, buffers, counts, starts)
  mapped = jax.shard_map(per_device, mesh=layout.mesh, in_specs=(P(), P(axis), P(axis), P(axis)),
                         out_specs=out_specs, axis_names={axis}, check_vma=False)
  totals, pe = mapped(loop_values, buffers, counts, starts)
  return [[t.astype(prog.eqns[c.index].outvars[j].aval.dtype)
           for t, j in zip(tt, _sum_outputs(prog.analysis.decisions[c.index]))]
          for tt, c in zip(totals, cut_outs)], pe


def feed_back(prog, cut, values, outer: dict) -> None:
  """Puts a reduced cut that later loops read into ``outer``: with its base, in its own dtype."""
  eqn, decision = prog.eqns[cut.index], prog.analysis.decisions[cut.index]
  made = [eqn.outvars[j] for j in _sum_outputs(decision)]
  value = _with_bases(eqn, decision, values, outer)
  outer.update(zip(made, [v.astype(o.aval.dtype) for v, o in zip(value, made)]))


def between_loops(prog, s: int, outer: dict) -> None:
  """The example-free work after loop ``s`` (1/weight_sum) that later loops need, as far as its inputs are ready."""
  for i in sorted({i for t in range(s + 1, prog.analysis.loops) for i in prog.middle[t]}):
    eqn = prog.eqns[i]
    ready = all(jx.is_literal(v) or v in outer for v in eqn.invars)
    if ready and not all(v in outer for v in eqn.outvars):  # the rest wait for a later loop's reductions
      jx.eval_equations([eqn], outer)


# Equations a gradient passes through on its way from the cut to the optimizer, its dimensions kept in order
# (or permuted, for a transpose), its other operands scalars.
_TO_STATE = frozenset({"transpose", "convert_element_type", "mul", "div", "neg", "copy"})


def _scatter_dim(prog, var, data_split) -> int | None:
  """The dimension to reduce-scatter a cut's value along: that of the ZeRO-split state leaf it becomes.

  Follows the value through transposes, casts and scalings (a gradient divided by the batch size, a
  dot's output transposed into the kernel's layout) until its shape is a split leaf's; ``None`` if it
  reaches none (it is then all-reduced whole). Only the value's sharding depends on this choice.
  """
  consumers: dict = {}
  for i in prog.post:
    for v in prog.eqns[i].invars:
      if not jx.is_literal(v):
        consumers.setdefault(v, []).append(i)
  by_shape: dict = {}
  for _, shape, dim in data_split:
    by_shape.setdefault(tuple(shape), set()).add(dim)
  where = list(range(len(jx.aval_shape(var))))  # where each of the cut's dimensions is now
  for _ in range(8):
    split = by_shape.get(jx.aval_shape(var))
    if split and len(split) == 1:
      target = next(iter(split))
      return where.index(target)
    users = consumers.get(var, [])
    if len(users) != 1 or jx.primitive_name(prog.eqns[users[0]]) not in _TO_STATE:
      return None
    eqn = prog.eqns[users[0]]
    if any(not jx.is_literal(v) and v is not var and jx.aval_shape(v) != () for v in eqn.invars):
      return None
    if jx.primitive_name(eqn) == "transpose":
      perm = tuple(eqn.params["permutation"])
      where = [perm.index(d) for d in where]
    var = eqn.outvars[0]
  return None


def _backward(prog, index: int | None) -> bool:
  """Whether equation ``index`` belongs to a transposed (gradient) pass, by its name stack."""
  return index is not None and jx.phase(prog.eqns[index]) == "backward"


def _low_precision(layout: Layout, x) -> bool:
  """Whether a final sum made by the backward pass crosses ``data`` in ``layout.reduce_dtype``: a floating array.

  Scalars (the loss's sum and weight, token counts), sums of the forward
  pass (metrics), sums that feed later loops and per-microbatch statistics
  stay float32; the callers check all but the first.
  """
  return layout.reduce_dtype != "float32" and jnp.issubdtype(x.dtype, jnp.floating) and x.size > 1


def _one_loop(prog, layout, s, outer, mine, cut_outs, batch_vars, buffers, count, start, pe_outs):
  """Runs loop ``s`` over this device's microbatches; its cuts' partial values and per-example outputs."""
  m = layout.microbatch
  eqns = [prog.eqns[i] for i in prog.loop_eqns[s]]
  indices = prog.loop_eqns[s]
  targets = {cut_outs[k].index: k for k in mine}

  def one(i, k: int = 1):
    """Microbatches ``i .. i + k - 1`` of this device, run as one batch of ``k * m`` examples."""
    size = k * m
    env = dict(outer)
    env.update(zip(prog.jaxpr.constvars, prog.analysis.jaxpr.consts))
    for v, b in zip(batch_vars, buffers):
      if k == 1:
        env[v] = jax.lax.dynamic_index_in_dim(b, i, 0, keepdims=False)
      else:
        env[v] = jax.lax.dynamic_slice_in_dim(b, i, k, 0).reshape((size,) + b.shape[2:])
    offset = start + i * m
    partial: dict[int, list] = {}
    for index, eqn in zip(indices, eqns):
      decision = prog.analysis.decisions[index]
      if decision is None:  # example-free work on a local statistic
        jx.eval_equations([eqn], env)
        continue
      cut = prog.cuts.get(index)
      out = _apply(prog, eqn, decision, env, offset, size, zero_base=cut is not None and cut.base is not None)
      summed = _sum_outputs(decision)
      env.update((eqn.outvars[j], x) for j, x in enumerate(out) if j not in summed)
      if index in targets:
        partial[targets[index]] = [_wide(out[j]) for j in summed]
        if prog.region and not cut.local:  # read as a mean, as the statistics are, by work on them
          env.update((eqn.outvars[j], (out[j] * (prog.batch / m)).astype(out[j].dtype)) for j in summed)
      if index in prog.absorbed:  # added to another sum in the loop
        env.update((eqn.outvars[j], out[j]) for j in summed)
      if cut is not None and cut.local:
        scale = prog.batch / m if cut.reduce == "sum" else 1
        env.update((eqn.outvars[j], (out[j] * scale).astype(out[j].dtype)) for j in summed)
    # per-microbatch statistics' results are averaged over microbatches; fused sums are summed
    averaged = [[_wide(env[v]) * (m / prog.batch) if prog.region else _wide(env[v])] for v in accumulated]
    outs = [env[v] if k == 1 else _split_fused(env[v], prog.analysis.axes[v].dim, k) for v in pe_outs]
    return [partial[k_] for k_ in mine] + averaged, outs

  accumulated = prog.accumulated if s == prog.analysis.loops - 1 else []
  kinds = [cut_outs[k].reduce for k in mine] + ["sum"] * len(accumulated)
  shapes = jax.eval_shape(one, 0)
  zeros = [[_identity(r, x.shape, x.dtype) for x in part] for r, part in zip(kinds, shapes[0])]
  pe_zero = [jnp.zeros((layout.max_count,) + x.shape, x.dtype) for x in shapes[1]]

  def body(i, carry, masked: bool, k: int = 1, limit=None):
    acc, pe = carry
    part, outs = one(i, k)
    if masked:  # slots from ``limit`` (default: the count) on are padding
      valid = i < (count if limit is None else limit)
      part = [[jnp.where(valid, x, _identity(r, x.shape, x.dtype)) for x in p] for r, p in zip(kinds, part)]
    acc = [[_combine(r)(a, x) for a, x in zip(aa, xx)] for r, aa, xx in zip(kinds, acc, part)]
    if k == 1:
      pe = [jax.lax.dynamic_update_index_in_dim(b, x, i, 0) for b, x in zip(pe, outs)]
    else:
      pe = [jax.lax.dynamic_update_slice_in_dim(b, x, i, 0) for b, x in zip(pe, outs)]
    return acc, pe

  uniform = layout.uniform_count
  peel = layout.overlap and s == prog.analysis.loops - 1  # the last microbatch(es) after the loop
  k = layout.overlap_microbatches if peel else 1
  if k > 1:  # every position has at least k microbatches (Plan checks): its last k run as one batch, unmasked
    if prog.region or any(c.local for c in prog.analysis.cuts):
      raise HetSpmdError(f"overlap_microbatches={k} would compute batch statistics over {k} microbatches at once; "
                         "a step with per-microbatch statistics (BatchNorm, batch_stats='local') needs "
                         "overlap_microbatches=1")
    first = (uniform if uniform is not None else count) - k
    if layout.lockstep and uniform is None:  # every position runs the longest loop, its own slots from first masked
      carry = jax.lax.fori_loop(0, layout.max_count - k, lambda i, c: body(i, c, True, limit=first), (zeros, pe_zero))
    else:
      carry = jax.lax.fori_loop(0, first, lambda i, c: body(i, c, False), (zeros, pe_zero))
    return body(first, carry, False, k)
  if uniform == 1:
    return body(0, (zeros, pe_zero), False)
  if uniform is not None:
    carry = jax.lax.fori_loop(0, uniform - peel, lambda i, c: body(i, c, False), (zeros, pe_zero))
    return body(uniform - 1, carry, False) if peel else carry
  if layout.lockstep:
    carry = jax.lax.fori_loop(0, layout.max_count - peel, lambda i, c: body(i, c, True), (zeros, pe_zero))
    return body(layout.max_count - 1, carry, True) if peel else carry
  if not peel:
    return jax.lax.fori_loop(0, count, lambda i, c: body(i, c, False), (zeros, pe_zero))
  last = jnp.maximum(count - 1, 0)  # a device with no microbatch runs one, masked to nothing
  return body(last, jax.lax.fori_loop(0, last, lambda i, c: body(i, c, False), (zeros, pe_zero)), True)


def _split_fused(x, dim: int, k: int):
  """A per-example output of ``k`` microbatches run as one, its examples along ``dim`` → ``[k, *one's shape]``."""
  shape = x.shape
  return jnp.moveaxis(x.reshape(shape[:dim] + (k, shape[dim] // k) + shape[dim + 1:]), dim, 0)


def _is_zero_broadcast(prog, var) -> bool:
  if jx.is_literal(var):
    return bool(np.all(np.asarray(var.val) == 0))
  i = prog.producer.get(var)
  return i is not None and jx.primitive_name(prog.eqns[i]) == "broadcast_in_dim" and jx.is_literal(
      prog.eqns[i].invars[0]) and bool(np.all(np.asarray(prog.eqns[i].invars[0].val) == 0))


def _sum_outputs(decision) -> list[int]:
  """The outputs of a cut that are reductions over the examples (a body's others are per-example)."""
  return [j for j, a in enumerate(decision.outputs) if a is None and j not in decision.invariant]


def _apply(prog, eqn, decision, env, offset, m, zero_base: bool = False) -> list[Any]:
  """One per-example or cut equation on one microbatch: its outputs."""
  invals = [operands.operand(prog, env, v, a, offset, m) for v, a in zip(eqn.invars, decision.inputs)]
  if zero_base:
    invals[decision.base] = jnp.zeros_like(invals[decision.base])
  if decision.body is not None:
    return _apply_body(eqn, decision, invals, offset, m)
  if jx.primitive_name(eqn) in _PLACEMENT:  # a sharding constraint: the loop's data axis is manual, XLA places it
    return list(invals)
  return jx.bind(eqn, invals, _microbatch_params(eqn, decision, m))


# Activation sharding constraints (nn.with_logical_constraint, with_sharding_constraint) inside the loop: the
# data axis is manual there, and the model axis's sharding follows from the parameters' by propagation.
_PLACEMENT = frozenset({"sharding_constraint", "mesh_cast", "reshard"})


class _Body:
  """A nested body's propagation, seen as the lowering sees a program."""

  def __init__(self, body):
    prop = body.propagation
    self.prop = prop
    self.jaxpr = prop.jaxpr.jaxpr
    self.consts = prop.jaxpr.consts
    self.eqns = self.jaxpr.eqns
    self.producer = {v: i for i, e in enumerate(self.eqns) for v in e.outvars}
    self.presliced = body.presliced
    self.analysis = self  # operands.operand reads .analysis.axes
    self.axes = prop.axes

  def rebuilt(self, var, axis):
    return operands.rebuilt(self, var, axis)

  def run(self, inputs, offset, m) -> list[Any]:
    env = dict(zip(self.jaxpr.constvars, self.consts))
    env.update(zip(self.jaxpr.invars, inputs))
    for eqn, decision in zip(self.eqns, self.prop.decisions):
      if decision is None:
        jx.eval_equations([eqn], env)
      else:
        env.update(zip(eqn.outvars, _apply(self, eqn, decision, env, offset, m)))
    return [jx.read(env, v) for v in self.jaxpr.outvars]


def _apply_body(eqn, decision, invals, offset, m) -> list[Any]:
  body = _Body(decision.body)
  name = jx.primitive_name(eqn)
  if name in ("remat2", "checkpoint"):
    return jx.checkpoint_call(eqn, lambda *xs: body.run(xs, offset, m), invals)
  parts = jx.scan_parts(eqn)
  nc, nk = parts.num_consts, parts.num_carry
  consts, init, xs = invals[:nc], list(invals[nc:nc + nk]), invals[nc + nk:]
  for k in decision.body.accumulators:  # partial sums start at zero; the initial value is added after reducing
    init[k] = jnp.zeros_like(init[k])

  def step(carry, x):
    out = body.run(list(consts) + list(carry) + list(x), offset, m)
    return out[:nk], out[nk:]

  carry, ys = jax.lax.scan(step, init, xs, length=parts.length, reverse=eqn.params["reverse"],
                           unroll=eqn.params.get("unroll", 1))
  return list(carry) + list(ys)
