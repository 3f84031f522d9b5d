"""Train steps written the way Flax users write them, run unchanged under uneven plans.

Each case trains 3 steps on 8 emulated devices with uneven microbatch counts
and compares with the same step run on one device, in float32 and as the same
math in float64 (``exactness``): parameters and metrics no further from float64
than a small factor times the single-device step's own rounding.
"""

import functools
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import hetspmd as hs

from conftest import require_devices
from exactness import NnxReference, Reference, assert_exact

KINDS = ["V100-32GB"] * 4 + ["P100-16GB"] * 4
STEPS = 3
VOCAB, SEQ = 40, 6


def _cluster():
  require_devices(8)
  return hs.Cluster.emulate(jax.devices()[:8], kinds=KINDS)


def _close(expected, actual, rtol=1e-4):
  for (path, e), a in zip(jax.tree_util.tree_flatten_with_path(expected)[0], jax.tree.leaves(actual)):
    e, a = np.asarray(e), np.asarray(a)
    scale = max(float(np.max(np.abs(e))), 1e-3)
    assert float(np.max(np.abs(e - a))) <= rtol * scale, jax.tree_util.keystr(path)


def _metrics_close(expected, actual, rtol=1e-5):
  for e, a in zip(jax.tree.leaves(expected), jax.tree.leaves(actual)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=1e-6)


def run_planned(step_fn, state, batches, ref, layout=(8, 1), microbatch=1, counts=None, options=None,
                **call_kwargs):
  """Trains ``state`` on ``batches`` with ``step_fn`` under a plan on 8 emulated devices, checking every step's
  metrics against ``ref`` (an ``exactness.Reference``); the step and the final state."""
  cluster = _cluster()
  batch = sum(counts) * microbatch
  plan = hs.plan_for(cluster, state, global_batch=batch, layout=layout, microbatch=microbatch, counts=counts)
  step = hs.parallelize(step_fn, cluster=cluster, plan=plan, global_batch=batch, **(options or {}))
  state = step.shard_state(state)
  for i, b in enumerate(batches):
    state, metrics = step(state, b, **call_kwargs)
    ref.check_metrics(metrics, i)
  return step, state


def _token_batches(batch, seed=0):
  rs = np.random.RandomState(seed)
  out = []
  for _ in range(STEPS):
    inputs = rs.randint(0, VOCAB, (batch, SEQ)).astype(np.int32)
    inputs[:, -2:] *= rs.randint(0, 2, (batch, 1))  # padding (token 0) at the end of some rows
    out.append({"inputs": inputs, "targets": np.roll(inputs, -1, axis=1)})
  return out


# --- Flax Linen, TrainState, the lm1b pattern ------------------------------------------


class TinyLM(nn.Module):
  """Embedding, a dropout-regularised MLP block, a tied-free output layer."""

  dropout: float = 0.1

  @nn.compact
  def __call__(self, tokens, train: bool):
    x = nn.Embed(VOCAB, 16)(tokens)
    h = nn.LayerNorm()(x)
    h = nn.Dense(32)(h)
    h = nn.Dropout(self.dropout, deterministic=not train)(nn.gelu(h))
    x = x + nn.Dense(16)(h)
    return nn.Dense(VOCAB)(x)


def lm1b_train_step(state, batch, config, learning_rate_fn, dropout_rng=None):
  """A step as lm1b writes it: a closure over the batch, token weights outside the loss, logits as aux."""
  inputs, targets = batch["inputs"], batch["targets"]
  weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)
  dropout_rng = jax.random.fold_in(dropout_rng, state.step)

  def loss_fn(params):
    logits = state.apply_fn({"params": params}, inputs, train=True, rngs={"dropout": dropout_rng})
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights
    weight_sum = weights.sum()
    return loss.sum() / weight_sum, (logits, weight_sum)

  step = state.step
  lr = learning_rate_fn(step)
  (_, (logits, weight_sum)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  del config
  new_state = state.apply_gradients(grads=grads)
  loss = (optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights).sum()
  accuracy = ((jnp.argmax(logits, -1) == targets) * weights).sum()
  metrics = {"loss": loss, "accuracy": accuracy, "denominator": weight_sum, "learning_rate": lr}
  return new_state, metrics


def _lm_state():
  model = TinyLM()
  params = model.init(jax.random.key(0), jnp.zeros((2, SEQ), jnp.int32), train=False)["params"]
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(3e-3, eps=1e-4))


