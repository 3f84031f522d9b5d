"""GPT-2 (Radford et al., 2019) in Flax NNX.

Published hyperparameters (the released checkpoints, as in the Hugging Face
model cards): context 1024, vocabulary 50257, GELU (tanh form), pre-LayerNorm
blocks, learned position embeddings, output projection tied to the token
embedding. Parameter counts of the released checkpoints: 124,439,808 (small),
354,823,168 (medium), 774,030,080 (large), 1,557,611,200 (XL).

Every block runs under ``jax.named_scope`` (``h_3/attn``, ``h_3/mlp``, ...),
so the traced graph carries Flax module paths. The training step is
deterministic (no dropout) so that it needs no RNG input.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from hetspmd.errors import InvalidValueError
from hetspmd.models.workload import Workload


@dataclasses.dataclass(frozen=True)
class GPT2Config:
  n_layer: int
  n_head: int
  d_model: int
  vocab_size: int = 50257
  n_ctx: int = 1024
  dtype: str = "float32"
  # the blocks stacked (nnx.vmap) and run by one nnx.scan, as pipeline stages need (hetspmd.lowering.staged)
  scan_layers: bool = False

  def __post_init__(self):
    if self.d_model % self.n_head:
      raise InvalidValueError(f"GPT2Config.d_model must be divisible by n_head={self.n_head}, got d_model={self.d_model}")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_head


class Attention(nnx.Module):
  def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
    self.n_head = cfg.n_head
    self.c_attn = nnx.Linear(cfg.d_model, 3 * cfg.d_model, dtype=cfg.dtype, rngs=rngs)
    self.c_proj = nnx.Linear(cfg.d_model, cfg.d_model, dtype=cfg.dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, s, d = x.shape
    q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)
    heads = lambda t: t.reshape(b, s, self.n_head, d // self.n_head)
    q, k, v = heads(q), heads(k), heads(v)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // self.n_head).astype(x.dtype)
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
    return self.c_proj(out)


class MLP(nnx.Module):
  def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
    self.c_fc = nnx.Linear(cfg.d_model, 4 * cfg.d_model, dtype=cfg.dtype, rngs=rngs)
    self.c_proj = nnx.Linear(4 * cfg.d_model, cfg.d_model, dtype=cfg.dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=True))


class Block(nnx.Module):
  def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
    self.ln_1 = nnx.LayerNorm(cfg.d_model, epsilon=1e-5, dtype=cfg.dtype, rngs=rngs)
    self.attn = Attention(cfg, rngs)
    self.ln_2 = nnx.LayerNorm(cfg.d_model, epsilon=1e-5, dtype=cfg.dtype, rngs=rngs)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    with jax.named_scope("ln_1"):
      h = self.ln_1(x)
    with jax.named_scope("attn"):
      x = x + self.attn(h)
    with jax.named_scope("ln_2"):
      h = self.ln_2(x)
    with jax.named_scope("mlp"):
      return x + self.mlp(h)


class GPT2(nnx.Module):
  def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
    self.wte = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, rngs=rngs)
    self.wpe = nnx.Embed(cfg.n_ctx, cfg.d_model, dtype=cfg.dtype, rngs=rngs)
    if cfg.scan_layers:
      @nnx.split_rngs(splits=cfg.n_layer)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def stack(rngs: nnx.Rngs):
        return Block(cfg, rngs)

      self.h = stack(rngs)
    else:
      self.h = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layer)])
    self.scan_layers = cfg.scan_layers
    self.ln_f = nnx.LayerNorm(cfg.d_model, epsilon=1e-5, dtype=cfg.dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    with jax.named_scope("embed"):
      x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1])[None, :])
    if self.scan_layers:
      @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
      def run(block, x):
        return block(x)

      with jax.named_scope("h"):
        x = run(self.h, x)
    else:
      for i, block in enumerate(self.h):
        with jax.named_scope(f"h_{i}"):
          x = block(x)
    with jax.named_scope("ln_f"):
      x = self.ln_f(x)
    with jax.named_scope("lm_head"):
      return self.wte.attend(x)


def lm_loss(model: GPT2, batch):
  """Mean next-token cross entropy over every position."""
  logits = model(batch["inputs"])
  with jax.named_scope("loss"):
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
    return jnp.mean(losses), {}


def lm_batch_spec(cfg: GPT2Config, batch: int, seq: int | None):
  shape = (batch, seq)
  return {"inputs": jax.ShapeDtypeStruct(shape, jnp.int32), "targets": jax.ShapeDtypeStruct(shape, jnp.int32)}


CONFIGS = {
    # name: (config, published parameter count or None)
    "gpt2-tiny": (GPT2Config(n_layer=2, n_head=4, d_model=64, vocab_size=512, n_ctx=128), None),
    "gpt2-small": (GPT2Config(n_layer=12, n_head=12, d_model=768), 124_439_808),
    "gpt2-medium": (GPT2Config(n_layer=24, n_head=16, d_model=1024), 354_823_168),
    "gpt2-large": (GPT2Config(n_layer=36, n_head=20, d_model=1280), 774_030_080),
    "gpt2-xl": (GPT2Config(n_layer=48, n_head=25, d_model=1600), 1_557_611_200),
    # the same blocks stacked with nnx.vmap and run by one nnx.scan: what pipeline stages need
    "gpt2-tiny-scan": (GPT2Config(n_layer=4, n_head=4, d_model=64, vocab_size=512, n_ctx=128, scan_layers=True), None),
}
CONFIGS.update({f"{name}-scan": (dataclasses.replace(cfg, scan_layers=True), published)
                for name, (cfg, published) in list(CONFIGS.items()) if published})


def workloads() -> list[Workload]:
  return [
      Workload(
          name=name,
          family="gpt2",
          config=cfg,
          build=GPT2,
          loss=lm_loss,
          batch_spec=lm_batch_spec,
          make_optimizer=lambda: optax.adam(3e-4),
          default_batch=2 if name.startswith("gpt2-tiny") else 8,
          default_seq=32 if name.startswith("gpt2-tiny") else 1024,
          max_seq=cfg.n_ctx,
          published_params=published,
          source="GPT-2 (Radford et al., 2019); released checkpoints" if published else "test size",
          test_size=published is None,
      )
      for name, (cfg, published) in CONFIGS.items()
  ]
