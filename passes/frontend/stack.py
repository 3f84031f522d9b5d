"""The layer stack of a train step: the forward scan over stacked layer parameters and its transpose.

A model that runs its layers as one scan over stacked parameters (Linen
``nn.scan``, NNX ``nnx.scan``, ``lax.scan`` over a stacked tree) has, once
calls are inlined, two scans outside every loop that pipeline stages cut:

* ``F``, the forward scan: not reversed, at least two iterations, in the
  forward pass, one carry that holds per-example values (the activation
  handed from layer to layer), and scanned inputs none of which does (the
  stacked parameters);
* ``B``, its transpose: the one reversed scan that reads ``F``'s results,
  as long as ``F``, with one carry (the activation's cotangent).

The planner and the lowering ask this one finder, so the stage plans the
search prices are those the lowering can run. Both describe the step's
top-level scans as :class:`ScanSite` values and call :func:`find_layer_stack`:

* the planner from the step's two traces (:func:`sites_in_traces`): the
  trace records every scan outside a loop (:class:`~hetspmd.passes.ir.ScanCall`),
  and an operand carries the example axis when its shape differs between
  the traces at two batch sizes;
* the lowering from the flat jaxpr of its microbatch program
  (:func:`sites_in_jaxpr`), where the batch-axis pass says which operands
  carry the example axis.

One function decides on one description, so the two cannot pick different
scans: they see the step's top-level scans in program order (the trace and
the lowering's flat jaxpr inline the same calls, those of
``_jax_adapter.CALL_RULES``), the same params, the same dataflow between
the scans, and the same operands as per-example (an operand whose shape
follows the batch is one the batch-axis pass gives the example axis). The
:class:`LayerStack` each gets compares equal: the same layer count, ``F`` and
``B`` at the same positions among the top-level scans. What this assumes:
the batch-axis pass keeps checkpointed blocks whole while the trace inlines
them, so a scan inside a ``jax.checkpoint`` is top-level for the trace only.
For a loss checkpointed whole (a plan's ``remat="full"``) neither finds a
stack (checked on a Linen ``nn.scan`` model). The planner's profile traces
the step without the plan's remat.

The lowering then checks what only it knows (how the microbatch loop's
other equations group around ``F`` and ``B``, batch statistics). A step
without a stack raises :class:`~hetspmd.errors.NoLayerStackError` saying
what differs; the planner then offers no stage plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Sequence

from hetspmd.errors import NoLayerStackError
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.ir import Graph, Source


@dataclasses.dataclass(frozen=True)
class ScanSite:
  """One top-level scan as the finder reads it.

  ``at``: where the caller finds it (an equation index, a graph loop id); ``reads`` and ``writes``: an
  identity per operand and result (``None`` for a literal), shared by the values that flow between
  scans; ``per_example``: per operand, whether it carries the example axis.
  """

  at: int
  reverse: bool
  length: int
  num_consts: int
  num_carry: int
  forward: bool
  reads: tuple[Hashable | None, ...]
  writes: tuple[Hashable | None, ...]
  per_example: tuple[bool, ...]

  @property
  def carries_layers(self) -> bool:
    """A forward layer scan: one per-example carry, every scanned input example-free (stacked parameters)."""
    carry = self.per_example[self.num_consts:self.num_consts + self.num_carry]
    xs = self.per_example[self.num_consts + self.num_carry:]
    return (not self.reverse and self.num_carry == 1 and carry[0] and bool(xs) and not any(xs) and self.forward
            and self.length >= 2)


@dataclasses.dataclass(frozen=True)
class LayerStack:
  """The layer stack found among a step's top-level scans.

  ``forward`` and ``backward``: ``F``'s and ``B``'s ``at`` (the caller's index; not compared);
  ``forward_scan`` and ``backward_scan``: their positions among the top-level scans searched.
  """

  length: int
  forward_scan: int
  backward_scan: int
  forward: int = dataclasses.field(compare=False)
  backward: int = dataclasses.field(compare=False)


def _refuse(reason: str) -> NoLayerStackError:
  return NoLayerStackError(f"pipeline stages need the step's layers as one scan over stacked parameters: {reason}")


def find_layer_stack(sites: Sequence[ScanSite]) -> LayerStack:
  """``F`` and ``B`` among ``sites`` (the step's top-level scans, in program order), or NoLayerStackError."""
  sites = list(sites)
  candidates = [s for s in sites if any(s.per_example)]
  forwards = [s for s in candidates if s.carries_layers]
  if len(forwards) != 1:
    raise _refuse(f"found {len(forwards)} forward scans over stacked parameters with an activation carried "
                  "through them; one is needed")
  f = forwards[0]
  made = {w for w in f.writes if w is not None}
  backwards = [s for s in candidates if s.reverse and any(r in made for r in s.reads if r is not None)]
  if len(backwards) != 1:
    raise _refuse(f"found {len(backwards)} reversed scans reading the forward scan's results; its transpose is one")
  b = backwards[0]
  if b.length != f.length or b.num_carry != 1:
    raise _refuse("the reversed scan does not run once per layer with one carried cotangent")
  return LayerStack(f.length, sites.index(f), sites.index(b), f.at, b.at)


def sites_in_jaxpr(eqns: Sequence[Any], per_example: Callable[[int, int], bool]) -> list[ScanSite]:
  """The scans among the equations ``eqns`` of a flat jaxpr; ``per_example(i, j)``: whether operand ``j``
  of equation ``i`` carries the example axis. Variables are their own identities."""
  sites = []
  for i, eqn in enumerate(eqns):
    if jx.primitive_name(eqn) != "scan":
      continue
    parts = jx.scan_parts(eqn)
    reads = tuple(None if jx.is_literal(v) else v for v in eqn.invars)
    sites.append(ScanSite(i, parts.reverse, parts.length, parts.num_consts, parts.num_carry,
                          jx.phase(eqn) == "forward", reads, tuple(eqn.outvars),
                          tuple(per_example(i, j) for j in range(len(eqn.invars)))))
  return sites


def sites_in_traces(small: Graph, large: Graph) -> list[ScanSite]:
  """The top-level scans of a step traced at two batch sizes (``large`` at the larger); an operand whose
  shape differs between the traces carries the example axis. Graph values are the identities; a result
  that is one of the scan's own operands (passed through unchanged) or a literal has none."""
  if [(s.loop, s.length, len(s.operands)) for s in small.scans] != [
      (s.loop, s.length, len(s.operands)) for s in large.scans]:
    raise _refuse("the step's scans differ between its traces at two batch sizes")
  sites = []
  for a, s in zip(small.scans, large.scans):
    reads = tuple(None if r.source is Source.LITERAL else r for r in s.operands)
    writes = tuple(None if r.source is Source.LITERAL or r in s.operands else r for r in s.results)
    per_example = tuple(x.shape != y.shape for x, y in zip(a.operand_types, s.operand_types))
    sites.append(ScanSite(s.loop, s.reverse, s.length, s.num_consts, s.num_carry, s.phase == "forward", reads,
                          writes, per_example))
  return sites
