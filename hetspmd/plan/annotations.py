"""Sharding annotations already written in a model: Flax NNX and Linen.

Users of MaxText, t5x or Flax NNX annotate parameters with names:
``nnx.with_partitioning(init, (None, "model"))`` (mesh axes) or Linen's
``nn.with_logical_partitioning(init, ("embed", "mlp"))`` (logical axes,
mapped to mesh axes by rules such as ``(("mlp", "model"), ("embed",
None))``). :func:`annotated_specs` reads them into ``{path: spec}`` over
mesh axes, the form plans use; ``plan_for(..., specs=...)`` and
``parallelize(..., specs=...)`` then keep them for the annotated leaves and
let hetspmd choose the rest.

Paths match state leaves by suffix, so specs read from a model's parameters
(``h_0/mlp/kernel``) also apply to ``params/h_0/mlp/kernel`` and to the
optimizer state that mirrors it (``opt_state/0/mu/h_0/mlp/kernel``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax

from hetspmd._pytree import path_str
from hetspmd.errors import InvalidValueError

Rules = Sequence[tuple[str, Any]]
_SHARDING_KEYS = ("out_sharding", "sharding_names", "sharding")


def _is_annotated(x: Any) -> bool:
  from flax import nnx
  from flax.core import meta

  return isinstance(x, (nnx.Variable, meta.Partitioned))


def _names(leaf: Any) -> tuple[Any, ...] | None:
  """The names a leaf is annotated with (mesh or logical), or None."""
  from flax import nnx

  if isinstance(leaf, nnx.Variable):
    metadata = leaf.get_metadata()
    for key in _SHARDING_KEYS:
      if metadata.get(key) is not None:
        return tuple(metadata[key])
    return None
  names = getattr(leaf, "names", None)
  return tuple(names) if names is not None else None


def _shape(leaf: Any) -> tuple[int, ...]:
  from flax import nnx

  value = leaf.get_value() if isinstance(leaf, nnx.Variable) else getattr(leaf, "value", leaf)
  return tuple(getattr(value, "shape", ()))


def _to_mesh(names: tuple[Any, ...], rules: Rules | None, where: str) -> tuple[Any, ...]:
  if rules is None:
    return names
  table = {}
  for rule in rules:
    if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
      raise InvalidValueError(f"a logical axis rule is a (logical name, mesh axis or None) pair, got {rule!r}")
    table.setdefault(rule[0], rule[1])  # the first rule for a name wins, as in flax
  out = []
  for name in names:
    if name is None:
      out.append(None)
    elif name not in table:
      raise InvalidValueError(f"{where}: logical axis {name!r} has no rule; rules cover {sorted(table)}")
    else:
      out.append(table[name])
  return tuple(out)


def annotated_specs(tree: Any, rules: Rules | None = None) -> dict[str, tuple[Any, ...]]:
  """``{path: mesh-axis spec}`` for every annotated leaf of ``tree``.

  Args:
    tree: NNX state or module parameters (``nnx.state(model, nnx.Param)``,
      variables carrying ``out_sharding`` metadata from
      ``nnx.with_partitioning``), or Linen boxed parameters
      (``nn.Partitioned`` / ``nn.LogicallyPartitioned`` from
      ``model.init`` before ``nn.unbox``).
    rules: logical-to-mesh axis rules, ``[(logical, mesh axis or None),
      ...]``; without them, names are taken to be mesh axes already.

  Leaves without annotations are left out: the planner decides them.
  """
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_annotated)[0]
  specs = {}
  for path, leaf in flat:
    names = _names(leaf) if _is_annotated(leaf) else None
    if names is None:
      continue
    where = path_str(path)
    spec = _to_mesh(names, rules, where)
    shape = _shape(leaf)
    if len(spec) > len(shape):
      raise InvalidValueError(f"{where}: annotation {names} names more dimensions than the leaf's shape {shape}")
    specs[where] = spec
  return specs


def match(path: str, rank: int, specs: Mapping[str, Sequence[Any]]) -> tuple[Any, ...] | None:
  """The spec of the longest key of ``specs`` that is a suffix of ``path`` (by component)."""
  best = None
  for key, spec in specs.items():
    key = key.strip("/")
    if (path == key or path.endswith("/" + key)) and len(spec) <= rank:
      if best is None or len(key) > len(best[0]):
        best = (key, tuple(spec))
  return None if best is None else best[1]


def check_axes(specs: Mapping[str, Sequence[Any]], axis_names: Sequence[str]) -> None:
  """Raises if a spec names a mesh axis the plan does not have."""
  for path, spec in specs.items():
    for entry in spec:
      for axis in (entry,) if isinstance(entry, str) else (entry or ()):
        if axis not in axis_names:
          raise InvalidValueError(
              f"the spec for {path!r} ({tuple(spec)}) names mesh axis {axis!r}; the plan's axes are "
              f"{tuple(axis_names)}. Map logical names with rules: annotated_specs(tree, rules=[({axis!r}, "
              f"'model'), ...])")
