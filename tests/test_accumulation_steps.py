"""Steps that accumulate gradients themselves, run unchanged: hetspmd's microbatches stand for the loop's chunks.

Big-model training code often brings its own accumulation: the batch
reshaped to ``(k, B/k, ...)`` and a ``lax.scan`` over the chunks summing
gradients in the carry, or a ``lax.fori_loop`` that slices chunk ``i`` out
of the batch; sometimes with ``optax.MultiSteps`` around the optimizer as
well. Such a loop is a sum over the batch, each chunk's constants kept, so
any plan's microbatches and weighted counts split it exactly. Loops that do
more than sum are refused with the reason.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import hetspmd as hs

from conftest import require_devices
from exactness import Reference

STEPS, CHUNKS = 3, 4
COUNTS, MICROBATCH = (3, 2, 2, 2, 2, 2, 2, 1), 2
BATCH = sum(COUNTS) * MICROBATCH  # 32: 4 chunks of 8, 16 microbatches of 2
VOCAB, WIDTH = 11, 16


class Tagger(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, WIDTH)(tokens)
    x = x + nn.Dense(WIDTH)(nn.gelu(nn.LayerNorm()(x)))
    return nn.Dense(VOCAB)(x)


def fresh_state(tx=None):
  model = Tagger()
  params = model.init(jax.random.key(0), jnp.zeros((2, 5), jnp.int32))["params"]
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx or optax.adam(3e-3, eps=1e-4))


def chunk_loss(params, state, chunk):
  logits = state.apply_fn({"params": params}, chunk["tokens"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, chunk["labels"]).mean()


def scan_accumulation_step(state, batch):
  chunks = jax.tree.map(lambda x: x.reshape((CHUNKS, -1) + x.shape[1:]), batch)

  def accumulate(carry, chunk):
    grads, loss = carry
    chunk_value, chunk_grads = jax.value_and_grad(chunk_loss)(state.params, state, chunk)
    return (jax.tree.map(jnp.add, grads, chunk_grads), loss + chunk_value), None

  zeros = jax.tree.map(jnp.zeros_like, state.params)
  (grads, loss), _ = jax.lax.scan(accumulate, (zeros, 0.0), chunks)
  grads = jax.tree.map(lambda g: g / CHUNKS, grads)
  return state.apply_gradients(grads=grads), {"loss": loss / CHUNKS}


def fori_accumulation_step(state, batch):
  size = batch["tokens"].shape[0] // CHUNKS

  def accumulate(i, carry):
    grads, loss = carry
    chunk = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i * size, size), batch)
    chunk_value, chunk_grads = jax.value_and_grad(chunk_loss)(state.params, state, chunk)
    return jax.tree.map(jnp.add, grads, chunk_grads), loss + chunk_value

  zeros = jax.tree.map(jnp.zeros_like, state.params)
  grads, loss = jax.lax.fori_loop(0, CHUNKS, accumulate, (zeros, 0.0))
  return state.apply_gradients(grads=jax.tree.map(lambda g: g / CHUNKS, grads)), {"loss": loss / CHUNKS}


def _batches(seed=0):
  rs = np.random.RandomState(seed)
  out = []
  for _ in range(STEPS):
    tokens = rs.randint(0, VOCAB, (BATCH, 5)).astype(np.int32)
    out.append({"tokens": tokens, "labels": np.roll(tokens, 1, axis=1)})
  return out


def _parallel(step_fn, state):
  require_devices(8)
  cluster = hs.Cluster.emulate(jax.devices()[:8], kinds=["A100-80GB"] + ["T4"] * 7)
  plan = hs.plan_for(cluster, state, global_batch=BATCH, microbatch=MICROBATCH, counts=COUNTS)
  return hs.parallelize(step_fn, cluster=cluster, plan=plan, global_batch=BATCH)


def _run_against_one_device(step_fn, make_state):
  batches = _batches()
  ref = Reference(step_fn, make_state()).run(batches)
  step = _parallel(step_fn, make_state())
  state = step.shard_state(make_state())
  for i, batch in enumerate(batches):
    state, metrics = step(state, batch)
    ref.check_metrics(metrics, i)
  ref.check(state.params, lambda s: s.params)
  return step, state


@pytest.mark.parametrize("step_fn", [scan_accumulation_step, jax.jit(scan_accumulation_step),
                                     fori_accumulation_step], ids=["scan", "jitted-scan", "fori_loop"])
def test_own_accumulation_loop_is_exact(step_fn):
  step, _ = _run_against_one_device(step_fn, fresh_state)
  assert "1 reduction(s) over the batch" in step.explain()


def test_own_accumulation_under_optax_multisteps():
  """MultiSteps around Adam: every second call applies the mean of two calls' gradients; the state between them
  (the running sum, the mini-step count) is example-free work after the loop's sums."""
  multi = lambda: fresh_state(optax.MultiSteps(optax.adam(3e-3, eps=1e-4), every_k_schedule=2))
  _, state = _run_against_one_device(scan_accumulation_step, multi)
  assert int(state.opt_state.gradient_step) == STEPS // 2


