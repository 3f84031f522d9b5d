"""Gradient buckets: which leaves share one collective over ``data``.

The one rule that both the planner's communication cost
(:mod:`hetspmd.planner.data_axis`) and the lowering's reductions
(:mod:`hetspmd.lowering.collectives`) follow, so that what is priced is what runs.
"""

from __future__ import annotations

from typing import Any, Sequence

# Small leaves are reduced together, concatenated into buckets of at most
# BUCKET_BYTES: one all-reduce per bucket instead of one per leaf, as each
# all-reduce pays a fixed latency (about 0.25 ms on 8 CPU devices, tens of
# microseconds on GPUs) and a model has hundreds of small leaves (biases,
# norms). Leaves above SMALL_LEAF_BYTES are reduced on their own: copying them
# into and out of a bucket costs more than the latency it saves.
SMALL_LEAF_BYTES = 2**20
BUCKET_BYTES = 32 * 2**20


def buckets(sizes: Sequence[tuple[Any, int]], small: int = SMALL_LEAF_BYTES, bucket_bytes: int = BUCKET_BYTES
            ) -> list[list[int]]:
  """How :func:`hetspmd.lowering.collectives.bucketed_psum` reduces leaves of ``(dtype, bytes)``: lists of leaf indices, one all-reduce each.

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
