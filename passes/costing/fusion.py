"""Memory traffic after XLA-style loop fusion.

A jaxpr lists every elementwise operation on its own; XLA fuses chains of
them (and the broadcasts, reshapes and converts between them) into one
kernel that reads its inputs once and writes only the values something
outside the kernel needs. Counting every jaxpr operation's operands and
results as memory traffic overstates memory-bound work several times over
(Adam's update is a dozen elementwise operations per parameter, one pass
over memory once fused).

:func:`fused_bytes` models producer–consumer fusion (with XLA's
multi-output fusion and duplication of cheap producers): a fusible
consumer (:data:`FUSIBLE` lists the primitives that can fuse) computes a
fusible producer's value in its own kernel unless the producer is a
reduction (a kernel root) or sits in another loop; nodes so joined form
one kernel. A kernel reads each value made outside it, and each step
input, once. A value is *materialized* (written to memory) when its
producer cannot fuse or is a reduction, when some consumer does not join
it, or when it is a step output. Nodes that cannot fuse keep their own
byte counts (``bytes_read + bytes_written`` from
:mod:`hetspmd.passes.costing.flops`).
"""

from __future__ import annotations

import numpy as np

from hetspmd.passes.costing.flops import ELEMENTWISE_PRIMITIVES
from hetspmd.passes.ir import Graph, Source

_SHAPE = frozenset({
    "reshape", "broadcast_in_dim", "squeeze", "expand_dims", "transpose", "slice", "concatenate",
    "pad", "rev", "iota", "copy", "copy_p", "stop_gradient", "pvary", "reduce_precision",
})
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"})
# Primitives a loop fusion can contain. Reductions fuse their producers but
# end a kernel: their result is always materialized.
FUSIBLE = ELEMENTWISE_PRIMITIVES | _SHAPE | REDUCTIONS


def _joins(producer, consumer) -> bool:
  """Whether ``consumer`` can compute ``producer``'s value inside its own kernel."""
  return (producer.primitive in FUSIBLE and producer.primitive not in REDUCTIONS
          and consumer.primitive in FUSIBLE and producer.loops == consumer.loops)


def materialized(graph: Graph) -> set[tuple[int, int]]:
  """``(node, output)`` pairs of values written to memory."""
  nodes = graph.nodes
  out: set[tuple[int, int]] = set()
  for o in graph.outputs:
    if o.source.source is Source.NODE:
      out.add((o.source.index, o.source.output))
  for node in nodes:
    if node.primitive not in FUSIBLE or node.primitive in REDUCTIONS:
      out.update((node.id, k) for k in range(len(node.outputs)))
    for ref in node.operands:
      if ref.source is Source.NODE and not _joins(nodes[ref.index], node):
        out.add((ref.index, ref.output))
  return out


def _find(parent: list[int], i: int) -> int:
  while parent[i] != i:
    parent[i] = parent[parent[i]]
    i = parent[i]
  return i


def kernels(graph: Graph) -> list[int]:
  """Per node, the id of a representative node of its kernel (fusible nodes joined by values)."""
  nodes = graph.nodes
  parent = list(range(len(nodes)))
  for node in nodes:
    for ref in node.operands:
      if ref.source is Source.NODE and _joins(nodes[ref.index], node):
        parent[_find(parent, node.id)] = _find(parent, ref.index)
  return [_find(parent, i) for i in range(len(nodes))]


def fused_traffic(graph: Graph) -> tuple[np.ndarray, np.ndarray]:
  """Bytes each node reads and writes per execution once fusible nodes are fused into kernels.

  A kernel reads each value made outside it (or a step input) once,
  attributed to the first of its nodes that reads it; it writes the
  materialized values its nodes make (a value can be both written, for a
  step output or a consumer that cannot fuse, and used inside the kernel).
  """
  nodes = graph.nodes
  kept = materialized(graph)
  kernel = kernels(graph)
  read: set[tuple[int, Source, int, int]] = set()
  reads, writes = np.zeros(len(nodes)), np.zeros(len(nodes))
  for node in nodes:
    if node.primitive not in FUSIBLE:
      reads[node.id], writes[node.id] = node.bytes_read, node.bytes_written
      continue
    k = kernel[node.id]
    for ref, t in zip(node.operands, node.inputs):
      if ref.source is Source.LITERAL or (ref.source is Source.NODE and kernel[ref.index] == k):
        continue
      key = (k, ref.source, ref.index, ref.output)
      if key not in read:
        read.add(key)
        reads[node.id] += t.nbytes
    writes[node.id] = sum(t.nbytes for j, t in enumerate(node.outputs) if (node.id, j) in kept)
  return reads, writes


def largest_written(graph: Graph) -> np.ndarray:
  """Per node, the bytes of the largest value it writes to memory per execution (0 when it writes none)."""
  kept = materialized(graph)
  return np.array([max((t.nbytes for j, t in enumerate(node.outputs) if (node.id, j) in kept), default=0)
                   for node in graph.nodes], float)


def fused_bytes(graph: Graph) -> np.ndarray:
  """Bytes each node moves (reads and writes) per execution after fusion; see :func:`fused_traffic`."""
  reads, writes = fused_traffic(graph)
  return reads + writes
