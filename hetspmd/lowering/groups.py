"""Group programs: each device group's own microbatch loop, joined by one uniform program over every device.

A group plan (:class:`hetspmd.plan.groups.GroupPlan`) runs a step as two
kinds of programs built from the same microbatch analysis:

* :func:`group_program`, one per group, over a mesh of the group's devices:
  the example-free work before the loop, then, inside a ``shard_map`` over
  the group, each device's loop over its own microbatches (the group's
  microbatch size, the device's count) giving that device's partial value of
  every cut, in float32 (the runtime casts the last loop's gradients to the
  plan's ``grad_reduce_dtype`` when there is no tail: :func:`narrowed`,
  :func:`narrow`), with a leading axis of one per device. Nothing
  crosses devices, so groups with different shapes run side by side.
* :func:`exchange_program`, over every device: each cut's partials
  (a global array with one row per device, assembled from the groups' rows
  without a copy) combined over the devices, then the rest of the step
  (the optimizer update, metrics) once, as the single program runs it. A
  step's per-example outputs (logits among the metrics) come from the group
  programs as each device's examples, padded to one width, and the exchange
  program puts them, with the tail's, into the global batch's order.

The partials are the same shape on every device (a gradient is parameter
shaped whatever the microbatch), so the exchange program is uniform.

With the optimizer state in shares (ZeRO-1 by memory), :func:`state_units`
cuts the update into units that read disjoint optimizer-state leaves (for
Adam: one parameter, its two moments and its new value), found by following
each output back through the step's equations. Each unit's leaves live whole
and unpadded on one device. The exchange program then computes only the
outputs no unit holds (the metrics, a step count) and hands every device the
reduced sums; :func:`update_program` runs one device's units on them, and
the parameters it made are sent to every device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from hetspmd.errors import HetSpmdError
from hetspmd.lowering.dataflow import labels_forward
from hetspmd.lowering.loop import LoopContext, between_loops, combined_over, feed_back, one_loop
from hetspmd.lowering.program import (Layout, Program, is_gradient_accumulated, is_gradient_cut,
                                     narrowable, sum_outputs)
from hetspmd.lowering.param_shards import ParamShards
from hetspmd.lowering.transfers import part_axis
from hetspmd.lowering.weighted import after_loops, before_loops, loop_part
from hetspmd.passes import _jax_adapter as jx
from hetspmd.plan.groups import padded_length, shard_axis





def check(prog: Program, tail: bool = False) -> None:
  """Refuses, with the reason, what group programs do not run yet."""
  if prog.analysis.loops > 1 and tail:
    raise HetSpmdError(f"this step needs {prog.analysis.loops} microbatch loops (a reduction over the batch feeds "
                       "later per-example work: exact batch statistics, a token count that scales the loss), and "
                       "a tail's examples would have to join every loop's reduction: use a group plan without a "
                       "tail")


def loop_cuts(cut_outs: Sequence[Any], s: int) -> list[int]:
  """The positions in ``cut_outs`` of loop ``s``'s cuts."""
  return [k for k, c in enumerate(cut_outs) if c.loop == s]


def _after_earlier(prog: Program, cut_outs: Sequence[Any], earlier: dict, s: int, outer: dict) -> None:
  """Into ``outer``: the reduced cuts of the loops before ``s`` that later loops read, and the example-free work
  between loops, as the single program puts them there."""
  for t in range(s):
    for k in loop_cuts(cut_outs, t):
      if cut_outs[k].feedback:
        feed_back(prog, cut_outs[k], earlier[k], outer)
    between_loops(prog, t, outer)


@dataclasses.dataclass(frozen=True)
class StateUnits:
  """The step's update cut into units over the held optimizer-state leaves (flat input indices ``held``).

  ``units[u]``: ``(held inputs, outputs)`` of unit ``u``, the outputs (flat output indices) that read those
  leaves and no other held leaf; ``kept``: ``{output: held input}`` for the outputs that are a held leaf's new
  value (they stay where the leaf lives); ``common``: the outputs that read no held leaf (computed once, in
  the exchange program, on every device)."""

  held: tuple[int, ...]
  units: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
  kept: tuple[tuple[int, int], ...]
  common: tuple[int, ...]

  @property
  def kept_outputs(self) -> frozenset:
    """The outputs that stay where their held leaf lives."""
    return frozenset(o for o, _ in self.kept)


