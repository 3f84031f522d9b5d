"""One data-flow index over a program's equations: who reads each variable, which outputs it is, and labels
carried forward through the equations.

Every walk over the step's data flow that the group lowering needs (which optimizer-state leaves an output
reads, which outputs a partial sum reaches, where a parameter is read only through a cast) is one of these:
:func:`labels_forward` carries sets of labels from seed variables through chosen equations in order (an
equation's outputs get the union of its inputs' labels), and :class:`DataFlow` answers "who reads this" and
"which outputs is this". Built once per :class:`hetspmd.lowering.program.Program` (``prog.flow``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping, Sequence

from hetspmd.passes import _jax_adapter as jx


@dataclasses.dataclass(frozen=True)
class DataFlow:
  """``readers``: ``{var: equation indices that read it, in order}``; ``outputs``: ``{var: the flat outputs that
  are it}`` (literals are in neither)."""

  readers: Mapping[Any, tuple[int, ...]]
  outputs: Mapping[Any, tuple[int, ...]]

  @classmethod
  def of(cls, eqns: Sequence[Any], outvars: Sequence[Any]) -> "DataFlow":
    readers: dict[Any, list[int]] = {}
    for k, eqn in enumerate(eqns):
      for v in dict.fromkeys(v for v in eqn.invars if not jx.is_literal(v)):
        readers.setdefault(v, []).append(k)
    outputs: dict[Any, list[int]] = {}
    for o, v in enumerate(outvars):
      if not jx.is_literal(v):
        outputs.setdefault(v, []).append(o)
    return cls({v: tuple(ks) for v, ks in readers.items()}, {v: tuple(os) for v, os in outputs.items()})

  def outputs_of(self, labels: Mapping[Any, frozenset], n_outputs: int) -> list[frozenset]:
    """Per flat output (of ``n_outputs``): the labels its variable carries (``labels``: from
    :func:`labels_forward`)."""
    out = [frozenset()] * n_outputs
    for v, os in self.outputs.items():
      for o in os:
        out[o] = labels.get(v, frozenset())
    return out


def labels_forward(eqns: Sequence[Any], seeds: Mapping[Any, frozenset], order: Iterable[int], *,
                   keep: Callable[[int, Any, Any], bool] | None = None) -> dict[Any, frozenset]:
  """``{var: labels}``: ``seeds`` carried through the equations ``order`` names, in that order, each output of an
  equation getting (besides its own seed) the union of its inputs' labels; ``keep(k, input, output)``, where
  given, says whether an input's labels pass to an output of equation ``k``."""
  labels = dict(seeds)
  for k in order:
    eqn = eqns[k]
    ins = [v for v in eqn.invars if not jx.is_literal(v) and v in labels]
    if not ins:
      continue
    for w in eqn.outvars:
      read = frozenset().union(*[labels[v] for v in ins if keep is None or keep(k, v, w)])
      if read:
        labels[w] = labels.get(w, frozenset()) | read
  return labels
