"""FSDP within a group: the parameters a group shards, as its loop sees them, and the program that splits them.

Inside a group that shards its parameters (:attr:`hetspmd.plan.groups.Group.shard_params`), each parameter
arrives split evenly over the group's devices (:func:`shard_program`), is gathered for each reader inside every
microbatch (:class:`ParamShards`, the loop's hook: :class:`hetspmd.lowering.loop.LoopContext`) and its gradient's
sum is reduce-scattered back onto the parts. Its devices run in lockstep.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hetspmd.lowering.transfers import pad_to
from hetspmd.passes import _jax_adapter as jx
from hetspmd.plan.groups import padded_length, shard_axis


@dataclasses.dataclass(frozen=True)
class ParamShards:
  """A group's parameters split evenly over its devices (FSDP inside the group), as its loop sees them.

  ``params``: ``(jaxpr variable, axis, size)`` of each parameter the loop reads as this device's part (the
  variable's whole value, zero-padded along ``axis`` to a multiple of ``n``, split over the mesh axis ``axis_name``
  of ``n`` devices). Inside the loop (:class:`hetspmd.lowering.loop.LoopContext`), every microbatch gathers each
  for each equation that reads it (:meth:`whole`; a layer scan a slice per iteration, :meth:`gathered_slice`; a
  checkpointed call inside it, :meth:`inner`) and reduce-scatters its gradient sums (:meth:`scattered`: every floating sum that is
  not a scalar, split along :func:`hetspmd.plan.groups.shard_axis`) into an accumulator of parts. Collectives
  inside the loop need every device to run the same trip count: the group's layout is in lockstep. After the
  loop, each device's row of a split sum is its part in place and zeros elsewhere (:meth:`rows`), so the rows
  still add up to the group's sum."""

  axis_name: str
  n: int
  params: tuple
  derived: tuple = ()  # example-free equations before the loop on the parameters (a reshape, a cast), redone
  # the last loop's partial values (flat, as the loop returns them) left as this device's part after the loop,
  # not made rows: their owners join the parts (:func:`rows_on`), so no device of the group holds them whole
  kept: frozenset = frozenset()
  # (parted only) {flat partial value: the dtype it crosses devices in} of the kept sums narrowed before they do
  narrow: tuple = ()

  @functools.cached_property
  def made(self) -> frozenset:
    """The values the loop reads of the parameters: the parameters and the example-free work on them."""
    return frozenset([v for v, _, _ in self.params] + [v for e in self.derived for v in e.outvars])

  @functools.cached_property
  def _split(self) -> dict:
    """``{value: (axis, size)}`` of the values gathered from parts: every parameter, and every cast of one (a
    cast is gathered as the cast, at its own dtype's bytes)."""
    out = {v: (a, size) for v, a, size in self.params}
    for e in self.derived:
      if jx.primitive_name(e) == "convert_element_type" and e.invars[0] in out:
        out[e.outvars[0]] = out[e.invars[0]]
    return out

  @functools.cached_property
  def _maker(self) -> dict:
    return {v: e for e in self.derived for v in e.outvars}

  def read_by(self, eqn: Any) -> tuple:
    """The values of :attr:`made` that ``eqn`` reads."""
    return tuple(dict.fromkeys(v for v in eqn.invars if not jx.is_literal(v) and v in self.made))

  def reads(self, eqn: Any, *, example_free: bool = False, rebuilt: tuple = ()) -> tuple[tuple, dict, dict]:
    """How ``eqn`` reads these parameters: ``(gathered, scanned, passed)``, the values gathered whole for it
    (``rebuilt``: what rebuilding its operands reads too), the parts a layer scan slices (:meth:`scanned_by`) and
    the parts a checkpointed call takes (:meth:`passed_by`). An example-free equation gathers all it reads."""
    scanned = {} if example_free else self.scanned_by(eqn)
    passed = {} if example_free else self.passed_by(eqn)
    inside = {*scanned.values(), *passed.values()}
    gathered = tuple(dict.fromkeys(v for v in (*self.read_by(eqn), *rebuilt) if v not in inside))
    return gathered, scanned, passed

  def passed_by(self, eqn: Any) -> dict:
    """``{input position: value}`` of the parts a checkpointed call (``jax.checkpoint``, a remat policy's) takes
    as they are: each reader inside it gathers its own copy (:meth:`inner`)."""
    if jx.primitive_name(eqn) not in ("remat2", "checkpoint"):
      return {}
    return {j: v for j, v in enumerate(eqn.invars) if not jx.is_literal(v) and v in self._split}

  def inner(self, passed: dict) -> "ParamShards":
    """These shards as a nested body sees them: ``passed`` (``{body input: value}``) its inputs that are parts."""
    return ParamShards(self.axis_name, self.n, tuple((b, *self._split[v]) for b, v in passed.items()))

  def scanned_by(self, eqn: Any) -> dict:
    """``{input position: value}`` of the parts a scan takes as sliced inputs (a layer scan's stacked
    parameters, split along an axis after the layers'): each iteration gathers its own slice
    (:meth:`gathered_slice`), so at most about two layers are whole at once."""
    if jx.primitive_name(eqn) != "scan":
      return {}
    parts = jx.scan_parts(eqn)
    first = parts.num_consts + parts.num_carry
    return {j: v for j, v in enumerate(eqn.invars) if j >= first and not jx.is_literal(v)
            and v in self._split and self._split[v][0] > 0}

  def part_of(self, var: Any, outer: dict) -> Any:
    """This device's part of a parameter, or of a cast of one (the cast made on the part)."""
    if var in outer:
      return outer[var]
    eqn = self._maker[var]
    env = {eqn.invars[0]: self.part_of(eqn.invars[0], outer)}
    jx.eval_equations([eqn], env)
    return env[var]

  def gathered_slice(self, var: Any, part: Any, after: Any) -> Any:
    """One iteration's slice of a scanned ``var``'s part, gathered whole after ``after`` (the iteration's carry)."""
    a, size = self._split[var]
    return self._gather(part, a - 1, size, (after,) if after is not None else ())

  def _gather(self, part: Any, a: int, size: int, after: tuple) -> Any:
    tie = next((x for x in after if _numeric(x)), None)
    if tie is not None:
      part = part + _zero_after(tie).astype(part.dtype)
    gathered = jax.lax.all_gather(part, self.axis_name, axis=a, tiled=True)
    return jax.lax.slice_in_dim(gathered, 0, size, axis=a)

  def whole(self, var: Any, outer: dict, after: tuple = ()) -> Any:
    """``var`` (a parameter, or example-free work on parameters) whole, gathered from the parts in ``outer`` for
    one reader: an all-gather of its part (of a cast, the cast part), cut to its size, that starts no earlier
    than the values ``after`` exist: the part has a zero made of them added (:func:`_zero_after`), so XLA
    neither moves the gather out of the microbatch loop nor merges it with another reader's, and each gathered
    copy lives from one reader to the next. (An optimization barrier does neither on CPU: XLA expands it into
    control dependencies before its common-subexpression pass, which then merges the gathers.)"""
    if var in self._split:
      a, size = self._split[var]
      return self._gather(self.part_of(var, outer), a, size, after)
    eqn = self._maker[var]
    env = {v: self.whole(v, outer, after) if v in self.made else outer[v]
           for v in eqn.invars if not jx.is_literal(v)}
    jx.eval_equations([eqn], env)
    return env[var]

  def axis_of(self, reduce: str, x: Any) -> int | None:
    """The axis a partial value (or its shape) is reduce-scattered along, or None (kept whole on each device)."""
    if reduce != "sum" or not jnp.issubdtype(x.dtype, jnp.floating):
      return None
    return shard_axis(x.shape, self.n)

  def scattered(self, parts: list, kinds: list, presplit: dict | None = None) -> list:
    """One microbatch's partial values, each floating sum reduce-scattered over the group onto its parts (not those
    at ``presplit``'s ``(partial, value)`` positions: a layer scan scattered them a slice at a time)."""
    presplit = presplit or {}
    return [[x if (p, q) in presplit or (a := self.axis_of(r, x)) is None else self._scatter(x, a)
             for q, x in enumerate(xs)] for p, (r, xs) in enumerate(zip(kinds, parts))]

  def _scatter(self, x: Any, a: int) -> Any:
    return jax.lax.psum_scatter(pad_to(x, a, padded_length(x.shape[a], self.n)), self.axis_name,
                                scatter_dimension=a, tiled=True)

  def slice_axis(self, shape: tuple, dtype: Any) -> int | None:
    """The axis (of the stacked value) a layer scan's stacked gradient sum is reduce-scattered along a slice at a
    time, or None: floating, and a slice that splits (:func:`hetspmd.plan.groups.shard_axis`)."""
    if not jnp.issubdtype(dtype, jnp.floating) or len(shape) < 2:
      return None
    inner = shard_axis(shape[1:], self.n)
    return None if inner is None else inner + 1

  def scattered_slice(self, axis: int, valid: Any, y: Any) -> Any:
    """One iteration's slice of a stacked gradient sum, widened, masked (``valid``: None where every microbatch
    counts) and reduce-scattered along ``axis`` (of the slice) onto this device's part."""
    y = y.astype(jnp.float32) if jnp.finfo(y.dtype).bits < 32 else y
    if valid is not None:
      y = jnp.where(valid, y, jnp.zeros_like(y))
    return self._scatter(y, axis)

  def part_shape(self, reduce: str, x: Any) -> tuple:
    """The shape of a partial value's accumulator: a part's where it is reduce-scattered."""
    a, shape = self.axis_of(reduce, x), list(x.shape)
    if a is not None:
      shape[a] = padded_length(shape[a], self.n) // self.n
    return tuple(shape)

  def rows(self, acc: list, kinds: list, shapes: list, presplit: dict | None = None) -> list:
    """The accumulated parts as this device's rows, each the whole value's shape (``shapes``): its part in place,
    zeros elsewhere (the padding cut off); a value :attr:`kept` names stays its part (padding and all).
    ``presplit``: ``{(partial, value): (axis, shape)}`` of the parts a layer scan scattered along ``axis``."""
    presplit = presplit or {}
    first = list(itertools.accumulate((len(xs) for xs in acc), initial=0))  # each partial's first flat position

    def row(x, reduce, like, at_):
      a = presplit[at_][0] if at_ in presplit else self.axis_of(reduce, like)
      if a is None or first[at_[0]] + at_[1] in self.kept:
        return x
      size = like.shape[a]
      whole = jnp.zeros(x.shape[:a] + (padded_length(size, self.n),) + x.shape[a + 1:], x.dtype)
      at = jax.lax.axis_index(self.axis_name) * x.shape[a]
      return jax.lax.slice_in_dim(jax.lax.dynamic_update_slice_in_dim(whole, x, at, a), 0, size, axis=a)

    return [[row(x, r, like, (p, q)) for q, (x, like) in enumerate(zip(xs, ss))]
            for p, (r, xs, ss) in enumerate(zip(kinds, acc, shapes))]

  def parted(self, acc: list, kinds: list, stacked: dict) -> list:
    """A group that does not shard, beside groups of its size that do
    (:attr:`~hetspmd.plan.execution.Execution.parts_exchange`): each sum :attr:`kept` names (this device's own,
    accumulated whole over its loop) reduce-scattered over the group onto the part a sharded group's device holds
    of it: along :meth:`axis_of`'s axis, or for a layer scan's stacked sum (``stacked``: ``{(partial, value):
    axis}``, :meth:`slice_axis`'s) along that one, widened as :meth:`scattered_slice` widens it. A sum
    :attr:`narrow` names is cast to its dtype first: it crosses devices in it, as the sharded group's part
    does after its loop."""
    first = list(itertools.accumulate((len(xs) for xs in acc), initial=0))
    narrow = dict(self.narrow)

    def part(x, reduce, at):
      j = first[at[0]] + at[1]
      if j not in self.kept:
        return x
      a = stacked[at] if at in stacked else self.axis_of(reduce, x)
      if j in narrow and a is not None:
        return self._scatter(x.astype(narrow[j]), a)
      if at in stacked:
        return self._scatter(x.astype(jnp.float32) if jnp.finfo(x.dtype).bits < 32 else x, a)
      return x if a is None else self._scatter(x, a)

    return [[part(x, r, (p, q)) for q, x in enumerate(xs)] for p, (r, xs) in enumerate(zip(kinds, acc))]


