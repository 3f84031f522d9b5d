"""``hetspmd.value_and_grad``, ``hetspmd.weighted`` and the gradient reductions over ``data``.

A train step needs nothing from hetspmd: :func:`hetspmd.parallelize` derives
the microbatch program from the step's jaxpr (:mod:`hetspmd.passes.batch_axis.analysis`,
:mod:`hetspmd.lowering.weighted`). :func:`value_and_grad` is a thin layer over
``jax.value_and_grad`` for steps that want to say more: its loss may be
``hetspmd.weighted(total, weight)`` (a token-masked sum and the number of
tokens), reduced as ``total / weight`` over the global batch, and inside a
parallelized step it checkpoints the loss under the plan's remat policy.
Auxiliary metrics are reduced the same way: plain values as example means,
``weighted`` values as ratios of sums.

The reductions over ``data`` after the microbatch loop live here too: one
``psum`` per bucket of small leaves (:func:`bucketed_psum`) and, under ZeRO,
reduce-scatters onto the shards (:func:`bucketed_psum_scatter`); :func:`reduce_over_data` applies them to
the cuts of a microbatch program, with gradients cast to a narrower dtype for the wire where asked.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from hetspmd._pytree import leaves_with_paths


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


# The plan's remat policy while parallelize() traces a step (see hetspmd.plan.value.REMAT_POLICIES).
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
      total, weight = _wide(loss.total), _wide(loss.weight)
    elif share is not None:
      total, weight = _wide(loss) * share, jnp.float32(share)
    else:  # float32 at least, so that loss × examples cannot overflow float16
      total, weight = _wide(loss) * examples, jnp.float32(examples)
    aux_totals, aux_weights = _split_aux(aux, examples)
    return total, (weight, aux_totals, aux_weights)

  return objective


def _wide(x: Any) -> Any:
  x = jnp.asarray(x)
  return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32 else x


def _split_aux(aux: Any, examples: int) -> tuple[Any, Any]:
  def totals(x):
    return x.total if _is_weighted(x) else jnp.asarray(x) * examples

  def weights(x):
    return jnp.asarray(x.weight, jnp.float32) if _is_weighted(x) else jnp.float32(examples)

  return (jax.tree.map(totals, aux, is_leaf=_is_weighted), jax.tree.map(weights, aux, is_leaf=_is_weighted))


def _finish(total, weight, aux_totals, aux_weights, grads, has_aux, grad_dtypes=None, normalised=False):
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
  return _finish(total, weight, aux_totals, aux_weights, grads, has_aux, _grad_dtypes(flat, treedef, argnums))


# Small leaves are reduced together, concatenated into buckets of at most
# BUCKET_BYTES: one all-reduce per bucket instead of one per leaf, as each
# all-reduce pays a fixed latency (about 0.25 ms on 8 CPU devices, tens of
# microseconds on GPUs) and a model has hundreds of small leaves (biases,
# norms). Leaves above SMALL_LEAF_BYTES are reduced on their own: copying them
# into and out of a bucket costs more than the latency it saves.
SMALL_LEAF_BYTES = 2**20
BUCKET_BYTES = 32 * 2**20


def bucketed_psum(tree: Any, axis: str, small: int = SMALL_LEAF_BYTES, bucket_bytes: int = BUCKET_BYTES) -> Any:
  """``jax.lax.psum(tree, axis)``, with small leaves of one dtype concatenated into buckets."""
  leaves, treedef = jax.tree.flatten(tree)
  out: list[Any] = [None] * len(leaves)
  sizes = [(jnp.result_type(x), int(np.size(x)) * jnp.result_type(x).itemsize) for x in leaves]
  for bucket in buckets(sizes, small, bucket_bytes):
    if len(bucket) == 1:
      out[bucket[0]] = jax.lax.psum(leaves[bucket[0]], axis)
      continue
    flat = jax.lax.psum(jnp.concatenate([jnp.ravel(leaves[i]) for i in bucket]), axis)
    offset = 0
    for i in bucket:
      size = int(np.size(leaves[i]))
      out[i] = flat[offset:offset + size].reshape(np.shape(leaves[i]))
      offset += size
  return jax.tree.unflatten(treedef, out)


def bucketed_psum_scatter(leaves: Sequence[Any], dims: Sequence[int], axis: str, small: int = SMALL_LEAF_BYTES,
                          bucket_bytes: int = BUCKET_BYTES) -> list[Any]:
  """``jax.lax.psum_scatter(leaf, axis, scatter_dimension=dim, tiled=True)`` for every leaf, small ones bucketed.

  A bucket lays each leaf out as ``[axis size, rest]`` (its scattered
  dimension first), concatenates the rows and scatters dimension 0 once;
  every position's block of a leaf is then a contiguous run of its row.
  """
  n = jax.lax.axis_size(axis)
  out: list[Any] = [None] * len(leaves)
  sizes = [(jnp.result_type(x), int(np.size(x)) * jnp.result_type(x).itemsize) for x in leaves]
  for bucket in buckets(sizes, small, bucket_bytes):
    if len(bucket) == 1:
      i = bucket[0]
      out[i] = jax.lax.psum_scatter(leaves[i], axis, scatter_dimension=dims[i], tiled=True)
      continue
    moved = [jnp.moveaxis(leaves[i], dims[i], 0) for i in bucket]
    rows = jax.lax.psum_scatter(jnp.concatenate([m.reshape(n, -1) for m in moved], axis=1), axis,
                                scatter_dimension=0, tiled=True)[0]
    offset = 0
    for i, m in zip(bucket, moved):
      block = (m.shape[0] // n,) + m.shape[1:]
      width = math.prod(block)
      out[i] = jnp.moveaxis(rows[offset:offset + width].reshape(block), 0, dims[i])
      offset += width
  return out


def scatter_dim(path: str, shape: tuple[int, ...], data_split: Sequence[tuple[str, tuple[int, ...], int]]
                ) -> int | None:
  """The dimension along which the gradient at ``path`` (relative to the differentiated argument) is scattered.

  That of the state leaf of the same shape whose path ends with ``path``
  and which is split along ``data`` (the optimizer state mirroring the
  parameter, or the parameter itself under ZeRO-3); ``None`` if there is
  none: the gradient is all-reduced whole.
  """
  for state_path, state_shape, dim in data_split:
    if state_shape == tuple(shape) and path and (state_path == path or state_path.endswith("/" + path)):
      return dim
  return None


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


def buckets(sizes: Sequence[tuple[Any, int]], small: int = SMALL_LEAF_BYTES, bucket_bytes: int = BUCKET_BYTES
            ) -> list[list[int]]:
  """How :func:`bucketed_psum` reduces leaves of ``(dtype, bytes)``: lists of leaf indices, one all-reduce each.

  A large leaf is reduced alone; small ones are grouped by dtype, in order,
  into runs of at most ``bucket_bytes``.
  """
  open_buckets: dict[Any, tuple[list[int], int]] = {}
  done: list[list[int]] = []
  for i, (dtype, nbytes) in enumerate(sizes):
    if nbytes > small:
      done.append([i])
      continue
    bucket, used = open_buckets.get(dtype, ([], 0))
    if bucket and used + nbytes > bucket_bytes:
      done.append(bucket)
      bucket, used = [], 0
    open_buckets[dtype] = (bucket + [i], used + nbytes)
  return done + [bucket for bucket, _ in open_buckets.values()]


def _rematted(fun: Callable[..., Any], policy: str) -> Callable[..., Any]:
  """``fun`` under the plan's remat policy (see :data:`hetspmd.plan.value.REMAT_POLICIES`)."""
  if policy == "full":
    return jax.checkpoint(fun)
  if policy == "dots":
    return jax.checkpoint(fun, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
  if policy == "all_dots":
    return jax.checkpoint(fun, policy=jax.checkpoint_policies.dots_saveable)
  return fun


def _widen(tree: Any) -> Any:
  """Accumulate low-precision floats in float32."""
  return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating)
                      and jnp.finfo(x.dtype).bits < 32 else x, tree)