def state_units(prog: Program, held: Sequence[int], new_value_of: dict[int, int]) -> StateUnits:
  """:class:`StateUnits` of ``prog`` for the flat inputs ``held`` (large optimizer-state leaves); ``new_value_of``:
  ``{output: input}`` for the outputs that are the new value of a state leaf.

  Refuses a step whose microbatch loop reads a held leaf: the group programs could not read it."""
  deps = labels_forward(prog.eqns, {prog.invars[i]: frozenset((i,)) for i in held}, range(len(prog.eqns)))
  for k in sorted(set(range(len(prog.eqns))) - set(prog.pre) - set(prog.post)):  # the loop's equations
    read = frozenset().union(*[deps.get(v, frozenset()) for v in prog.eqns[k].invars if not jx.is_literal(v)])
    if read:
      raise HetSpmdError(f"the microbatch loop reads optimizer-state leaves (flat inputs {sorted(read)}, at "
                         f"{jx.user_location(prog.eqns[k])}): hold the state replicated (a group plan without "
                         "state_shares)")
  parent = {i: i for i in held}

  def root(i):
    while parent[i] != i:
      parent[i] = parent[parent[i]]
      i = parent[i]
    return i

  reads = {}
  for o, labels in enumerate(prog.flow.outputs_of(deps, len(prog.outvars))):
    mine = set(labels)
    if o in new_value_of and new_value_of[o] in parent:
      mine.add(new_value_of[o])
    reads[o] = sorted(mine)
    for i in reads[o][1:]:
      parent[root(i)] = root(reads[o][0])
  groups: dict[int, tuple[list, list]] = {}
  for i in held:
    groups.setdefault(root(i), ([], []))[0].append(i)
  for o, mine in reads.items():
    if mine:
      groups[root(mine[0])][1].append(o)
  units = tuple((tuple(ins), tuple(outs)) for ins, outs in groups.values())
  kept = tuple((o, i) for o, i in sorted(new_value_of.items()) if i in parent)
  return StateUnits(tuple(held), units, kept, tuple(o for o, mine in reads.items() if not mine))


def narrow_reads(prog: Program, made_by: dict[int, frozenset]) -> dict[int, Any]:
  """``{flat input: dtype}`` of the parameters the step reads, outside the update that makes them, only through
  casts to one narrower floating dtype (a model computing in bfloat16 from float32 parameters; the cast before
  the loops, or inside a remat's checkpoint or a jit that reads the parameter only so): their programs can be
  given those casts instead (half the bytes to send and to hold), and the update keeps the parameter itself.
  ``made_by``: for each candidate input, the flat outputs of the update that makes its new value (work that
  feeds only those, such as AdamW's decay term, may read it whole); a parameter whose other readers (a metric, a
  penalty in the loss, a loop) would see the cast's rounding is left out."""
  readers = prog.flow.readers
  pre, post = set(prog.pre) - set(prog.hoisted), set(prog.post)
  outputs = {v for v in prog.outvars if not jx.is_literal(v)}
  out = {}
  for i, unit_outputs in made_by.items():
    var = prog.invars[i]
    wide = jnp.dtype(jx.aval_dtype(var))
    narrow, casts = set(), set()
    for k in readers.get(var, ()):
      inside = _cast_only(prog.eqns[k], var) if k not in post else None
      if inside:
        narrow |= inside
        casts.add(k)
    if var in outputs or len(narrow) != 1 or not jnp.issubdtype(wide, jnp.floating):
      continue
    (dtype,) = narrow
    reached = _reached(prog, var, casts, pre | post)
    if (jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < wide.itemsize and reached is not None
        and reached <= unit_outputs):
      out[i] = dtype
  return out


def _cast_only(eqn: Any, var: Any) -> set | None:
  """The dtypes ``eqn`` reads ``var`` as, where it reads it only through casts: a cast itself, or a call (a
  remat's checkpoint, a jit) whose body reads it only so; None otherwise."""
  if jx.primitive_name(eqn) == "convert_element_type":
    return {jnp.dtype(jx.aval_dtype(eqn.outvars[0]))}
  body = jx.call_body(eqn)
  if body is None:
    return None
  found: set = set()
  for j, v in enumerate(eqn.invars):
    if v is not var:
      continue
    inner = jx.invars(body)[j]
    for e in jx.equations(body):
      if any(u is inner for u in e.invars):
        dtypes = _cast_only(e, inner)
        if not dtypes:
          return None
        found |= dtypes
  return found or None


def _reached(prog: Program, var: Any, casts: set, free: set) -> frozenset | None:
  """The flat outputs ``var`` reaches other than through the equations ``casts`` (a decay term of AdamW before
  the loops, the update after them), or None where it reaches an equation outside ``free`` (the example-free
  work before and after the loops): the loops would read it."""
  labels = labels_forward(prog.eqns, {var: frozenset((0,))}, (k for k in range(len(prog.eqns)) if k not in casts))
  read = {k for v in labels for k in prog.flow.readers.get(v, ()) if k not in casts}
  if read - free:
    return None
  return frozenset(o for o, mine in enumerate(prog.flow.outputs_of(labels, len(prog.outvars))) if mine)


