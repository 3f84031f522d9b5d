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


def new_state_leaves(state: Any, out_tree: Any) -> dict[int, int]:
  """``{flat output: flat state leaf}`` of a step's outputs that are a new state: the step's outputs, or its first
  output, shaped like ``state`` (``out_tree``: the outputs' structure); empty where neither is."""
  outputs = jax.tree.unflatten(out_tree, list(range(out_tree.num_leaves)))
  structure = jax.tree.structure(state)
  new_state = (outputs if jax.tree.structure(outputs) == structure else outputs[0]
               if isinstance(outputs, tuple) and outputs and jax.tree.structure(outputs[0]) == structure else None)
  if new_state is None:
    return {}
  return dict(zip(jax.tree.leaves(new_state), range(structure.num_leaves)))
