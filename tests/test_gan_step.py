"""A GAN step: the discriminator is updated first, and the generator's loss reads the updated discriminator.

The discriminator's new parameters come from a sum over the batch (its
gradient) and feed the generator's per-example work, so the microbatch
program computes them in an earlier loop over the microbatches and runs
the generator's loop after it. Three steps on 8 emulated devices against
one device, with both ways of treating batch statistics (there are none
here, so they must agree).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from exactness import Reference
from test_unmodified_steps import STEPS, run_planned


class Generator(nn.Module):
  @nn.compact
  def __call__(self, z):
    return nn.Dense(4)(nn.relu(nn.Dense(8)(z)))


class Discriminator(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(nn.relu(nn.Dense(8)(x)))[:, 0]


TX = optax.adam(1e-2, eps=1e-4)


def _state():
  g = Generator().init(jax.random.key(0), jnp.zeros((2, 3)))["params"]
  d = Discriminator().init(jax.random.key(1), jnp.zeros((2, 4)))["params"]
  return {"g": g, "d": d, "g_opt": TX.init(g), "d_opt": TX.init(d)}


def gan_train_step(state, batch):
  generator, discriminator = Generator(), Discriminator()

  def d_loss(d_params):
    fake = generator.apply({"params": state["g"]}, batch["z"])
    real_logits = discriminator.apply({"params": d_params}, batch["real"])
    fake_logits = discriminator.apply({"params": d_params}, fake)
    return (jax.nn.softplus(-real_logits) + jax.nn.softplus(fake_logits)).mean()

  d_value, d_grads = jax.value_and_grad(d_loss)(state["d"])
  updates, d_opt = TX.update(d_grads, state["d_opt"], state["d"])
  d_params = optax.apply_updates(state["d"], updates)

  def g_loss(g_params):
    fake = generator.apply({"params": g_params}, batch["z"])
    return jax.nn.softplus(-discriminator.apply({"params": d_params}, fake)).mean()

  g_value, g_grads = jax.value_and_grad(g_loss)(state["g"])
  updates, g_opt = TX.update(g_grads, state["g_opt"], state["g"])
  new_state = {"g": optax.apply_updates(state["g"], updates), "d": d_params, "g_opt": g_opt, "d_opt": d_opt}
  return new_state, {"d_loss": d_value, "g_loss": g_value}


@pytest.mark.parametrize("batch_stats", ["local", "exact"])
def test_gan_step_is_exact(batch_stats):
  counts, microbatch = (3, 3, 2, 2, 2, 1, 1, 0), 2
  batch = sum(counts) * microbatch
  rs = np.random.RandomState(0)
  batches = [{"real": rs.randn(batch, 4).astype(np.float32), "z": rs.randn(batch, 3).astype(np.float32)}
             for _ in range(STEPS)]
  ref = Reference(gan_train_step, _state()).run(batches)
  step, state = run_planned(gan_train_step, _state(), batches, ref, (8, 1), microbatch, counts,
                            options={"batch_stats": batch_stats})
  ref.check(state["g"], lambda s: s["g"])
  ref.check(state["d"], lambda s: s["d"])
  assert "2 microbatch loop(s)" in step.explain()
