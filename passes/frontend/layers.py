"""Layer grouping: nodes grouped by Flax module path, repeats marked.

A layer is every node (forward, backward and any optimizer work recorded under
the scope) whose module path is the same, in graph order. Nodes outside any
scope form the layer named :data:`TOP_LEVEL`. Two layers repeat one another
when their node sequences have the same structure (:meth:`Node.signature`):
the later one's ``repeat_of`` names the first, so a search can solve one
representative and reuse its answer for every repeat.
"""

from __future__ import annotations

from typing import Sequence

from hetspmd.passes.ir import Layer, Node, totals

TOP_LEVEL = "(top)"


def group_layers(nodes: Sequence[Node]) -> tuple[Layer, ...]:
  members: dict[str, list[Node]] = {}
  for node in nodes:
    members.setdefault(node.module_path or TOP_LEVEL, []).append(node)
  first_with: dict[tuple, str] = {}
  layers = []
  for name, group in members.items():
    signature = tuple(n.signature() for n in group)
    repeat_of = first_with.setdefault(signature, name)
    flops, trans, nbytes = totals(group)
    layers.append(Layer(
        name=name,
        node_ids=tuple(n.id for n in group),
        flops=flops,
        transcendentals=trans,
        bytes=nbytes,
        repeat_of=None if repeat_of == name else repeat_of,
    ))
  return tuple(layers)
