"""Roles of step inputs: parameter, optimizer state, batch, RNG key, other.

Inputs are named by a path of components: the argument's name from the
function signature (``state``, ``batch``; ``arg0`` when it has none) followed
by the pytree keys, joined with ``/``: ``state/params/h_0/attn/kernel``.

Explicit roles (``roles=`` in :func:`hetspmd.trace`) map either an argument
index or a path prefix to a role; the longest matching prefix wins over an
index. Without one, roles are inferred for the common
``train_step(state, batch)``:

1. key-typed arrays, or ``uint32`` leaves under ``rng``/``key``: ``rng``;
2. anything under ``opt_state`` (optax state, Flax ``TrainState``; also
   ``opt``, ``optimizer_state``, ``optim_state``) or held in an NNX
   ``OptState`` variable except the step counter: ``opt_state``;
3. the step counter (``step``): ``other``;
4. leaves under ``params`` or held in an ``nnx.Param``: ``param``;
5. other NNX variables (batch statistics, caches), and leaves under
   ``batch_stats``/``cache`` (Linen's collections as plain arrays): ``other``;
6. remaining floating leaves of the first argument of a multi-argument step:
   ``param``;
7. leaves of later arguments and keyword arguments: ``batch``;
8. everything else: ``other``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from hetspmd.errors import InvalidValueError
from hetspmd.passes.ir import Role


@dataclasses.dataclass(frozen=True, slots=True)
class Leaf:
  """One flattened step input before its role is known."""

  path: tuple[str, ...]
  argnum: int | None  # None for keyword arguments
  dtype: str
  variable_type: str | None  # NNX variable class holding the leaf, if any

  @property
  def path_str(self) -> str:
    return "/".join(self.path)


_COLLECTIONS = frozenset({"batch_stats", "cache"})  # Linen's non-parameter collections
_OPT_STATE_NAMES = frozenset({"opt_state", "opt", "optimizer_state", "optim_state"})
_RNG_NAMES = frozenset({"rng", "rngs", "key", "keys", "dropout_rng", "prng_key"})


def parse_role(value: Any, where: str) -> Role:
  try:
    return Role(value.value if isinstance(value, Role) else value)
  except ValueError:
    valid = ", ".join(r.value for r in Role)
    raise InvalidValueError(f"roles[{where!r}] = {value!r} is not a role; valid roles are {valid}") from None


def _split_prefix(prefix: str) -> tuple[str, ...]:
  return tuple(p for p in prefix.replace(".", "/").split("/") if p)


def assign_roles(leaves: Sequence[Leaf], num_args: int, roles: Mapping[int | str, Any] | None = None) -> tuple[Role, ...]:
  """The role of every leaf, from ``roles`` where given, else inferred."""
  explicit = _explicit_roles(leaves, roles or {})
  return tuple(explicit[i] if explicit[i] is not None else infer_role(leaf, num_args) for i, leaf in enumerate(leaves))


def _explicit_roles(leaves: Sequence[Leaf], roles: Mapping[int | str, Any]) -> list[Role | None]:
  out: list[Role | None] = [None] * len(leaves)
  best: list[int] = [-1] * len(leaves)  # length of the prefix that set it
  for key, value in roles.items():
    role = parse_role(value, str(key))
    matched = False
    for i, leaf in enumerate(leaves):
      if isinstance(key, int):
        hit, strength = leaf.argnum == key, 0
      else:
        prefix = _split_prefix(key)
        hit, strength = leaf.path[: len(prefix)] == prefix, len(prefix)
      if hit and strength > best[i]:
        out[i], best[i] = role, strength
      matched |= hit
    if not matched:
      sample = ", ".join(sorted({"/".join(l.path[:2]) for l in leaves})[:8])
      raise InvalidValueError(
          f"roles key {key!r} matches no input; give an argument index (0..{max(l.argnum or 0 for l in leaves)}) "
          f"or a path prefix such as: {sample}")
  return out


def infer_role(leaf: Leaf, num_args: int) -> Role:
  names = set(leaf.path)
  vtype = leaf.variable_type or ""
  if leaf.dtype.startswith("key<") or (leaf.dtype == "uint32" and names & _RNG_NAMES):
    return Role.RNG
  if leaf.path and leaf.path[-1] == "step" and not names & _OPT_STATE_NAMES:
    return Role.OTHER
  if names & _OPT_STATE_NAMES or vtype in ("OptState", "OptArray", "OptVariable"):
    return Role.OPT_STATE
  if "params" in names or vtype == "Param":
    return Role.PARAM
  if vtype or names & _COLLECTIONS:
    return Role.OTHER
  floating = leaf.dtype.startswith(("float", "bfloat"))
  if leaf.argnum == 0 and num_args > 1 and floating:
    return Role.PARAM
  if leaf.argnum is None or (leaf.argnum or 0) >= 1:
    return Role.BATCH
  return Role.OTHER
