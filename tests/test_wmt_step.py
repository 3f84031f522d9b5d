"""A translation step shaped like Flax's WMT example, run unchanged under uneven plans.

An encoder-decoder with packed examples: inputs and targets of different
lengths, each row holding two sequences told apart by segmentation ids,
positions restarting per sequence, padding, causal and cross-attention
masks built from them inside the model, attention and residual dropout
from a key folded with the step, label smoothing with its normalising
constant, a loss divided by the token-weight sum, metrics computed from
the logits returned as aux, and a warmup / inverse-square-root schedule.
Three steps on 8 emulated devices against the same step on one device.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

from exactness import Reference, assert_exact
from test_unmodified_steps import STEPS, run_planned

VOCAB, SRC, TGT, WIDTH, HEADS = 32, 7, 5, 16, 2


class Block(nn.Module):
  """Self-attention, optional cross-attention, MLP; pre-norm, dropout on every residual branch."""

  cross: bool
  rate: float = 0.1

  @nn.compact
  def __call__(self, x, self_mask, encoded=None, cross_mask=None, deterministic=False):
    attend = functools.partial(nn.MultiHeadDotProductAttention, num_heads=HEADS, dropout_rate=self.rate,
                               deterministic=deterministic)
    h = attend()(nn.LayerNorm()(x), mask=self_mask)
    x = x + nn.Dropout(self.rate, deterministic=deterministic)(h)
    if self.cross:
      h = attend()(nn.LayerNorm()(x), encoded, mask=cross_mask)
      x = x + nn.Dropout(self.rate, deterministic=deterministic)(h)
    h = nn.Dense(WIDTH)(nn.relu(nn.Dense(2 * WIDTH)(nn.LayerNorm()(x))))
    return x + nn.Dropout(self.rate, deterministic=deterministic)(h)


def _shift_right(tokens):
  return jnp.pad(tokens, ((0, 0), (1, 0)))[:, :-1]


class Translator(nn.Module):
  deterministic: bool = False

  @nn.compact
  def __call__(self, inputs, targets, inputs_positions, targets_positions, inputs_segmentation,
               targets_segmentation):
    embed = nn.Embed(VOCAB, WIDTH)
    position = nn.Embed(max(SRC, TGT), WIDTH)
    src_mask = nn.combine_masks(nn.make_attention_mask(inputs > 0, inputs > 0),
                                nn.make_attention_mask(inputs_segmentation, inputs_segmentation, jnp.equal))
    x = embed(inputs) + position(inputs_positions)
    encoded = nn.LayerNorm()(Block(cross=False)(x, src_mask, deterministic=self.deterministic))
    decoder_in = _shift_right(targets)
    # a packed row's second sequence starts from token 0 after the shift, as the example's decoder does
    decoder_in = decoder_in * (targets_segmentation == _shift_right(targets_segmentation))
    tgt_mask = nn.combine_masks(nn.make_attention_mask(targets > 0, targets > 0),
                                nn.make_causal_mask(targets),
                                nn.make_attention_mask(targets_segmentation, targets_segmentation, jnp.equal))
    cross_mask = nn.combine_masks(nn.make_attention_mask(targets > 0, inputs > 0),
                                  nn.make_attention_mask(targets_segmentation, inputs_segmentation, jnp.equal))
    y = embed(decoder_in) + position(targets_positions)
    y = Block(cross=True)(y, tgt_mask, encoded, cross_mask, deterministic=self.deterministic)
    return embed.attend(nn.LayerNorm()(y))  # logits through the shared embedding


def weighted_cross_entropy(logits, targets, weights, label_smoothing=0.0):
  confidence = 1.0 - label_smoothing
  low = (1.0 - confidence) / (VOCAB - 1)
  constant = -(confidence * jnp.log(confidence) + (VOCAB - 1) * low * jnp.log(low + 1e-20))
  soft = jax.nn.one_hot(targets, VOCAB) * (confidence - low) + low
  loss = -jnp.sum(soft * nn.log_softmax(logits), axis=-1) - constant
  return (loss * weights).sum(), weights.sum()


def wmt_train_step(state, batch, config, learning_rate_fn, label_smoothing=0.0, dropout_rng=None):
  keys = ["inputs", "targets", "inputs_position", "targets_position", "inputs_segmentation",
          "targets_segmentation"]
  inputs, targets, inputs_positions, targets_positions, inputs_segmentation, targets_segmentation = (
      batch.get(k) for k in keys)
  weights = jnp.where(targets > 0, 1, 0).astype(jnp.float32)
  dropout_rng = jax.random.fold_in(dropout_rng, state.step)

  def loss_fn(params):
    logits = Translator(**config).apply(
        {"params": params}, inputs, targets, inputs_positions, targets_positions, inputs_segmentation,
        targets_segmentation, rngs={"dropout": dropout_rng})
    loss, weight_sum = weighted_cross_entropy(logits, targets, weights, label_smoothing)
    return loss / weight_sum, logits

  step = state.step
  (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  new_state = state.apply_gradients(grads=grads)
  loss, denominator = weighted_cross_entropy(logits, targets, weights)
  accuracy = (jnp.equal(jnp.argmax(logits, axis=-1), targets) * weights).sum()
  metrics = {"loss": loss, "accuracy": accuracy, "denominator": denominator,
             "learning_rate": learning_rate_fn(step)}
  return new_state, metrics


def _packed(length, rng, rows):
  """Two sequences per row (lengths drawn), padding after them: tokens, positions, segmentation ids."""
  tokens = np.zeros((rows, length), np.int32)
  positions = np.zeros((rows, length), np.int32)
  segments = np.zeros((rows, length), np.int32)
  for r in range(rows):
    first = rng.randint(1, length - 1)
    second = rng.randint(0, length - first + 1)
    for s, (start, n) in enumerate([(0, first), (first, second)]):
      tokens[r, start:start + n] = rng.randint(1, VOCAB, n)
      positions[r, start:start + n] = np.arange(n)
      segments[r, start:start + n] = s + 1
  return tokens, positions, segments


def _batches(rows, seed=0):
  rng = np.random.RandomState(seed)
  out = []
  for _ in range(STEPS):
    inputs, inputs_position, inputs_segmentation = _packed(SRC, rng, rows)
    targets, targets_position, targets_segmentation = _packed(TGT, rng, rows)
    out.append(dict(inputs=inputs, targets=targets, inputs_position=inputs_position,
                    targets_position=targets_position, inputs_segmentation=inputs_segmentation,
                    targets_segmentation=targets_segmentation))
  return out


def _schedule(peak=3e-3, warmup=2):
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup),
                               lambda count: peak * jnp.sqrt(warmup / jnp.maximum(count + warmup, 1.0))],
                              boundaries=[warmup])


def _state(schedule):
  model = Translator(deterministic=True)
  zeros = [jnp.zeros((2, n), jnp.int32) for n in (SRC, TGT, SRC, TGT, SRC, TGT)]
  params = jax.jit(model.init)(jax.random.key(0), *zeros)["params"]
  # eps well above float32 rounding: attention's key bias has a gradient of exactly zero in exact arithmetic,
  # and a small eps would let Adam scale its rounding noise (which differs with the summation order) to steps
  return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                       tx=optax.adamw(schedule, b2=0.98, eps=1e-4, weight_decay=1e-4))


def _attention_keys(tree, path=""):
  """``(path, the key projection's parameters)`` of every attention layer in a parameter tree."""
  for name, value in tree.items():
    if name == "key" and isinstance(value, dict) and "bias" in value:
      yield f"{path}/{name}", value
    elif isinstance(value, dict):
      yield from _attention_keys(value, f"{path}/{name}")


WMT_CASES = [
    # (data, model) layout, counts, microbatch
    ((8, 1), (3, 3, 2, 2, 1, 1, 1, 0), 2),
    ((4, 2), (3, 2, 2, 1), 2),
]


@pytest.mark.parametrize("layout,counts,microbatch", WMT_CASES, ids=[f"{c[0]}-{c[1]}" for c in WMT_CASES])
def test_wmt_step_is_exact(layout, counts, microbatch):
  batch = sum(counts) * microbatch
  schedule = _schedule()
  step_fn = functools.partial(wmt_train_step, config={}, learning_rate_fn=schedule, label_smoothing=0.1)
  batches = _batches(batch)
  rng = jax.random.key(3)
  ref = Reference(step_fn, _state(schedule)).run(batches, dropout_rng=rng)
  assert all(float(m["loss"]) > 0 and float(m["denominator"]) > 0 for m in ref.single_metrics)

  step, state = run_planned(step_fn, _state(schedule), batches, ref, layout, microbatch, counts,
                            dropout_rng=rng)
  # attention's key bias shifts every logit of a query's row alike, which softmax ignores: its gradient is zero
  # in exact arithmetic and rounding noise in float32, which a different summation order changes. Both runs
  # must leave it at noise level; every other leaf must match (exactness: against float64).
  key_bias = lambda tree: {k: v.pop("bias") for k, v in _attention_keys(tree)}
  ref_params, params = jax.tree.map(np.asarray, ref.single.params), jax.tree.map(np.asarray, state.params)
  ref64_params = jax.tree.map(np.asarray, ref.ref64.params)
  for noise in (key_bias(ref_params), key_bias(params), key_bias(ref64_params)):
    assert noise and max(float(np.max(np.abs(x))) for x in noise.values()) < 1e-5
  assert_exact(params, ref_params, ref64_params, what="parameters")
  assert int(state.step) == STEPS
  assert "per-device trip counts" in step.explain()
