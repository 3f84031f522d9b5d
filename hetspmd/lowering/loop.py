"""The microbatch loop's shared pieces: one equation on one microbatch, nested bodies, one device's loop.

Both program builders use them: the weighted data-parallel loop
(:mod:`hetspmd.lowering.weighted`) and the lockstep stage ticks
(:mod:`hetspmd.lowering.staged`). :class:`LoopContext` is what one device's
loop reads (the program, the layout, the cuts it sums, its batch buffers, its
count and first example); :func:`one_loop` runs loop ``s`` of the program over
this device's microbatches.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hetspmd._dtypes import wide
from hetspmd.errors import HetSpmdError
from hetspmd.lowering import operands
from hetspmd.lowering.program import Layout, Program, microbatch_params, sum_outputs, with_bases
from hetspmd.passes import _jax_adapter as jx


def identity(reduce: str, shape, dtype):
  """The value that leaves a ``reduce`` (``sum``, ``max`` or ``min``) unchanged, filled to ``shape``."""
  if reduce == "sum":
    return jnp.zeros(shape, dtype)
  if jnp.issubdtype(dtype, jnp.bool_):
    return jnp.full(shape, reduce == "min", dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.full(shape, -jnp.inf if reduce == "max" else jnp.inf, dtype)
  info = jnp.iinfo(dtype)
  return jnp.full(shape, info.min if reduce == "max" else info.max, dtype)


def _sum_in_own_dtype(x, axis: int):
  """``x`` summed over ``axis`` in its own dtype (``jnp.sum`` adds bfloat16 in float32, so a sum over devices would
  cross them in float32)."""
  if x.dtype not in (jnp.bfloat16, jnp.float16):
    return jnp.sum(x, axis=axis)
  return jax.lax.reduce(x, np.zeros((), x.dtype), jax.lax.add, (axis,))


# how each kind of partial value combines: two at a time (a loop's carry), and over an axis of rows (devices)
_PAIRWISE = {"sum": jnp.add, "max": jnp.maximum, "min": jnp.minimum}
_OVER_AXIS = {"sum": _sum_in_own_dtype, "max": jnp.max, "min": jnp.min}


def combiner(reduce: str):
  """``f(a, b)``: two partial values of a ``reduce`` combined."""
  return _PAIRWISE[reduce]


def combined_over(reduce: str):
  """``f(x, axis)``: the rows of a ``reduce``'s partial values along ``axis`` combined, in their own dtype."""
  return _OVER_AXIS[reduce]


def feed_back(prog, cut, values, outer: dict) -> None:
  """Puts a reduced cut that later loops read into ``outer``: with its base, in its own dtype."""
  eqn, decision = prog.eqns[cut.index], prog.analysis.decisions[cut.index]
  made = [eqn.outvars[j] for j in sum_outputs(decision)]
  value = with_bases(eqn, decision, values, outer)
  outer.update(zip(made, [v.astype(o.aval.dtype) for v, o in zip(value, made)]))


def between_loops(prog, s: int, outer: dict) -> None:
  """The example-free work after loop ``s`` (1/weight_sum) that later loops need, as far as its inputs are ready."""
  for i in sorted({i for t in range(s + 1, prog.analysis.loops) for i in prog.middle[t]}):
    eqn = prog.eqns[i]
    ready = all(jx.is_literal(v) or v in outer for v in eqn.invars)
    if ready and not all(v in outer for v in eqn.outvars):  # the rest wait for a later loop's reductions
      jx.eval_equations([eqn], outer)


@dataclasses.dataclass(frozen=True)
class LoopOperands:
  """What a loop builder (:func:`hetspmd.lowering.weighted.loop_part`, :func:`hetspmd.lowering.staged.loop_part`)
  takes from the step's run: the values its loops read from outside them (``inputs``, jaxpr variables, and their
  ``values``), the batch inputs and their padded microbatch buffers, every position's count and first example, the
  cuts it sums and the per-example outputs it fills."""

  inputs: tuple
  values: tuple
  batch_vars: tuple
  buffers: tuple
  counts: Any
  starts: Any
  cut_outs: tuple
  pe_outs: tuple
  # partial values made elsewhere (group programs' loops), added into the final loop's before it is reduced: per
  # cut of ``cut_outs``, then per accumulated value, its values with a leading axis of one row per position
  extra: tuple = ()