LM_CASES = [
    # (data, model) layout, counts, microbatch, wrapped in jax.jit
    ((8, 1), (3, 3, 2, 2, 1, 1, 1, 0), 2, False),
    ((8, 1), (2, 2, 2, 2, 1, 1, 1, 1), 3, True),
    ((4, 2), (3, 2, 2, 1), 2, True),
    ((2, 4), (5, 3), 2, False),
]


@pytest.mark.parametrize("layout,counts,microbatch,jitted", LM_CASES,
                         ids=[f"{c[0]}-{c[1]}-mb{c[2]}{'-jit' if c[3] else ''}" for c in LM_CASES])
def test_linen_lm1b_step_is_exact(layout, counts, microbatch, jitted):
  batch = sum(counts) * microbatch
  schedule = optax.linear_schedule(1e-3, 1e-4, 10)
  step_fn = functools.partial(lm1b_train_step, config=None, learning_rate_fn=schedule)
  if jitted:
    step_fn = jax.jit(step_fn)
  batches = _token_batches(batch)
  rng = jax.random.key(7)
  ref = Reference(step_fn, _lm_state()).run(batches, dropout_rng=rng)

  step, state = run_planned(step_fn, _lm_state(), batches, ref, layout, microbatch, counts, dropout_rng=rng)
  ref.check(state.params, lambda s: s.params)
  assert int(state.step) == STEPS
  text = step.explain()
  assert "2 microbatch loop(s)" in text  # weight_sum scales the backward pass: an earlier, cheap loop
  assert "per-device trip counts" in text
  # each microbatch draws only its own slice of the dropout mask (TinyLM's hidden width is 32)
  program = step.lower(state, batches[0], dropout_rng=rng).as_text()
  assert f"{batch}x{SEQ}x32xui32" not in program and f"{microbatch}x{SEQ}x32xui32" in program


class TinyDecoder(nn.Module):
  """lm1b's masking: padding and causal masks combined, attention with dropout."""

  @nn.compact
  def __call__(self, tokens, train: bool):
    mask = nn.combine_masks(nn.make_attention_mask(tokens > 0, tokens > 0), nn.make_causal_mask(tokens))
    x = nn.Embed(VOCAB, 16)(tokens)
    x = x + nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.1, deterministic=not train)(
        nn.LayerNorm()(x), mask=mask)
    return nn.Dense(VOCAB)(x)


def test_lm1b_masks_are_built_per_microbatch():
  model = TinyDecoder()
  params = model.init(jax.random.key(0), jnp.ones((2, SEQ), jnp.int32), train=False)["params"]
  state0 = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3, eps=1e-4))
  step_fn = functools.partial(lm1b_train_step, config=None, learning_rate_fn=lambda s: 1e-3)
  counts, microbatch = (3, 2, 2, 1, 1, 1, 1, 1), 2
  batch = sum(counts) * microbatch
  batches, rng = _token_batches(batch, seed=5), jax.random.key(9)
  ref = Reference(step_fn, state0).run(batches, dropout_rng=rng)
  cluster = _cluster()
  plan = hs.plan_for(cluster, state0, global_batch=batch, microbatch=microbatch, counts=counts)
  step = hs.parallelize(step_fn, cluster=cluster, plan=plan, global_batch=batch)
  state = step.shard_state(state0)
  program = step.lower(state, batches[0], dropout_rng=rng).as_text()
  for b in batches:
    state, metrics = step(state, b, dropout_rng=rng)
  ref.check_metrics(metrics, len(batches) - 1)
  ref.check(state.params, lambda s: s.params)
  # neither the causal mask nor the attention dropout's draw is made at the global batch
  assert f"tensor<{batch}x1x{SEQ}x{SEQ}x" not in program and f"tensor<{batch}x2x{SEQ}x{SEQ}x" not in program


