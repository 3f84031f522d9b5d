"""A small NNX model and its in-place train step, shaped as Flax's NNX toy examples shape them: a
``nnx.Sequential`` of two ``nnx.Linear`` layers, an ``nnx.Optimizer`` over its ``nnx.Param``\\ s, and a step that
takes ``nnx.value_and_grad`` of a closure over the batch and updates the optimizer in place."""

import numpy as np
import optax
from flax import nnx


def make(tx: optax.GradientTransformation):
  """A fresh model (the same initial values on every call) and its optimizer."""
  model = nnx.Sequential(nnx.Linear(16, 32, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(32, 4, rngs=nnx.Rngs(1)))
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def train_step(model, optimizer, batch):
  def loss_fn(model):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def batch(n: int = 32) -> dict:
  rng = np.random.default_rng(0)
  return {"x": rng.normal(size=(n, 16)).astype(np.float32), "y": rng.integers(0, 4, n).astype(np.int32)}
