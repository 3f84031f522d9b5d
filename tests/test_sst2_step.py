"""A sentence classifier shaped like Flax's SST-2 example, run unchanged under uneven plans.

Embeddings with dropout, a bidirectional LSTM (``nn.Bidirectional`` of two
``nn.RNN(nn.LSTMCell)``) over padded sentences of their own lengths
(``seq_lengths``: the backward direction reverses each sentence within its
length, and each direction's final carry is read at the sentence's last
token, ``carries[lengths - 1, jnp.arange(batch)]``), a dense head, a mean
cross entropy, accuracy as a metric; also with the loss under
``jax.checkpoint``, whose body the rewrite reaches too. Three steps on 8
emulated devices against one device.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

from exactness import Reference
from test_unmodified_steps import STEPS, run_planned

VOCAB, LENGTH, HIDDEN = 30, 7, 8


class TextClassifier(nn.Module):
  @nn.compact
  def __call__(self, tokens, lengths, train: bool):
    x = nn.Dropout(0.2, deterministic=not train)(nn.Embed(VOCAB, 8)(tokens))
    lstm = nn.Bidirectional(nn.RNN(nn.LSTMCell(HIDDEN)), nn.RNN(nn.LSTMCell(HIDDEN)), return_carry=True)
    (forward, backward), _ = lstm(x, seq_lengths=lengths)
    hidden = jnp.concatenate([forward[1], backward[1]], axis=-1)
    return nn.Dense(2)(nn.Dropout(0.2, deterministic=not train)(hidden))


def sst2_train_step(state, batch, rngs, checkpointed=False):
  rng = jax.random.fold_in(rngs, state.step)

  @(jax.checkpoint if checkpointed else (lambda f: f))
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["token_ids"], batch["length"], train=True,
                            rngs={"dropout": rng})
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean(), logits

  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
  return state.apply_gradients(grads=grads), {"loss": loss, "accuracy": accuracy}


def _state():
  model = TextClassifier()
  params = jax.jit(model.init, static_argnames="train")(
      jax.random.key(0), jnp.ones((2, LENGTH), jnp.int32), jnp.array([LENGTH, 3]), train=False)["params"]
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2, eps=1e-4))


def _batches(batch):
  rs = np.random.RandomState(1)
  out = []
  for _ in range(STEPS):
    lengths = rs.randint(1, LENGTH + 1, batch).astype(np.int32)
    tokens = rs.randint(1, VOCAB, (batch, LENGTH)) * (np.arange(LENGTH)[None] < lengths[:, None])
    out.append({"token_ids": tokens.astype(np.int32), "length": lengths,
                "label": rs.randint(0, 2, batch).astype(np.int32)})
  return out


CASES = [
    # (data, model) layout, counts, the loss under jax.checkpoint
    ((8, 1), (3, 3, 2, 2, 2, 1, 1, 0), False),
    ((4, 2), (3, 2, 2, 1), False),
    ((8, 1), (3, 3, 2, 2, 2, 1, 1, 0), True),
]


@pytest.mark.parametrize("layout,counts,checkpointed", CASES,
                         ids=[f"{c[0]}{'-checkpointed' if c[2] else ''}" for c in CASES])
def test_sst2_step_is_exact(layout, counts, checkpointed):
  microbatch = 2
  batch = sum(counts) * microbatch
  batches = _batches(batch)
  rng = jax.random.key(4)
  step_fn = functools.partial(sst2_train_step, checkpointed=checkpointed)
  ref = Reference(step_fn, _state()).run(batches, rng)
  step, state = run_planned(step_fn, _state(), batches, ref, layout, microbatch, counts, rngs=rng)
  ref.check(state.params, lambda s: s.params)
  assert int(state.step) == STEPS
  assert "inlined" not in step.explain()  # a checkpointed loss stays one block, its recomputation kept