@pytest.mark.parametrize("overlap", [False, True], ids=["loop", "overlapped"])
def test_lockstep_loop_is_exact(overlap):
  """Where XLA puts a global-rendezvous collective in the loop, every position runs the largest count, masked
  (overlapped: the last of them after the loop, masked too)."""
  counts, microbatch = (3, 2, 2, 1, 1, 1, 1, 0), 2
  batch = sum(counts) * microbatch
  step_fn = functools.partial(lm1b_train_step, config=None, learning_rate_fn=lambda s: 1e-3)
  b, rng = _token_batches(batch)[0], jax.random.key(3)
  ref = Reference(step_fn, _lm_state()).run([b], dropout_rng=rng)
  cluster = _cluster()
  plan = hs.plan_for(cluster, _lm_state(), global_batch=batch, microbatch=microbatch, counts=counts,
                     overlap_reduction=overlap)
  step = hs.parallelize(step_fn, cluster=cluster, plan=plan, global_batch=batch)
  placed = step.shard_state(_lm_state())
  step._runner._lockstep = True  # as if the compiled loop held a collective-permute
  state, metrics = step(placed, b, dropout_rng=rng)
  ref.check_metrics(metrics, 0)
  ref.check(state.params, lambda s: s.params)
  assert "in lockstep" in step.explain()


@pytest.mark.parametrize("overlap", [False, True], ids=["loop", "overlapped"])
def test_per_example_outputs_come_back_whole_in_global_order(overlap):
  counts, microbatch = (3, 1, 2, 2, 1, 0, 1, 2), 2
  batch = sum(counts) * microbatch

  def step_fn(state, batch):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, batch["inputs"], train=False)
      per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean(-1)
      return per_example.mean(), per_example
    (loss, per_example), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss, "per_example": per_example}

  b = _token_batches(batch)[0]
  ref = Reference(step_fn, _lm_state()).run([b])
  cluster = _cluster()
  plan = hs.plan_for(cluster, _lm_state(), global_batch=batch, microbatch=microbatch, counts=counts,
                     overlap_reduction=overlap)
  step = hs.parallelize(step_fn, cluster=cluster, plan=plan, global_batch=batch)
  _, metrics = step(step.shard_state(_lm_state()), b)
  assert metrics["per_example"].shape == (batch,)
  ref.check_metrics(metrics, 0)


# --- Flax NNX, in place, the mnist pattern ------------------------------------------


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.linear1 = nnx.Linear(12, 24, rngs=rngs)
    self.dropout = nnx.Dropout(0.2, rngs=rngs)
    self.linear2 = nnx.Linear(24, 5, rngs=rngs)

  def __call__(self, x):
    return self.linear2(self.dropout(nnx.relu(self.linear1(x))))


def nnx_loss_fn(model, batch):
  logits = model(batch["image"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return loss, logits


def nnx_train_step(model, optimizer, metrics, batch):
  grad_fn = nnx.value_and_grad(nnx_loss_fn, has_aux=True)
  (loss, logits), grads = grad_fn(model, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])
  optimizer.update(model, grads)


def _nnx_objects():
  model = MLP(nnx.Rngs(params=0, dropout=1))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2, eps=1e-4), wrt=nnx.Param)
  metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
  return model, optimizer, metrics


def check_nnx(ref, mine):
  """``mine`` (model, optimizer, metrics) after a planned run against ``ref``, an ``NnxReference``."""
  ref64 = ref.ref64
  assert_exact(mine[2].compute(), ref.single[2].compute(), ref64[2].compute(), what="metrics")
  assert_exact(nnx.state(mine[0], nnx.Param), nnx.state(ref.single[0], nnx.Param), nnx.state(ref64[0], nnx.Param),
               what="parameters")


def _image_batches(batch, shape=(12,), classes=5):
  rs = np.random.RandomState(3)
  return [{"image": rs.randn(batch, *shape).astype(np.float32),
           "label": rs.randint(0, classes, batch).astype(np.int32)} for _ in range(STEPS)]


@pytest.mark.parametrize("wrap", ["none", "nnx.jit"])
@pytest.mark.parametrize("layout,counts", [((8, 1), (3, 3, 2, 2, 2, 1, 1, 0)), ((4, 2), (2, 2, 1, 1))])
def test_nnx_in_place_step_is_exact(wrap, layout, counts):
  microbatch = 2
  batch = sum(counts) * microbatch
  step_fn = nnx.jit(nnx_train_step) if wrap == "nnx.jit" else nnx_train_step
  batches = _image_batches(batch)
  ref = NnxReference(nnx_train_step, _nnx_objects()).run(batches)
  mine = _nnx_objects()
  cluster = _cluster()
  plan = hs.plan_for(cluster, nnx.state(mine), global_batch=batch, layout=layout, microbatch=microbatch,
                     counts=counts)
  step = hs.parallelize(step_fn, cluster=cluster, plan=plan, global_batch=batch)
  for b in batches:
    assert step(*mine, b) is None
  check_nnx(ref, mine)
  assert int(mine[1].step[...]) == STEPS
  kernel = mine[0].linear1.kernel[...]
  assert kernel.sharding.mesh.shape["data"] == layout[0]  # the objects now hold the plan's shardings