def sums_order(base: Program, other: Program) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """How the partial sums of ``other`` (the same step traced under another remat policy) line up with those of
  ``base`` (the exchange program's trace): for each value ``base``'s last loop returns (its cuts' values, then its
  accumulated values, flattened), the position of the same value among ``other``'s, and ``base``'s values per
  partial sum. Remat changes how the backward pass is cut (a checkpointed block's gradients come out of one
  cut, where without it they are sums fused into the loop), not what the example-free rest of the step does
  with each gradient: values are matched by their reduction, shape and the step's outputs they reach (a
  gradient keeps its shape on the way to its parameter's new value, or is padded into it). Refused when a value
  is not told apart or has no match."""
  mine, theirs = _signatures(base), _signatures(other)
  if sorted(mine) != sorted(theirs) or len(set(mine)) != len(mine):
    raise HetSpmdError("under another remat policy this step's reductions over the batch do not line up with "
                       "the ones the exchange program reduces: give every group the same remat policy")
  where = {sig: i for i, sig in enumerate(theirs)}
  return tuple(where[sig] for sig in mine), tuple(len(part) for part in _partials(base))


def narrowed(prog: Program, dtype: str) -> tuple[tuple[bool, ...], ...]:
  """Per partial sum the last loop returns (as :func:`_partials` orders them), which of its values cross devices
  in ``dtype``: the gradients (sums made by the backward pass that feed no later loop nor a per-microbatch
  region), floating and not scalars, as the single program narrows them
  (:func:`hetspmd.lowering.program.low_precision`); the loss's sum, token counts and metrics stay float32."""
  def floating(v) -> bool:
    return narrowable(dtype, jx.aval_dtype(v), math.prod(jx.aval_shape(v)))

  cut_outs, out = prog.cut_outs, []
  for k, part in zip(loop_cuts(cut_outs, prog.analysis.loops - 1), _partials(prog)):
    gradient = is_gradient_cut(prog, cut_outs[k])
    out.append(tuple(gradient and floating(v) for _, v in part))
  return tuple(out) + tuple((is_gradient_accumulated(prog, v) and floating(v),) for v in prog.accumulated)


def narrow(partials: Sequence[Sequence[Any]], mask: Sequence[Sequence[bool]], dtype: str) -> list[list[Any]]:
  """``partials`` with the values ``mask`` (:func:`narrowed`) names cast to ``dtype``."""
  return [[x.astype(dtype) if m else x for x, m in zip(part, flags)] for part, flags in zip(partials, mask)]


def _partials(prog: Program) -> list[list[tuple[str, Any]]]:
  """Per partial sum the last loop returns (its cuts, then the accumulated values), ``(reduction, var)`` of each
  of its values."""
  cut_outs = prog.cut_outs
  out = []
  for k in loop_cuts(cut_outs, prog.analysis.loops - 1):
    cut = cut_outs[k]
    out.append([(cut.reduce, prog.eqns[cut.index].outvars[j])
                for j in sum_outputs(prog.analysis.decisions[cut.index])])
  return out + [[("sum", v)] for v in prog.accumulated]


def partial_reductions(prog: Program, s: int) -> list[list[str]]:
  """Per partial sum :func:`group_program` returns for loop ``s`` (its cuts, then, for the last loop, the
  accumulated values), how each of its values combines over devices: ``sum``, ``max`` or ``min``."""
  if s == prog.analysis.loops - 1:
    return [[reduce for reduce, _ in part] for part in _partials(prog)]
  cut_outs = prog.cut_outs
  return [[cut_outs[k].reduce] * len(sum_outputs(prog.analysis.decisions[cut_outs[k].index]))
          for k in loop_cuts(cut_outs, s)]


def partial_values(prog: Program) -> list[tuple[str, tuple[int, ...]]]:
  """Per value of the last loop's partial sums (flattened as :func:`partial_readers` lists them): how it combines
  over devices and its shape."""
  return [(reduce, jx.aval_shape(var)) for part in _partials(prog) for reduce, var in part]


def _signatures(prog: Program) -> list[tuple]:
  """Per value of :func:`_partials` (flattened): its reduction, shape, and the step outputs (by position) it reaches through the
  example-free rest of the step, by equations that neither reduce it (a gradient norm) nor broadcast it (a
  normaliser): a gradient reaches its parameter's new value and moments."""
  values = [value for part in _partials(prog) for value in part]
  seeds: dict[Any, frozenset] = {}
  for j, (_, var) in enumerate(values):
    seeds[var] = seeds.get(var, frozenset()) | {j}

  def kept(k, v, w) -> bool:  # a scalar (a normaliser, a norm) reaches everything; a reduction is not followed
    return (jx.primitive_name(prog.eqns[k]) != "broadcast_in_dim" and
            math.prod(jx.aval_shape(w)) >= math.prod(jx.aval_shape(v)))

  labels = labels_forward(prog.eqns, seeds, sorted(prog.post), keep=kept)
  reached: list[set] = [set() for _ in values]
  for o, mine in enumerate(prog.flow.outputs_of(labels, len(prog.outvars))):
    for j in mine:
      reached[j].add(o)
  return [(reduce, jx.aval_shape(var), tuple(sorted(r))) for (reduce, var), r in zip(values, reached)]


