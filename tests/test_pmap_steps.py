"""Train steps written for ``jax.pmap``, handed to ``hs.parallelize`` unchanged.

The shape is the one of pmap-era Flax image classification: gradients,
metrics and the new BatchNorm statistics averaged with ``lax.pmean`` over
the replicas' axis name, a ResNet whose BatchNorm syncs its statistics over
that name, and, for mixed precision, ``DynamicScale.value_and_grad(...,
axis_name=...)`` with float16 compute. Under hetspmd the axis means "the
whole global batch", whatever the plan's weighted counts; the reference is
the same step run as one replica holding the global batch
(``jax.vmap(step, in_axes=(None, 0), axis_name=...)`` over a leading axis
of size 1), compared in float32 and float64 (``exactness``).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import dynamic_scale as dynamic_scale_lib
from flax.training import train_state

import hetspmd as hs

from conftest import require_devices
from exactness import Reference, assert_exact

STEPS = 3
CLASSES, SIDE = 4, 6
AXIS = "replicas"  # any name: hetspmd takes it from the step
COUNTS, MICROBATCH = (3, 2, 2, 1, 1, 1, 1, 0), 2
BATCH = sum(COUNTS) * MICROBATCH


def one_replica(step, axis_name=AXIS, batch_argnum=1):
  """``step`` as ``pmap`` would run it on a single replica that holds the whole batch."""
  in_axes = [None] * 3
  in_axes[batch_argnum] = 0

  def run(*args):
    args = list(args)
    args[batch_argnum] = jax.tree.map(lambda x: x[None], args[batch_argnum])
    out = jax.vmap(step, in_axes=tuple(in_axes[:len(args)]), axis_name=axis_name)(*args)
    return jax.tree.map(lambda x: x[0], out)

  return run


class Block(nn.Module):
  width: int
  stride: int = 1
  dtype: object = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool):
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.8, axis_name=AXIS,
                             dtype=self.dtype)
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
    h = nn.relu(norm()(conv(self.width, (3, 3), (self.stride, self.stride))(x)))
    h = norm()(conv(self.width, (3, 3))(h))
    if x.shape != h.shape:
      x = norm()(conv(self.width, (1, 1), (self.stride, self.stride))(x))
    return nn.relu(x + h)


class SmallResNet(nn.Module):
  dtype: object = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(4, (3, 3), use_bias=False, dtype=self.dtype)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.8, axis_name=AXIS, dtype=self.dtype)(x))
    x = Block(4, dtype=self.dtype)(x, train)
    x = Block(6, stride=2, dtype=self.dtype)(x, train)
    return nn.Dense(CLASSES, dtype=self.dtype)(jnp.mean(x, axis=(1, 2))).astype(jnp.float32)


class State(train_state.TrainState):
  batch_stats: dict
  dynamic_scale: dynamic_scale_lib.DynamicScale | None = None


def make_state(dtype=jnp.float32, scale=None):
  model = SmallResNet(dtype)
  variables = jax.jit(functools.partial(model.init, train=False))(jax.random.key(3), jnp.zeros((2, SIDE, SIDE, 3)))
  return State.create(apply_fn=model.apply, params=variables["params"], batch_stats=variables["batch_stats"],
                      tx=optax.sgd(0.05, momentum=0.9), dynamic_scale=scale)


def cross_entropy(logits, labels):
  return -jnp.mean(jnp.sum(jax.nn.one_hot(labels, CLASSES) * nn.log_softmax(logits), axis=-1))


def pmap_train_step(state, batch, *, chunks=1):
  """A pmap-era step. ``chunks > 1`` (references only): the forward pass normalises each of ``chunks`` slices of
  the batch with its own statistics, as ``batch_stats="local"`` does with microbatches."""

  def loss_fn(params):
    images, labels = ([batch[k]] if chunks == 1 else jnp.split(batch[k], chunks) for k in ("image", "label"))
    losses, stats, logits = [], [], []
    for x, y in zip(images, labels):
      out, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, x,
                                    mutable=["batch_stats"])
      losses.append(cross_entropy(out, y))
      stats.append(updates["batch_stats"])
      logits.append(out)
    stats = jax.tree.map(lambda *s: sum(s) / len(s), *stats)
    return sum(losses) / chunks, (stats, jnp.concatenate(logits))

  (loss, (new_stats, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  grads = jax.lax.pmean(grads, axis_name=AXIS)
  new_stats = jax.lax.pmean(new_stats, axis_name=AXIS)
  metrics = jax.lax.pmean({"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])},
                          axis_name=AXIS)
  metrics["examples"] = jax.lax.psum(jnp.sum(batch["label"] >= 0), axis_name=AXIS)
  return state.apply_gradients(grads=grads, batch_stats=new_stats), metrics


def mixed_precision_step(state, batch):
  """The float16 variant: a dynamic loss scale over the replicas; an update whose gradients are not finite is
  skipped (parameters, optimizer state and statistics kept) and the scale backs off."""

  def loss_fn(params):
    logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, batch["image"],
                                     mutable=["batch_stats"])
    return cross_entropy(logits, batch["label"]), updates["batch_stats"]

  grad_fn = state.dynamic_scale.value_and_grad(loss_fn, has_aux=True, axis_name=AXIS)
  scale, is_finite, (loss, new_stats), grads = grad_fn(state.params)
  new_stats = jax.lax.pmean(new_stats, axis_name=AXIS)
  updated = state.apply_gradients(grads=grads, batch_stats=new_stats)
  keep = functools.partial(jax.tree.map, functools.partial(jnp.where, is_finite))
  new_state = updated.replace(params=keep(updated.params, state.params),
                              opt_state=keep(updated.opt_state, state.opt_state),
                              batch_stats=keep(updated.batch_stats, state.batch_stats), dynamic_scale=scale)
  return new_state, {"loss": jax.lax.pmean(loss, AXIS), "finite": is_finite, "scale": scale.scale}


def _batches(poisoned_step=None):
  rs = np.random.RandomState(11)
  out = []
  for i in range(STEPS):
    image = rs.randn(BATCH, SIDE, SIDE, 3).astype(np.float32)
    if i == poisoned_step:
      image[BATCH - 3, 0, 0, 0] = np.inf  # one example of a late microbatch: the update must be skipped
    out.append({"image": image, "label": rs.randint(0, CLASSES, BATCH).astype(np.int32)})
  return out


def _parallel(step_fn, state, **options):
  require_devices(8)
  cluster = hs.Cluster.emulate(jax.devices()[:8], kinds=["A100-40GB"] * 3 + ["V100-16GB"] * 5)
  plan = hs.plan_for(cluster, state, global_batch=BATCH, microbatch=MICROBATCH, counts=COUNTS)
  return hs.parallelize(step_fn, cluster=cluster, plan=plan, global_batch=BATCH, **options)


@pytest.mark.parametrize("batch_stats", ["exact", "local"])
def test_resnet_step_written_for_pmap(batch_stats):
  chunks = 1 if batch_stats == "exact" else BATCH // MICROBATCH
  ref = Reference(one_replica(functools.partial(pmap_train_step, chunks=chunks)), make_state()).run(_batches())
  step = _parallel(pmap_train_step, make_state(), batch_stats=batch_stats)
  state = step.shard_state(make_state())
  for i, batch in enumerate(_batches()):
    state, metrics = step(state, batch)
    ref.check_metrics(metrics, i)
    assert int(metrics["examples"]) == BATCH  # a psum over the replicas counts the global batch
  ref.check(state.params, lambda s: s.params)
  ref.check(state.batch_stats, lambda s: s.batch_stats)
  assert step.axis_name == (AXIS,)
  assert f"collectives over '{AXIS}' (pmap style)" in step.explain()


# float16 work is rounded to float16's unit wherever it sits, and hetspmd sums it in another order (each microbatch's
# weight gradients rounded to float16, then added in float32): the float64 reference widens float16 work too, and
# each metric and each leaf's total update must be within 8 float16 units of its size, or 8x the single-device
# step's distance, of the exact math. A dropped microbatch of 2 of the 22 examples moves them by about 10%.
EPS16 = float(jnp.finfo(jnp.float16).eps)


def _moved(after, before):
  return jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), after, before)


def test_mixed_precision_step_written_for_pmap_skips_a_non_finite_update():
  scale = dynamic_scale_lib.DynamicScale(scale=2.0 ** 8)
  batches = _batches(poisoned_step=1)
  initial = jax.device_get(make_state(jnp.float16, scale))
  ref = Reference(one_replica(mixed_precision_step), make_state(jnp.float16, scale), half=True)
  step = _parallel(mixed_precision_step, make_state(jnp.float16, scale), axis_name=AXIS, batch_stats="exact")
  state = step.shard_state(make_state(jnp.float16, scale))
  before = None
  for i, batch in enumerate(batches):
    ref.step(batch)
    params = jax.device_get(state.params)
    state, metrics = step(state, batch)
    finite = bool(metrics["finite"])
    assert finite == bool(ref.single_metrics[i]["finite"]) == (i != 1)
    if finite:
      assert_exact(metrics, ref.single_metrics[i], ref.ref64_metrics[i], eps=EPS16, what=f"metrics of step {i}")
    else:  # skipped: nothing moved, the scale halved
      assert not np.isfinite(float(metrics["loss"]))
      jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), params)
      assert float(metrics["scale"]) == float(before) / 2
    before = metrics["scale"]
  for part in ("params", "batch_stats"):
    start = getattr(initial, part)
    assert_exact(_moved(jax.device_get(getattr(state, part)), start), _moved(getattr(ref.single, part), start),
                 _moved(getattr(ref.ref64, part), start), eps=EPS16, what=part)


def test_axis_index_is_the_one_replicas():
  """``lax.axis_index`` is 0 and ``lax.axis_size`` 1: a per-replica dropout key folds in replica 0."""

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(CLASSES)(nn.Dropout(0.3, deterministic=False)(nn.relu(nn.Dense(12)(x))))

  def step(state, batch, key):
    key = jax.random.fold_in(key, jax.lax.axis_index(AXIS))

    def loss_fn(params):
      return cross_entropy(state.apply_fn({"params": params}, batch["x"], rngs={"dropout": key}), batch["y"])

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    grads = jax.tree.map(lambda g: g / jax.lax.axis_size(AXIS), jax.lax.psum(grads, AXIS))
    return state.apply_gradients(grads=grads), {"loss": jax.lax.pmean(loss, AXIS)}

  def fresh():
    params = Net().init(jax.random.key(0), jnp.zeros((1, 5)))["params"]
    return train_state.TrainState.create(apply_fn=Net().apply, params=params, tx=optax.adam(1e-2, eps=1e-3))

  rs = np.random.RandomState(2)
  batches = [{"x": rs.randn(BATCH, 5).astype(np.float32), "y": rs.randint(0, CLASSES, BATCH).astype(np.int32)}
             for _ in range(STEPS)]
  keys = [jax.random.key(10 + i) for i in range(STEPS)]
  ref = Reference(one_replica(step), fresh())
  parallel = _parallel(step, fresh())
  state = parallel.shard_state(fresh())
  for i, (batch, key) in enumerate(zip(batches, keys)):
    ref.step(batch, key)
    state, metrics = parallel(state, batch, key)
    ref.check_metrics(metrics, i)
  ref.check(state.params, lambda s: s.params)


def test_a_named_axis_the_step_does_not_use_is_refused():
  step = _parallel(pmap_train_step, make_state(), axis_name="batch")
  with pytest.raises(hs.HetSpmdError, match=f"collective over the axis name '{AXIS}'.*axis_name=\\('batch', "
                                            f"'{AXIS}'\\)"):
    step(step.shard_state(make_state()), _batches()[0])


def test_search_reads_a_pmap_step():
  cluster = hs.Cluster.parse("1x2xA100-40GB+1x2xV100-16GB")
  result = hs.search(pmap_train_step, make_state(), _batches()[0], cluster, global_batch=64, top=1)
  assert result.plans and result.plans[0].throughput > 0
