"""Uneven pipeline stages in one SPMD program: a padded layer stack run with per-device trip counts.

A stack of identical layers (the parameters of layer ``l`` are ``leaf[l]`` of every leaf of a stacked
tree, as ``nn.scan``, ``nnx.vmap`` or a stacked zoo model hold them) is cut into consecutive stages of
uneven length, one stage per row of a ``stage`` mesh axis. Every device runs the same program:

* the stack is stored padded: stage ``s`` holds its ``layers[s]`` layers in a block of
  ``max(layers)`` rows of a ``[stages * max(layers), ...]`` array sharded over ``stage``, the rest zeros;
* the schedule is GPipe in lockstep ticks: ``M + S - 1`` forward ticks, then ``M + S - 1`` backward
  ticks, for ``M`` microbatches and ``S`` stages. Each tick starts with one ``ppermute`` over ``stage``
  (activations forward, their cotangents back), so every device meets every collective the same number
  of times;
* inside a tick a stage runs its own layers as a ``while`` loop with its own trip count (``layers[s]``,
  or 0 in a tick where it has no microbatch), with no collective inside: a faster stage is given more
  layers, and a stage with fewer layers really does less work (DESIGN.md, mechanism 6);
* a stage keeps each layer's input per microbatch and, with ``recompute=False``, the residuals of the
  layer's ``jax.vjp`` too; its backward runs the layer's pullback (recomputing the forward first when the
  residuals were not kept) and hands the input's cotangent on. The loss head runs on the last stage
  (``lax.cond``), so its cost is that stage's alone;
* a ``data`` axis inside a stage splits every microbatch's examples evenly; the stack's gradients are
  summed over ``data`` once, after the ticks, among the devices of one stage.

The result is the gradient of ``sum_m head(stack(xs[m]), targets[m])`` with respect to the stack, the head
and every ``xs[m]``, equal to the single-device one up to the order of float sums.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from hetspmd.errors import InvalidValueError


@dataclasses.dataclass(frozen=True)
class Stages:
  """Consecutive layers per stage (uneven), and the microbatches that flow through them."""

  layers: tuple[int, ...]
  microbatches: int
  stage_axis: str = "stage"
  data_axis: str | None = "data"
  # keep only each layer's input and recompute its forward in the backward pass (GPipe's choice), or keep
  # every residual of the layer's forward (no recomputation, more memory)
  recompute: bool = True

  def __post_init__(self):
    if not self.layers or min(self.layers) < 1:
      raise InvalidValueError(f"every stage needs at least one layer, got layers={self.layers}")
    if self.microbatches < 1:
      raise InvalidValueError(f"a pipeline needs at least one microbatch, got {self.microbatches}")

  @property
  def num_stages(self) -> int:
    return len(self.layers)

  @property
  def max_layers(self) -> int:
    return max(self.layers)

  @property
  def total_layers(self) -> int:
    return sum(self.layers)

  @property
  def ticks(self) -> int:
    """Lockstep ticks of each direction: the last microbatch leaves the last stage at tick M + S - 2."""
    return self.microbatches + self.num_stages - 1

  def rows(self) -> np.ndarray:
    """Row of the padded stack that holds each layer, in layer order."""
    return np.concatenate([s * self.max_layers + np.arange(n) for s, n in enumerate(self.layers)]).astype(np.int32)


def schedule_seconds(stages: Stages, forward: Sequence[float], backward: Sequence[float], head: float = 0.0,
                     transfer: float = 0.0) -> float:
  """Predicted seconds of :func:`pipelined_grad`'s ticks (the gradient reduction after them excluded).

  ``forward[s]`` and ``backward[s]``: one layer's forward and backward (without its recomputed forward) on
  one microbatch on stage ``s``'s devices; ``head``: the head's forward and backward on one microbatch on
  the last stage; ``transfer``: one boundary send of a microbatch's activations. Every tick lasts as long
  as its slowest stage, since the ``ppermute`` that starts the next one waits for every device.
  """
  if len(forward) != stages.num_stages or len(backward) != stages.num_stages:
    raise InvalidValueError(f"one forward and one backward time per stage ({stages.num_stages}), got "
                            f"{len(forward)} and {len(backward)}")
  last = stages.num_stages - 1
  tick_f = max(n * f + (head if s == last else 0.0) for s, (n, f) in enumerate(zip(stages.layers, forward)))
  tick_b = max(n * (b + (f if stages.recompute else 0.0)) for n, f, b in zip(stages.layers, forward, backward))
  sends = 2 * transfer if stages.num_stages > 1 else 0.0
  return stages.ticks * (tick_f + tick_b + sends)


def pack(stack: Any, stages: Stages) -> Any:
  """The padded stack: ``[stages * max_layers, ...]`` per leaf, each stage's layers first in its block."""
  rows = stages.rows()

  def one(leaf):
    if leaf.shape[0] != stages.total_layers:
      raise InvalidValueError(f"a stacked leaf of shape {leaf.shape} has {leaf.shape[0]} layers; the stages "
                              f"{stages.layers} hold {stages.total_layers}")
    out = jnp.zeros((stages.num_stages * stages.max_layers,) + leaf.shape[1:], leaf.dtype)
    return out.at[rows].set(leaf)

  return jax.tree.map(one, stack)


