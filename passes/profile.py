"""``profile_step``: a step function → its :class:`~hetspmd.passes.costing.step_cost.StepProfile`.

The step is traced at two batch sizes (:data:`PROFILE_BATCHES`); the per-node
costs are fitted as linear in the batch, and the tensor-parallel strategy
spaces of the model-axis sizes the search tries (:data:`MODEL_SIZES`) are built
once, for every search over the profile to reuse.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable, Sequence

import jax
import numpy as np

from hetspmd.errors import HetSpmdError, NoLayerStackError
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes import remat
from hetspmd.passes.costing import step_cost
from hetspmd.passes.costing.step_cost import StepProfile
from hetspmd.passes.frontend import stack
from hetspmd.passes.frontend.tracing import trace
from hetspmd.passes.ir import Source
from hetspmd.passes.sharding import strategies


MODEL_SIZES = (2, 4, 8)       # model-axis sizes whose strategy spaces profile_step prepares


PROFILE_BATCHES = (2, 4)


def with_batch(batch: Any, size: int) -> Any:
  """``batch`` as ``ShapeDtypeStruct``s with ``size`` examples (every leaf's leading axis)."""
  def resize(x):
    shape = tuple(np.shape(x))
    if not shape:
      raise HetSpmdError("every batch leaf needs a leading batch axis; got a scalar")
    return jax.ShapeDtypeStruct((size,) + shape[1:], x.dtype)

  return jax.tree.map(resize, batch)


def fingerprint(jaxpr: Any) -> str:
  """A jaxpr's identity: its equations' primitives in order and its inputs' shapes and dtypes."""
  names = " ".join(jx.primitive_name(e) for e in jx.equations(jaxpr))
  inputs = " ".join(str(getattr(v, "aval", v)) for v in jaxpr.jaxpr.invars)
  return hashlib.sha256(f"{names}|{inputs}".encode()).hexdigest()


def step_fingerprint(fn: Callable[[Any, Any], Any], state: Any, batch: Any) -> str:
  """:func:`fingerprint` of ``fn(state, batch)`` (a :class:`~hetspmd.runtime.runner.Trace`'s ``state_batch()``
  and its batch) traced on their shapes, its calls inlined, the batch at a fixed size (any batch of the step
  gives the same): what a calibration of the step carries and what the search checks it against, however the
  step was wrapped. Another model, another size of it or another sequence length differs."""
  closed, _ = jx.trace_to_jaxpr(fn, (jx.to_abstract(state), with_batch(batch, PROFILE_BATCHES[1])), {})
  return fingerprint(jx.inline_calls(closed))


def profile_step(fn: Callable[..., Any], state: Any, batch: Any) -> StepProfile:
  """Traces ``fn(state, batch)`` at two batch sizes, fits the per-node costs, prepares the strategy spaces."""
  small, large = PROFILE_BATCHES
  graphs = [trace(fn, state, with_batch(batch, b)) for b in PROFILE_BATCHES]
  profile = step_cost.step_profile(graphs[0], graphs[1], small, large)
  return with_strategy_spaces(with_scan_layers(profile) if profile.layer_activation is None else profile)


def with_scan_layers(profile: StepProfile) -> StepProfile:
  """``profile`` with remat ``"layers"`` priced for its layer scan (:mod:`hetspmd.passes.remat_scan`), if it has
  one whose transpose reads per-example residuals: the forward scan's body runs again, and its stacked
  residuals give way to the stacked layer inputs and one layer's residuals."""
  small, large = profile.traces
  try:
    found = stack.find_layer_stack(stack.sites_in_traces(small, large))
  except NoLayerStackError:
    return profile
  remade = _scan_residuals(found, small, large)
  if not remade:
    return profile
  peaks = []
  for graph, batch in zip((small, large), profile.trace_batches):
    f = graph.scans[found.forward_scan]
    per_layer = sum(graph.nodes[r.index].outputs[r.output].nbytes for r in (f.results[k] for k in remade))
    carry = f.operand_types[f.num_consts].nbytes
    peaks.append(profile.activation.at(batch) - per_layer * (f.length - 1) + carry * f.length)
  loop = small.scans[found.forward_scan].loop
  recomputed = np.array([n.phase == "forward" and loop in n.loops for n in small.nodes], bool)
  return dataclasses.replace(profile, layer_recomputed=recomputed,
                             layer_activation=step_cost.fit_linear(*peaks, *profile.trace_batches))


def layer_nodes(profile: StepProfile) -> tuple[np.ndarray, int] | None:
  """Per node of ``profile``, whether it runs in the step's layer scan (its forward or its transpose), and how
  many layers the scan runs; None where the step has no layer scan."""
  if len(profile.traces) < 2:
    return None
  small, large = profile.traces
  try:
    found = stack.find_layer_stack(stack.sites_in_traces(small, large))
  except NoLayerStackError:
    return None
  loops = {small.scans[found.forward_scan].loop, small.scans[found.backward_scan].loop}
  return np.array([bool(loops.intersection(n.loops)) for n in small.nodes], bool), found.length


def block_nodes(profile: StepProfile) -> np.ndarray | None:
  """Per node of ``profile``, whether it is in the forward of the block a calibration times of a step that
  unrolls its layers (:func:`hetspmd.passes.remat.timed_segment` of the numbered layers remat ``"layers"``
  finds); None where the step has no such layer."""
  if len(profile.traces) < 2:
    return None
  found = step_cost.layer_segments(*profile.traces)
  if not found:
    return None
  mask = np.zeros(len(profile.traces[0].nodes), bool)
  mask[list(remat.timed_segment(found).members)] = True
  return mask


def _scan_residuals(found: stack.LayerStack, small: Any, large: Any) -> list[int]:
  """The positions of the forward scan's stacked per-example results that its transpose reads."""
  def nbytes(graph, ref):
    return graph.nodes[ref.index].outputs[ref.output].nbytes

  f, b, f_large = small.scans[found.forward_scan], small.scans[found.backward_scan], large.scans[found.forward_scan]
  return [k for k in range(f.num_carry, len(f.results))
          if f.results[k].source is Source.NODE and f.results[k] in b.operands
          and nbytes(small, f.results[k]) != nbytes(large, f_large.results[k])]


def with_strategy_spaces(profile: StepProfile, sizes: Sequence[int] = MODEL_SIZES) -> StepProfile:
  """``profile`` with the tensor-parallel strategy spaces of ``sizes`` built (the search reuses them)."""
  spaces = {m: strategies.strategy_space(profile, m) for m in sizes}
  return dataclasses.replace(profile, strategy_spaces={**profile.strategy_spaces, **spaces})
