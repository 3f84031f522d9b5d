"""``hetspmd.value_and_grad``, ``hetspmd.grad`` and ``hetspmd.weighted``: what a step may say about its loss.

A train step needs nothing from hetspmd: :func:`hetspmd.parallelize` derives
the microbatch program from the step's jaxpr (:mod:`hetspmd.passes.batch_axis.analysis`,
:mod:`hetspmd.lowering.weighted`). :func:`value_and_grad` is a thin layer over
``jax.value_and_grad`` for steps that want to say more: its loss may be
``hetspmd.weighted(total, weight)`` (a token-masked sum and the number of
tokens), reduced as ``total / weight`` over the global batch, and inside a
parallelized step it checkpoints the loss under the plan's remat policy.
Auxiliary metrics are reduced the same way: plain values as example means,
``weighted`` values as ratios of sums.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hetspmd._dtypes import wide
from hetspmd._pytree import leaves_with_paths
from hetspmd.passes import _jax_adapter as jx


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Weighted:
  """A loss or metric given as ``total / weight``, to be reduced as sums."""

  total: Any
  weight: Any


def weighted(total: Any, weight: Any) -> Weighted:
  """Marks a loss (or metric) as ``total / weight`` with a data-dependent weight."""
  return Weighted(total, weight)


def _is_weighted(x: Any) -> bool:
  return isinstance(x, Weighted)


# A policy of the runtime's own, not a plan's: checkpointed, every residual saved. It recomputes nothing, as
# "none" does, but cuts the backward pass where the other policies do (group programs under several policies
# must line up their sums).
SAVED = "saved"

# The plan's remat policy while parallelize() traces a step (see hetspmd.plan.options.REMAT_POLICIES).
_REMAT: contextvars.ContextVar[str] = contextvars.ContextVar("hetspmd_remat", default="none")


# While set: every hetspmd.value_and_grad call appends its function's name (the runtime asks whether a
# step can apply a remat policy).
_CALLS: contextvars.ContextVar[list | None] = contextvars.ContextVar("hetspmd_calls", default=None)


@contextlib.contextmanager
def recording_calls():
  """Within: the names of the functions :func:`value_and_grad` differentiates, in a list it yields."""
  calls: list = []
  token = _CALLS.set(calls)
  try:
    yield calls
  finally:
    _CALLS.reset(token)


@contextlib.contextmanager
def remat_policy(policy: str):
  """Within: :func:`value_and_grad` checkpoints its loss under ``policy``."""
  token = _REMAT.set(policy)
  try:
    with jx.trace_key(f"remat={policy}"):  # a jitted step traced under another policy is traced again
      yield policy
  finally:
    _REMAT.reset(token)


# --- the objective: (numerator, normaliser, metric sums) -------------------------


def _objective(fun: Callable[..., Any], has_aux: bool, examples: int, share: float | None = None,
               kinds: list | None = None) -> Callable[..., Any]:
  """``fun`` → ``args -> (total, (weight, aux_totals, aux_weights))``.

  A plain (mean) loss counts ``examples``; with ``share`` (the microbatch's
  share of the step's examples, known when tracing) it is scaled by it
  instead, so that the summed gradients are already the step's mean and need
  no division pass. Whether the loss was ``weighted`` is appended to
  ``kinds`` while tracing.
  """

  def objective(*args, **kwargs):
    out = fun(*args, **kwargs)
    loss, aux = out if has_aux else (out, None)
    if kinds is not None:
      kinds.append(_is_weighted(loss))
    if _is_weighted(loss):
      total, weight = wide(loss.total), wide(loss.weight)
    elif share is not None:
      total, weight = wide(loss) * share, jnp.float32(share)
    else:  # float32 at least, so that loss × examples cannot overflow float16
      total, weight = wide(loss) * examples, jnp.float32(examples)
    aux_totals, aux_weights = _split_aux(aux, examples)
    return total, (weight, aux_totals, aux_weights)

  return objective


def _split_aux(aux: Any, examples: int) -> tuple[Any, Any]:
  def totals(x):
    return x.total if _is_weighted(x) else jnp.asarray(x) * examples

  def weights(x):
    return jnp.asarray(x.weight, jnp.float32) if _is_weighted(x) else jnp.float32(examples)

  return (jax.tree.map(totals, aux, is_leaf=_is_weighted), jax.tree.map(weights, aux, is_leaf=_is_weighted))


def _finish(total, weight, aux_totals, aux_weights, grads, has_aux, *, grad_dtypes=None, normalised=False):
  """The step's loss, gradients (and aux); ``normalised``: total and gradients are already means."""
  if normalised:
    loss = total
  else:
    loss = total / weight
    grads = jax.tree.map(lambda g: g / weight, grads)  # divide in the accumulation dtype, then narrow
  if grad_dtypes is not None:
    grads = _narrow(grads, grad_dtypes)
  if has_aux:
    aux = jax.tree.map(lambda t, w: t / w, aux_totals, aux_weights)
    return (loss, aux), grads
  return loss, grads


def value_and_grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False
                   ) -> Callable[..., Any]:
  """Like ``jax.value_and_grad``; ``fun`` may return ``hetspmd.weighted(total, weight)``.

  ``fun`` returns a scalar mean loss or ``hetspmd.weighted(total, weight)``
  (with ``has_aux``, a pair ``(loss, aux)``); the value is the loss over the
  whole batch (``total / weight`` for a weighted one). Inside a parallelized
  step the loss is checkpointed under the plan's remat policy.
  """

  def wrapped(*args, **kwargs):
    calls = _CALLS.get()
    if calls is not None:
      calls.append(getattr(fun, "__name__", "loss"))
    return _single_device(_rematted(fun, _REMAT.get()), argnums, has_aux, args, kwargs)

  return wrapped


def grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable[..., Any]:
  """Like ``jax.grad``; see :func:`value_and_grad`."""
  vg = value_and_grad(fun, argnums, has_aux)

  def wrapped(*args, **kwargs):
    value, grads = vg(*args, **kwargs)
    return (grads, value[1]) if has_aux else grads

  return wrapped


def _examples_in(args: Any, kwargs: Any) -> int:
  leaves = [x for x in jax.tree.leaves((args, kwargs)) if getattr(x, "ndim", 0) >= 1]
  return int(leaves[0].shape[0]) if leaves else 1


def _single_device(fun, argnums, has_aux, args, kwargs):
  examples = _examples_in(args, kwargs)
  objective = _objective(fun, has_aux, examples)
  (total, (weight, aux_totals, aux_weights)), grads = jax.value_and_grad(objective, argnums, has_aux=True)(
      *args, **kwargs)
  flat, treedef = jax.tree.flatten((args, kwargs))
  return _finish(total, weight, aux_totals, aux_weights, grads, has_aux,
                 grad_dtypes=_grad_dtypes(flat, treedef, argnums))


def _differentiated(flat, treedef, argnums):
  args, _ = jax.tree.unflatten(treedef, flat)
  return args[argnums] if isinstance(argnums, int) else tuple(args[i] for i in argnums)


def _grad_leaves(flat, treedef, argnums) -> list[tuple[str, tuple[int, ...]]]:
  """``(path, shape)`` of every gradient leaf, in flattening order; paths within each differentiated argument."""
  differentiated = _differentiated(flat, treedef, argnums)
  parts = [differentiated] if isinstance(argnums, int) else list(differentiated)
  return [(path, tuple(np.shape(x))) for part in parts for path, x in leaves_with_paths(part)]


def _grad_treedef(flat, treedef, argnums):
  return jax.tree.structure(_differentiated(flat, treedef, argnums))


def _rematted(fun: Callable[..., Any], policy: str) -> Callable[..., Any]:
  """``fun`` under the plan's remat policy (see :data:`hetspmd.plan.options.REMAT_POLICIES`)."""
  if policy == "full":
    return jax.checkpoint(fun)
  if policy == "dots":
    return jax.checkpoint(fun, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
  if policy == "all_dots":
    return jax.checkpoint(fun, policy=jax.checkpoint_policies.dots_saveable)
  if policy == SAVED:  # "layers" is applied to the traced step, not here (hetspmd.passes.remat)
    return jax.checkpoint(fun, policy=jax.checkpoint_policies.everything_saveable)
  return fun


def _widen(tree: Any) -> Any:
  """Accumulate low-precision floats in float32."""
  return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating)
                      and jnp.finfo(x.dtype).bits < 32 else x, tree)


def _grad_dtypes(flat, treedef, argnums):
  return _differentiated([getattr(x, "dtype", None) for x in flat], treedef, argnums)


def _narrow(grads: Any, dtypes: Any) -> Any:
  return jax.tree.map(lambda g, d: g.astype(d) if d is not None else g, grads, dtypes)