@dataclasses.dataclass(frozen=True)
class LoopContext:
  """What one device's microbatch loops read: the program, the layout, the cuts they sum (in the order the
  builder reduces them), the batch inputs and this device's padded buffers of them, its count and first example."""

  prog: Program
  layout: Layout
  cut_outs: tuple
  batch_vars: tuple
  buffers: tuple
  count: Any
  start: Any
  # a group's parameters split over its devices (hetspmd.lowering.param_shards.ParamShards): gathered in each
  # microbatch, its sums reduce-scattered into parts and made rows after the loop; the layout is in lockstep
  shards: Any = None
  # a group that does not shard beside groups of its size that do (Execution.parts_exchange): a ParamShards of no
  # parameters whose kept sums each device reduce-scatters after its loop onto a sharded group's parts
  parts: Any = None


def one_loop(ctx: LoopContext, s: int, outer: dict, mine: Sequence[int], pe_outs: Sequence[Any] = ()):
  """Runs loop ``s`` over this device's microbatches; its cuts' partial values and per-example outputs.

  ``outer`` holds the values the loop reads from outside it; ``mine`` are the
  positions (in ``ctx.cut_outs``) of the cuts this loop sums; ``pe_outs`` the
  per-example outputs it fills, one slot per microbatch.
  """
  return _DeviceLoop(ctx, s, outer, tuple(mine), tuple(pe_outs)).run()