def _numeric(x: Any) -> bool:
  """Whether ``x`` is a non-empty array of numbers (not a PRNG key): one a zero can be made of."""
  dtype = getattr(x, "dtype", None)
  return dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended) and jnp.size(x) > 0


def _zero_after(x: Any) -> Any:
  """A scalar zero that XLA cannot fold, made of ``x``'s first element: ``min(|x|, 0)``, with a NaN taken as 0 (a
  padding slot's NaN, from a zero example, must not reach the parts every device gathers)."""
  first = (jnp.ravel(x)[0] if jnp.ndim(x) else x).astype(jnp.float32)
  return jnp.minimum(jnp.abs(jnp.where(jnp.isnan(first), 0.0, first)), 0.0)


def shard_program(mesh: Mesh, axes: tuple[int, ...]) -> Callable[[list], list]:
  """``program(values) -> parts``: each value (replicated on ``mesh``'s one axis) zero-padded along its axis of
  ``axes`` to a multiple of the device count and split evenly over the devices: each device keeps its own part of
  the copy it has (nothing crosses devices)."""
  name, n = mesh.axis_names[0], mesh.size
  out = [NamedSharding(mesh, P(*([None] * a), name)) for a in axes]
  return jax.jit(lambda xs: [pad_to(x, a, padded_length(x.shape[a], n)) for x, a in zip(xs, axes)],
                 out_shardings=out)