@pytest.mark.parametrize("batch_argnums", [None, 0])
def test_nnx_cached_partial_step_is_exact(batch_argnums):
  """``nnx.cached_partial(train_step, model, optimizer, metrics)`` called with the batch alone, as Flax
  suggests for repeated steps: the bound objects are the step's state, updated in place."""
  counts, microbatch = (3, 3, 2, 2, 2, 1, 1, 0), 2
  batch = sum(counts) * microbatch
  batches = _image_batches(batch)
  ref = NnxReference(nnx_train_step, _nnx_objects()).run(batches)
  mine = _nnx_objects()
  cached = nnx.cached_partial(nnx.jit(nnx_train_step), *mine)
  cluster = _cluster()
  plan = hs.plan_for(cluster, nnx.state(mine), global_batch=batch, microbatch=microbatch, counts=counts)
  step = hs.parallelize(cached, cluster=cluster, plan=plan, global_batch=batch, batch_argnums=batch_argnums)
  for b in batches:
    assert step(b) is None
  check_nnx(ref, mine)
  assert int(mine[1].step[...]) == STEPS


def test_nnx_step_with_an_auto_plan_weights_by_speed():
  model, optimizer, metrics = _nnx_objects()
  step = hs.parallelize(nnx_train_step, cluster=_cluster(), global_batch=64)
  step(model, optimizer, metrics, _image_batches(64)[0])
  counts = step.plan.microbatch_counts
  assert counts[0] > counts[-1] and sum(counts) * step.plan.microbatch == 64
  assert np.isfinite(float(metrics.compute()["loss"]))


# --- BatchNorm: per-microbatch statistics by default, exact on request ------------------


class ConvBN(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Conv(6, (3, 3), use_bias=False)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    x = nn.relu(x)
    x = nn.avg_pool(x, (2, 2), (2, 2)).reshape(x.shape[0], -1)
    return nn.Dense(5)(x)


class BNState(train_state.TrainState):
  batch_stats: dict


def _bn_state():
  model = ConvBN()
  variables = model.init(jax.random.key(0), jnp.zeros((2, 8, 8, 1)), train=False)
  return BNState.create(apply_fn=model.apply, params=variables["params"], tx=optax.sgd(0.1),
                        batch_stats=variables["batch_stats"])


def bn_train_step(state, batch):
  """The imagenet example's pattern: batch_stats mutable in the loss, new statistics from its aux output."""

  def loss_fn(params):
    logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, batch["image"],
                                     train=True, mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, updates

  (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  state = state.apply_gradients(grads=grads).replace(batch_stats=updates["batch_stats"])
  return state, {"loss": loss}


def _microbatch_bn_step(microbatch):
  """One device, each microbatch normalised with its own statistics; the new running averages are the mean of
  the microbatches' (as data parallel training with per-device BatchNorm averages its devices')."""

  def step(state, batch):
    n = batch["image"].shape[0]

    def loss_fn(params):
      total, stats = 0.0, []
      for i in range(0, n, microbatch):
        logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                         batch["image"][i:i + microbatch], train=True, mutable=["batch_stats"])
        total += optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"][i:i + microbatch]).sum()
        stats.append(updates["batch_stats"])
      return total / n, jax.tree.map(lambda *xs: sum(xs) / len(xs), *stats)

    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads).replace(batch_stats=stats), {"loss": loss}

  return step