def partial_readers(prog: Program) -> tuple[frozenset, ...]:
  """Per value of the last loop's partial sums (flattened as :func:`_partials` orders them), the flat outputs that
  read it through the example-free rest of the step (an equation's outputs read all its inputs)."""
  values = [var for part in _partials(prog) for _, var in part]
  seeds: dict[Any, frozenset] = {}
  for j, var in enumerate(values):
    seeds[var] = seeds.get(var, frozenset()) | {j}
  deps = labels_forward(prog.eqns, seeds, sorted(prog.post))
  readers: list[set] = [set() for _ in values]
  for o, mine in enumerate(prog.flow.outputs_of(deps, len(prog.outvars))):
    for j in mine:
      readers[j].add(o)
  return tuple(frozenset(r) for r in readers)


def with_placeholders(prog: Program, inputs: Sequence[Any], missing: Sequence[int]) -> list[Any]:
  """The step's flat inputs with zeros standing in at ``missing``: leaves held on other devices, which no output
  of the program reads (``jax.jit`` drops the zeros with the work that would use them)."""
  out, given = [], iter(inputs)
  missing = set(missing)
  for i, v in enumerate(prog.invars):
    out.append(jnp.zeros(jx.aval_shape(v), jx.aval_dtype(v)) if i in missing else next(given))
  return out


def group_program(prog: Program, layout: Layout, s: int | None = None, width: int = 0, shards: dict | None = None,
                  kept: frozenset = frozenset(), *, parts: bool = False, narrow: dict | None = None):
  """``program(inputs, counts, starts, earlier) -> (partials, examples)``: the group's loop ``s`` (default: the
  last).
  ``inputs``: the step's flat jaxpr inputs on the group's devices, each batch input its padded microbatch buffer
  ``[devices * max_count, microbatch, ...]`` sharded over ``layout.data_axis``; ``counts`` and ``starts``: each
  device's count and first global example; ``earlier``: ``{cut position: reduced values}`` of the earlier loops'
  cuts (:func:`combine_program`). ``partials``: per cut of loop ``s``, then (for the last loop) per value the loop
  adds into (``Program.accumulated``: a gradient's transpose or a sum of two gradients, fused into the loop), its
  values with a leading axis of one row per device, sharded over the group. ``examples``: for the last loop, per
  per-example output of the step (:func:`per_example_outputs`), each device's examples of it in its own order,
  padded to ``width`` (:func:`example_rows`), with a leading axis of one row per device.

  ``shards`` (``{flat input: axis}``, :func:`shardable`'s) runs the loop FSDP-style: each of those inputs is
  given as its zero-padded value split along ``axis`` over the group (:func:`hetspmd.lowering.param_shards.shard_program`),
  gathered for each reader inside every microbatch, the gradients' sums reduce-scattered onto parts as they
  accumulate,
  each device's row of a split sum its part in place and zeros elsewhere (:class:`~hetspmd.lowering.param_shards.ParamShards`),
  or its part alone for the sums ``kept`` names (flat, as the loop returns them: :func:`part_sums`).
  The layout must be in lockstep. Without ``shards``, ``parts`` (beside sharded groups of its size:
  :attr:`~hetspmd.plan.execution.Execution.parts_exchange`) makes each device's row of a sum ``kept`` names the
  part a sharded group's device would hold: the group's sum reduce-scattered after the loop, in the dtype
  ``narrow`` (``{flat partial value: dtype}``) gives it where it names it."""
  axis = layout.data_axis
  s = prog.analysis.loops - 1 if s is None else s
  pe_outs = per_example_outputs(prog) if s == prog.analysis.loops - 1 else ()
  split = {prog.invars[i]: a for i, a in (shards or {}).items()}
  derived = _derived(prog, split) if split else ()
  made = {v for k in derived for v in prog.eqns[k].outvars}
  param_shards = _param_shards(prog, shards, axis, layout.mesh.shape[axis], kept) if shards else None
  scatter = (ParamShards(axis, layout.mesh.shape[axis], (), (), frozenset(kept),
                         tuple(sorted((narrow or {}).items())))
             if parts and not shards and kept and prog.analysis.loops - 1 == s else None)

  def run(inputs, counts, starts, earlier=None):
    given = {v: inputs[i] for i, v in enumerate(prog.invars) if v in split}
    whole = [jnp.zeros(jx.aval_shape(v), jx.aval_dtype(v)) if v in split else x for v, x in zip(prog.invars, inputs)]
    env, ops = before_loops(prog, whole, counts, starts)  # the zeros' work is dead: the loop redoes it on the parts
    mine = loop_cuts(ops.cut_outs, s)
    read = [v for v in ops.inputs if v not in made and v not in split] + _derived_reads(prog, derived, made, split)
    read = list(dict.fromkeys(read))
    specs = [P() for _ in read] + [P(*([None] * a), axis) for a in split.values()]

    def per_device(values, buffers, counts, starts, earlier):
      outer = dict(zip(read + list(split), values))
      _after_earlier(prog, ops.cut_outs, earlier, s, outer)
      ctx = LoopContext(prog, layout, ops.cut_outs, ops.batch_vars, tuple(buffers), counts[0], starts[0],
                        param_shards, scatter)
      partials, outs = one_loop(ctx, s, outer, mine, pe_outs)
      outs = [example_rows(x, prog.analysis.axes[v].dim, width)[None] for v, x in zip(pe_outs, outs)]
      return [[x[None] for x in part] for part in partials], outs  # the cuts', then the sums the loop adds into

    return jax.shard_map(per_device, mesh=layout.mesh, in_specs=(specs, P(axis), P(axis), P(axis), P()),
                         out_specs=P(axis), axis_names={axis}, check_vma=False)(
                             [env[v] for v in read] + [given[v] for v in split], list(ops.buffers), counts, starts,
                             dict(earlier or {}))

  return run


