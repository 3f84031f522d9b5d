"""Steps written for ``pmap``: their collectives over a named axis, read as collectives over the global batch.

Flax code from before ``jit`` with shardings runs its step under
``jax.pmap(train_step, axis_name='batch')`` and says "over every replica"
with collectives over that name: ``lax.pmean(grads, 'batch')``, the
metrics' ``pmean``, ``nn.BatchNorm(axis_name='batch')``,
``dynamic_scale.value_and_grad(..., axis_name='batch')``. Traced alone,
such a step fails: nothing binds the name.

hetspmd traces it as the one replica of a pool that holds the whole global
batch: the step runs under ``jax.vmap(..., axis_name=name, axis_size=1)``
with nothing mapped. There ``psum`` and ``pmean`` over the name are the
identity, a ``BatchNorm`` over the name normalises over the global batch,
``lax.axis_size(name)`` is 1 and ``lax.axis_index(name)`` is 0, and the
jaxpr that results holds no collective at all: the microbatch analysis
sees a plain single-device step, and any plan, weighted counts included,
splits it as it splits any other. The reference it matches is the same
step run by ``jax.vmap(step, in_axes=(None, 0), axis_name='batch')`` over a
leading axis of size 1: one replica, the global batch.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax

from hetspmd.errors import InvalidValueError
from hetspmd.passes import _jax_adapter as jx

# A step binds at most this many names of its own; more means the error is not about a missing binding.
_MAX_NAMES = 8


def axis_names(value: Any) -> tuple[str, ...] | None:
  """``parallelize(..., axis_name=...)`` as a tuple of names (``None``: found from the step when it is traced)."""
  if value is None:
    return None
  names = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (tuple, list)) else None
  if names is None or not all(isinstance(n, str) and n for n in names):
    raise InvalidValueError(f"axis_name must be the step's collective axis name (a string such as 'batch') or a "
                            f"tuple of them, got {value!r}")
  return names


def bind(fn: Callable[..., Any], names: Sequence[str]) -> Callable[..., Any]:
  """``fn`` with each axis of ``names`` bound at size 1 around it, nothing mapped: its collectives over them are
  identities and its outputs come back as they are."""
  for name in reversed(tuple(names)):
    fn = jax.vmap(fn, in_axes=None, out_axes=None, axis_name=name, axis_size=1)
  return fn


def free_names(fn: Callable[..., Any], *args: Any, known: Sequence[str] = ()) -> tuple[str, ...]:
  """The axis names ``fn(*args)`` runs collectives over that nothing binds (beyond ``known``), found by
  abstract traces (nothing runs)."""
  names = tuple(known)
  for _ in range(_MAX_NAMES):
    try:
      jax.eval_shape(bind(fn, names), *args)
      return names
    except NameError as error:
      name = jx.unbound_axis_name(error)
      if name is None or name in names:
        raise
      names += (name,)
  return names


def binding(fn: Callable[..., Any], names: tuple[str, ...] | None,
            found: Callable[[tuple[str, ...]], None] = lambda names: None) -> Callable[..., Any]:
  """``fn`` with its collective axis names bound. ``names=None``: the names are found on the first call, by one
  extra abstract trace, kept for the calls after it and handed to ``found``."""
  known = [names]

  @functools.wraps(fn)
  def bound(*args: Any) -> Any:
    chosen = known[0]
    if chosen is None:
      chosen = known[0] = free_names(fn, *args)
      found(chosen)
    if not chosen:
      return fn(*args)
    try:
      return bind(fn, chosen)(*args)
    except NameError as error:
      other = jx.unbound_axis_name(error)
      if other is None:
        raise
      raise InvalidValueError(f"the step runs a collective over the axis name {other!r}, which "
                              f"parallelize(axis_name={chosen if len(chosen) > 1 else chosen[0]!r}) does not "
                              f"name: pass axis_name={(*chosen, other)!r}, or leave axis_name out to take the "
                              "names from the step") from None

  return bound