@pytest.mark.parametrize("batch_stats", ["exact", "local"])
def test_batch_norm_statistics(batch_stats):
  counts, microbatch = (2, 2, 2, 1, 1, 1, 1, 0), 2
  batch = sum(counts) * microbatch
  batches = _image_batches(batch, shape=(8, 8, 1))
  if batch_stats == "exact":
    ref = Reference(bn_train_step, _bn_state()).run(batches)
  else:
    ref = Reference(_microbatch_bn_step(microbatch), _bn_state()).run(batches)
  cluster = _cluster()
  plan = hs.plan_for(cluster, _bn_state(), global_batch=batch, microbatch=microbatch, counts=counts)
  step = hs.parallelize(bn_train_step, cluster=cluster, plan=plan, global_batch=batch, batch_stats=batch_stats)
  state = step.shard_state(_bn_state())
  for i, b in enumerate(batches):
    state, metrics = step(state, b)
    ref.check_metrics(metrics, i)
  ref.check(state.params, lambda s: s.params)
  ref.check(state.batch_stats, lambda s: s.batch_stats)
  if batch_stats == "exact":
    assert "microbatch loop(s)" in step.explain() and "per microbatch" not in step.explain()
  else:
    assert "batch statistics per microbatch of 2" in step.explain()


# --- scan over layers, with and without remat ---------------------------------------------


class ScanBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return x + nn.Dense(16)(nn.gelu(nn.LayerNorm()(x))), None


class ScanLM(nn.Module):
  remat: bool = False

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, 16)(tokens)
    block = nn.remat(ScanBlock) if self.remat else ScanBlock
    x, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)()(x, None)
    return nn.Dense(VOCAB)(x)


def _classifier_step(inputs: str, labels: str):
  """A TrainState step with a mean cross-entropy over ``batch[inputs]`` against ``batch[labels]``."""

  def train_step(state, batch):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, batch[inputs])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch[labels]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  return train_step


@pytest.mark.parametrize("remat", [False, True])
def test_scan_over_layers_is_exact(remat):
  model = ScanLM(remat)
  params = model.init(jax.random.key(0), jnp.zeros((2, SEQ), jnp.int32))["params"]
  state0 = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3, eps=1e-4))
  train_step = jax.jit(_classifier_step("inputs", "targets"))

  counts, microbatch = (3, 2, 2, 2, 1, 1, 1, 0), 2
  batch = sum(counts) * microbatch
  batches = _token_batches(batch)
  ref = Reference(train_step, state0, jit=train_step).run(batches)
  cluster = _cluster()
  plan = hs.plan_for(cluster, state0, global_batch=batch, microbatch=microbatch, counts=counts)
  step = hs.parallelize(train_step, cluster=cluster, plan=plan, global_batch=batch)
  if remat:  # the checkpointed block stays one: its recomputation reaches XLA behind an optimization barrier
    assert "optimization_barrier" in step.lower(step.shard_state(state0), batches[0]).as_text()
  state = step.shard_state(state0)
  for i, b in enumerate(batches):
    state, metrics = step(state, b)
    ref.check_metrics(metrics, i)
  ref.check(state.params, lambda s: s.params)


# --- what cannot be split, and what can though it is unusual ----------------------------


def _mlp_state():
  params = {"w": jnp.full((4, 3), 0.1), "b": jnp.zeros((3,))}
  return {"params": params, "opt_state": optax.sgd(0.1).init(params)}


def _step_with_loss(loss_of_outputs):
  tx = optax.sgd(0.1)

  def train_step(state, batch):
    def loss_fn(params):
      out = jnp.tanh(batch["x"] @ params["w"] + params["b"])
      return loss_of_outputs(out, batch)
    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, {"loss": loss}

  return train_step


def _debug_print(out, batch):
  jax.debug.callback(lambda v: None, out)
  return out.mean()


MIXING = [
    ("sort", lambda out, b: (jnp.sort(out, axis=0) * jnp.arange(out.shape[0])[:, None]).mean()),
    ("rev", lambda out, b: (jnp.flip(out, axis=0) * jnp.arange(out.shape[0])[:, None]).mean()),
    ("top_k", lambda out, b: jax.lax.top_k(out.T, 2)[0].mean()),
    ("cumsum", lambda out, b: jnp.cumsum(out, axis=0).mean()),
    ("gather", lambda out, b: (out[jnp.asarray(np.random.RandomState(0).permutation(out.shape[0]))] * out).mean()),
    ("dot_general", lambda out, b: (out @ out.T).mean()),  # every example against every other
    ("slice", lambda out, b: out[:4].mean()),
    ("argmax", lambda out, b: out.mean() + out[:, 0].argmax(axis=0).astype(jnp.float32)),
    ("debug_callback", _debug_print),
]