def _param_shards(prog: Program, shards: dict, axis_name: str, n: int, kept: frozenset = frozenset()) -> ParamShards:
  """The :class:`ParamShards` of ``shards`` (``{flat input: axis}``) over ``n`` devices on ``axis_name``, the sums
  ``kept`` names left as parts."""
  split = {prog.invars[i]: a for i, a in shards.items()}
  return ParamShards(axis_name, n, tuple((v, a, jx.aval_shape(v)[a]) for v, a in split.items()),
                     tuple(prog.eqns[k] for k in _derived(prog, split)), frozenset(kept))


@dataclasses.dataclass(frozen=True)
class ShardBytes:
  """Per device of a group that shards its parameters: the bytes of its parts (``held``; the padding included),
  of the parameters whole (``whole``), and the most its loop gathers for two readers in a row (``gathered``: a
  reader's copy is gathered while the reader before it runs; a layer scan's one iteration's slice)."""

  held: int
  whole: int
  gathered: int
  reader: int = 0  # the most one reader gathers (one layer's parameters, or one iteration's slice, and the next's)

  def xla_gpu_flags(self) -> str:
    """The XLA flags that let a GPU overlap these gathers and reduce-scatters with compute (JAX's GPU performance
    tips): the latency-hiding scheduler, and combine thresholds of one reader's bytes, so one layer's collectives
    go together and no more."""
    size = max(self.reader, 1)
    return (f"--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_all_gather_combine_threshold_bytes={size} "
            f"--xla_gpu_reduce_scatter_combine_threshold_bytes={size}")


