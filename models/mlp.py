"""A multilayer perceptron classifier in Flax NNX (the smallest workload).

Layers ``dense_0 .. dense_{n-1}`` with ReLU between them, softmax cross
entropy over integer labels. Each layer runs under ``jax.named_scope``.
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
class MLPConfig:
  features: tuple[int, ...]  # input width, hidden widths..., number of classes

  def __post_init__(self):
    if len(self.features) < 2 or any(f < 1 for f in self.features):
      raise InvalidValueError(f"MLPConfig.features needs at least two positive widths (input, ..., classes), "
                              f"got {self.features!r}")

  @property
  def num_classes(self) -> int:
    return self.features[-1]


class MLP(nnx.Module):
  def __init__(self, cfg: MLPConfig, rngs: nnx.Rngs):
    pairs = zip(cfg.features[:-1], cfg.features[1:])
    self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in pairs])

  def __call__(self, x: jax.Array) -> jax.Array:
    for i, layer in enumerate(self.layers):
      with jax.named_scope(f"dense_{i}"):
        x = layer(x)
        if i + 1 < len(self.layers):
          x = jax.nn.relu(x)
    return x


def classification_loss(model: MLP, batch):
  logits = model(batch["inputs"])
  with jax.named_scope("loss"):
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["labels"])
    return jnp.mean(losses), {"accuracy": accuracy}


def classification_batch_spec(cfg: MLPConfig, batch: int, seq: int | None):
  return {"inputs": jax.ShapeDtypeStruct((batch, cfg.features[0]), jnp.float32),
          "labels": jax.ShapeDtypeStruct((batch,), jnp.int32)}


CONFIGS = {
    "mlp-tiny": MLPConfig((32, 64, 64, 8)),
    "mlp": MLPConfig((784, 2048, 2048, 2048, 10)),
}


def workloads() -> list[Workload]:
  return [
      Workload(name=name, family="mlp", config=cfg, build=MLP, loss=classification_loss,
               batch_spec=classification_batch_spec, make_optimizer=lambda: optax.adam(1e-3),
               default_batch=16 if name == "mlp-tiny" else 256, test_size=name == "mlp-tiny",
               source="test size" if name == "mlp-tiny" else "synthetic 784-input classifier")
      for name, cfg in CONFIGS.items()
  ]