@pytest.mark.parametrize("primitive,loss", MIXING, ids=[m[0] for m in MIXING])
def test_steps_that_mix_examples_are_refused_naming_the_primitive(primitive, loss):
  batch = 16
  cluster = _cluster()
  step = hs.parallelize(_step_with_loss(loss), cluster=cluster, global_batch=batch, microbatch=2)
  data = {"x": np.ones((batch, 4), np.float32)}
  with pytest.raises(hs.HetSpmdError, match=rf"cannot be split into microbatches: {primitive}\b"):
    step(step.shard_state(_mlp_state()), data)


def test_a_loop_over_chunks_inside_the_differentiated_loss_is_exact():
  def accumulated(out, b):  # the loss sums its chunks' means; autodiff's transpose scans the chunks backwards
    return jax.lax.scan(lambda c, chunk: (c + chunk.mean(), None), 0.0, out.reshape((4, -1) + out.shape[1:]))[0]

  step_fn = _step_with_loss(accumulated)
  rs = np.random.RandomState(4)
  batches = [{"x": rs.randn(16, 4).astype(np.float32)} for _ in range(STEPS)]
  ref = Reference(step_fn, _mlp_state()).run(batches)
  step = hs.parallelize(step_fn, cluster=_cluster(), global_batch=16, microbatch=2)
  state = step.shard_state(_mlp_state())
  for i, b in enumerate(batches):
    state, metrics = step(state, b)
    ref.check_metrics(metrics, i)
  ref.check(state["params"], lambda s: s["params"])


def _router_balance(out, b):
  """An MoE router's load-balancing term: the batch's expert density times its mean routing probability."""
  probs = jax.nn.softmax(out)
  density = jax.nn.one_hot(jnp.argmax(out, -1), out.shape[-1]).mean(0)
  return out.mean() + 3.0 * jnp.sum(density * probs.mean(0))


UNUSUAL = [
    ("max_reduction", lambda out, b: out.mean() + 0.5 * out.max()),
    ("min_and_max", lambda out, b: out.mean() + (out.max(axis=0) - out.min(axis=0)).sum()),
    ("router_balance", _router_balance),  # a sum over the batch that feeds back, exact (not a batch statistic)
    ("leading_unit_reshape_and_flip", lambda out, b: jnp.flip(out.reshape(1, -1, 3), axis=2).mean()),
]


@pytest.mark.parametrize("name,loss", UNUSUAL, ids=[u[0] for u in UNUSUAL])
def test_decomposable_but_unusual_reductions_are_exact(name, loss):
  counts, microbatch = (3, 2, 2, 1, 1, 1, 1, 1), 2
  batch = sum(counts) * microbatch
  rs = np.random.RandomState(1)
  batches = [{"x": rs.randn(batch, 4).astype(np.float32)} for _ in range(STEPS)]
  fn = _step_with_loss(loss)
  ref = Reference(fn, _mlp_state()).run(batches)
  cluster = _cluster()
  plan = hs.plan_for(cluster, _mlp_state(), global_batch=batch, microbatch=microbatch, counts=counts)
  step = hs.parallelize(fn, cluster=cluster, plan=plan, global_batch=batch)
  state = step.shard_state(_mlp_state())
  for b in batches:
    state, m = step(state, b)
  ref.check_metrics(m, len(batches) - 1)
  ref.check(state["params"], lambda s: s["params"])


class DepthwiseCNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Conv(4, (3, 3))(x)
    x = nn.Conv(4, (3, 3), feature_group_count=4)(nn.relu(x))  # depthwise: its weight gradient groups channels
    return nn.Dense(5)(x.mean((1, 2)))


def test_depthwise_convolution_is_exact():
  model = DepthwiseCNN()
  params = model.init(jax.random.key(0), jnp.zeros((2, 8, 8, 1)))["params"]
  state0 = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
  train_step = _classifier_step("image", "label")

  counts, microbatch = (2, 2, 1, 1, 1, 1, 1, 1), 2
  batch = sum(counts) * microbatch
  b = _image_batches(batch, shape=(8, 8, 1))[0]
  ref = Reference(train_step, state0).run([b])
  cluster = _cluster()
  plan = hs.plan_for(cluster, state0, global_batch=batch, microbatch=microbatch, counts=counts)
  step = hs.parallelize(train_step, cluster=cluster, plan=plan, global_batch=batch)
  state, m = step(step.shard_state(state0), b)
  ref.check_metrics(m, 0)
  ref.check(state.params, lambda s: s.params)


