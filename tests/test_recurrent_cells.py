"""Recurrent cells under ``nn.RNN``, ``nn.Bidirectional``, ``nn.scan`` and ``nnx.RNN``, run unchanged.

The backward pass of a recurrent layer is a ``scan`` whose carries sum the
weight gradients over the examples; work on those partial sums inside the
scan body must be linear in them (:mod:`hetspmd.passes.batch_axis.linearity`).
Cells that fuse their gates into one matmul (``OptimizedLSTMCell``, a
hand-written cell with ``jnp.split``, the convolutions of ``ConvLSTMCell``)
concatenate their kernels, so the body splits the summed gradient of the
fused kernel: linear, and exact. Every Flax cell under ``plan="auto"`` on
four fast and four slow emulated devices (an uneven data split), the fused
LSTM in a bidirectional encoder over padded sentences under a searched plan
and a group plan, the NNX fused LSTM, and a hand-written cell (gates in a
jitted function, the cell under ``nn.remat``): each against one device.
Non-linear work on a sum in a scan body (its square, a running max) is still
refused, and the rule table is checked operand by operand.
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
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.batch_axis import linearity
from hetspmd.plan.groups import group_plan

from conftest import require_devices
from exactness import NnxReference, Reference, assert_exact

STEPS, BATCH, LENGTH, FEATURES, HIDDEN = 2, 22, 4, 3, 4


def _cluster():
  require_devices(8)
  return hs.Cluster.emulate(jax.devices()[:8], kinds=["V100-32GB"] * 4 + ["P100-16GB"] * 4)


# --- every Flax cell under nn.RNN, plan="auto" ------------------------------------------------------------------


class Gated(nn.RNNCellBase):
  """A hand-written GRU-like cell: its three kernels concatenated in a jitted function, one matmul, the gates
  taken apart with ``jnp.split``."""

  features: int

  @nn.compact
  def __call__(self, carry, x):
    kernels = [self.param(f"kernel_{g}", nn.initializers.lecun_normal(), (x.shape[-1] + self.features,
                                                                            self.features)) for g in "rzn"]
    bias = self.param("bias", nn.initializers.zeros_init(), (3 * self.features,))
    r, z, n = _fused_gates(jnp.concatenate([x, carry], -1), kernels, bias)
    h = (1 - nn.sigmoid(z)) * jnp.tanh(n * nn.sigmoid(r)) + nn.sigmoid(z) * carry
    return h, h

  def initialize_carry(self, rng, input_shape):
    return jnp.zeros(input_shape[:-1] + (self.features,))

  @property
  def num_feature_axes(self):
    return 1


@jax.jit
def _fused_gates(inputs, kernels, bias):
  return jnp.split(inputs @ jnp.concatenate(kernels, -1) + bias, 3, axis=-1)


CELLS = {
    "LSTMCell": lambda: nn.LSTMCell(HIDDEN),
    "OptimizedLSTMCell": lambda: nn.OptimizedLSTMCell(HIDDEN),
    "GRUCell": lambda: nn.GRUCell(HIDDEN),
    "MGUCell": lambda: nn.MGUCell(HIDDEN),
    "SimpleCell": lambda: nn.SimpleCell(HIDDEN),
    "ConvLSTMCell": lambda: nn.ConvLSTMCell(2, kernel_size=(3, 3)),
    "hand-written": lambda: Gated(HIDDEN),
    "hand-written-remat": lambda: nn.remat(Gated)(HIDDEN),
}
SHAPES = {"ConvLSTMCell": (LENGTH, 3, 3, 2)}  # (time, height, width, channels)


class Encoder(nn.Module):
  cell: str

  @nn.compact
  def __call__(self, x):
    last = nn.RNN(CELLS[self.cell]())(x)[:, -1]
    return nn.Dense(1)(last.reshape(last.shape[0], -1))[:, 0]


def regression_step(state, batch):
  def loss_fn(params):
    return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss}


def _encoder_state(cell):
  model = Encoder(cell)
  params = model.init(jax.random.key(0), jnp.ones((2,) + SHAPES.get(cell, (LENGTH, FEATURES))))["params"]
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2, eps=1e-4))


def _sequences(cell, seed=0):
  rs = np.random.RandomState(seed)
  shape = (BATCH,) + SHAPES.get(cell, (LENGTH, FEATURES))
  return [{"x": rs.randn(*shape).astype(np.float32), "y": rs.randn(BATCH).astype(np.float32)}
          for _ in range(STEPS)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cell", list(CELLS))
def test_every_flax_cell_under_nn_rnn_is_exact(cell):
  """``plan="auto"`` on four fast and four slow devices, the batch of 22 split unevenly."""
  batches = _sequences(cell)
  ref = Reference(regression_step, _encoder_state(cell)).run(batches)
  step = hs.parallelize(regression_step, cluster=_cluster(), plan="auto", global_batch=BATCH)
  state = _encoder_state(cell)
  for i, batch in enumerate(batches):
    state, metrics = step(state, batch)
    ref.check_metrics(metrics, i)
  ref.check(state.params, lambda s: s.params)
  assert len(set(step.plan.microbatch_counts)) > 1, step.plan.microbatch_counts  # an uneven split
  assert "inlined" not in step.explain()  # the remat'd cell stays one block per step of the scan