def unpack(padded: Any, stages: Stages) -> Any:
  """The layers of a padded stack (or of its gradient) in order: the inverse of :func:`pack`."""
  rows = stages.rows()
  return jax.tree.map(lambda leaf: leaf[rows], padded)


def _leaf(tree, index):
  return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, 0, keepdims=False), tree)


def _add(tree, index, value):
  return jax.tree.map(
      lambda x, v: jax.lax.dynamic_update_index_in_dim(
          x, jax.lax.dynamic_index_in_dim(x, index, 0, keepdims=False) + v.astype(x.dtype), index, 0), tree, value)


def tick_slot(t, lag, microbatches: int):
  """``(valid, index)``: the microbatch a stage takes in tick ``t`` when it runs ``lag`` ticks behind the first
  (its index clipped into range, for reading buffers; ``valid`` says whether it has one)."""
  m = t - lag
  return (m >= 0) & (m < microbatches), jnp.clip(m, 0, microbatches - 1)


def _residuals(pull, inputs) -> tuple:
  """The leaves of a ``jax.vjp`` pullback that are not the inputs themselves: what the backward needs kept."""
  given = {id(x) for x in jax.tree.leaves(inputs)}
  return tuple(r for r in jax.tree.leaves(pull) if id(r) not in given)


def _with_residuals(pull, inputs, kept):
  """``pull`` with its residuals replaced by ``kept`` (from :func:`_residuals` of the same function)."""
  given = {id(x) for x in jax.tree.leaves(inputs)}
  leaves, treedef = jax.tree.flatten(pull)
  kept = iter(kept)
  return jax.tree.unflatten(treedef, [r if id(r) in given else next(kept) for r in leaves])


def pipelined_grad(block: Callable[[Any, jax.Array], jax.Array], head: Callable[[Any, jax.Array, Any], jax.Array],
                   stages: Stages, mesh: jax.sharding.Mesh) -> Callable[..., tuple[Any, Any, Any, jax.Array]]:
  """``(padded_stack, head_params, xs, targets) -> (loss, d_padded_stack, d_head_params, d_xs)``.

  ``block(layer_params, h) -> h`` is one layer (same shape and dtype out as in); ``head(head_params, h,
  target) -> loss`` sums its loss over the microbatch's examples. ``xs`` is ``[M, B, ...]``: ``M``
  microbatches of ``B`` examples, split over ``data``; ``targets`` is any tree of ``[M, B, ...]`` leaves.
  The loss and gradients are sums over all ``M * B`` examples.
  """
  S = stages.num_stages
  st, da = stages.stage_axis, stages.data_axis
  if mesh.shape.get(st) != S:
    raise InvalidValueError(f"{S} stages need a mesh axis {st!r} of size {S}; the mesh has {dict(mesh.shape)}")
  if da is not None and da not in mesh.shape:
    raise InvalidValueError(f"the data axis {da!r} is not an axis of the mesh {dict(mesh.shape)}")
  axes = (st,) if da is None else (st, da)

  def per_device(stack, head_params, xs, targets):
    ticks = _Ticks(block, head, stages, stack, head_params, xs, targets, jax.lax.axis_index(st))
    saved, loss, dhead, dtop = ticks.forward()
    dstack, dxs = ticks.backward(saved, dtop)
    if da is not None:
      dstack = jax.lax.psum(dstack, da)
    return jax.lax.psum(loss, axes), dstack, jax.lax.psum(dhead, axes), dxs[None]

  data = P(None, da)
  mapped = jax.shard_map(per_device, mesh=mesh, in_specs=(P(st), P(), data, data),
                         out_specs=(P(), P(st), P(), P(st, None, da)), axis_names=set(axes), check_vma=False)

  def run(padded_stack, head_params, xs, targets):
    loss, dstack, dhead, dxs = mapped(padded_stack, head_params, xs, targets)
    return loss, dstack, dhead, dxs[0]

  return run


