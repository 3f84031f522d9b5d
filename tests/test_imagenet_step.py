"""An image-classification step shaped like Flax's ImageNet example, run unchanged under uneven plans.

A small ResNet (convolutions without bias, BatchNorm with running averages
in a mutable ``batch_stats`` collection, residual blocks with a projection
shortcut), a one-hot cross entropy averaged over the batch, an L2 penalty
over the kernels added inside the loss (example-free: its gradient must be
added once, not once per microbatch), SGD with Nesterov momentum on a
warmup-cosine schedule, the new statistics taken from the loss's aux output,
and accuracy and the learning rate as metrics. Three steps on 8 emulated
devices against the same step on one device, with the global batch's
statistics (``batch_stats="exact"``).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import hetspmd as hs

from exactness import Reference
from test_unmodified_steps import STEPS, _cluster, run_planned

CLASSES, SIZE = 5, 8
WEIGHT_DECAY = 1e-2


class Residual(nn.Module):
  features: int
  strides: int = 1

  @nn.compact
  def __call__(self, x, train: bool):
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5)
    y = nn.relu(norm()(nn.Conv(self.features, (3, 3), (self.strides, self.strides), use_bias=False)(x)))
    y = norm(scale_init=nn.initializers.zeros)(nn.Conv(self.features, (3, 3), use_bias=False)(y))
    if x.shape != y.shape:
      x = norm()(nn.Conv(self.features, (1, 1), (self.strides, self.strides), use_bias=False)(x))
    return nn.relu(x + y)


class TinyResNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(4, (3, 3), use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    x = Residual(4)(x, train)
    x = Residual(8, strides=2)(x, train)
    return nn.Dense(CLASSES)(jnp.mean(x, axis=(1, 2)))


class State(train_state.TrainState):
  batch_stats: dict


def imagenet_train_step(state, batch, learning_rate_fn):
  def loss_fn(params):
    logits, new_model_state = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, batch["image"],
                                             mutable=["batch_stats"])
    one_hot = jax.nn.one_hot(batch["label"], CLASSES)
    loss = -jnp.mean(jnp.sum(one_hot * nn.log_softmax(logits), axis=-1))
    weight_l2 = sum(jnp.sum(x ** 2) for x in jax.tree.leaves(params) if x.ndim > 1)
    return loss + WEIGHT_DECAY * 0.5 * weight_l2, (new_model_state, logits)

  lr = learning_rate_fn(state.step)
  (loss, (new_model_state, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  new_state = state.apply_gradients(grads=grads, batch_stats=new_model_state["batch_stats"])
  metrics = {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"]), "learning_rate": lr}
  return new_state, metrics


def _state(schedule):
  model = TinyResNet()
  variables = jax.jit(functools.partial(model.init, train=False))(jax.random.key(0), jnp.zeros((2, SIZE, SIZE, 3)))
  return State.create(apply_fn=model.apply, params=variables["params"], batch_stats=variables["batch_stats"],
                      tx=optax.sgd(schedule, momentum=0.9, nesterov=True))


def _batches(batch):
  rs = np.random.RandomState(5)
  return [{"image": rs.randn(batch, SIZE, SIZE, 3).astype(np.float32),
           "label": rs.randint(0, CLASSES, batch).astype(np.int32)} for _ in range(STEPS)]


CASES = [
    # (data, model) layout, counts, microbatch
    ((8, 1), (3, 2, 2, 2, 1, 1, 1, 0), 2),
    ((8, 1), (1,) * 8, 4),
]


@pytest.mark.parametrize("layout,counts,microbatch", CASES, ids=[f"{c[1]}-mb{c[2]}" for c in CASES])
def test_imagenet_step_is_exact(layout, counts, microbatch):
  batch = sum(counts) * microbatch
  schedule = optax.warmup_cosine_decay_schedule(0.0, 0.1, warmup_steps=1, decay_steps=10)
  step_fn = functools.partial(imagenet_train_step, learning_rate_fn=schedule)
  batches = _batches(batch)
  ref = Reference(step_fn, _state(schedule)).run(batches)

  _, state = run_planned(step_fn, _state(schedule), batches, ref, layout, microbatch, counts,
                         options={"batch_stats": "exact"})
  ref.check(state.params, lambda s: s.params)
  ref.check(state.batch_stats, lambda s: s.batch_stats)
  assert int(state.step) == STEPS


def test_the_weight_penalty_is_added_once():
  """On all-zero images every feature is zero, so the classifier kernel's gradient is the penalty's alone.

  Its first update is then ``-lr * 1.9 * WEIGHT_DECAY * kernel`` (Nesterov with momentum 0.9 from a zero
  trace): counted once per microbatch or per position it would be 15 or 8 times that.
  """
  counts, microbatch = (3, 2, 2, 2, 1, 1, 1, 0), 2
  batch = sum(counts) * microbatch
  schedule = optax.constant_schedule(0.1)
  step_fn = functools.partial(imagenet_train_step, learning_rate_fn=schedule)
  zero = {"image": np.zeros((batch, SIZE, SIZE, 3), np.float32), "label": np.zeros(batch, np.int32)}
  cluster = _cluster()
  plan = hs.plan_for(cluster, _state(schedule), global_batch=batch, microbatch=microbatch, counts=counts)
  step = hs.parallelize(step_fn, cluster=cluster, plan=plan, global_batch=batch, batch_stats="exact")
  state, _ = step(step.shard_state(_state(schedule)), zero)
  kernel = np.asarray(_state(schedule).params["Dense_0"]["kernel"])
  moved = np.asarray(state.params["Dense_0"]["kernel"]) - kernel
  ref = Reference(step_fn, _state(schedule)).run([zero])  # one device: the penalty once, in float32 and float64
  ref.check(state.params, lambda s: s.params)
  # and in closed form: 15 or 8 times the penalty would be off by 14 or 7 times the update itself
  np.testing.assert_allclose(moved, -0.1 * 1.9 * WEIGHT_DECAY * kernel, rtol=1e-4, atol=1e-9)


def _fused_step(schedule, batch_stats):
  counts, microbatch = (3, 3, 2, 2, 2, 2, 2, 2), 2
  batch = sum(counts) * microbatch
  cluster = _cluster()
  plan = hs.plan_for(cluster, _state(schedule), global_batch=batch, microbatch=microbatch, counts=counts,
                     overlap_reduction=True, overlap_microbatches=2)
  step_fn = functools.partial(imagenet_train_step, learning_rate_fn=schedule)
  return step_fn, hs.parallelize(step_fn, cluster=cluster, plan=plan, global_batch=batch, batch_stats=batch_stats)


@pytest.mark.timeout(300)
def test_fused_overlapped_pass_with_exact_batch_statistics():
  """Exact statistics are the global batch's, made in earlier loops: the final loop's last 2 microbatches may
  run as one batch."""
  schedule = optax.constant_schedule(0.1)
  step_fn, step = _fused_step(schedule, "exact")
  batches = _batches(step.plan.global_batch)
  ref, state = Reference(step_fn, _state(schedule)), step.shard_state(_state(schedule))
  for i, b in enumerate(batches):
    ref.step(b)
    state, metrics = step(state, b)
    ref.check_metrics({"loss": metrics["loss"]}, i)
  ref.check(state.params, lambda s: s.params)
  ref.check(state.batch_stats, lambda s: s.batch_stats)


def test_fused_overlapped_pass_is_refused_per_microbatch_statistics():
  schedule = optax.constant_schedule(0.1)
  _, step = _fused_step(schedule, "local")
  with pytest.raises(hs.HetSpmdError, match="overlap_microbatches=2 would compute batch statistics over 2"):
    step(step.shard_state(_state(schedule)), _batches(step.plan.global_batch)[0])


class _NormedMLP(nn.Module):
  width: int = 1024

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Dense(self.width)(x)))
    return nn.Dense(CLASSES)(nn.relu(nn.Dense(self.width)(x)))


def _normed_state():
  model = _NormedMLP()
  variables = model.init(jax.random.key(0), jnp.zeros((2, 64)), train=False)
  return State.create(apply_fn=model.apply, params=variables["params"], batch_stats=variables["batch_stats"],
                      tx=optax.sgd(0.01))


def _normed_step(state, batch):
  def loss_fn(params):
    logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, batch["x"],
                                     mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean(), updates

  (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"]), {"loss": loss}


@pytest.mark.timeout(300)
def test_search_keeps_the_overlapped_pass_unfused_under_per_microbatch_statistics():
  """The search would fuse the overlapped pass here (wide layers, uneven kinds) but for the BatchNorm."""
  batch_size = 4096
  rs = np.random.RandomState(0)
  batch = {"x": rs.randn(batch_size, 64).astype(np.float32), "label": rs.randint(0, CLASSES, batch_size)}
  for batch_stats, fused in (("local", False), ("exact", True)):
    step = hs.parallelize(_normed_step, cluster=_cluster(), plan="search", global_batch=batch_size,
                          example_batch=batch, batch_stats=batch_stats)
    state = step.shard_state(_normed_state())
    assert (step.plan.overlap_microbatches > 1) == fused, (batch_stats, step.plan.summary())
    state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
