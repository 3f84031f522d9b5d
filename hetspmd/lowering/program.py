"""What the lowering reads of a step's microbatch analysis, computed once: :class:`Layout` and :class:`Program`.

:class:`Layout` says how the batch lies on the devices (mesh, microbatch,
counts, reduce dtype, overlap, stages). :class:`Program` holds the analysed
jaxpr split into the work before the loops, each loop's equations, the work
between loops and after them, with the per-equation facts the loop builders
(:mod:`hetspmd.lowering.loop`, :mod:`~hetspmd.lowering.weighted`,
:mod:`~hetspmd.lowering.staged`) ask for.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from hetspmd.lowering import operands
from hetspmd.errors import HetSpmdError
from hetspmd.lowering.dataflow import DataFlow
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.batch_axis.analysis import Analysis
from hetspmd.passes.batch_axis.rules import Axis
from hetspmd.passes.costing import flops
from hetspmd.passes.frontend.tracing import tensor_type


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
  # gradients (final sums made by the backward pass, see low_precision) cross data in this dtype
  reduce_dtype: str = "float32"
  # the final loop's last microbatch runs after the loop, so its gradients' reductions can overlap it
  overlap: bool = False
  # the peeled pass runs this many microbatches as one batch (every position has at least this many)
  overlap_microbatches: int = 1
  # layers per pipeline stage (hetspmd.lowering.staged): the mesh's ``stage_axis`` cuts the step's layer scan
  stages: tuple[int, ...] = ()
  stage_axis: str = "stage"
  # host callbacks ``start(position) -> int32 0`` and ``end(position, value) -> int32 0`` around each position's
  # microbatch loop (hetspmd.runtime.rebalancing.LoopClock): its own loop's time, read with no extra work
  clock: Any = None
  # the loops read their trip counts when they run, never as constants (equal counts too): the program then
  # runs any counts that fit ``max_count`` (a group with slots, hetspmd.plan.groups.Group.slots)
  counts_at_run: bool = False

  @property
  def positions(self) -> int:
    return len(self.counts)

  @property
  def uniform_count(self) -> int | None:
    return self.counts[0] if len(set(self.counts)) == 1 and not self.counts_at_run else None


def counts_fixed_when_traced(analysis: Any) -> bool:
  """Whether a single program built from ``analysis`` reads the microbatch counts when it is traced, not only
  as its ``counts`` argument: a step output that keeps the batch axis (logits among the metrics) is put back in
  global order from :attr:`Layout.counts`. Otherwise one program runs any counts that keep the layout's
  ``max_count``, ``uniform_count`` and ``overlap_microbatches``."""
  return any(not jx.is_literal(v) and v in analysis.axes for v in jx.outvars(analysis.jaxpr))


def microbatch_params(eqn, decision, m: int) -> dict[str, Any]:
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


class Program:
  """The parts of the analysis the lowering needs, computed once."""

  def __init__(self, analysis: Analysis, batch_inputs: Sequence[int], fuse: bool = True):
    self.analysis = analysis
    closed = analysis.jaxpr
    self.eqns = jx.equations(closed)
    self.invars, self.outvars = jx.invars(closed), jx.outvars(closed)
    self.constvars, self.consts = jx.constvars(closed), jx.consts(closed)
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
                   for v in e.invars if not jx.is_literal(v)} | {v for v in self.outvars
                                                               if not jx.is_literal(v)}
      self.accumulated = [v for v in sorted(made & consumers, key=definition_order(self))]
    self.hoisted = self._hoisted()
    self.early = {v for copy in self.hoisted.values() for v in copy.outvars}  # made before the loop too
    self.loop_only = self._loop_only()
    # example-free work on values that exist only inside the loop (a scan's saved parameters) runs there
    for i, eqn in enumerate(self.eqns):
      if analysis.decisions[i] is None and any(v in self.loop_only for v in eqn.outvars):
        self.after_local.add(i)
    for v in self.outvars:
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

  @functools.cached_property
  def flow(self) -> DataFlow:
    """Who reads each variable, which outputs it is (built on first use)."""
    return DataFlow.of(self.eqns, self.outvars)

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
            if not jx.is_literal(v)} | {v for v in self.outvars if not jx.is_literal(v)}
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
    for v in self.outvars:
      if not jx.is_literal(v):
        uses[v] = uses.get(v, 0) + 2
    sums: dict = {}
    for c in self.analysis.cuts:
      d = self.analysis.decisions[c.index]
      zero_base = c.base is None or is_zero_broadcast(self, self.eqns[c.index].invars[c.base])
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
    self.accumulated = sorted(made, key=definition_order(self))

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

  @property
  def cut_outs(self) -> tuple:
    """The cuts the loops sum and reduce, in order: every cut but those absorbed into a fused sum."""
    return tuple(c for c in self.analysis.cuts if c.index not in self.absorbed)

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
      wanted.update(v for v in self.outvars if not jx.is_literal(v) and v in self.analysis.axes)
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
    batch_vars = {self.invars[i] for i in self.batch_inputs}
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
  prog = Program(analysis, batch_inputs)
  if analysis.loops == 1:
    return 1.0
  work = [_work(e) for e in prog.eqns]
  union = set().union(*map(set, prog.loop_eqns))
  total = sum(work[i] for i in union)
  return sum(work[i] for loop in prog.loop_eqns for i in loop) / total if total else 1.0


def _work(eqn) -> float:
  body = jx.call_body(eqn) or (jx.scan_parts(eqn).body if jx.primitive_name(eqn) == "scan" else None)
  if body is not None:
    repeat = jx.scan_parts(eqn).length if jx.primitive_name(eqn) == "scan" else 1
    return repeat * sum(_work(e) for e in jx.equations(body))
  cost, _ = flops.cost_of(jx.primitive_name(eqn), [tensor_type(v) for v in eqn.invars],
                          [tensor_type(v) for v in eqn.outvars], eqn.params)
  return cost.flops + cost.bytes_written


def with_bases(eqn, decision, values, env) -> list[Any]:
  """Reduced partial sums plus what they were started from: a scatter-add's operand, a scan's initial carries."""
  summed = sum_outputs(decision)
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


def definition_order(prog: Program):
  index = {}
  for i, v in enumerate(prog.invars):
    index[v] = (-1, i)
  for i, eqn in enumerate(prog.eqns):
    for j, v in enumerate(eqn.outvars):
      index[v] = (i, j)
  return lambda v: index.get(v, (-2, 0))


# Equations a gradient passes through on its way from the cut to the optimizer, its dimensions kept in order
# (or permuted, for a transpose), its other operands scalars.
_TO_STATE = frozenset({"transpose", "convert_element_type", "mul", "div", "neg", "copy"})


def scatter_dim_of(prog, var, data_split) -> int | None:
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


def is_backward(prog, index: int | None) -> bool:
  """Whether equation ``index`` belongs to a transposed (gradient) pass, by its name stack."""
  return index is not None and jx.phase(prog.eqns[index]) == "backward"


def low_precision(layout: Layout, x) -> bool:
  """Whether a final sum made by the backward pass crosses ``data`` in ``layout.reduce_dtype``: a floating array.

  Scalars (the loss's sum and weight, token counts), sums of the forward
  pass (metrics), sums that feed later loops and per-microbatch statistics
  stay float32; the callers check all but the first.
  """
  return narrowable(layout.reduce_dtype, x.dtype, x.size)


def narrowable(reduce_dtype: str, dtype: Any, size: int) -> bool:
  """Whether a gradient of ``dtype`` and ``size`` elements crosses devices in ``reduce_dtype``: a floating array
  (not a scalar) when the plan narrows at all. ``reduce_dtype="float32"`` casts nothing: a sum crosses in the
  dtype it accumulates in (:func:`wire_dtypes`)."""
  return reduce_dtype != "float32" and jnp.issubdtype(dtype, jnp.floating) and size > 1


def wire_dtypes(analysis: Analysis, reduce_dtype: str) -> list[str]:
  """The dtypes the step's gradient sums (:func:`is_gradient_cut`'s, floating) really cross ``data`` in:
  ``reduce_dtype`` where the plan narrows them, else the dtype they accumulate in (float32 for a float16 or
  bfloat16 gradient, its own for a float32 or float64 one); narrowest first."""
  eqns = jx.equations(analysis.jaxpr)
  out = set()
  for cut in analysis.cuts:
    if cut.reduce != "sum" or cut.feedback or cut.local or jx.phase(eqns[cut.index]) != "backward":
      continue
    for j in sum_outputs(analysis.decisions[cut.index]):
      v = eqns[cut.index].outvars[j]
      dtype, size = jx.aval_dtype(v), int(np.prod(jx.aval_shape(v)))
      if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        continue
      out.add(np.dtype(reduce_dtype) if narrowable(reduce_dtype, dtype, size) else
              np.dtype(jnp.float32) if jnp.finfo(dtype).bits < 32 else np.dtype(dtype))
  return [str(d) for d in sorted(out, key=lambda d: d.itemsize)]


def is_gradient_cut(prog: "Program", cut: Any) -> bool:
  """Whether a cut's sum is a gradient, which may cross devices narrowed: a sum made by the backward pass that
  feeds no later loop (``feedback``) nor a per-microbatch region (``local``). The loss's sum, token counts and
  metrics are not."""
  return cut.reduce == "sum" and not cut.feedback and not cut.local and is_backward(prog, cut.index)


def is_gradient_accumulated(prog: "Program", var: Any) -> bool:
  """Whether an accumulated value is a gradient, which may cross devices narrowed: made by the backward pass,
  in a program with no per-microbatch region."""
  return not prog.region and is_backward(prog, prog.producer.get(var))


def is_zero_broadcast(prog, var) -> bool:
  if jx.is_literal(var):
    return bool(np.all(np.asarray(var.val) == 0))
  i = prog.producer.get(var)
  return i is not None and jx.primitive_name(prog.eqns[i]) == "broadcast_in_dim" and jx.is_literal(
      prog.eqns[i].invars[0]) and bool(np.all(np.asarray(prog.eqns[i].invars[0].val) == 0))


def sum_outputs(decision) -> list[int]:
  """The outputs of a cut that are reductions over the examples (a body's others are per-example)."""
  return [j for j, a in enumerate(decision.outputs) if a is None and j not in decision.invariant]
