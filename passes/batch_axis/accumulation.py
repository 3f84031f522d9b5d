"""A ``fori_loop`` accumulation over slices of the batch, rewritten as a ``scan`` over its chunks.

A step that accumulates gradients itself often loops ``for i in range(k)``
with ``lax.fori_loop`` and cuts microbatch ``i`` out of the whole batch
inside the body: ``lax.dynamic_slice_in_dim(x, i * m, m)`` (or ``x[i * m:
(i + 1) * m]`` with a traced ``i``). With a static trip count JAX lowers the
loop to a ``scan`` whose carry holds the counter and whose constants hold
the batch. This pass rewrites such a scan into the form
``lax.scan(body, carry, batch.reshape(k, m, ...))`` takes: the batch arrays
become scanned inputs of shape ``(k, m, ...)``, each slice is the step's
chunk, and the counter (read by nothing but the slices' starts) is dropped.
The analysis (:mod:`hetspmd.passes.batch_axis.analysis`) then reads the loop
as any accumulation loop over chunks. The rewrite is exact: it checks, by
evaluating the start for every ``i``, that slice ``i`` is chunk ``i``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from hetspmd.passes import _jax_adapter as jx


@dataclasses.dataclass(frozen=True)
class _Loop:
  """What the rewrite of one scan needs: the counter carry, the sliced constants, and the body equations that
  only serve the counter (its increment, the slices' starts) or are the slices."""

  counter: int          # carry position of the counter
  sliced: tuple         # const positions whose only use is the chunk slices
  slices: dict          # body var made by a slice -> const position
  skipped: frozenset    # ids of body equations dropped by the rewrite


def rewrite(closed: Any, global_batch: int) -> Any:
  """``closed`` with every top-level counted loop over chunks of the batch (see the module docstring) written as a
  scan over the chunks; the same closed jaxpr if it has none."""
  eqns = jx.equations(closed)
  read = jx.read_vars(closed)
  found = {id(e): loop for e in eqns if jx.primitive_name(e) == "scan"
           for loop in [_counted_chunks(e, global_batch, read)] if loop is not None}
  if not found:
    return closed

  def over_chunks(eqn, env):
    return _scan_over_chunks(eqn, found[id(eqn)], [jx.read(env, v) for v in eqn.invars])

  return jx.retraced(closed, {key: over_chunks for key in found})


def _counted_chunks(eqn, global_batch: int, read: frozenset) -> _Loop | None:
  """The counted loop over chunks of the batch that ``eqn`` (a scan) is, or None; ``read``: the variables of the
  program that something reads (the counter's final value must not be)."""
  parts = jx.scan_parts(eqn)
  body, nc, nk, k = parts.body, parts.num_consts, parts.num_carry, parts.length
  if parts.reverse or k < 2 or global_batch % k:
    return None
  invars, outvars, beqns = jx.invars(body), jx.outvars(body), jx.equations(body)
  counters = [i for i in range(nk) if jx.literal_int(eqn.invars[nc + i]) == 0 and eqn.outvars[i] not in read
              and jx.increments_by_one(body, invars[nc + i], outvars[i])]
  chunk = global_batch // k
  for i in counters:
    counter = invars[nc + i]
    derived, computing = _derived(beqns, counter)
    slices = {}
    for e in beqns:
      if jx.primitive_name(e) != "dynamic_slice" or e.invars[1] not in derived:
        continue
      j = invars.index(e.invars[0]) if e.invars[0] in invars[:nc] else None
      if j is None or not _is_chunk(e, eqn.invars[j], chunk, global_batch):
        return None
      slices[e.outvars[0]] = j
    serving = computing | {id(e) for e in beqns if e.outvars and e.outvars[0] in slices}
    if not slices or not _only_serves(beqns, outvars, derived, serving, i, {invars[j] for j in slices.values()}):
      continue
    if not all(_starts_at_chunks(beqns, counter, e, k, chunk, computing) for e in beqns
               if e.outvars and e.outvars[0] in slices):
      return None
    return _Loop(i, tuple(sorted(set(slices.values()))), slices, frozenset(serving))
  return None


def _derived(beqns, counter) -> tuple[set, set]:
  """Body variables computed from ``counter`` and the ids of the equations that compute them, up to the slices
  that read them (a slice's chunk is no index)."""
  derived, ids = {counter}, set()
  for e in beqns:
    if jx.primitive_name(e) == "dynamic_slice":
      continue
    if any(not jx.is_literal(v) and v in derived for v in e.invars):
      derived.update(e.outvars)
      ids.add(id(e))
  return derived, ids


def _only_serves(beqns, outvars, derived, serving, counter_pos: int, sliced) -> bool:
  """Whether the counter reaches nothing but the slices' starts and its own increment, and the sliced constants
  (body inputs ``sliced``) are read by nothing but the slices."""
  for e in beqns:
    if id(e) in serving:
      continue
    if any(not jx.is_literal(v) and (v in derived or v in sliced) for v in e.invars):
      return False
  return all(j == counter_pos or jx.is_literal(v) or (v not in derived and v not in sliced)
             for j, v in enumerate(outvars))


def _is_chunk(e, operand, chunk: int, global_batch: int) -> bool:
  """Whether slice ``e`` cuts ``chunk`` examples along dimension 0 of a batch-sized operand, whole elsewhere."""
  shape = jx.aval_shape(operand)
  sizes = tuple(e.params["slice_sizes"])
  return (bool(shape) and shape[0] == global_batch and sizes == (chunk,) + tuple(shape[1:])
          and all(jx.literal_int(v) == 0 for v in e.invars[2:]))


def _starts_at_chunks(beqns, counter, e, k: int, chunk: int, computing) -> bool:
  """Whether slice ``e``'s start is ``i * chunk`` for every count ``i`` (the counter's equations evaluated)."""
  for i in range(k):
    env = {counter: np.int32(i)}
    for other in beqns:
      if other is e:
        break
      if id(other) in computing and all(jx.is_literal(v) or v in env for v in other.invars):
        jx.eval_equations([other], env)
    start = e.invars[1]
    value = jx.literal_int(start) if jx.is_literal(start) else env.get(start)
    if value is None or int(np.asarray(value)) != i * chunk:
      return False
  return True


def _scan_over_chunks(eqn, loop: _Loop, invals) -> list:
  """``eqn`` (a counted loop) run as a scan over the chunks of its sliced constants; its outputs (the counter's
  final value in its place)."""
  parts = jx.scan_parts(eqn)
  body, nc, nk, k = parts.body, parts.num_consts, parts.num_carry, parts.length
  consts, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]
  chunks = [consts[j].reshape((k, -1) + tuple(consts[j].shape[1:])) for j in loop.sliced]
  binvars, boutvars = jx.invars(body), jx.outvars(body)

  def step(carry, x):
    own_xs, chunk = x
    env = dict(zip(jx.constvars(body), jx.consts(body)))
    env.update((v, c) for j, (v, c) in enumerate(zip(binvars[:nc], consts)) if j not in loop.sliced)
    carries = list(carry[:loop.counter]) + [None] + list(carry[loop.counter:])
    env.update((v, c) for v, c in zip(binvars[nc:nc + nk], carries) if c is not None)
    env.update(zip(binvars[nc + nk:], own_xs))
    by_const = dict(zip(loop.sliced, chunk))
    env.update((v, by_const[j]) for v, j in loop.slices.items())
    for e in jx.equations(body):
      if id(e) not in loop.skipped:
        env.update(zip(e.outvars, jx.bind(e, [jx.read(env, v) for v in e.invars])))
    out = [None if j == loop.counter else jx.read(env, v) for j, v in enumerate(boutvars)]
    return out[:loop.counter] + out[loop.counter + 1:nk], out[nk:]

  init_wo = list(init[:loop.counter]) + list(init[loop.counter + 1:])
  carry, ys = jax.lax.scan(step, init_wo, (list(xs), chunks), length=k, unroll=eqn.params.get("unroll", 1))
  return list(carry[:loop.counter]) + [np.int32(k)] + list(carry[loop.counter:]) + list(ys)
