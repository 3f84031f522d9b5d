"""Layer rows between a ``stage``-sharded stack's even blocks and each stage's own uneven layers.

The state keeps a stacked leaf (layer parameters, their optimizer moments)
in ``S`` even blocks over ``stage``; a stage runs its own, uneven, layers.
:class:`Exchange` moves rows from blocks to stages before the ticks
(:meth:`Exchange.gather`) and the gradients' rows back after them
(:meth:`Exchange.scatter`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Exchange:
  """Moves layer rows between the even blocks a ``stage``-sharded stack is stored in (``length / S`` rows each)
  and each stage's own uneven layers (padded to the largest stage), with one ``ppermute`` per distance between
  a layer's owner and its user. Padding rows travel as zeros and are added, so every real row arrives exact."""

  layers: tuple[int, ...]
  axis: str

  @property
  def block(self) -> int:
    return sum(self.layers) // len(self.layers)

  def shifts(self):
    """Per distance ``d`` (owner ``t = s + d`` of rows stage ``s`` runs): rows sent, and per stage the
    owner's offset (indexed by the owner), the user's offset and count (indexed by the user)."""
    S, Q = len(self.layers), self.block
    starts = np.cumsum((0,) + self.layers[:-1])
    out = []
    for d in range(-(S - 1), S):
      src, dst, cnt = np.zeros(S, np.int32), np.zeros(S, np.int32), np.zeros(S, np.int32)
      for user in range(S):
        owner = user + d
        if not 0 <= owner < S:
          continue
        lo, hi = max(starts[user], owner * Q), min(starts[user] + self.layers[user], (owner + 1) * Q)
        if hi > lo:
          src[owner], dst[user], cnt[user] = lo - owner * Q, lo - starts[user], hi - lo
      if cnt.any():
        pairs = [(u + d, u) for u in range(S) if cnt[u]]
        out.append((d, int(cnt.max()), src, dst, cnt, pairs))
    return out

  def gather(self, block, stage):
    """This stage's layers, padded to ``max(layers)`` rows, from the blocks (``block``: this stage's)."""
    if jax.dtypes.issubdtype(block.dtype, jax.dtypes.prng_key):  # per-layer rng keys travel as their bits
      return jax.random.wrap_key_data(self.gather(jax.random.key_data(block), stage), impl=jax.random.key_impl(block))
    L = max(self.layers)
    shifts = self.shifts()
    extra = max(r for _, r, *_ in shifts)
    source = _pad_rows(block, extra)
    out = jnp.zeros((L + extra,) + block.shape[1:], block.dtype)
    for d, rows, src, dst, cnt, pairs in shifts:
      send = jax.lax.dynamic_slice_in_dim(source, jnp.asarray(src)[stage], rows, 0)
      recv = send if d == 0 else jax.lax.ppermute(send, self.axis, pairs)
      recv = _first_rows(recv, jnp.asarray(cnt)[stage])
      out = out + jax.lax.dynamic_update_slice_in_dim(jnp.zeros_like(out), recv, jnp.asarray(dst)[stage], 0)
    return out[:L]

  def scatter(self, padded, stage):
    """The inverse of :meth:`gather` for gradients: each stage's rows sent back to and added into their block."""
    Q = self.block
    shifts = self.shifts()
    extra = max(r for _, r, *_ in shifts)
    source = _pad_rows(padded, extra)
    out = jnp.zeros((Q + extra,) + padded.shape[1:], padded.dtype)
    for d, rows, src, dst, cnt, pairs in shifts:
      send = _first_rows(jax.lax.dynamic_slice_in_dim(source, jnp.asarray(dst)[stage], rows, 0), jnp.asarray(cnt)[stage])
      recv = send if d == 0 else jax.lax.ppermute(send, self.axis, [(b, a) for a, b in pairs])
      out = out + jax.lax.dynamic_update_slice_in_dim(jnp.zeros_like(out), recv, jnp.asarray(src)[stage], 0)
    return out[:Q]


def _pad_rows(x, extra: int):
  return jnp.concatenate([x, jnp.zeros((extra,) + x.shape[1:], x.dtype)])


def _first_rows(x, count):
  keep = (jnp.arange(x.shape[0]) < count).reshape((-1,) + (1,) * (x.ndim - 1))
  return jnp.where(keep, x, jnp.zeros_like(x))
