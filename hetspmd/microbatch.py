"""Gradient accumulation over per-device microbatch counts.

``hetspmd.value_and_grad`` is a drop-in for ``jax.value_and_grad`` that
marks where one microbatch's gradient is computed. Outside a
``hetspmd.parallelize`` step it behaves like the JAX function. Inside one,
the runtime has replaced the step's batch by a padded buffer of microbatches
(``[data positions * max count, microbatch, ...]``) and a per-position count;
the call then becomes a ``shard_map`` that is manual over the ``data`` axis
only and, on every device, runs ``fori_loop(0, count_i, ...)`` over its own
microbatches, accumulating the loss numerator, its normaliser, the gradients
and the metrics. One ``psum`` over ``data`` after the loop (small leaves
concatenated into buckets: :func:`bucketed_psum`; under ZeRO, gradients
whose state is split along ``data`` are reduce-scattered onto that split
instead: :func:`bucketed_psum_scatter`) and one division
give exactly the single-device result: work is proportional to ``count_i``,
so a slow device really does less. The model axis stays with XLA's automatic
partitioner inside the loop (its groups share one count).

A loss is either a scalar, the mean over the microbatch's examples, or
``hetspmd.weighted(total, weight)`` (e.g. a token-masked sum and the number of
tokens): then the result is the global total over the global weight, as on
one device. Auxiliary metrics are reduced the same way: plain values as
example means, ``weighted`` values as ratios of sums.
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
from hetspmd.errors import HetSpmdError


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


@dataclasses.dataclass(frozen=True)
class _StepContext:
  """What the runtime tells ``value_and_grad`` while tracing a step."""

  mesh: Any
  data_axis: str
  batch_leaf_ids: frozenset[int]
  counts: Any  # int32[data positions], sharded over the data axis
  microbatch: int
  remat: str  # plan remat policy: one of hetspmd.plan.REMAT_POLICIES
  buffer_dims: tuple[int, int]  # leading dims of every batch buffer: (positions * max_count, microbatch)
  lockstep: bool  # every position runs max_count microbatches, padding masked
  uniform_count: int | None  # every position has this many microbatches (no padding): a static loop
  calls: list  # appended to on every use, so the runtime can tell it happened
  global_examples: int = 0  # examples per step over all positions (0: unknown)
  # (path, shape, dim) of the state leaves split along data (ZeRO): gradients that mirror one are reduce-scattered
  data_split: tuple[tuple[str, tuple[int, ...], int], ...] = ()


_ACTIVE: contextvars.ContextVar[_StepContext | None] = contextvars.ContextVar("hetspmd_step", default=None)


@contextlib.contextmanager
def step_context(ctx: _StepContext):
  token = _ACTIVE.set(ctx)
  try:
    yield ctx
  finally:
    _ACTIVE.reset(token)


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
  """Like ``jax.value_and_grad``; inside a parallelized step, accumulates over microbatches.

  ``fun`` returns a scalar mean loss or ``hetspmd.weighted(total, weight)``
  (with ``has_aux``, a pair ``(loss, aux)``). The batch must reach ``fun`` as
  an argument (not a closure), so that each microbatch can be sliced from it.
  """

  def wrapped(*args, **kwargs):
    ctx = _ACTIVE.get()
    if ctx is None:
      return _single_device(fun, argnums, has_aux, args, kwargs)
    ctx.calls.append(getattr(fun, "__name__", "loss"))
    return _accumulate(ctx, fun, argnums, has_aux, args, kwargs)

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


# --- inside a parallelized step -------------------------------------------------


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _accumulate(ctx: _StepContext, fun, argnums, has_aux, args, kwargs):
  flat, treedef = jax.tree.flatten((args, kwargs))
  is_batch = [id(x) in ctx.batch_leaf_ids for x in flat]
  buffer_dims = ctx.buffer_dims
  derived = [i for i, x in enumerate(flat) if not is_batch[i] and _is_array(x) and tuple(np.shape(x)[:2]) == buffer_dims]
  if derived or not any(is_batch):
    raise HetSpmdError(
        f"hetspmd.value_and_grad({getattr(fun, '__name__', 'fn')}) must receive the step's batch arrays unchanged, "
        "as arguments: "
        + ("it got arrays computed from them; move that computation into the loss function"
           if derived else "it got none of them; pass the batch to the loss function instead of closing over it"))
  # Python floats may be differentiated: make them arrays so they become varying like the rest.
  flat = [jnp.asarray(x) if isinstance(x, float) and not is_batch[i] else x for i, x in enumerate(flat)]
  positions = [i for i, b in enumerate(is_batch) if not b and _is_array(flat[i])]
  batch_positions = [i for i, b in enumerate(is_batch) if b]
  static = {i: x for i, x in enumerate(flat) if not is_batch[i] and not _is_array(flat[i])}
  axis = ctx.data_axis
  # Over a data axis of one position the reduction is the identity; XLA's
  # partitioner also rejects an all-reduce over a manual axis of size 1.
  single = ctx.mesh.shape[axis] == 1

  data_only = ctx.mesh.size == ctx.mesh.shape[axis]  # every leaf is whole on each device
  # Data parallel only, a gradient whose optimizer state (ZeRO-1) or parameter (ZeRO-3) is split
  # along data leaves the loop reduce-scattered onto that split, so the update runs on shards
  # without a full all-reduce first: ZeRO then moves one all-reduce's bytes per step
  # (reduce-scatter and the parameters' all-gather), not one and a half. With a model axis XLA
  # would gather each model-split gradient before scattering it, so there it is all-reduced.
  dims = [scatter_dim(path, shape, ctx.data_split) if data_only and not single else None
          for path, shape in _grad_leaves(flat, treedef, argnums)]

  def reduce(acc):
    if single:
      return acc
    leaves, tree = jax.tree.flatten(acc)
    split = dict(zip(range(len(leaves) - len(dims), len(leaves)), dims))  # gradients flatten last
    whole = [i for i in range(len(leaves)) if split.get(i) is None]
    scattered = [i for i in range(len(leaves)) if split.get(i) is not None]
    out = [None] * len(leaves)
    if data_only:
      summed = bucketed_psum([leaves[i] for i in whole], axis)
    else:  # leaves split over the model axis would be gathered to be concatenated
      summed = jax.lax.psum([leaves[i] for i in whole], axis)
    parts = bucketed_psum_scatter([leaves[i] for i in scattered], [split[i] for i in scattered], axis)
    for i, x in zip(whole + scattered, list(summed) + list(parts)):
      out[i] = x
    return jax.tree.unflatten(tree, out)
  vary = (lambda x: x) if single else (lambda x: jax.lax.pcast(x, (axis,), to="varying"))
  loss_fun = _rematted(fun, ctx.remat)
  share = ctx.microbatch / ctx.global_examples if ctx.global_examples else None
  kinds: list[bool] = []
  objective = _objective(loss_fun, has_aux, ctx.microbatch, share, kinds)
  vg = jax.value_and_grad(objective, argnums, has_aux=True)

  def rebuild(arrays, microbatch):
    leaves = [None] * len(flat)
    for i, x in static.items():
      leaves[i] = x
    for i, x in zip(positions, arrays):
      leaves[i] = x
    for i, x in zip(batch_positions, microbatch):
      leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)

  def per_device(arrays, buffers, counts):
    # Replicated inputs become varying before the loop: otherwise their
    # gradients carry an implicit psum, which deadlocks when trip counts differ.
    arrays = [vary(x) for x in arrays]

    def one(i):
      microbatch = [jax.lax.dynamic_index_in_dim(b, i, 0, keepdims=False) for b in buffers]
      a, kw = rebuild(arrays, microbatch)
      (total, (weight, aux_t, aux_w)), grads = vg(*a, **kw)
      return _widen((total, weight, aux_t, aux_w, grads))

    if ctx.uniform_count == 1:
      return reduce(one(0))
    zeros = jax.tree.map(lambda s: vary(jnp.zeros(s.shape, s.dtype)), jax.eval_shape(one, 0))
    if ctx.uniform_count is not None:
      acc = jax.lax.fori_loop(0, ctx.uniform_count, lambda i, acc: jax.tree.map(jnp.add, acc, one(i)), zeros)
    elif ctx.lockstep:
      # Same trip count everywhere (collectives inside stay matched); padded
      # microbatches contribute exact zeros.
      def body(i, acc):
        valid = i < counts[0]
        return jax.tree.map(lambda a, x: a + jnp.where(valid, x, jnp.zeros_like(x)), acc, one(i))

      acc = jax.lax.fori_loop(0, buffers[0].shape[0], body, zeros)
    else:
      acc = jax.lax.fori_loop(0, counts[0], lambda i, acc: jax.tree.map(jnp.add, acc, one(i)), zeros)
    return reduce(acc)

  # One data position needs no manual axis: the loop runs as it is, the model axis left to XLA.
  grad_specs = jax.tree.unflatten(_grad_treedef(flat, treedef, argnums),
                                  [P() if d is None else P(*([None] * d), axis) for d in dims])
  sharded = per_device if single else jax.shard_map(
      per_device, mesh=ctx.mesh, in_specs=(P(), P(axis), P(axis)), out_specs=(P(), P(), P(), P(), grad_specs),
      axis_names={axis})
  arrays = [flat[i] for i in positions]
  buffers = [flat[i] for i in batch_positions]
  total, weight, aux_t, aux_w, grads = sharded(arrays, buffers, ctx.counts)
  normalised = share is not None and not any(kinds)
  return _finish(total, weight, aux_t, aux_w, grads, has_aux, _grad_dtypes(flat, treedef, argnums), normalised)


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
  """``fun`` under the plan's remat policy (see :data:`hetspmd.plan.REMAT_POLICIES`)."""
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
