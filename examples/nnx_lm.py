"""A Gemma-3-shaped language model in Flax NNX, and its train step as Flax's Gemma example writes one: NNX in
place, ``train_step(model, optimizer, rngs, batch, metrics, label_smoothing, pad_id)``.

Search how it would split over a pool, from the command line (nothing is allocated: the model comes from
``nnx.eval_shape`` and the batch is ``jax.ShapeDtypeStruct``s)::

    hetspmd search --step examples/nnx_lm.py:gemma3_1b --cluster '1x8xA100-80GB+1x8xV100-32GB;inter=100Gbps'

or from Python::

    step, args, kwargs = gemma3_1b()
    print(hetspmd.search(step, *args, cluster="1x8xA100-80GB+1x8xV100-32GB;inter=100Gbps", **kwargs))

``tiny()`` is the same model, small: a search in seconds (``objects(...)`` makes the model to run).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Config:
  """The model's sizes. The defaults are Gemma 3 1B's: 26 layers, 4 query heads sharing one key/value head of
  256, a gated MLP of 6912, a vocabulary of 262,144 tied to the embedding, and 5 sliding-window layers (512
  tokens) to each global one."""

  vocab: int = 262_144
  width: int = 1152
  layers: int = 26
  heads: int = 4
  kv_heads: int = 1
  head_dim: int = 256
  hidden: int = 6912
  window: int = 512
  global_every: int = 6
  dtype: str = "bfloat16"  # compute; the parameters stay float32
  dropout: float = 0.0


class RMSNorm(nnx.Module):
  def __init__(self, width: int, *, rngs: nnx.Rngs):
    self.scale = nnx.Param(jnp.zeros((width,), jnp.float32))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (normed * (1.0 + self.scale[...])).astype(x.dtype)


def rope(x, positions, base: float = 10_000.0):
  """Rotary position embedding over the last axis of ``x`` (``[batch, seq, heads, dim]``)."""
  half = x.shape[-1] // 2
  freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions[..., None, None].astype(jnp.float32) * freq
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  a, b = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
  """Grouped-query attention with normed queries and keys; ``window`` tokens back, or all (a global layer)."""

  def __init__(self, cfg: Config, window: int | None, *, rngs: nnx.Rngs):
    dense = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=cfg.dtype, rngs=rngs)
    self.cfg, self.window = cfg, window
    self.q = dense(cfg.width, cfg.heads * cfg.head_dim)
    self.kv = dense(cfg.width, 2 * cfg.kv_heads * cfg.head_dim)
    self.out = dense(cfg.heads * cfg.head_dim, cfg.width)
    self.q_norm, self.k_norm = RMSNorm(cfg.head_dim, rngs=rngs), RMSNorm(cfg.head_dim, rngs=rngs)

  def __call__(self, x, positions, pad):
    cfg = self.cfg
    b, s, _ = x.shape
    q = self.q_norm(self.q(x).reshape(b, s, cfg.heads, cfg.head_dim))
    k, v = jnp.split(self.kv(x).reshape(b, s, 2 * cfg.kv_heads, cfg.head_dim), 2, axis=2)
    q, k = rope(q, positions), rope(self.k_norm(k), positions)
    q = q.reshape(b, s, cfg.kv_heads, cfg.heads // cfg.kv_heads, cfg.head_dim)
    logits = jnp.einsum("bqkgd,btkd->bkgqt", q, k).astype(jnp.float32) / jnp.sqrt(cfg.head_dim)
    i, j = jnp.arange(s)[:, None], jnp.arange(s)[None, :]
    allowed = (j <= i) & ((i - j < self.window) if self.window else True)
    allowed = allowed[None, None, None] & ~pad[:, None, None, None, :]
    probs = jax.nn.softmax(jnp.where(allowed, logits, -1e30), axis=-1).astype(v.dtype)
    return self.out(jnp.einsum("bkgqt,btkd->bqkgd", probs, v).reshape(b, s, cfg.heads * cfg.head_dim))


class Block(nnx.Module):
  def __init__(self, cfg: Config, window: int | None, *, rngs: nnx.Rngs):
    dense = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=cfg.dtype, rngs=rngs)
    self.attn_norm, self.mlp_norm = RMSNorm(cfg.width, rngs=rngs), RMSNorm(cfg.width, rngs=rngs)
    self.attn = Attention(cfg, window, rngs=rngs)
    self.gate, self.up, self.down = dense(cfg.width, cfg.hidden), dense(cfg.width, cfg.hidden), dense(cfg.hidden, cfg.width)
    self.drop = nnx.Dropout(cfg.dropout)

  def __call__(self, x, positions, pad, rngs):
    x = x + self.drop(self.attn(self.attn_norm(x), positions, pad), rngs=rngs)
    h = self.mlp_norm(x)
    return x + self.drop(self.down(jax.nn.gelu(self.gate(h)) * self.up(h)), rngs=rngs)


class Transformer(nnx.Module):
  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab, cfg.width, dtype=cfg.dtype, rngs=rngs)
    self.blocks = nnx.List([Block(cfg, None if (i + 1) % cfg.global_every == 0 else cfg.window, rngs=rngs)
                            for i in range(cfg.layers)])
    self.final_norm = RMSNorm(cfg.width, rngs=rngs)

  def __call__(self, tokens, pad, rngs=None):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x = self.embed(tokens) * jnp.sqrt(self.cfg.width).astype(self.cfg.dtype)
    for block in self.blocks:
      x = block(x, positions, pad, rngs)
    return self.embed.attend(self.final_norm(x)).astype(jnp.float32)  # the embedding, tied


def train_step(model, optimizer, rngs, batch, metrics, label_smoothing, pad_id):
  """One step of next-token prediction, padding masked out, labels smoothed: the model and optimizer updated in
  place, the loss recorded in ``metrics``."""
  tokens = batch["inputs"]
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  weights = (targets != pad_id).astype(jnp.float32)

  def loss_fn(model):
    logits = model(inputs, inputs == pad_id, rngs)
    labels = optax.smooth_labels(jax.nn.one_hot(targets, model.cfg.vocab), label_smoothing)
    loss = optax.softmax_cross_entropy(logits, labels)
    return jnp.sum(loss * weights) / jnp.maximum(jnp.sum(weights), 1.0)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  metrics.update(loss=loss)


def objects(cfg: Config, seed: int = 0):
  """The model, its optimizer (AdamW), the dropout keys and the metrics."""
  model = Transformer(cfg, rngs=nnx.Rngs(params=seed))
  optimizer = nnx.Optimizer(model, optax.adamw(3e-4, weight_decay=0.1), wrt=nnx.Param)
  return model, optimizer, nnx.Rngs(dropout=seed + 1), nnx.MultiMetric(loss=nnx.metrics.Average("loss"))


def search_inputs(cfg: Config, batch: int, seq: int):
  """``(step, args, kwargs)`` for ``hetspmd.search`` / ``hetspmd search --step``: the objects abstract
  (``nnx.eval_shape``), the batch a ``jax.ShapeDtypeStruct``; nothing allocated."""
  model, optimizer, rngs, metrics = nnx.eval_shape(lambda: objects(cfg))
  tokens = {"inputs": jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)}
  return train_step, (model, optimizer, rngs, tokens, metrics, 0.1, 0), {}


def gemma3_1b():
  """Gemma 3 1B in bfloat16, sequences of 1024, a global batch of 64."""
  return search_inputs(Config(), batch=64, seq=1024)


def tiny():
  """A small model of the same shape (two layers, one global), abstract as ``gemma3_1b()``'s: a quick search."""
  return search_inputs(Config(vocab=256, width=32, layers=2, heads=4, kv_heads=2, head_dim=8, hidden=64, window=4,
                              global_every=2, dtype="float32"), batch=16, seq=16)
