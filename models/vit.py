"""Vision Transformer (Dosovitskiy et al., 2021) in Flax NNX.

"An Image is Worth 16x16 Words" (ICLR 2021), Table 1: ViT-Base has 12
layers, width 768, MLP 3072, 12 heads (86M parameters); ViT-Large has 24
layers, width 1024, MLP 4096, 16 heads (307M in the paper's table). The
counts here follow timm's ``vit_base_patch16_224`` and
``vit_large_patch16_224`` with a 1000-class head: 86,567,656 and
304,326,632 parameters.

Layout as in timm: a patch embedding (a convolution whose kernel and stride
are the patch size), a class token and learned position embeddings for the
``(image / patch)**2 + 1`` tokens, pre-LayerNorm encoder blocks (multi-head
self-attention with a fused ``qkv`` projection, then an MLP with exact GELU),
a final LayerNorm (epsilon 1e-6 throughout), and a linear head on the class
token. Images are NHWC float32, labels int32 below ``num_classes``.

Every stage runs under ``jax.named_scope`` (``patch_embed``, ``blocks_3/attn``,
``blocks_3/mlp``, ``norm``, ``head``), so the traced graph carries module
paths. The training step is deterministic (no dropout, no stochastic depth)
so that it needs no RNG input; the optimizer is Adam (1e-3), as in the paper
(without its weight decay and learning-rate schedule).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from hetspmd.errors import InvalidValueError
from hetspmd.models.mlp import classification_loss
from hetspmd.models.workload import Workload


@dataclasses.dataclass(frozen=True)
class ViTConfig:
  image_size: int
  patch_size: int
  num_layers: int
  d_model: int
  num_heads: int
  mlp_dim: int
  num_classes: int = 1000
  channels: int = 3

  def __post_init__(self):
    if self.image_size % self.patch_size:
      raise InvalidValueError(f"ViTConfig.image_size must be divisible by patch_size={self.patch_size}, "
                              f"got image_size={self.image_size}")
    if self.d_model % self.num_heads:
      raise InvalidValueError(f"ViTConfig.d_model must be divisible by num_heads={self.num_heads}, "
                              f"got d_model={self.d_model}")

  @property
  def num_tokens(self) -> int:
    """Patches plus the class token."""
    return (self.image_size // self.patch_size) ** 2 + 1


class Attention(nnx.Module):
  def __init__(self, cfg: ViTConfig, rngs: nnx.Rngs):
    self.num_heads = cfg.num_heads
    self.qkv = nnx.Linear(cfg.d_model, 3 * cfg.d_model, rngs=rngs)
    self.proj = nnx.Linear(cfg.d_model, cfg.d_model, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, s, d = x.shape
    q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
    heads = lambda t: t.reshape(b, s, self.num_heads, d // self.num_heads)
    q, k, v = heads(q), heads(k), heads(v)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // self.num_heads).astype(x.dtype)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
    return self.proj(out)


class MLP(nnx.Module):
  def __init__(self, cfg: ViTConfig, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(cfg.d_model, cfg.mlp_dim, rngs=rngs)
    self.fc2 = nnx.Linear(cfg.mlp_dim, cfg.d_model, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))


class Block(nnx.Module):
  def __init__(self, cfg: ViTConfig, rngs: nnx.Rngs):
    self.norm1 = nnx.LayerNorm(cfg.d_model, epsilon=1e-6, rngs=rngs)
    self.attn = Attention(cfg, rngs)
    self.norm2 = nnx.LayerNorm(cfg.d_model, epsilon=1e-6, rngs=rngs)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    with jax.named_scope("norm1"):
      h = self.norm1(x)
    with jax.named_scope("attn"):
      x = x + self.attn(h)
    with jax.named_scope("norm2"):
      h = self.norm2(x)
    with jax.named_scope("mlp"):
      return x + self.mlp(h)


class ViT(nnx.Module):
  def __init__(self, cfg: ViTConfig, rngs: nnx.Rngs):
    p = cfg.patch_size
    self.patch_embed = nnx.Conv(cfg.channels, cfg.d_model, kernel_size=(p, p), strides=(p, p), padding="VALID",
                                rngs=rngs)
    self.cls_token = nnx.Param(jnp.zeros((1, 1, cfg.d_model), jnp.float32))
    self.pos_embed = nnx.Param(0.02 * jax.random.truncated_normal(rngs.params(), -2.0, 2.0,
                                                                  (1, cfg.num_tokens, cfg.d_model), jnp.float32))
    self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
    self.norm = nnx.LayerNorm(cfg.d_model, epsilon=1e-6, rngs=rngs)
    self.head = nnx.Linear(cfg.d_model, cfg.num_classes, rngs=rngs)

  def __call__(self, images: jax.Array) -> jax.Array:
    """``[batch, height, width, channels]`` images to ``[batch, num_classes]`` logits."""
    with jax.named_scope("patch_embed"):
      x = self.patch_embed(images)
      b, h, w, d = x.shape
      x = x.reshape(b, h * w, d)
    with jax.named_scope("pos_embed"):
      cls = jnp.broadcast_to(self.cls_token[...], (b, 1, d))
      x = jnp.concatenate([cls, x], axis=1) + self.pos_embed[...]
    for i, block in enumerate(self.blocks):
      with jax.named_scope(f"blocks_{i}"):
        x = block(x)
    with jax.named_scope("norm"):
      x = self.norm(x)
    with jax.named_scope("head"):
      return self.head(x[:, 0])


def image_batch_spec(cfg, batch: int, seq: int | None):
  """NHWC float32 images and int32 labels (shared with :mod:`hetspmd.models.cnn`)."""
  return {"inputs": jax.ShapeDtypeStruct((batch, cfg.image_size, cfg.image_size, cfg.channels), jnp.float32),
          "labels": jax.ShapeDtypeStruct((batch,), jnp.int32)}


CONFIGS = {
    # name: (config, published parameter count or None)
    "vit-tiny": (ViTConfig(image_size=32, patch_size=8, num_layers=2, d_model=64, num_heads=4, mlp_dim=256,
                           num_classes=10), None),
    "vit-b16": (ViTConfig(image_size=224, patch_size=16, num_layers=12, d_model=768, num_heads=12, mlp_dim=3072),
                86_567_656),
    "vit-l16": (ViTConfig(image_size=224, patch_size=16, num_layers=24, d_model=1024, num_heads=16, mlp_dim=4096),
                304_326_632),
}


def workloads() -> list[Workload]:
  return [
      Workload(
          name=name,
          family="vit",
          config=cfg,
          build=ViT,
          loss=classification_loss,
          batch_spec=image_batch_spec,
          make_optimizer=lambda: optax.adam(1e-3),
          default_batch=8 if published is None else 64,
          published_params=published,
          source="ViT (Dosovitskiy et al., 2021); timm parameter counts" if published else "test size",
          test_size=published is None,
      )
      for name, (cfg, published) in CONFIGS.items()
  ]
