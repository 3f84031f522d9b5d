"""A step shaped like Flax's MNIST example: one jitted function makes the gradients, another applies them.

``apply_model(state, images, labels) -> (grads, loss, accuracy)`` takes the
images and labels as two batch arguments and returns no new state;
``update_model(state, grads)`` is a plain ``jax.jit`` of
``state.apply_gradients`` on the sharded state. Only ``apply_model`` is
parallelized, so the state it is given must stay alive (nothing donated).
Three steps on 8 emulated devices against one device.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import hetspmd as hs

from exactness import Reference
from test_unmodified_steps import STEPS, _cluster


class CNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.avg_pool(nn.relu(nn.Conv(4, (3, 3))(x)), (2, 2), (2, 2))
    x = x.reshape((x.shape[0], -1))
    return nn.Dense(10)(nn.relu(nn.Dense(16)(x)))


@jax.jit
def apply_model(state, images, labels):
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, images)
    loss = jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=jax.nn.one_hot(labels, 10)))
    return loss, logits

  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return grads, loss, jnp.mean(jnp.argmax(logits, -1) == labels)


@jax.jit
def update_model(state, grads):
  return state.apply_gradients(grads=grads)


def _state():
  model = CNN()
  params = model.init(jax.random.key(0), jnp.ones((1, 8, 8, 1)))["params"]
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1, momentum=0.9))


def test_mnist_apply_then_update_is_exact():
  counts, microbatch = (3, 3, 2, 2, 2, 1, 1, 0), 2
  batch = sum(counts) * microbatch
  rs = np.random.RandomState(0)
  data = [(rs.randn(batch, 8, 8, 1).astype(np.float32), rs.randint(0, 10, batch).astype(np.int32))
          for _ in range(STEPS)]
  def mnist_step(state, images, labels):  # the two functions one after the other, as one step for the reference
    grads, loss, accuracy = apply_model(state, images, labels)
    return update_model(state, grads), {"loss": loss, "accuracy": accuracy}

  ref = Reference(mnist_step, _state())
  for images, labels in data:
    ref.step(images, labels)

  cluster = _cluster()
  state = _state()
  plan = hs.plan_for(cluster, state, global_batch=batch, microbatch=microbatch, counts=counts)
  step = hs.parallelize(apply_model, cluster=cluster, plan=plan, global_batch=batch)
  state = step.shard_state(state)
  for i, (images, labels) in enumerate(data):
    grads, got_loss, got_accuracy = step(state, images, labels)
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))  # no new state came back: none donated
    state = update_model(state, grads)
    ref.check_metrics({"loss": got_loss, "accuracy": got_accuracy}, i)
  ref.check(state.params, lambda s: s.params)
  assert int(state.step) == STEPS
