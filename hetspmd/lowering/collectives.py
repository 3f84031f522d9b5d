"""The reductions over ``data`` after the microbatch loop.

One ``psum`` per bucket of small leaves (:func:`bucketed_psum`, buckets by
:func:`hetspmd.plan.gradient_buckets.buckets`) and, under ZeRO, reduce-scatters onto the
shards (:func:`bucketed_psum_scatter`); :func:`reduce_over_data` applies them to
the cuts of a microbatch program, with gradients cast to a narrower dtype for the
wire where asked.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from hetspmd.plan.gradient_buckets import BUCKET_BYTES, SMALL_LEAF_BYTES, buckets


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


def reduce_over_data(partials, reduces, scatter_dims, axis, *, single, data_only, low=None, dtype="float32"):
  """Each partial (a list of arrays) reduced over ``axis`` with its ``reduces[k]`` (sum, max or min).

  Sums split along ``scatter_dims[k]`` are reduce-scattered there, the rest all-reduced (bucketed when
  ``data_only``); ``low[k][j]``: output ``j`` of partial ``k`` crosses the wire in ``dtype``.
  """
  if single:
    return partials
  if low is not None and any(any(lo) for lo in low):
    narrow = [[x.astype(dtype) if lo else x for x, lo in zip(part, los)] for part, los in zip(partials, low)]
    reduced = _manual_everywhere(lambda xs: reduce_over_data(xs, reduces, scatter_dims, axis, single=single, data_only=data_only),
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