@dataclasses.dataclass(frozen=True)
class _DeviceLoop:
  """Loop ``s`` on one device: one microbatch's pass, one accumulating step, and the schedule of steps."""

  ctx: LoopContext
  s: int
  outer: dict
  mine: tuple
  pe_outs: tuple

  @functools.cached_property
  def shapes(self) -> Any:
    """One microbatch's partial values and per-example outputs, as shapes (traced once)."""
    return jax.eval_shape(self.microbatches, 0)

  @property
  def accumulated(self) -> list:
    prog = self.ctx.prog
    return prog.accumulated if self.s == prog.analysis.loops - 1 else []

  @property
  def kinds(self) -> list[str]:
    return [self.ctx.cut_outs[k].reduce for k in self.mine] + ["sum"] * len(self.accumulated)

  def microbatches(self, i, k: int = 1, valid=None):
    """Microbatches ``i .. i + k - 1`` of this device, run as one batch of ``k * m`` examples (``valid``: whether
    they count, where a layer scan's gradients are reduce-scattered inside it: :attr:`presplit`)."""
    prog, m = self.ctx.prog, self.ctx.layout.microbatch
    size = k * m
    targets = {self.ctx.cut_outs[k_].index: k_ for k_ in self.mine}
    shards = self.ctx.shards
    env = dict(self.outer) if shards is None else {v: x for v, x in self.outer.items() if v not in shards.made}
    env.update(zip(prog.constvars, prog.consts))
    for v, b in zip(self.ctx.batch_vars, self.ctx.buffers):
      if k == 1:
        env[v] = jax.lax.dynamic_index_in_dim(b, i, 0, keepdims=False)
      else:
        env[v] = jax.lax.dynamic_slice_in_dim(b, i, k, 0).reshape((size,) + b.shape[2:])
    after = tuple(env[v] for v in self.ctx.batch_vars)  # the first gather waits for this microbatch
    offset = self.ctx.start + i * m
    partial: dict[int, list] = {}
    for index in prog.loop_eqns[self.s]:
      if shards is None:
        ran = run_equation(prog, index, env, offset, size)
      else:
        ran, after = self._run_sharded(index, env, after, offset, size, valid)
      if ran is None:  # example-free work on a local statistic
        continue
      eqn, cut, out, summed = prog.eqns[index], prog.cuts.get(index), *ran
      if index in targets:
        partial[targets[index]] = [wide(out[j]) for j in summed]
        if prog.region and not cut.local:  # read as a mean, as the statistics are, by work on them
          env.update((eqn.outvars[j], (out[j] * (prog.batch / m)).astype(out[j].dtype)) for j in summed)
      if index in prog.absorbed:  # added to another sum in the loop
        env.update((eqn.outvars[j], out[j]) for j in summed)
      if cut is not None and cut.local:
        scale = prog.batch / m if cut.reduce == "sum" else 1
        env.update((eqn.outvars[j], (out[j] * scale).astype(out[j].dtype)) for j in summed)
    # per-microbatch statistics' results are averaged over microbatches; fused sums are summed
    averaged = [[wide(env[v]) * (m / prog.batch) if prog.region else wide(env[v])] for v in self.accumulated]
    outs = [env[v] if k == 1 else split_fused(env[v], prog.analysis.axes[v].dim, k) for v in self.pe_outs]
    return [partial[k_] for k_ in self.mine] + averaged, outs

  def _run_sharded(self, index: int, env: dict, after: tuple, offset, size: int, valid):
    """Equation ``index`` in a group that shards its parameters: each split value it reads gathered for it (after
    ``after``, the reader before it's inputs), a layer scan's a slice per iteration, and its gradients' slices
    reduce-scattered inside it (:attr:`presplit`); :func:`run_equation`'s result and the next reader's ``after``."""
    prog, shards = self.ctx.prog, self.ctx.shards
    eqn = prog.eqns[index]
    decision = prog.analysis.decisions[index]
    read, hooks, after = gather_reads(shards, eqn, env, self.outer, after, example_free=decision is None,
                                      rebuilt=rebuild_reads(prog, eqn, decision, shards.made))
    ys = {path: {j: functools.partial(shards.scattered_slice, axis - 1, valid) for j, axis in at.items()}
          for path, at in self._ys_split.get(index, {}).items()}
    hooks = dataclasses.replace(hooks, ys=ys.get((), {}), nested={path[0]: at for path, at in ys.items() if path})
    ran = run_equation(prog, index, env, offset, size, hooks)
    for v in read:
      del env[v]
    return ran, after

  @functools.cached_property
  def presplit(self) -> dict:
    """``{(partial position, value position): (axis, whole shape)}`` of the partial values a sharded group's layer
    scan reduce-scatters inside itself, a slice per iteration (its stacked gradients: never whole on a device);
    the scan may sit in a checkpointed call (a remat policy's)."""
    return {at: (axis, shape) for at, (_, _, axis, shape) in self._stacked.items()}

  @functools.cached_property
  def _stacked(self) -> dict:
    """``{(partial position, value position): (path, ys position, axis, whole shape)}``: where each of
    :attr:`presplit`'s values is stacked (``path``: ``()`` for the cut's own scan, ``(k,)`` for equation ``k`` of
    its checkpointed body)."""
    return self._stacked_in(self.ctx.shards)

  def _stacked_in(self, shards: Any) -> dict:
    """:attr:`_stacked` for a group split as ``shards`` (a :class:`~hetspmd.lowering.param_shards.ParamShards`)."""
    prog = self.ctx.prog
    if shards is None:
      return {}
    out = {}
    for p, k_ in enumerate(self.mine):
      cut = self.ctx.cut_outs[k_]
      eqn, decision = prog.eqns[cut.index], prog.analysis.decisions[cut.index]
      if (cut.reduce != "sum" or cut.local or prog.region or cut.index in prog.absorbed or decision is None
          or decision.body is None):  # (a sum the loop reads again stays whole)
        continue
      for q, j in enumerate(sum_outputs(decision)):
        shape = jx.aval_shape(eqn.outvars[j])
        where = _stacked_output(eqn, decision, j)
        axis = shards.slice_axis(shape, jx.aval_dtype(eqn.outvars[j])) if where is not None else None
        if axis is not None:
          out[(p, q)] = (*where, axis, shape)
    return out

  @functools.cached_property
  def _ys_split(self) -> dict:
    """``{equation index: {path: {ys position: axis}}}`` of :attr:`presplit`."""
    out: dict = {}
    for (p, _), (path, ys, axis, _) in self._stacked.items():
      out.setdefault(self.ctx.cut_outs[self.mine[p]].index, {}).setdefault(path, {})[ys] = axis
    return out

  def step(self, i, carry, masked: bool, k: int = 1, limit=None):
    """Adds microbatches ``i .. i + k - 1`` to ``carry``; ``masked``: slots from ``limit`` (default: the count)
    on are padding and add nothing."""
    acc, pe = carry
    valid = i < (self.ctx.count if limit is None else limit) if masked else None
    part, outs = self.microbatches(i, k, valid)
    kinds, presplit = self.kinds, self.presplit
    if masked:
      part = [[x if (p, q) in presplit else jnp.where(valid, x, identity(r, x.shape, x.dtype))
               for q, x in enumerate(xs)] for p, (r, xs) in enumerate(zip(kinds, part))]
    if self.ctx.shards is not None:  # after the mask: a padding slot adds nothing to another device's part
      part = self.ctx.shards.scattered(part, kinds, presplit)
    acc = [[combiner(r)(a, x) for a, x in zip(aa, xx)] for r, aa, xx in zip(kinds, acc, part)]
    if k == 1:
      pe = [jax.lax.dynamic_update_index_in_dim(b, x, i, 0) for b, x in zip(pe, outs)]
    else:
      pe = [jax.lax.dynamic_update_slice_in_dim(b, x, i, 0) for b, x in zip(pe, outs)]
    return acc, pe

  def zero(self):
    """The empty carry: every sum's identity, every per-example output's slots zero."""
    shapes = self.shapes
    shards = self.ctx.shards
    presplit = self.presplit
    zeros = [[identity(r, x.shape if shards is None or (p, q) in presplit else shards.part_shape(r, x), x.dtype)
              for q, x in enumerate(part)] for p, (r, part) in enumerate(zip(self.kinds, shapes[0]))]
    return zeros, [jnp.zeros((self.ctx.layout.max_count,) + x.shape, x.dtype) for x in shapes[1]]

  def run(self):
    """The schedule's partial values and per-example outputs; a sharded group's parts made rows, or beside
    sharded groups (``ctx.parts``) the sums they keep as parts reduce-scattered onto the same parts."""
    acc, pe = self.schedule()
    if self.ctx.shards is not None:
      wholes = [[jax.ShapeDtypeStruct(self.presplit[(p, q)][1], x.dtype) if (p, q) in self.presplit else x
                 for q, x in enumerate(xs)] for p, xs in enumerate(self.shapes[0])]
      acc = self.ctx.shards.rows(acc, self.kinds, wholes, self.presplit)
    elif self.ctx.parts is not None:
      stacked = {at: axis for at, (_, _, axis, _) in self._stacked_in(self.ctx.parts).items()}
      acc = self.ctx.parts.parted(acc, self.kinds, stacked)
    return acc, pe

  def schedule(self):
    """The schedule: a loop of this device's count (or, in lockstep, the longest one, masked), with the last
    microbatch(es) peeled after it when the layout overlaps the reduction with them."""
    layout, prog, count = self.ctx.layout, self.ctx.prog, self.ctx.count
    step, zero = self.step, self.zero()
    uniform = layout.uniform_count
    peel = layout.overlap and self.s == prog.analysis.loops - 1  # the last microbatch(es) after the loop
    k = layout.overlap_microbatches if peel else 1
    if k > 1:
      return self._run_fused(k)
    if uniform == 1:
      return step(0, zero, False)
    if uniform is not None:
      carry = jax.lax.fori_loop(0, uniform - peel, lambda i, c: step(i, c, False), zero)
      return step(uniform - 1, carry, False) if peel else carry
    if layout.lockstep:
      trips = self.trips()
      carry = jax.lax.fori_loop(0, trips - peel, lambda i, c: step(i, c, True), zero)
      return step(jnp.maximum(trips - 1, 0), carry, True) if peel else carry
    if not peel:
      return jax.lax.fori_loop(0, count, lambda i, c: step(i, c, False), zero)
    last = jnp.maximum(count - 1, 0)  # a device with no microbatch runs one, masked to nothing
    return step(last, jax.lax.fori_loop(0, last, lambda i, c: step(i, c, False), zero), True)

  def trips(self):
    """A lockstep loop's trip count: the longest count over the data axis (one scalar ``pmax``), the same on every
    device, so the collectives inside it pair up; the buffer slots past it (:attr:`Layout.max_count`) are not run.
    Read when the program runs, so that new counts that fit the buffers need no new program."""
    return jax.lax.pmax(self.ctx.count, self.ctx.layout.data_axis)

  def _run_fused(self, k: int):
    """Every position has at least ``k`` microbatches (Plan checks): its last ``k`` run as one batch, unmasked."""
    layout, prog, step = self.ctx.layout, self.ctx.prog, self.step
    if prog.region or any(c.local for c in prog.analysis.cuts):
      raise HetSpmdError(f"overlap_microbatches={k} would compute batch statistics over {k} microbatches at once; "
                         "a step with per-microbatch statistics (BatchNorm, batch_stats='local') needs "
                         "overlap_microbatches=1")
    uniform = layout.uniform_count
    first = (uniform if uniform is not None else self.ctx.count) - k
    if layout.lockstep and uniform is None:  # every position runs the longest loop, its own slots from first masked
      carry = jax.lax.fori_loop(0, self.trips() - k, lambda i, c: step(i, c, True, limit=first), self.zero())
    else:
      carry = jax.lax.fori_loop(0, first, lambda i, c: step(i, c, False), self.zero())
    return step(first, carry, False, k)