def _grad_dtypes(flat, treedef, argnums):
  return _differentiated([getattr(x, "dtype", None) for x in flat], treedef, argnums)


def _narrow(grads: Any, dtypes: Any) -> Any:
  return jax.tree.map(lambda g, d: g.astype(d) if d is not None else g, grads, dtypes)


def reduce_over_data(partials, reduces, scatter_dims, axis, single, data_only, low=None, dtype="float32"):
  """Each partial (a list of arrays) reduced over ``axis`` with its ``reduces[k]`` (sum, max or min).

  Sums split along ``scatter_dims[k]`` are reduce-scattered there, the rest all-reduced (bucketed when
  ``data_only``); ``low[k][j]``: output ``j`` of partial ``k`` crosses the wire in ``dtype``.
  """
  if single:
    return partials
  if low is not None and any(any(lo) for lo in low):
    narrow = [[x.astype(dtype) if lo else x for x, lo in zip(part, los)] for part, los in zip(partials, low)]
    reduced = _manual_everywhere(lambda xs: reduce_over_data(xs, reduces, scatter_dims, axis, single, data_only),
                                 narrow, axis)
    return [[y.astype(x.dtype) for x, y in zip(part, out)] for part, out in zip(partials, reduced)]
  out: list = [None] * len(partials)
  sums = [k for k, r in enumerate(reduces) if r == "sum"]
  whole = [k for k in sums if scatter_dims[k] is None]
  flat = [x for k in whole for x in partials[k]]
  summed = bucketed_psum(flat, axis) if data_only else jax.lax.psum(flat, axis)
  it = iter(summed)
  for k in whole:
    out[k] = [next(it) for _ in partials[k]]
  split = [k for k in sums if scatter_dims[k] is not None]
  parts = bucketed_psum_scatter([partials[k][0] for k in split], [scatter_dims[k] for k in split], axis)
  for k, x in zip(split, parts):
    out[k] = [x]
  for k, r in enumerate(reduces):
    if r == "max":
      out[k] = [jax.lax.pmax(x, axis) for x in partials[k]]
    elif r == "min":
      out[k] = [jax.lax.pmin(x, axis) for x in partials[k]]
  return out


def _manual_everywhere(fn, values, axis):
  """``fn(values)`` with every mesh axis manual (the data-only meshes reduced precision runs on).

  XLA's CPU compiler widens a bfloat16 all-reduce to float32 by
  cloning its reduction, and fails (``Invalid binary instruction opcode
  copy``) on the copy that a partially manual ``shard_map`` puts there; a
  fully manual region has none.
  """
  mesh = jax.sharding.get_abstract_mesh()
  others = set(mesh.axis_names) - {axis}
  if not others:
    return fn(values)
  return jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), axis_names=others, check_vma=False)(values)
