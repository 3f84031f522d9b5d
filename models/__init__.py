"""The hetspmd model zoo (import as ``hetspmd.models``).

``names()`` lists the registered workloads; ``get(name)`` returns one
:class:`Workload`.
"""

from __future__ import annotations


from hetspmd.errors import UnknownNameError, closest
from hetspmd.models import bert, cnn, gpt2, gpt3, linen_lm, mlp, vit
from hetspmd.models.workload import Workload as Workload

_REGISTRY: dict[str, Workload] = {w.name: w for module in (mlp, gpt2, gpt3, bert, vit, cnn, linen_lm) for w in module.workloads()}


def names() -> list[str]:
  """Registered workload names, in registration order."""
  return list(_REGISTRY)


def test_names() -> list[str]:
  """Names of the small configs that tests compile and run."""
  return [name for name, w in _REGISTRY.items() if w.test_size]


def get(name: str) -> Workload:
  """The workload registered as ``name``."""
  try:
    return _REGISTRY[name]
  except KeyError:
    close = closest(name, names())
    raise UnknownNameError(f"unknown model {name!r}; known models: {', '.join(names())}"
                           + (f". Did you mean {close!r}?" if close else "")) from None


__all__ = ["Workload", "get", "names", "test_names"]
