"""Which equations of a train step carry the example axis, and where the step reduces over it.

The pass reads a train step traced at the global batch (its jaxpr holds the
forward pass, autodiff's backward pass and the optimizer update). It
assumes the batch inputs carry the example axis as their dimension 0, and
propagates that axis forward through every equation by the rule table of
:mod:`hetspmd.passes.batch_axis.rules` (keyed by primitive). Checkpointed blocks
and ``scan`` bodies are analysed as units (:class:`Body`): their cuts must
flow linearly to their outputs. Each equation then falls into one of three
kinds:

* **free**: touches no example axis (the optimizer update, learning-rate
  schedules, RNG keys). It runs once.
* **per-example**: maps examples to examples (the forward and backward
  activations). On a microbatch it runs on that microbatch's slice, with the
  global trace's constants kept (the ``1/B`` of a mean stays ``1/B``).
* **cut**: reduces over the example axis to an example-free value (a loss
  sum, the weight gradients' dots and convolutions that contract the batch,
  a scatter-add into an embedding's gradient, a max). A cut is decomposable:
  the global value is the sum (max, min) of its values over microbatches.

An equation that mixes examples in any other way (a sort or cumulative sum
along the batch, indexing the batch, a contrastive similarity matrix) is
refused with :class:`~hetspmd.HetSpmdError` naming the primitive and the
Flax module it came from. So is a side effect that sees per-example values.

A value carries the example axis as ``Axis(dim, per_example)``: dimension
``dim`` has ``B * per_example`` entries, example-major (``per_example > 1``
after a reshape merges the batch with the dimensions after it, as
``logits.reshape(-1, vocab)`` does).

Cuts whose result feeds back into per-example work (a token count that
scales the backward pass, BatchNorm's statistics) are *feedback* cuts. One
that depends only on the batch is *exact*: it gets an earlier, cheap loop
over the microbatches. One that depends on floating-point state (batch
statistics of activations) is *local* by default: each microbatch
normalises with its own statistics, read as means (scaled by ``B/m``), as
per-device BatchNorm does in data-parallel training; ``batch_stats="exact"``
makes those exact too, at the cost of a loop per statistic.

An equation with no example axis on its inputs is free; for one with an
example axis, the default rule (:func:`default_rule`) treats it as
elementwise when it has no axis-like parameter and its outputs keep the
input's shape, and refuses it otherwise. A primitive without a rule that carries a
nested jaxpr (anything but a checkpoint, ``scan``, ``while`` or ``cond`` once
calls are inlined, and the combiners of the rules' scatters) is never
elementwise: it raises :class:`~hetspmd.errors.UnsupportedPrimitiveError`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from hetspmd.errors import HetSpmdError
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.batch_axis import accumulation, linearity, self_indexing
from hetspmd.passes import remat, remat_scan
from hetspmd.passes.batch_axis.rules import RULES as RULES
from hetspmd.passes.batch_axis.rules import Axis as Axis
from hetspmd.passes.batch_axis.rules import Decision as Decision
from hetspmd.passes.batch_axis.rules import Mixing as Mixing
from hetspmd.passes.batch_axis.rules import default_rule as default_rule


class _Inline(Exception):
  """A checkpointed block that cannot run as one unit per microbatch: analyse it inlined instead."""


# --- the analysis ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Cut:
  """An equation that reduces over the example axis; ``loop``: the microbatch loop that computes it."""

  index: int  # into the flat jaxpr's equations
  reduce: str
  base: int | None
  feedback: bool  # its value reaches per-example work
  local: bool  # per-microbatch statistics (read as means within the microbatch), not exact
  loop: int


@dataclasses.dataclass(frozen=True)
class Analysis:
  """The example axis of every value of a flat train-step jaxpr, and its cuts."""

  jaxpr: Any  # jx.ClosedJaxpr with calls inlined
  global_batch: int
  axes: dict  # var -> Axis (per-example values only)
  decisions: tuple  # per equation: Decision, or None for a free equation
  cuts: tuple[Cut, ...]
  loops: int  # microbatch loops (1 + exact feedback levels)
  notes: tuple[str, ...] = ()  # what the program gives up, for explain()
  loop_only: frozenset = frozenset()  # example-free values that exist only inside the microbatch loop

  def cut_at(self, index: int) -> Cut | None:
    return self._cuts_by_index.get(index)

  @property
  def _cuts_by_index(self) -> dict[int, Cut]:
    return {c.index: c for c in self.cuts}

  def describe(self) -> list[str]:
    """One line per cut: what it reduces and how the microbatch program treats it."""
    eqns = jx.equations(self.jaxpr)
    lines = []
    for cut in self.cuts:
      eqn = eqns[cut.index]
      where = jx.module_path(eqn) or jx.user_location(eqn)
      how = ("per-microbatch statistic (batch_stats='exact' makes it exact)" if cut.local
             else f"exact, loop {cut.loop}" + (", feeds later per-example work" if cut.feedback else ""))
      lines.append(f"{jx.primitive_name(eqn)} ({cut.reduce}) at {where}: {how}")
    return lines

  @property
  def local_statistics(self) -> tuple[Cut, ...]:
    return tuple(c for c in self.cuts if c.local)


def refusal(eqn, reason: str) -> HetSpmdError:
  name = jx.primitive_name(eqn)
  where = jx.module_path(eqn)
  return HetSpmdError(
      f"the train step cannot be split into microbatches: {name} "
      + (f"in {where!r} " if where else "") + f"({jx.user_location(eqn)}) {reason}. Each example must be "
      "computed on its own until a sum, mean, max or min over the batch; compute this part per example, or "
      "run it outside the parallelized step")


@dataclasses.dataclass(frozen=True)
class Propagation:
  """The example axis through one flat jaxpr: per variable, per equation, and its cuts in order."""

  jaxpr: Any  # jx.ClosedJaxpr with calls inlined
  axes: dict  # var -> Axis (per-example values only)
  decisions: tuple  # per equation: Decision, or None for a free equation
  cut_list: tuple  # (equation index, Decision) of every cut
  cut_deps: dict  # var -> bit set over cut_list: the cuts it depends on
  stateful: dict  # var -> whether it depends on floating-point state
  loop_only: frozenset = frozenset()  # example-free values made inside the microbatch loop (body invariants)


def propagate(flat: Any, in_axes: dict, batch: int, stateful_inputs: Sequence[Any] = (),
              linear_inputs: Sequence[Any] = (), keep: frozenset = frozenset()) -> Propagation:
  """Propagates ``in_axes`` (var -> Axis) through the equations of the flat closed jaxpr ``flat``.

  ``linear_inputs``: inputs that count as sums over the examples already (a scan's accumulator carries).
  ``keep``: the call primitives (checkpoints) that nested bodies keep whole rather than inline.
  """
  axes: dict = dict(in_axes)
  cut_deps: dict = {}
  stateful: dict = {v: True for v in stateful_inputs}
  decisions: list = []
  cut_list: list = []
  loop_only: set = set()
  for v in linear_inputs:  # one pseudo-cut bit for all of them
    cut_deps[v] = 1
  if linear_inputs:
    cut_list.append((-1, Decision((), (), reduce="sum")))
  read = jx.read_vars(flat)
  for index, eqn in enumerate(jx.equations(flat)):
    in_axes_ = [None if jx.is_literal(v) else axes.get(v) for v in eqn.invars]
    deps, state = 0, False
    for v in eqn.invars:
      if not jx.is_literal(v):
        deps |= cut_deps.get(v, 0)
        state = state or stateful.get(v, False)
    if all(a is None for a in in_axes_):
      decisions.append(None)
      inside = any(v in loop_only for v in eqn.invars if not jx.is_literal(v))
      for v in eqn.outvars:
        cut_deps[v], stateful[v] = deps, state
        if inside:
          loop_only.add(v)
      continue
    decision = _decide(eqn, in_axes_, batch, keep, read)
    decisions.append(decision)
    loop_only.update(eqn.outvars[j] for j in decision.invariant)
    if decision.reduce is not None:
      cut_list.append((index, decision))
      bit = 1 << len(cut_list) - 1
    for j, (v, a) in enumerate(zip(eqn.outvars, decision.outputs)):
      if a is not None:
        axes[v] = a
        cut_deps[v] = deps
      else:
        cut_deps[v] = bit if decision.reduce is not None and j not in decision.invariant else deps
      stateful[v] = state
  return Propagation(flat, axes, tuple(decisions), tuple(cut_list), cut_deps, stateful, frozenset(loop_only))


def _decide(eqn, in_axes, batch, keep: frozenset = frozenset(), read: frozenset = frozenset()) -> Decision:
  """``eqn``'s Decision; ``read``: the variables of its jaxpr that something reads (its unused outputs are not)."""
  name = jx.primitive_name(eqn)
  if jx.is_effectful(eqn):
    raise refusal(eqn, "is a side effect that sees per-example values, so it cannot be split over devices")
  chunked = [a for a in in_axes if a is not None and a.chunks > 1]
  if chunked and name != "scan":
    raise refusal(eqn, f"reads the batch split into {chunked[0].chunks} chunks (batch.reshape(chunks, -1, ...)) "
                  "other than as the scanned input of a lax.scan that sums over them, as a gradient accumulation "
                  "loop does")
  if jx.is_checkpoint(eqn):
    return _checkpoint_rule(eqn, in_axes, batch, keep)
  if name == "scan":
    if chunked:
      return _accumulation_rule(eqn, in_axes, batch, keep, read)
    return _scan_rule(eqn, in_axes, batch, keep)
  if name in ("while", "cond"):
    raise refusal(eqn, f"is a {name} over per-example values, which hetspmd does not split (write the loop as "
                  "lax.scan or a Python loop)")
  if jx.has_nested_jaxpr(eqn) and name not in RULES:  # its body may mix examples: never the default rule
    raise jx.unsupported_body(eqn)
  rule = RULES.get(name, default_rule)
  try:
    return rule(eqn, in_axes, batch)
  except Mixing as e:
    raise refusal(eqn, str(e)) from None


def analyse(closed: Any, batch_inputs: Sequence[int], global_batch: int, *, batch_stats: str = "local",
            float_state_inputs: Sequence[int] = (), remat: str = "none",
            param_paths: dict[int, str] | None = None) -> Analysis:
  """Propagates the example axis from the jaxpr inputs ``batch_inputs`` (dimension 0) and finds the cuts.

  ``closed`` is inlined first (:func:`jx.inline_calls`; checkpointed blocks and scans stay whole and are
  analysed as units). ``float_state_inputs``: the inputs holding floating-point state (parameters,
  statistics); a feedback cut that depends on one is a batch statistic. ``remat``: a plan's remat policy;
  under ``"layers"`` each layer's per-example residuals are recomputed from its saved inputs before the backward
  pass reads them (:mod:`hetspmd.passes.remat`), whatever differentiated the step; ``param_paths``
  (``{input position: path}`` of the parameters) finds the layers of steps whose module paths name none.
  """
  if batch_stats not in ("local", "exact"):
    raise HetSpmdError(f"batch_stats must be 'local' or 'exact', got {batch_stats!r}")
  try:
    flat, notes = _flat(closed, _UNITS, global_batch), ()
    if remat == "layers":
      flat, notes = _layers_recomputed(flat, batch_inputs, global_batch, param_paths)
    return _analyse(flat, batch_inputs, global_batch,
                    batch_stats=batch_stats, float_state_inputs=float_state_inputs, notes=notes, keep=_UNITS)
  except _Inline as e:
    return _analyse(_flat(closed, frozenset(), global_batch), batch_inputs, global_batch,
                    batch_stats=batch_stats, float_state_inputs=float_state_inputs, keep=frozenset(),
                    notes=(f"checkpointed blocks inlined (their recomputation is lost): {e}",))


_UNITS = jx.CHECKPOINTS


def _layers_recomputed(flat: Any, batch_inputs: Sequence[int], global_batch: int, param_paths: dict[int, str] | None
                       ) -> tuple[Any, tuple[str, ...]]:
  """``flat`` with each layer's per-example residuals recomputed (:func:`remat.rematerialize`), and a note."""
  prop = propagate(flat, _input_axes(flat, batch_inputs, global_batch), global_batch, keep=_UNITS)
  flat, found = remat.rematerialize(flat, lambda v: v in prop.axes, param_paths)
  if not found:
    flat, layers = remat_scan.rematerialize_scan(flat, lambda v: v in prop.axes)
    if layers:
      return flat, (f"remat 'layers': the layer scan's {layers} layers recomputed in its transpose from their "
                    "inputs",)
    return flat, ("remat 'layers': no repeated, numbered layer scope reads residuals of its own, so nothing is "
                  "recomputed",)
  per_example = lambda values: sum(_nbytes(v) for v in values if v in prop.axes) / global_batch
  remade = per_example(v for s in found for v in s.residuals)
  kept = per_example(dict.fromkeys(v for s in found for v in s.inputs))
  return flat, (f"remat 'layers': {len(found)} layers recomputed from their inputs before their backward pass "
                f"({found[0].layer} .. {found[-1].layer}); per example, {remade / 1e6:.3g} MB of residuals remade, "
                f"{kept / 1e6:.3g} MB of layer inputs kept",)


def _nbytes(v: Any) -> int:
  shape, _, itemsize = jx.describe_aval(v.aval)
  return int(np.prod(shape, dtype=np.int64)) * itemsize


def _flat(closed: Any, keep: frozenset, global_batch: int) -> Any:
  """The step inlined but for ``keep``, its self-indexing gathers batched and its counted loops over chunks of the
  batch written as scans over the chunks (:mod:`hetspmd.passes.batch_axis.accumulation`)."""
  return accumulation.rewrite(self_indexing.rewrite(jx.inline_calls(closed, keep=keep)), global_batch)


def _input_axes(flat: Any, batch_inputs: Sequence[int], global_batch: int) -> dict:
  invars = jx.invars(flat)
  in_axes = {}
  for i in batch_inputs:
    shape = jx.aval_shape(invars[i])
    if not shape or shape[0] != global_batch:
      raise HetSpmdError(f"batch input {i} has shape {shape}; its leading axis must be the global batch "
                         f"{global_batch}")
    in_axes[invars[i]] = Axis(0)
  return in_axes


def _analyse(flat, batch_inputs, global_batch, *, batch_stats, float_state_inputs, notes, keep) -> Analysis:
  invars = jx.invars(flat)
  in_axes = _input_axes(flat, batch_inputs, global_batch)
  prop = propagate(flat, in_axes, global_batch, [invars[i] for i in float_state_inputs], keep=keep)
  cuts = _schedule(jx.equations(flat), list(prop.cut_list), prop.axes, prop.decisions, cut_deps=prop.cut_deps,
                   stateful=prop.stateful, batch_stats=batch_stats)
  loops = 1 + max((c.loop for c in cuts), default=0)
  return Analysis(flat, global_batch, prop.axes, prop.decisions, cuts, loops, tuple(notes), prop.loop_only)


# --- nested bodies evaluated per microbatch ------------------------------------------


@dataclasses.dataclass(frozen=True)
class Body:
  """A nested jaxpr run per microbatch as one unit, its outputs per-example values or sums over its examples.

  ``propagation`` covers the inlined body; ``presliced``: body inputs the caller already cut to the
  microbatch; ``accumulators``: (scan) carry positions holding sums, started at zero and given their
  initial value once after the reduction.
  """

  propagation: Propagation
  presliced: frozenset
  accumulators: tuple[int, ...] = ()
  chunked: bool = False  # a step's own accumulation loop over chunks of the batch: on a microbatch, one chunk


def _check_body(prop: Propagation, what: str, eqn) -> None:
  """Raises Mixing unless every cut in the body is a plain sum that only flows linearly to the body's outputs
  (:mod:`hetspmd.passes.batch_axis.linearity`: which example-free equations keep a sum a sum)."""
  eqns = jx.equations(prop.jaxpr)
  producers = {v: i for i, e in enumerate(eqns) for v in e.outvars}
  is_zero = lambda v: linearity.is_zero(v, producers, eqns)
  for index, decision in prop.cut_list:
    if index < 0:
      continue
    if decision.reduce != "sum":
      raise Mixing(f"its {what} takes a {decision.reduce} over the examples")
    if decision.base is not None and not is_zero(eqns[index].invars[decision.base]):
      raise Mixing(f"its {what} scatter-adds over the examples into a non-zero array")
  for v in prop.axes:
    if prop.cut_deps.get(v, 0):
      raise Mixing(f"its {what} feeds a sum over the examples back into per-example work")
  for e, decision in zip(eqns, prop.decisions):
    if decision is not None:
      continue
    summed = [not jx.is_literal(v) and prop.cut_deps.get(v, 0) != 0 for v in e.invars]
    why = linearity.reason(e, summed, is_zero) if any(summed) else None
    if why is not None:
      raise Mixing(f"its {what} {why}")
  del eqn


def _invariant_outputs(prop: Propagation) -> tuple[int, ...]:
  """Body outputs computed from no example and no sum over them (a parameter saved for the backward pass)."""
  return tuple(j for j, v in enumerate(jx.outvars(prop.jaxpr))
               if not jx.is_literal(v) and v not in prop.axes and prop.cut_deps.get(v, 0) == 0)


def _checkpoint_rule(eqn, in_axes, batch, keep) -> Decision:
  body = self_indexing.rewrite(jx.inline_calls(jx.call_body(eqn), keep=keep))
  invars = jx.invars(body)
  prop = propagate(body, {v: a for v, a in zip(invars, in_axes) if a is not None}, batch, keep=keep)
  try:
    _check_body(prop, "checkpointed block", eqn)
  except Mixing as e:
    raise _Inline(str(e)) from None
  return _body_decision(eqn, prop, in_axes, invars, jx.outvars(body), ())


def _body_decision(eqn, prop, in_axes, invars, outvars, accumulators, *, shift_in=None, shift_out=None,
                   chunked: bool = False) -> Decision:
  """The Decision of an equation whose body ``prop`` maps ``invars`` to ``outvars``."""
  demanded = _demanded(prop)
  inputs = []
  presliced = set()
  for j, (v, a) in enumerate(zip(invars, in_axes)):
    if a is None and v in demanded:
      inner = demanded[v]
      inputs.append(inner if shift_in is None else shift_in(j, inner))
      presliced.add(v)
    else:
      inputs.append(a)
  outputs = []
  for j, v in enumerate(outvars):
    axis = None if jx.is_literal(v) else prop.axes.get(v)
    outputs.append(axis if axis is None or shift_out is None else shift_out(j, axis))
  summed = any(not jx.is_literal(v) and prop.axes.get(v) is None and prop.cut_deps.get(v, 0) for v in outvars)
  body = Body(prop, frozenset(presliced), tuple(accumulators), chunked)
  return Decision(tuple(outputs), tuple(inputs), reduce="sum" if summed else None, body=body,
                  invariant=_invariant_outputs(prop))


def _demanded(prop: Propagation) -> dict:
  """Example-free body inputs that some per-example equation reads along an example axis."""
  invars = set(jx.invars(prop.jaxpr))
  out = {}
  for e, decision in zip(jx.equations(prop.jaxpr), prop.decisions):
    if decision is None:
      continue
    for v, a in zip(e.invars, decision.inputs):
      if a is not None and not jx.is_literal(v) and v in invars and v not in prop.axes:
        out.setdefault(v, a)
  return out


def _scan_rule(eqn, in_axes, batch, keep) -> Decision:
  parts = jx.scan_parts(eqn)
  body = self_indexing.rewrite(jx.inline_calls(parts.body, keep=keep))
  invars, outvars = jx.invars(body), jx.outvars(body)
  nc, nk = parts.num_consts, parts.num_carry
  for j, a in enumerate(in_axes[nc + nk:]):
    if a is not None and a.dim == 0:
      raise refusal(eqn, "scans along the examples, so each step sees the one before it")
  inner = list(in_axes[:nc + nk]) + [None if a is None else a.moved(a.dim - 1) for a in in_axes[nc + nk:]]
  # the carries' example axes: a fixed point (an activation carried from layer to layer)
  for _ in range(nk + 1):
    prop = propagate(body, {v: a for v, a in zip(invars, inner) if a is not None}, batch,
                     linear_inputs=_accumulator_vars(body, nc, nk, inner, batch), keep=keep)
    changed = False
    for k in range(nk):
      out = outvars[k]
      axis = None if jx.is_literal(out) else prop.axes.get(out)
      if axis != inner[nc + k]:
        if inner[nc + k] is not None and axis is None:
          break
        inner[nc + k] = axis
        changed = True
    if not changed:
      break
  for k in range(nk):
    out = outvars[k]
    if (None if jx.is_literal(out) else prop.axes.get(out)) != inner[nc + k]:
      raise refusal(eqn, "carries a value whose example axis changes from one step to the next")
  # accumulators: example-free carries that sum over the examples; propagate again with only those
  accumulators = tuple(k for k in range(nk) if inner[nc + k] is None and not jx.is_literal(outvars[k])
                       and prop.cut_deps.get(outvars[k], 0) & ~1)
  prop = propagate(body, {v: a for v, a in zip(invars, inner) if a is not None}, batch,
                   linear_inputs=[invars[nc + k] for k in accumulators], keep=keep)
  try:
    _check_body(prop, "scan body", eqn)
  except Mixing as e:
    raise refusal(eqn, str(e)) from None
  outer_in = list(inner[:nc + nk]) + [None if a is None else a.moved(a.dim + 1) for a in inner[nc + nk:]]
  for j in range(nc + nk, len(in_axes)):
    outer_in[j] = in_axes[j]
  shift_in = lambda j, a: a.moved(a.dim + 1) if j >= nc + nk else a
  shift_out = lambda j, a: a.moved(a.dim + 1) if j >= nk else a
  decision = _body_decision(eqn, prop, outer_in, invars, outvars, accumulators, shift_in=shift_in, shift_out=shift_out)
  return decision


def _accumulation_rule(eqn, in_axes, batch, keep, read) -> Decision:
  """A step's own gradient accumulation loop: a ``scan`` over the ``k`` chunks of ``batch.reshape(k, -1, ...)``
  whose carries sum over the examples. Its sums are sums over the whole batch, each chunk's constants kept (a
  chunk's ``1/(B/k)``), so on a microbatch of ``m`` examples the loop runs its body once, on them as one chunk,
  and the plan's microbatches and counts split the batch in place of the loop's chunks. Refused, with the
  reason, where the loop does more than sum: a carry that changes and reaches a result (a running max, an
  optimizer update inside the loop), per-chunk outputs, random draws per chunk, the whole batch beside its
  chunks."""
  parts = jx.scan_parts(eqn)
  body = self_indexing.rewrite(jx.inline_calls(parts.body, keep=keep))
  invars, outvars = jx.invars(body), jx.outvars(body)
  nc, nk, k = parts.num_consts, parts.num_carry, parts.length
  what = f"is a gradient accumulation loop over {k} chunks of the batch that"
  for j, a in enumerate(in_axes):
    if a is not None and (j < nc + nk or a.chunks != k or a.dim != 1):
      raise refusal(eqn, f"{what} also reads examples other than its chunks, one per step")
  chunk = batch // k
  inner = [None] * (nc + nk) + [None if a is None else Axis(0, a.per_example) for a in in_axes[nc + nk:]]
  start = {v: a for v, a in zip(invars, inner) if a is not None}
  prop = propagate(body, start, chunk, linear_inputs=_accumulator_vars(body, nc, nk, inner, chunk), keep=keep)
  accumulators = tuple(i for i in range(nk) if not jx.is_literal(outvars[i]) and prop.cut_deps.get(outvars[i], 0) & ~1)
  prop = propagate(body, start, chunk, linear_inputs=[invars[nc + i] for i in accumulators], keep=keep)
  for i in range(nk):
    changes = outvars[i] is not invars[nc + i]
    if i not in accumulators and changes and (_reaches_results(body, invars[nc + i], i)
                                              or eqn.outvars[i] in read):
      raise refusal(eqn, f"{what} carries a value from chunk to chunk that is not a sum over the examples (a "
                    "running max, an update inside the loop), so its chunks cannot be split another way")
  if any(v in read for v in eqn.outvars[nk:]):
    if any(not jx.is_literal(v) and v in prop.axes for v in outvars[nk:]):
      raise refusal(eqn, f"{what} returns per-example values chunk by chunk (the scan's ys; autodiff's transpose "
                    "of a loop over chunks inside a differentiated loss makes them): loop over the chunks around "
                    "jax.grad, summing the gradients in the carry")
    raise refusal(eqn, f"{what} returns a value per chunk (the scan's ys): sum it in the carry instead, so that "
                  "hetspmd's microbatches can stand for the chunks")
  for e, d in zip(jx.equations(body), prop.decisions):
    if d is not None and jx.primitive_name(e) in ("random_bits", "random_wrap", "threefry2x32"):
      raise refusal(eqn, f"{what} draws random numbers for each chunk's examples, which hetspmd's microbatches "
                    "would draw differently")
  try:
    _check_body(prop, "body", eqn)
  except Mixing as e:
    raise refusal(eqn, f"{what} does more than sum: {e}") from None
  shift_in = lambda j, a: Axis(a.dim + 1, a.per_example, k) if j >= nc + nk else a
  return _body_decision(eqn, prop, in_axes, invars, outvars, accumulators, shift_in=shift_in, chunked=True)


def _reaches_results(body, carry_in, own: int) -> bool:
  """Whether body input ``carry_in`` reaches any body output but its own carry (``own``)."""
  reached = {carry_in}
  for e in jx.equations(body):
    if any(not jx.is_literal(v) and v in reached for v in e.invars):
      reached.update(e.outvars)
  return any(not jx.is_literal(v) and v in reached for j, v in enumerate(jx.outvars(body)) if j != own)


def _accumulator_vars(body, nc, nk, inner, batch) -> list:
  """Carry inputs that may hold sums over the examples: every example-free carry (checked linear afterwards)."""
  invars = jx.invars(body)
  return [invars[nc + k] for k in range(nk) if inner[nc + k] is None
          and jx.aval_dtype(invars[nc + k]) is not None and str(jx.aval_dtype(invars[nc + k])).startswith(
              ("float", "bfloat", "complex"))]


_SQUARES = frozenset({"convert_element_type", "square", "integer_pow", "mul", "abs", "copy"})


def _normalises(eqns, index, local_bits, axes, decisions, *, cut_deps, consumers, producers) -> bool:
  """Whether the sum at ``eqns[index]`` is a statistic that normalises the activations it sums.

  BatchNorm's pattern: per-example work subtracts the statistic from the values it summed
  (``x - mean``), or scales by it values that another such statistic centred (``(x - mean) *
  rsqrt(var)``). A load-balancing term (an MoE router's expert density) is neither: it stays exact.
  """
  summed = {v for v in eqns[index].invars if not jx.is_literal(v) and v in axes}
  for v in list(summed):  # x from x * x, x ** 2, a cast of x
    i = producers.get(v)
    if i is not None and jx.primitive_name(eqns[i]) in _SQUARES:
      summed.update(u for u in eqns[i].invars if not jx.is_literal(u) and u in axes)
  seen: set = set()
  frontier = [v for v in eqns[index].outvars]
  while frontier:
    v = frontier.pop()
    for i in consumers.get(v, ()):
      if i in seen:
        continue
      seen.add(i)
      e = eqns[i]
      if decisions[i] is None:  # example-free work on the statistic (1/N, rsqrt(var + eps))
        frontier.extend(e.outvars)
        continue
      per_example = [u for u in e.invars if not jx.is_literal(u) and u in axes]
      name = jx.primitive_name(e)
      if name == "sub" and any(u in summed for u in per_example):
        return True
      if name in ("mul", "div") and any(cut_deps.get(u, 0) & local_bits for u in per_example):
        return True
      if name in ("broadcast_in_dim", "reshape", "convert_element_type") and not per_example:
        frontier.extend(e.outvars)  # a broadcast of the statistic is per-example in shape only
  return False


def _schedule(eqns, cut_list, axes, decisions, *, cut_deps, stateful, batch_stats) -> tuple[Cut, ...]:
  """Feedback, local or exact, and the loop (ASAP levels, then as late as possible) of every cut."""
  n = len(cut_list)
  feedback = [False] * n
  # which cuts the per-example inputs of each cut depend on
  needs = [0] * n
  for k, (index, _) in enumerate(cut_list):
    for v in eqns[index].invars:
      if not jx.is_literal(v):
        needs[k] |= cut_deps.get(v, 0)
  for v, axis in axes.items():
    bits = cut_deps.get(v, 0)
    k = 0
    while bits:
      if bits & 1:
        feedback[k] = True
      bits >>= 1
      k += 1
  local = [False] * n
  consumers: dict = {}
  producers = {v: i for i, e in enumerate(eqns) for v in e.outvars}
  for i, e in enumerate(eqns):
    for v in e.invars:
      if not jx.is_literal(v):
        consumers.setdefault(v, []).append(i)
  for k, (index, decision) in enumerate(cut_list):
    eqn = eqns[index]
    depends_on_state = any(stateful.get(v, False) for v in eqn.invars if not jx.is_literal(v))
    # a statistic of activations; one computed from an exact global value (the count of an exact max) stays exact
    after_exact = any(needs[k] >> j & 1 and not local[j] for j in range(k))
    if not (feedback[k] and batch_stats == "local" and depends_on_state and decision.reduce == "sum"
            and not after_exact):
      continue
    local_bits = sum(1 << j for j in range(k) if local[j])
    if jx.phase(eqn) == "backward":  # a statistic's gradient is per microbatch where the statistic is
      local[k] = bool(needs[k] & local_bits)
    else:
      local[k] = _normalises(eqns, index, local_bits, axes, decisions, cut_deps=cut_deps, consumers=consumers,
                              producers=producers)
  # ASAP level: one more than the exact cuts it needs; local cuts stay in their microbatch
  level = [0] * n
  for k in range(n):
    bits, j = needs[k], 0
    while bits:
      if bits & 1 and not local[j]:
        level[k] = max(level[k], level[j] + 1)
      elif bits & 1:
        level[k] = max(level[k], level[j])
      bits >>= 1
      j += 1
  last = max(level, default=0)
  loop = [last] * n
  for k in reversed(range(n)):  # as late as possible: just before the first loop that needs it
    bits, j = needs[k], 0
    while bits:
      if bits & 1:
        loop[j] = min(loop[j], loop[k] - (0 if local[j] else 1))
      bits >>= 1
      j += 1
  return tuple(Cut(index, d.reduce, d.base, feedback[k], local[k], loop[k])
               for k, (index, d) in enumerate(cut_list))
