"""Readable pytree paths shared by the front end, plans and the runtime.

A path is the pytree keys joined by ``/``: ``params/h_0/attn/c_attn/kernel``.
The ``value`` attribute that NNX variables flatten through names nothing and
is dropped.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax


def key_name(key: Any) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_components(path: Sequence[Any]) -> tuple[str, ...]:
  parts = [key_name(k) for k in path]
  if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
    parts = parts[:-1]
  return tuple(parts)


def path_str(path: Sequence[Any]) -> str:
  return "/".join(path_components(path))


def leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
  """(path string, leaf) for every leaf of ``tree``, in flattening order."""
  return [(path_str(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]