def shard_bytes(prog: Program, shards: dict, n: int) -> ShardBytes:
  """:class:`ShardBytes` of the parameters ``shards`` (``{flat input: axis}``) split over ``n`` devices."""
  ps = _param_shards(prog, shards, "", n)
  size = lambda v: math.prod(jx.aval_shape(v)) * np.dtype(jx.aval_dtype(v)).itemsize
  held = sum(size(v) // length * padded_length(length, n) // n for v, _, length in ps.params)
  loop = [(prog.eqns[k], prog.analysis.decisions[k]) for eqns in prog.loop_eqns for k in eqns]
  reads = _gathered_reads(ps, loop, size)
  pairs = [a + b for a, b in zip(reads, reads[1:])] or reads
  return ShardBytes(held, sum(size(v) for v, _, _ in ps.params), max(pairs, default=0), max(reads, default=0))


def _gathered_reads(ps: ParamShards, eqns: Sequence[tuple], size) -> list[int]:
  """The bytes each reader of ``eqns`` (``(equation, decision)`` pairs, in order) gathers, as the loop gathers them
  (:func:`hetspmd.lowering.loop.gather_reads`): a layer scan's slice (this iteration's and the next's), a
  checkpointed call's readers inside it, the rest whole."""
  reads = []
  for eqn, decision in eqns:
    whole, scanned, passed = ps.reads(eqn, example_free=decision is None)
    if passed and decision.body is not None:  # its body's readers, each gathering its own copy
      body = decision.body.propagation
      inner = ps.inner({jx.invars(body.jaxpr)[j]: v for j, v in passed.items()})
      reads += _gathered_reads(inner, list(zip(jx.equations(body.jaxpr), body.decisions)), size)
    sliced = sum(size(v) // max(jx.aval_shape(v)[0], 1) for v in scanned.values())
    if scanned or whole:
      reads.append(sum(size(v) for v in whole) + 2 * sliced)
  return reads


def inputs_read(prog: Program, inputs: Sequence[int]) -> list[frozenset]:
  """Per flat output, which of the flat ``inputs`` it reads through the example-free work outside the loops (what
  a program that takes the loops' sums, not their work, reads: the exchange, an owner's update); one walk."""
  seeds = {prog.invars[i]: frozenset([i]) for i in inputs}
  labels = labels_forward(prog.eqns, seeds, sorted({*prog.pre, *prog.post, *(k for m in prog.middle for k in m)}))
  return prog.flow.outputs_of(labels, len(prog.outvars))


def shardable(prog: Program, floats: Sequence[int], n: int) -> dict[int, int]:
  """``{flat input: axis}`` of the parameters (``floats``: the step's floating state inputs) a group of ``n``
  devices can hold split during its loops (:attr:`hetspmd.plan.groups.Group.shard_params`), each along
  :func:`hetspmd.plan.groups.shard_axis`: those the loops read, directly or through example-free work before them
  (a bias's reshape, a cast: redone inside each microbatch on the gathered value, :func:`_derived`), that no work
  between the loops reads and that are not scalars. The
  update after the loops runs in other programs, on whole parameters."""
  out = {}
  scanned = _scanned(prog)
  splittable = _splittable(prog, [prog.invars[i] for i in floats])
  for i in floats:
    var = prog.invars[i]
    shape = jx.aval_shape(var)
    axis = shard_axis(shape, n)
    if var in scanned:  # a layer scan's stacked parameter: split after the layers, gathered a slice at a time
      inner = shard_axis(shape[1:], n)
      axis = None if inner is None else inner + 1
    if axis is not None and var in splittable:
      out[i] = axis
  return out


def _splittable(prog: Program, candidates: Sequence[Any]) -> set:
  """Of ``candidates`` (input variables), those :func:`_derived` would split one at a time, found in one walk of
  the equations (each variable its own label): a loop reads it, no work between the loops nor a hoisted copy
  reads it, and whatever reads the example-free work on it before the loops is a loop, that work, or the update."""
  loops = {k for eqns in prog.loop_eqns for k in eqns}
  middle = {k for m in prog.middle for k in m}
  pre, post = set(prog.pre), set(prog.post)
  labels = {v: frozenset([v]) for v in candidates}
  derived: dict = {v: set() for v in candidates}
  looped, refused = set(), set()
  for k in sorted(pre | loops | middle):
    eqn = prog.eqns[k]
    hit = frozenset().union(*[labels[v] for v in eqn.invars if not jx.is_literal(v) and v in labels])
    if not hit:
      continue
    if k in prog.hoisted:
      refused |= frozenset().union(*[labels[v] for v in prog.hoisted[k].invars
                                     if not jx.is_literal(v) and v in labels])
    if k in middle:
      refused |= hit
    elif k in loops:
      looped |= hit
    else:
      for v in hit:
        derived[v].add(k)
      for w in eqn.outvars:
        labels[w] = labels.get(w, frozenset()) | hit
  reached: dict = {v: {v} for v in candidates}
  for w, mine in labels.items():
    for v in mine:
      reached[v].add(w)
  return {v for v in candidates if v in looped and v not in refused
          and not {k for u in reached[v] for k in prog.flow.readers.get(u, ())} - loops - post - derived[v]}


def _scanned(prog: Program) -> set:
  """The step's inputs a scan in a loop reads as sliced inputs (a layer scan's stacked parameters), directly or
  through casts before the loops."""
  sliced = set()
  for index in (k for eqns in prog.loop_eqns for k in eqns):
    eqn = prog.eqns[index]
    if jx.primitive_name(eqn) == "scan":
      parts = jx.scan_parts(eqn)
      sliced.update(v for v in eqn.invars[parts.num_consts + parts.num_carry:] if not jx.is_literal(v))
  for k in reversed(sorted(prog.pre)):  # a cast's input is sliced where the cast is
    eqn = prog.eqns[k]
    if jx.primitive_name(eqn) == "convert_element_type" and eqn.outvars[0] in sliced:
      sliced.add(eqn.invars[0])
  return sliced


def _derived(prog: Program, split: dict) -> tuple[int, ...] | None:
  """The example-free equations before the loops that read the parameters ``split`` names, directly or through one
  another (indices, in order): the loop redoes them on the gathered values. None where the parameters cannot be
  split: no loop reads them, or work between the loops or a hoisted copy of the loop's does. (Other values those
  equations read come into the loop whole: :func:`_derived_reads`.)"""
  loops = {k for eqns in prog.loop_eqns for k in eqns}
  middle = {k for m in prog.middle for k in m}
  pre, post = set(prog.pre), set(prog.post)
  reached, derived, looped = set(split), [], False
  for k in sorted(pre | loops | middle):
    eqn = prog.eqns[k]
    if not any(v in reached for v in eqn.invars if not jx.is_literal(v)):
      continue
    if k in middle or (k in prog.hoisted and any(v in reached for v in prog.hoisted[k].invars if not jx.is_literal(v))):
      return None  # work between the loops, or a hoisted copy (a scan's PRNG counters), reads them whole
    if k in loops:
      looped = True
      continue
    derived.append(k)
    reached.update(eqn.outvars)
  if not looped:
    return None
  readers = {k for v in reached for k in prog.flow.readers.get(v, ())}
  if readers - loops - post - set(derived):
    return None
  return tuple(derived)


def _derived_reads(prog: Program, derived: Sequence[int], made: set, split: dict) -> list:
  """The values the ``derived`` equations read besides the split parameters and one another's results: made
  before the loops (inputs, example-free work), passed into the loop whole."""
  return [v for k in derived for v in prog.eqns[k].invars
          if not jx.is_literal(v) and v not in made and v not in split and v not in prog.constvars]


def combine_program(prog: Program, s: int):
  """``program(partials) -> {cut position: values}``: loop ``s``'s cuts, each device's partial values (a leading
  axis of one row per device) combined over the devices, for the later loops' group programs."""

  def run(partials):
    cut_outs = prog.cut_outs
    return {k: _combined(prog, cut_outs[k], part) for k, part in zip(loop_cuts(cut_outs, s), partials)}

  return run


def _combined(prog: Program, cut: Any, part: Sequence[Any]) -> list[Any]:
  """One cut's per-device rows combined over the devices, in its outputs' dtypes."""
  outvars = [prog.eqns[cut.index].outvars[j] for j in sum_outputs(prog.analysis.decisions[cut.index])]
  return [combined_over(cut.reduce)(x, axis=0).astype(v.aval.dtype) for x, v in zip(part, outvars)]


def exchange_program(prog: Program, tail: Layout | None = None, outputs: Sequence[int] | None = None, *,
                     sums: bool = True, order: np.ndarray | None = None):
  """``program(inputs, partials, counts, starts, earlier, examples) -> outputs``: every cut's partials combined
  over the devices (their leading axis; ``earlier``: the earlier loops' totals), then the example-free rest of
  the step. ``inputs``: the step's flat jaxpr inputs.

  Without ``tail`` the batch inputs are unread (``counts``, ``starts`` too). With ``tail`` (a layout over every
  device, each running the same count of the same microbatch, its last one peeled so the reduction overlaps
  it), each batch input is the tail's microbatch buffer: every device runs the tail's microbatches, adds the
  groups' partials into their sums and reduces them (:func:`hetspmd.lowering.weighted.loop_part`).

  With ``outputs`` (flat output indices: the ones no state unit holds), the program returns ``(those outputs,
  sums)``, ``sums`` being ``(cut totals, accumulated values)`` for :func:`update_program`; with ``sums=False``
  only those outputs (each device's :func:`owner_update_program` reduces the sums its units read).

  With ``order`` (for a step with per-example outputs: :meth:`hetspmd.plan.groups.GroupPlan.example_slots`),
  ``examples`` are the group programs' rows of them, joined over the devices: they and the tail's (each device's
  examples in its own order) are put into the global batch's order."""

  def run(inputs: Sequence[Any], partials: Sequence[Sequence[Any]], counts=None, starts=None, earlier=None,
          examples: Sequence[Any] = ()):
    partials = _filled(prog, partials)
    env, ops = before_loops(prog, inputs, counts, starts)
    if tail is not None:
      totals, accumulated, tail_examples = _with_tail(prog, tail, dataclasses.replace(ops, extra=tuple(partials)))
    else:
      totals, accumulated = _reduced(prog, ops.cut_outs, partials, earlier)
      tail_examples = ()
    accumulated = [x.astype(v.aval.dtype) for v, x in zip(prog.accumulated, accumulated)]
    env.update(zip(prog.accumulated, accumulated))
    after_loops(prog, env, ops.cut_outs, totals)
    if order is not None:
      env.update(zip(per_example_outputs(prog), global_order(prog, examples, tail_examples, order)))
    if outputs is None:
      return [jx.read(env, v) for v in prog.outvars]
    mine = [jx.read(env, prog.outvars[o]) for o in outputs]
    return (mine, (list(totals), accumulated)) if sums else mine

  return run


def _filled(prog: Program, partials: Sequence[Sequence[Any]]) -> list[list[Any]]:
  """The last loop's ``partials`` with zeros standing in for the sums groups hand their owners as parts (None:
  :func:`hetspmd.lowering.transfers.without_pieces`), which no output the exchange program makes reads (``jax.jit``
  drops the zeros with the work that would use them), and a hybrid plan's groups' parts of a sum (one row per
  group, zero-padded along one axis: :func:`hetspmd.lowering.transfers.part_rows`) cut to the value's shape."""
  def row(x, v):
    shape = jx.aval_shape(v)
    if x is None:
      return jnp.zeros((1,) + shape, jx.aval_dtype(v))
    if tuple(x.shape[1:]) == tuple(shape):
      return x
    axis = part_axis(tuple(x.shape[1:]), shape)
    return jax.lax.slice_in_dim(x, 0, shape[axis], axis=axis + 1)

  return [[row(x, v) for x, (_, v) in zip(part, values)] for part, values in zip(partials, _partials(prog))]


def part_sums(prog: Program, common: Sequence[int]) -> dict[int, tuple[int, ...]]:
  """``{flat partial value: its shape}`` of the last loop's sums a group sharding its parameters may hand their
  owners as parts (:attr:`hetspmd.lowering.param_shards.ParamShards.kept`): those no output of ``common`` (the
  exchange program's) reads. None in a step of several loops (an earlier loop's sums feed a later one)."""
  if prog.analysis.loops > 1:
    return {}
  readers = partial_readers(prog)
  return {j: shape for j, ((reduce, shape), r) in enumerate(zip(partial_values(prog), readers))
          if reduce == "sum" and shape and not r & set(common)}


def update_program(prog: Program, outputs: Sequence[int]):
  """``program(inputs, sums) -> outputs``: the example-free rest of the step from the reduced ``sums`` of
  :func:`exchange_program`, giving the flat outputs ``outputs`` (one device's state units). ``inputs``: the
  step's flat jaxpr inputs; the batch inputs are unread."""

  def run(inputs: Sequence[Any], sums) -> list[Any]:
    totals, accumulated = sums
    env, ops = before_loops(prog, inputs, None, None)
    env.update(zip(prog.accumulated, accumulated))
    after_loops(prog, env, ops.cut_outs, totals)
    return [jx.read(env, prog.outvars[o]) for o in outputs]

  return run


def owner_update_program(prog: Program, outputs: Sequence[int], devices: int):
  """``program(inputs, rows, earlier) -> outputs``: :func:`update_program` reducing its own sums. ``rows``: per
  value of the last loop's partial sums (flattened as :func:`partial_readers` lists them), every device's row
  (a leading axis of one), ``devices`` of them, all on this device, or None for a value ``outputs`` do not read
  (zeros stand in; ``jax.jit`` drops them); ``earlier``: the earlier loops' reduced cuts (:func:`combine_program`)."""

  shapes = _partials(prog)

  def run(inputs: Sequence[Any], rows: Sequence[Any], earlier=None) -> list[Any]:
    env, ops = before_loops(prog, inputs, None, None)
    flat = iter([jnp.concatenate(r) if r is not None else jnp.zeros((devices,) + jx.aval_shape(v), jx.aval_dtype(v))
                 for r, (_, v) in zip(rows, (value for part in shapes for value in part))])
    totals, accumulated = _reduced(prog, ops.cut_outs, [[next(flat) for _ in part] for part in shapes], earlier)
    env.update(zip(prog.accumulated, [x.astype(v.aval.dtype) for v, x in zip(prog.accumulated, accumulated)]))
    after_loops(prog, env, ops.cut_outs, totals)
    return [jx.read(env, prog.outvars[o]) for o in outputs]

  return run


def _reduced(prog: Program, cut_outs: Sequence[Any], partials: Sequence[Sequence[Any]], earlier) -> tuple[list, list]:
  """The last loop's ``partials`` (each value with a leading axis of one row per device) combined over the rows:
  every cut's totals (the earlier loops' from ``earlier``) and the accumulated values."""
  last = loop_cuts(cut_outs, prog.analysis.loops - 1)
  final = {k: _combined(prog, cut_outs[k], part) for k, part in zip(last, partials)}
  totals = [final[k] if k in final else earlier[k] for k in range(len(cut_outs))]
  return totals, [combined_over("sum")(x, 0) for (x,) in partials[len(last):]]


def _with_tail(prog: Program, tail: Layout, ops):
  """The tail's loop on every device, the groups' partials added into its sums before they are reduced: the
  cuts' totals, the accumulated values and the per-example outputs' buffers (``[devices * count, value of one
  microbatch]``)."""
  totals, rest = loop_part(prog, tail, ops)  # rest: the per-example buffers, with the accumulated values if any
  examples, accumulated = rest if prog.accumulated else (rest, [])
  return totals, accumulated, examples


def per_example_outputs(prog: Program) -> tuple[Any, ...]:
  """The step's outputs that keep the batch axis (logits among the metrics), in output order, as the loops fill
  them (:func:`hetspmd.lowering.weighted.before_loops`)."""
  return tuple(v for v in prog.outvars if not jx.is_literal(v) and v in prog.analysis.axes)


def example_rows(buf, dim: int, width: int | None = None):
  """One device's slots of a per-example output, ``[slots, value of one microbatch]`` (its examples along
  ``dim``), as its examples in order along a leading axis, ``[slots * microbatch, rest]``; zero-padded to
  ``width`` rows when given."""
  moved = jnp.moveaxis(buf, dim + 1, 1)
  flat = moved.reshape((moved.shape[0] * moved.shape[1],) + moved.shape[2:])
  if width is None or width == flat.shape[0]:
    return flat
  return jnp.concatenate([flat, jnp.zeros((width - flat.shape[0],) + flat.shape[1:], flat.dtype)])


def global_order(prog: Program, examples: Sequence[Any], tail_examples: Sequence[Any], order: np.ndarray) -> list:
  """Each per-example output of the step in the global batch's order: ``examples``, the groups' rows of it
  (``[devices, width, rest]``), then the tail's buffers, are taken at ``order`` (an example's slot among them
  all) and the batch axis put back where the step has it."""
  tails = iter(tail_examples)
  out = []
  for v, rows in zip(per_example_outputs(prog), examples):
    dim = prog.analysis.axes[v].dim
    flat = rows.reshape((rows.shape[0] * rows.shape[1],) + rows.shape[2:])
    if tail_examples:
      flat = jnp.concatenate([flat, example_rows(next(tails), dim).astype(flat.dtype)])
    out.append(jnp.moveaxis(jnp.take(flat, order, axis=0), 0, dim).astype(jx.aval_dtype(v)))
  return out