def _refused(step_fn, match):
  step = _parallel(step_fn, fresh_state())
  with pytest.raises(hs.HetSpmdError, match=match):
    step(step.shard_state(fresh_state()), _batches()[0])


def test_a_running_max_in_the_carry_is_refused():
  def step_fn(state, batch):
    chunks = jax.tree.map(lambda x: x.reshape((CHUNKS, -1) + x.shape[1:]), batch)

    def body(carry, chunk):
      grads, worst = carry
      value, g = jax.value_and_grad(chunk_loss)(state.params, state, chunk)
      return (jax.tree.map(jnp.add, grads, g), jnp.maximum(worst, value)), None

    (grads, worst), _ = jax.lax.scan(body, (jax.tree.map(jnp.zeros_like, state.params), -jnp.inf), chunks)
    return state.apply_gradients(grads=grads), {"worst chunk": worst}

  _refused(step_fn, "gradient accumulation loop over 4 chunks of the batch that does more than sum: its body "
                    "applies max to a sum over the examples")


def test_an_update_inside_the_loop_is_refused():
  def step_fn(state, batch):
    chunks = jax.tree.map(lambda x: x.reshape((CHUNKS, -1) + x.shape[1:]), batch)

    def body(inner, chunk):
      grads = jax.grad(chunk_loss)(inner.params, inner, chunk)
      return inner.apply_gradients(grads=grads), None

    state, _ = jax.lax.scan(body, state, chunks)
    return state, {}

  _refused(step_fn, "gradient accumulation loop over 4 chunks")


def test_per_chunk_outputs_are_refused():
  def step_fn(state, batch):
    chunks = jax.tree.map(lambda x: x.reshape((CHUNKS, -1) + x.shape[1:]), batch)

    def body(grads, chunk):
      value, g = jax.value_and_grad(chunk_loss)(state.params, state, chunk)
      return jax.tree.map(jnp.add, grads, g), value

    grads, losses = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, state.params), chunks)
    return state.apply_gradients(grads=grads), {"losses": losses}

  _refused(step_fn, r"returns a value per chunk \(the scan's ys\): sum it in the carry")


def test_a_loss_normalised_by_each_chunks_own_count_is_refused():
  def step_fn(state, batch):
    chunks = jax.tree.map(lambda x: x.reshape((CHUNKS, -1) + x.shape[1:]), batch)

    def chunk_mean(params, chunk):  # a mean over the chunk's non-padding tokens: depends on how chunks are cut
      logits = state.apply_fn({"params": params}, chunk["tokens"])
      weights = (chunk["tokens"] > 0).astype(jnp.float32)
      losses = optax.softmax_cross_entropy_with_integer_labels(logits, chunk["labels"])
      return jnp.sum(losses * weights) / jnp.sum(weights)

    def body(grads, chunk):
      return jax.tree.map(jnp.add, grads, jax.grad(chunk_mean)(state.params, chunk)), None

    grads, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, state.params), chunks)
    return state.apply_gradients(grads=grads), {}

  _refused(step_fn, "gradient accumulation loop over 4 chunks of the batch that does more than sum: its body "
                    "feeds a sum over the examples back into per-example work")