def test_activation_sharding_constraints_are_placement_only():
  """A logical constraint on activations (MaxText style) inside the loss: the loop keeps the data axis."""
  counts, microbatch = (2, 2, 1, 1, 1, 1, 1, 1), 2
  batch = sum(counts) * microbatch
  cluster = _cluster()
  plan = hs.plan_for(cluster, _mlp_state(), global_batch=batch, microbatch=microbatch, counts=counts)
  sharding = jax.sharding.NamedSharding(plan.mesh(), jax.sharding.PartitionSpec("data"))
  fn = _step_with_loss(lambda out, b: jax.lax.with_sharding_constraint(out, sharding).mean())
  data = {"x": np.random.RandomState(2).randn(batch, 4).astype(np.float32)}
  ref = Reference(fn, _mlp_state()).run([data])
  step = hs.parallelize(fn, cluster=cluster, plan=plan, global_batch=batch)
  state, m = step(step.shard_state(_mlp_state()), data)
  ref.check_metrics(m, 0)
  ref.check(state["params"], lambda s: s["params"])


def test_embedding_gradient_scatter_add_is_exact():
  """An embedding's gradient is a scatter-add of every example's rows into one table: a sum over examples."""
  table0 = jnp.asarray(np.random.RandomState(0).randn(VOCAB, 8).astype(np.float32))
  tx = optax.sgd(0.5)

  def train_step(state, batch):
    def loss_fn(table):
      return jnp.sum(table[batch["inputs"]] ** 2) / batch["inputs"].shape[0]
    loss, grads = jax.value_and_grad(loss_fn)(state["table"])
    updates, opt_state = tx.update(grads, state["opt"], state["table"])
    return {"table": state["table"] + updates, "opt": opt_state}, {"loss": loss}

  counts, microbatch = (2, 2, 2, 2, 1, 1, 1, 1), 2
  batch = sum(counts) * microbatch
  batches = _token_batches(batch)
  state0 = {"table": table0, "opt": tx.init(table0)}
  ref = Reference(train_step, state0).run(batches)
  cluster = _cluster()
  plan = hs.plan_for(cluster, state0, global_batch=batch, microbatch=microbatch, counts=counts)
  step = hs.parallelize(train_step, cluster=cluster, plan=plan, global_batch=batch)
  state = step.shard_state(state0)
  for b in batches:
    state, _ = step(state, b)
  ref.check(state["table"], lambda s: s["table"])
  assert any("scatter-add" in line for line in step._runner.analysis.describe())


# --- finding the batch ------------------------------------------------------------------


def test_a_step_without_a_batch_argument_is_refused_with_what_was_seen():
  step = hs.parallelize(_step_with_loss(lambda out, b: out.mean()), cluster=_cluster(), global_batch=16)
  with pytest.raises(hs.HetSpmdError, match="no argument of the step is a batch of 16 examples.*batch_argnums"):
    step(step.shard_state(_mlp_state()), {"x": np.ones((12, 4), np.float32)})


def test_batch_argnums_names_the_batch():
  fn = _step_with_loss(lambda out, b: out.mean())
  batch = 16
  # the state's leaves lead with 16 too: detection alone would find two batches
  data = {"x": np.random.RandomState(0).randn(batch, 4).astype(np.float32)}
  state0 = _mlp_state()
  state0["params"]["extra"] = jnp.zeros((batch,))
  state0["opt_state"] = optax.sgd(0.1).init(state0["params"])
  ref = Reference(fn, state0).run([data])
  step = hs.parallelize(fn, cluster=_cluster(), global_batch=batch, microbatch=2, batch_argnums=1)
  state, m = step(step.shard_state(state0), data)
  ref.check_metrics(m, 0)
  ref.check(state["params"], lambda s: s["params"])


# --- more than one process ---------------------------------------------------------------