def _stacked_output(eqn, decision, j: int) -> tuple | None:
  """``(path, ys position)`` where output ``j`` of a cut with a body is made as a scan's stacked output: the cut's
  own scan (``path`` ``()``), or a scan of its checkpointed body whose output it is (``(k,)``); else None."""
  if jx.primitive_name(eqn) == "scan":
    carry = jx.scan_parts(eqn).num_carry
    return ((), j - carry) if j >= carry else None
  if jx.primitive_name(eqn) not in ("remat2", "checkpoint"):
    return None
  jaxpr = decision.body.propagation.jaxpr
  out = jx.outvars(jaxpr)[j]
  for k, inner in enumerate(jx.equations(jaxpr)):
    if jx.primitive_name(inner) == "scan" and out in inner.outvars:
      position, carry = inner.outvars.index(out), jx.scan_parts(inner).num_carry
      return ((k,), position - carry) if position >= carry else None
  return None


def split_fused(x, dim: int, k: int):
  """A per-example output of ``k`` microbatches run as one, its examples along ``dim`` → ``[k, *one's shape]``."""
  shape = x.shape
  return jnp.moveaxis(x.reshape(shape[:dim] + (k, shape[dim] // k) + shape[dim + 1:]), dim, 0)


@dataclasses.dataclass(frozen=True)
class ScanHooks:
  """What a nested body does besides its equations, for a group that shards its parameters: a scan's ``slices``
  (``{input position: f(slice, carry)}``) made of an input's slice before the body reads it, and ``ys``
  (``{output position among the stacked outputs: f(slice)}``) made of an output's slice before it is stacked; a
  checkpointed call's ``inner`` (``(shards, {input position: value})``): the parts it takes, gathered for each
  reader inside it (:meth:`hetspmd.lowering.param_shards.ParamShards.inner`), and ``nested``: the ``ys`` of the
  scans in its body, by equation index."""

  slices: dict = dataclasses.field(default_factory=dict)
  ys: dict = dataclasses.field(default_factory=dict)
  inner: tuple | None = None
  nested: dict = dataclasses.field(default_factory=dict)  # a checkpointed body's: {equation index: its ys}

  def __bool__(self) -> bool:
    return bool(self.slices or self.ys or self.inner or self.nested)


def rebuild_reads(prog, eqn, decision, made) -> tuple:
  """The values of ``made`` (a group's split parameters) that rebuilding ``eqn``'s operands at the microbatch's
  size reads (:func:`hetspmd.lowering.operands.operand`: a class token broadcast to the batch)."""
  if decision is None:
    return ()
  found = []
  for v, a in zip(eqn.invars, decision.inputs):
    if jx.is_literal(v) or a is None or v in prog.analysis.axes or v in getattr(prog, "presliced", ()):
      continue
    chain = prog.rebuilt(v, a)
    found += [u for u in operands.chain_inputs(chain) if u in made] if chain else []
  return tuple(dict.fromkeys(found))


def gather_reads(shards, eqn, env: dict, parts: dict, after: tuple, *, example_free: bool = False,
                 rebuilt: tuple = ()):
  """Puts in ``env`` what ``eqn`` reads of a group's split parameters (``parts``: their parts, by variable): each
  gathered whole for it alone, after ``after`` (the reader before it's inputs); a layer scan's stacked parts and a
  checkpointed call's parts as they are, gathered inside (a slice per iteration; per reader). The values put,
  the :class:`ScanHooks` that gather inside, and the next reader's ``after``. ``rebuilt``: what its operands'
  rebuilding reads of them (:func:`rebuild_reads`), gathered whole too."""
  gathered, scanned, passed = shards.reads(eqn, example_free=example_free, rebuilt=rebuilt)
  inside = {*scanned.values(), *passed.values()}
  env.update({v: shards.whole(v, parts, after) for v in gathered})
  env.update({v: shards.part_of(v, parts) for v in inside})
  if gathered or inside:
    after = tuple(env[v] for v in eqn.invars if not jx.is_literal(v) and v not in shards.made and v in env) or after
  hooks = ScanHooks({j: functools.partial(shards.gathered_slice, v) for j, v in scanned.items()},
                    inner=(shards, passed) if passed else None)
  return (*gathered, *inside), hooks, after


def run_equation(prog, index: int, env: dict, offset, m: int, hooks: ScanHooks | None = None
                 ) -> tuple[list[Any], list[int]] | None:
  """Equation ``index`` on one microbatch of ``m`` examples from ``offset``: its outputs put in ``env`` but the
  sums over the examples, returned with their positions; ``None`` for example-free work, evaluated as it is.
  ``hooks``: for a scan, what each iteration does besides its body (a sharded group's layer scan gathers its
  parameters' slices and reduce-scatters its gradients' slices: :class:`ScanHooks`)."""
  eqn, decision = prog.eqns[index], prog.analysis.decisions[index]
  if decision is None:
    if hooks:
      raise HetSpmdError("a sharded group's layer scan must read the microbatch's examples")
    jx.eval_equations([eqn], env)
    return None
  cut = prog.cuts.get(index)
  out = apply(prog, eqn, decision, env, offset, m, zero_base=cut is not None and cut.base is not None,
              hooks=hooks)
  summed = sum_outputs(decision)
  env.update((eqn.outvars[j], x) for j, x in enumerate(out) if j not in summed)
  return out, summed


def apply(prog, eqn, decision, env, offset, m, *, zero_base: bool = False, hooks: ScanHooks | None = None
          ) -> list[Any]:
  """One per-example or cut equation on one microbatch: its outputs (``hooks``: :func:`run_equation`'s)."""
  invals = [operands.operand(prog, env, v, a, offset, m) for v, a in zip(eqn.invars, decision.inputs)]
  if zero_base:
    invals[decision.base] = jnp.zeros_like(invals[decision.base])
  if decision.body is not None:
    return _apply_body(eqn, decision, invals, offset, m, hooks or ScanHooks())
  if hooks:
    raise HetSpmdError(f"a sharded group's parameters are sliced by {jx.primitive_name(eqn)}, which is not a scan")
  if jx.primitive_name(eqn) in _PLACEMENT:  # a sharding constraint: the loop's data axis is manual, XLA places it
    return list(invals)
  return jx.bind(eqn, invals, microbatch_params(eqn, decision, m))


# Activation sharding constraints (nn.with_logical_constraint, with_sharding_constraint) inside the loop: the
# data axis is manual there, and the model axis's sharding follows from the parameters' by propagation.
_PLACEMENT = frozenset({"sharding_constraint", "mesh_cast", "reshard"})


class Body:
  """A nested body's propagation, seen as the lowering sees a program."""

  def __init__(self, body):
    prop = body.propagation
    self.prop = prop
    self.eqns = jx.equations(prop.jaxpr)
    self.invars, self.outvars = jx.invars(prop.jaxpr), jx.outvars(prop.jaxpr)
    self.constvars, self.consts = jx.constvars(prop.jaxpr), jx.consts(prop.jaxpr)
    self.producer = {v: i for i, e in enumerate(self.eqns) for v in e.outvars}
    self.presliced = body.presliced
    self.analysis = self  # operands.operand reads .analysis.axes
    self.axes = prop.axes

  def rebuilt(self, var, axis):
    return operands.rebuilt(self, var, axis)

  def run(self, inputs, offset, m, shards=None, nested: dict | None = None) -> list[Any]:
    """The body's outputs; ``shards`` (a :class:`hetspmd.lowering.param_shards.ParamShards` of its inputs): the
    inputs that are split parameters' parts, gathered for each reader; ``nested``: ``{equation index: ys}`` of
    its scans (:class:`ScanHooks`)."""
    env = dict(zip(self.constvars, self.consts))
    env.update(zip(self.invars, inputs))
    parts = {v: env.pop(v) for v in self.invars if v in shards.made} if shards is not None else {}
    after = tuple(env[v] for v in self.invars if v in env)  # the first gather waits for the body's inputs
    for k, (eqn, decision) in enumerate(zip(self.eqns, self.prop.decisions)):
      read, hooks = (), None
      if shards is not None:
        read, hooks, after = gather_reads(shards, eqn, env, parts, after, example_free=decision is None,
                                          rebuilt=rebuild_reads(self, eqn, decision, shards.made))
      if nested and k in nested:
        hooks = dataclasses.replace(hooks or ScanHooks(), ys=nested[k])
      if decision is None:
        jx.eval_equations([eqn], env)
      else:
        env.update(zip(eqn.outvars, apply(self, eqn, decision, env, offset, m, hooks=hooks)))
      for v in read:
        del env[v]
    return [jx.read(env, v) for v in self.outvars]


def _apply_body(eqn, decision, invals, offset, m, hooks: ScanHooks) -> list[Any]:
  body = Body(decision.body)
  name = jx.primitive_name(eqn)
  if name in ("remat2", "checkpoint"):
    inner = None
    if hooks.inner is not None:  # the parts it takes, each gathered for each reader inside
      shards, passed = hooks.inner
      inner = shards.inner({body.invars[j]: v for j, v in passed.items()})
    return jx.checkpoint_call(eqn, lambda *xs: body.run(xs, offset, m, inner, hooks.nested), invals)
  parts = jx.scan_parts(eqn)
  nc, nk = parts.num_consts, parts.num_carry
  consts, init, xs = invals[:nc], list(invals[nc:nc + nk]), invals[nc + nk:]
  for k in decision.body.accumulators:  # partial sums start at zero; the initial value is added after reducing
    init[k] = jnp.zeros_like(init[k])

  first = nc + nk

  def step(carry, x):
    x = [hooks.slices[first + j](v, carry[0] if carry else None) if first + j in hooks.slices else v
         for j, v in enumerate(x)]
    out = body.run(list(consts) + list(carry) + x, offset, m)
    return out[:nk], [hooks.ys[j](y) if j in hooks.ys else y for j, y in enumerate(out[nk:])]

  length = 1 if decision.body.chunked else parts.length  # an accumulation loop: the microbatch is one chunk
  carry, ys = jax.lax.scan(step, init, xs, length=length, reverse=eqn.params["reverse"],
                           unroll=eqn.params.get("unroll", 1))
  return list(carry) + list(ys)