@dataclasses.dataclass(frozen=True)
class _Ticks:
  """One device's part of :func:`pipelined_grad`'s schedule: its stage's rows of the stack (``stack``), the head,
  every microbatch's input and target, and its stage index."""

  block: Callable[[Any, jax.Array], jax.Array]
  head: Callable[[Any, jax.Array, Any], jax.Array]
  stages: Stages
  stack: Any
  head_params: Any
  xs: Any
  targets: Any
  stage: Any

  @property
  def layers(self):
    return jnp.asarray(self.stages.layers, jnp.int32)[self.stage]

  def _shift(self, x, pairs):
    return jax.lax.ppermute(x, self.stages.stage_axis, pairs) if self.stages.num_stages > 1 else x

  def forward(self):
    """The forward ticks: what each layer kept per microbatch, the loss, the head's gradient and the cotangent
    of the stack's output per microbatch (the last stage's)."""
    stages = self.stages
    h0 = jnp.zeros_like(self.xs[0])
    kept = () if stages.recompute else jax.eval_shape(
        lambda p, h: _residuals(jax.vjp(self.block, p, h)[1], (p, h)), _leaf(self.stack, 0), h0)
    saved = jax.tree.map(lambda a: jnp.zeros((stages.microbatches, stages.max_layers) + a.shape, a.dtype), (h0, kept))
    zeros_head = jax.tree.map(jnp.zeros_like, self.head_params)
    carry = (h0, saved, jnp.zeros((), jnp.float32), zeros_head, jnp.zeros_like(self.xs))
    _, saved, loss, dhead, dtop = jax.lax.fori_loop(0, stages.ticks, self.forward_tick, carry)
    return saved, loss, dhead, dtop

  def forward_tick(self, t, carry):
    S = self.stages.num_stages
    send, saved, loss, dhead, dtop = carry
    recv = self._shift(send, [(s, s + 1) for s in range(S - 1)])
    valid, mi = tick_slot(t, self.stage, self.stages.microbatches)
    h = jnp.where(self.stage == 0, self.xs[mi], recv)
    h, saved = self.layers_forward(h, jnp.where(valid, self.layers, 0), saved, mi)

    def run_head(args):
      loss, dhead, dtop = args
      value, pull = jax.vjp(lambda p, x: self.head(p, x, _leaf(self.targets, mi)), self.head_params, h)
      dp, dx = pull(jnp.ones_like(value))
      return (loss + value.astype(jnp.float32), jax.tree.map(jnp.add, dhead, dp),
              jax.lax.dynamic_update_index_in_dim(dtop, dx, mi, 0))

    loss, dhead, dtop = jax.lax.cond(valid & (self.stage == S - 1), run_head, lambda a: a, (loss, dhead, dtop))
    return h, saved, loss, dhead, dtop

  def layers_forward(self, h, n, saved, m):
    """The stage's first ``n`` layers on microbatch ``m``, keeping each layer's input (and residuals)."""
    def body(l, carry):
      h, saved = carry
      p = _leaf(self.stack, l)
      if self.stages.recompute:
        out, kept = self.block(p, h), ()
      else:
        out, pull = jax.vjp(self.block, p, h)
        kept = _residuals(pull, (p, h))
      saved = jax.tree.map(lambda buf, v: buf.at[m, l].set(v), saved, (h, kept))
      return out, saved
    return jax.lax.fori_loop(0, n, body, (h, saved))

  def backward(self, saved, dtop):
    """The backward ticks: the stage's stack gradient and (on the first stage) every microbatch's input's."""
    h0 = jnp.zeros_like(self.xs[0])
    dstack = jax.tree.map(jnp.zeros_like, self.stack)
    tick = lambda t, carry: self.backward_tick(t, carry, saved, dtop)
    _, dstack, dxs = jax.lax.fori_loop(0, self.stages.ticks, tick, (h0, dstack, jnp.zeros_like(self.xs)))
    return dstack, dxs

  def backward_tick(self, t, carry, saved, dtop):
    S = self.stages.num_stages
    send, dstack, dxs = carry
    recv = self._shift(send, [(s + 1, s) for s in range(S - 1)])
    valid, mi = tick_slot(t, S - 1 - self.stage, self.stages.microbatches)
    g = jnp.where(self.stage == S - 1, dtop[mi], recv)
    g, dstack = self.layers_backward(g, jnp.where(valid, self.layers, 0), dstack, mi, saved)
    dxs = jnp.where(valid & (self.stage == 0), jax.lax.dynamic_update_index_in_dim(dxs, g, mi, 0), dxs)
    return g, dstack, dxs

  def layers_backward(self, g, n, dstack, m, saved):
    """The stage's first ``n`` layers' pullbacks on microbatch ``m``, in reverse, adding each layer's gradient."""
    def body(i, carry):
      g, dstack = carry
      l = n - 1 - i
      h, kept = jax.tree.map(lambda buf: buf[m, l], saved)
      p = _leaf(self.stack, l)
      _, pull = jax.vjp(self.block, p, h)  # with kept residuals, only its structure is used (the rest is dead)
      if not self.stages.recompute:
        pull = _with_residuals(pull, (p, h), kept)
      dp, g = pull(g)
      return g, _add(dstack, l, dp)
    return jax.lax.fori_loop(0, n, body, (g, dstack))
