"""An NNX model whose layers are stacked with ``nnx.vmap`` and run with ``nnx.scan``, trained in place.

Each layer owns a dropout rng stream, so the stacked streams' counters
advance inside the scan over layers: the step returns them (NNX writes
them back into the model) although no example reaches them. With
``nnx.remat`` on the layers the scan also hands the stacked parameters back,
and the optimizer update reads them from there. hetspmd runs the scan per
microbatch inside its loop and, for such values, a copy of the scan pruned
to them once before the loop. Three steps on 8 emulated devices against
``nnx.jit`` on one device (Adam, and Adam under ``optax.MultiSteps``):
parameters, metrics and every rng counter.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import hetspmd as hs

from exactness import NnxReference
from test_unmodified_steps import _cluster, _image_batches, check_nnx

LAYERS, WIDTH, CLASSES = 3, 12, 5


class Block(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.dropout = nnx.Dropout(0.2, rngs=rngs)

  def __call__(self, x):
    return x + self.dropout(nnx.gelu(self.linear(self.norm(x))))


class ScannedMLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stack(rngs: nnx.Rngs):
      return Block(rngs)

    self.blocks = stack(rngs)
    self.head = nnx.Linear(WIDTH, CLASSES, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def run(block, x):
      return block(x)

    return self.head(run(self.blocks, x))


class RematScannedMLP(ScannedMLP):
  """The same stack, each layer checkpointed (``nnx.remat`` inside ``nnx.scan``): the scan then hands the
  stacked parameters back as the blocks' new state, and the optimizer update reads them from it."""

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    @nnx.remat
    def run(block, x):
      return block(x)

    return self.head(run(self.blocks, x))


def loss_fn(model, batch):
  logits = model(batch["image"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean(), logits


def train_step(model, optimizer, metrics, batch):
  (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])
  optimizer.update(model, grads)


OPTIMIZERS = {"adam": lambda: optax.adam(1e-2, eps=1e-4),
              "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2, eps=1e-4), every_k_schedule=2)}


def _objects(model_class, optimizer):
  model = model_class(nnx.Rngs(params=0, dropout=1))
  optimizer = nnx.Optimizer(model, OPTIMIZERS[optimizer](), wrt=nnx.Param)
  return model, optimizer, nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))


CASES = [
    # model, optimizer, (data, model) layout, counts
    (ScannedMLP, "adam", (8, 1), (3, 3, 2, 2, 2, 1, 1, 0)),
    (ScannedMLP, "adam", (4, 2), (2, 2, 1, 1)),
    (RematScannedMLP, "adam", (8, 1), (3, 3, 2, 2, 2, 1, 1, 0)),
    (RematScannedMLP, "multisteps", (8, 1), (3, 3, 2, 2, 2, 1, 1, 0)),
]


@pytest.mark.parametrize("model_class,optimizer,layout,counts", CASES,
                         ids=[f"{c[0].__name__}-{c[1]}-{c[2]}" for c in CASES])
def test_scanned_nnx_layers_are_exact(model_class, optimizer, layout, counts):
  microbatch = 2
  batch = sum(counts) * microbatch
  batches = _image_batches(batch, shape=(WIDTH,), classes=CLASSES)
  reference = NnxReference(train_step, _objects(model_class, optimizer)).run(batches)
  ref = reference.single
  mine = _objects(model_class, optimizer)
  plan = hs.plan_for(_cluster(), nnx.state(mine), global_batch=batch, layout=layout, microbatch=microbatch,
                     counts=counts)
  step = hs.parallelize(train_step, cluster=_cluster(), plan=plan, global_batch=batch)
  for b in batches:
    assert step(*mine, b) is None
  check_nnx(reference, mine)
  counters = [(nnx.state(m, nnx.RngCount)) for m in (ref[0], mine[0])]
  expected, actual = (jax.tree.map(np.asarray, c) for c in counters)
  assert jax.tree.structure(expected) == jax.tree.structure(actual)
  for e, a in zip(jax.tree.leaves(expected), jax.tree.leaves(actual)):
    np.testing.assert_array_equal(a, e)
  stacked = np.asarray(mine[0].blocks.dropout.rngs.count[...])
  assert stacked.shape == (LAYERS,) and (stacked == len(batches)).all()  # one draw per layer per step