def lm1b_in_processes(counts, microbatch: int) -> str:
  """The start of a script for :func:`multiprocess.run_processes`: imports, this module as ``t``, the lm1b step
  as ``fn``, its ``batches`` and ``rng``, ``ref`` / ``ref_metrics`` after training on one local device (and
  ``reference``, the same in float64), and ``train_planned(**plan_options) -> (last loss, largest parameter
  difference from ref, leaves and losses further from float64 than exactness allows)`` training under a plan
  with ``counts`` over 4 V100s and 4 P100s, each process feeding its own positions' examples."""
  batch = sum(counts) * microbatch
  mine = sum(counts[:4]) * microbatch
  return textwrap.dedent(f"""
      import functools, json
      import numpy as np, jax
      from jax.experimental import multihost_utils
      import hetspmd as hs
      import types
      sys.modules["conftest"] = types.SimpleNamespace(require_devices=lambda n: None)  # keep 4 devices here
      sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
      import test_unmodified_steps as t
      fn = functools.partial(t.lm1b_train_step, config=None, learning_rate_fn=lambda s: 1e-3)
      batches, rng = t._token_batches({batch}), jax.random.key(7)
      from exactness import Reference, excess
      local = jax.local_devices()[0]
      reference = Reference(fn, t._lm_state(), jit=jax.jit(fn, device=local)).run(batches, dropout_rng=rng)
      ref, ref_metrics = reference.single, reference.single_metrics[-1]
      cluster = hs.Cluster.emulate(jax.devices(), kinds=["V100-32GB"] * 4 + ["P100-16GB"] * 4)
      mine = slice(0, {mine}) if jax.process_index() == 0 else slice({mine}, {batch})

      def train_planned(**options):
        plan = hs.plan_for(cluster, t._lm_state(), global_batch={batch}, microbatch={microbatch},
                           counts={tuple(counts)}, **options)
        step = hs.parallelize(fn, cluster=cluster, plan=plan, global_batch={batch})
        state = step.shard_state(t._lm_state())
        losses = []
        for b in batches:
          state, metrics = step(state, {{k: v[mine] for k, v in b.items()}}, dropout_rng=rng)
          losses.append(metrics["loss"])
        got = jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), state.params)
        diff = max(float(np.max(np.abs(np.asarray(a) - b)) / max(float(np.max(np.abs(a))), 1e-3))
                   for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(got)))
        over = excess(got, ref.params, reference.ref64.params)
        over.update(excess(losses, [m["loss"] for m in reference.single_metrics],
                           [m["loss"] for m in reference.ref64_metrics]))
        return float(metrics["loss"]), diff, {{k: v[0] for k, v in over.items() if v[0] > 0}}
  """)


@pytest.mark.timeout(300)
def test_unmodified_linen_step_in_two_processes():
  """2 processes x 4 CPU devices over gloo, each feeding its own examples, an lm1b-style step."""
  from multiprocess import run_processes

  results = run_processes(lm1b_in_processes((3, 2, 2, 1, 1, 1, 1, 1), 2) + textwrap.dedent("""
      loss, diff, over = train_planned()
      print(json.dumps({"over": over}))
  """), num_processes=2, devices_per_process=4, timeout=240)
  for r in results:  # parameters and losses as close to float64 as exactness asks
    assert r["over"] == {}


def test_exact_batch_statistics_are_priced_as_recomputed_forward_work():
  from hetspmd import lowering
  from hetspmd.passes.batch_axis import analysis as microbatch

  batch = {"image": jnp.zeros((8, 8, 8, 1)), "label": jnp.zeros((8,), jnp.int32)}
  closed = jax.make_jaxpr(bn_train_step)(_bn_state(), batch)
  leaves = jax.tree.leaves(_bn_state())
  inputs, floats = (len(leaves), len(leaves) + 1), [i for i, x in enumerate(leaves) if jnp.asarray(x).dtype == jnp.float32]
  factors = {mode: lowering.recompute_factor(microbatch.analyse(closed, inputs, 8, batch_stats=mode,
                                                                float_state_inputs=floats), inputs)
             for mode in ("local", "exact")}
  assert factors["local"] == 1.0
  assert 1.2 < factors["exact"] < 3.0  # the statistics' loops run the convolution again, not the backward pass
  lm = jax.make_jaxpr(functools.partial(lm1b_train_step, config=None, learning_rate_fn=lambda s: 1e-3))(
      _lm_state(), {"inputs": jnp.zeros((8, SEQ), jnp.int32), "targets": jnp.zeros((8, SEQ), jnp.int32)},
      dropout_rng=jax.random.key(0))
  k = len(jax.tree.leaves(_lm_state()))
  analysis = microbatch.analyse(lm, (k, k + 1), 8)
  assert analysis.loops == 2 and lowering.recompute_factor(analysis, (k, k + 1)) < 1.01  # the token count's loop
