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
and a group plan, NNX's fused LSTM, and a hand-written cell (gates in a
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


@functools.cache
def _encoder_params(cell):
  params = jax.jit(Encoder(cell).init)(jax.random.key(0), jnp.ones((2,) + SHAPES.get(cell, (LENGTH, FEATURES))))
  return jax.tree.map(np.asarray, params)  # host copies: a step may donate the arrays it is given


def _encoder_state(cell):
  model, params = Encoder(cell), _encoder_params(cell)["params"]
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


# --- the fused LSTM in a bidirectional encoder over padded sentences: a searched plan and a group plan -----------

VOCAB = 20


class BiEncoder(nn.Module):
  """Flax's SST-2 encoder with the fused LSTM: a ``nn.Bidirectional`` pair of ``nn.RNN`` over sentences of their
  own lengths (``seq_lengths``), then a ``nn.scan`` of the cell over its outputs read at each sentence's last
  token."""

  @nn.compact
  def __call__(self, tokens, lengths):
    x = nn.Embed(VOCAB, FEATURES)(tokens)
    both = nn.Bidirectional(nn.RNN(nn.OptimizedLSTMCell(HIDDEN)), nn.RNN(nn.OptimizedLSTMCell(HIDDEN)))
    x = both(x, seq_lengths=lengths)
    scan = nn.scan(nn.OptimizedLSTMCell, variable_broadcast="params", split_rngs={"params": False}, in_axes=1,
                   out_axes=1)
    carry = nn.OptimizedLSTMCell(HIDDEN, parent=None).initialize_carry(jax.random.key(0), x[:, 0].shape)
    _, y = scan(HIDDEN)(carry, x)
    last = jnp.take_along_axis(y, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return nn.Dense(2)(last)


def sentence_step(state, batch):
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["tokens"], batch["lengths"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss}


@functools.cache
def _sentence_params():
  params = jax.jit(BiEncoder().init)(jax.random.key(0), jnp.ones((2, LENGTH + 1), jnp.int32),
                                     jnp.array([LENGTH + 1, 2]))
  return jax.tree.map(np.asarray, params)


def _sentence_state():
  model, params = BiEncoder(), _sentence_params()
  return train_state.TrainState.create(apply_fn=model.apply, params=params["params"],
                                       tx=optax.adam(1e-2, eps=1e-4))


def _sentences(seed=1):
  rs = np.random.RandomState(seed)
  out = []
  for _ in range(STEPS):
    lengths = rs.randint(1, LENGTH + 2, BATCH).astype(np.int32)
    tokens = rs.randint(1, VOCAB, (BATCH, LENGTH + 1)) * (np.arange(LENGTH + 1)[None] < lengths[:, None])
    out.append({"tokens": tokens.astype(np.int32), "lengths": lengths,
                "label": rs.randint(0, 2, BATCH).astype(np.int32)})
  return out


# two groups: the fast four with microbatches of 2, the slow four with microbatches of 1 (14 + 8 examples)
GROUPS = [((0, 1, 2, 3), 2, (2, 2, 2, 1)), ((4, 5, 6, 7), 1, (2, 2, 2, 2))]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("plan", ["search", "group"])
def test_a_bidirectional_fused_lstm_encoder_is_exact(plan):
  batches = _sentences()
  ref = Reference(sentence_step, _sentence_state()).run(batches)
  if plan == "search":
    step = hs.parallelize(sentence_step, cluster=_cluster(), plan="search", global_batch=BATCH)
  else:
    require_devices(8)
    step = hs.parallelize(sentence_step, plan=group_plan(GROUPS, BATCH), global_batch=BATCH)
  state = _sentence_state()
  for i, batch in enumerate(batches):
    state, metrics = step(state, batch)
    ref.check_metrics(metrics, i)
  ref.check(state.params, lambda s: s.params)
  assert step.grouped or plan == "search"  # the search prices a group plan too, and may take either


# --- NNX --------------------------------------------------------------------------------------------------------


def _nnx_objects():
  from flax import nnx

  class Recurrent(nnx.Module):
    def __init__(self, rngs):
      self.rnn = nnx.RNN(nnx.OptimizedLSTMCell(FEATURES, HIDDEN, rngs=rngs))
      self.head = nnx.Linear(HIDDEN, 1, rngs=rngs)

    def __call__(self, x):
      return self.head(self.rnn(x)[:, -1])[:, 0]

  model = Recurrent(nnx.Rngs(0))
  return model, nnx.Optimizer(model, optax.adam(1e-2, eps=1e-4), wrt=nnx.Param)


def nnx_step(model, optimizer, batch):
  from flax import nnx

  loss_fn = lambda model: jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
  optimizer.update(model, nnx.grad(loss_fn)(model))


@pytest.mark.timeout(300)
def test_an_nnx_fused_lstm_is_exact():
  """``nnx.OptimizedLSTMCell`` holds its gates' kernels fused already (one ``Linear`` for the inputs, one for the
  hidden state), so its scan body splits activations, not summed gradients: ``plan="auto"``, exact."""
  from flax import nnx

  batches = _sequences("nnx")
  ref = NnxReference(nnx_step, _nnx_objects()).run(batches)
  mine = _nnx_objects()
  step = hs.parallelize(nnx_step, cluster=_cluster(), plan="auto", global_batch=BATCH)
  for batch in batches:
    assert step(*mine, batch) is None
  assert_exact(nnx.state(mine[0], nnx.Param), nnx.state(ref.single[0], nnx.Param), nnx.state(ref.ref64[0], nnx.Param),
               what="parameters")
  assert len(set(step.plan.microbatch_counts)) > 1


# --- still refused: non-linear work on a sum in a scan body -------------------------------------------------------


def _penalised_step(squash):
  """A loss with a penalty accumulated over time in a ``lax.scan`` from each step's sum over the examples:
  squared, or kept as a running max. Neither is a sum of per-microbatch parts."""

  def step_fn(state, batch):
    def loss_fn(params):
      hidden = state.apply_fn({"params": params}, batch["x"])

      def body(penalty, h):
        total = h.sum()
        return (penalty + total ** 2 if squash == "square" else jnp.maximum(penalty, total)), None

      penalty, _ = jax.lax.scan(body, 0.0, hidden.transpose(1, 0, 2))
      return jnp.mean(hidden) + 1e-3 * penalty

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  return step_fn


class _Recurrent(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.RNN(nn.OptimizedLSTMCell(HIDDEN))(x)


@pytest.mark.parametrize("squash,primitive", [("square", "integer_pow"), ("max", "max")])
def test_non_linear_work_on_a_sum_in_a_scan_body_is_refused(squash, primitive):
  model = _Recurrent()
  params = model.init(jax.random.key(0), jnp.ones((2, LENGTH, FEATURES)))["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
  step = hs.parallelize(_penalised_step(squash), cluster=_cluster(), plan="auto", global_batch=BATCH)
  with pytest.raises(hs.HetSpmdError, match=f"its scan body applies {primitive} to a sum over the examples"):
    step(state, _sequences("refused")[0])


# --- the rule table, operand by operand ---------------------------------------------------------------------------

M, V = jnp.ones((4, 6)), jnp.ones((6,))
I, IDX = jnp.int32(1), jnp.array([0, 2])
U, U0 = jnp.uint32(1), jnp.uint32(0)  # unsigned indices: lax takes them as they are (no wrapping of negatives)
LINEAR = [
    # (name, function, arguments, positions holding a sum)
    ("split", lambda s: jnp.split(s, 2, -1), (M,), (0,)),
    ("jitted-split", jax.jit(lambda s: jnp.split(s, 3, 0)[1]), (V,), (0,)),
    ("rev-transpose-reshape", lambda s: jax.lax.rev(s, (0,)).T.reshape(-1), (M,), (0,)),
    ("expand-squeeze-broadcast", lambda s: jnp.broadcast_to(jnp.expand_dims(s, 0).squeeze(0), (2, 4, 6)), (M,), (0,)),
    ("neg-sub-add", lambda s, t: -(s - t) + s, (M, M), (0, 1)),
    ("reduce_sum-cumsum", lambda s: jnp.cumsum(s.sum(0)), (M,), (0,)),
    ("dynamic_slice", lambda s, i: jax.lax.dynamic_slice(s, (i, 0), (2, 2)), (M, I), (0,)),
    ("dynamic_update_slice", lambda s, t, i: jax.lax.dynamic_update_slice(s, t, (i, 0)), (M, M[:2], I), (0, 1)),
    ("gather", lambda s, i: s[i], (M, IDX), (0,)),
    ("gather-fill-0", lambda s, i: s.at[i].get(mode="fill", fill_value=0), (M, IDX), (0,)),
    ("scatter-add", lambda s, t, i: s.at[i].add(t), (M, M[:2], IDX), (0, 1)),
    ("complex-parts", lambda s, t: jnp.real(jax.lax.complex(s, t)) + jnp.imag(jnp.conj(jax.lax.complex(s, t))),
     (M, M), (0, 1)),
    ("fft", lambda s: jnp.fft.fft(s).real, (M,), (0,)),
    ("products", lambda s, w: (s * w) @ w.T / w[:, :1], (M, M), (0,)),
    ("conv", lambda s, w: jax.lax.conv(s[None, None], w[None, None], (1, 1), "SAME"), (M, M[:3, :3]), (0,)),
    ("select-concatenate-pad", lambda s, p: jnp.pad(jnp.concatenate([jnp.where(p, s, 0.0), s]), 1),
     (M, M > 0), (0,)),
    ("casts", lambda s: s.astype(jnp.bfloat16).astype(jnp.float32), (M,), (0,)),
    ("checkpoint", jax.checkpoint(lambda s: jnp.split(s, 2)[0] * 2.0), (M,), (0,)),
]
NOT_LINEAR = [
    ("max", lambda s: jnp.maximum(s, 0.0), (M,), (0,), "applies max to a sum"),
    ("square", lambda s: s ** 2, (M,), (0,), "applies integer_pow to a sum"),
    ("reduce_max", lambda s: s.max(), (M,), (0,), "applies reduce_max to a sum"),
    ("cumprod", lambda s: jnp.cumprod(s, 0), (M,), (0,), "applies cumprod to a sum"),
    ("sum-times-itself", lambda s: s * s, (M,), (0,), "multiplies two sums"),
    ("two-sums", lambda s, t: s @ t.T, (M, M), (0, 1), "multiplies two sums"),
    ("divisor", lambda w, s: w / s, (M, M), (1,), "divides by a sum"),
    ("plus-constant", lambda s: s + 1.0, (M,), (0,), "adds a sum over the examples to a value that is not one"),
    ("pad-value", lambda s: jnp.pad(s, 1, constant_values=1.0), (M,), (0,), "pads a sum over the examples"),
    ("index", lambda w, i: jax.lax.dynamic_slice(w, (i, U0), (2, 2)), (M, U), (1,),
     "indexes or sizes dynamic_slice by a sum"),
    ("predicate", lambda p, a, b: jax.lax.select_n(p, a, b), (M > 0, M, M), (0, 1, 2),
     r"selects or indexes by a sum over the examples \(select_n\)"),
    ("update-indices", lambda s, i: jax.lax.dynamic_update_slice(s, s[:2], (i, U0)), (M, U), (0, 1),
     r"selects or indexes by a sum over the examples \(dynamic_update_slice\)"),
    ("gather-fill-nan", lambda s, i: s.at[i].get(mode="fill"), (M, IDX), (0,), "fill value that is not zero"),
    ("to-integer", lambda s: s.astype(jnp.int32), (M,), (0,), "converts a sum over the examples to int32"),
    ("checkpoint", jax.checkpoint(lambda s: jnp.maximum(s, 0.0)), (M,), (0,), "applies max to a sum"),
    ("while", lambda s: jax.lax.while_loop(lambda x: x[0, 0] < 9.0, lambda x: x * 2.0, s), (M,), (0,),
     "applies while to a sum"),
]


def _use(fn, args, summed):
  closed = jx.inline_calls(jax.make_jaxpr(fn)(*args), keep=jx.CHECKPOINTS)
  return linearity.nonlinear_use(closed, [jx.invars(closed)[j] for j in summed])


@pytest.mark.parametrize("fn,args,summed", [c[1:] for c in LINEAR], ids=[c[0] for c in LINEAR])
def test_linear_work_on_sums_is_accepted(fn, args, summed):
  assert _use(fn, args, summed) is None


@pytest.mark.parametrize("fn,args,summed,reason", [c[1:] for c in NOT_LINEAR], ids=[c[0] for c in NOT_LINEAR])
def test_non_linear_work_on_sums_is_named(fn, args, summed, reason):
  import re

  assert re.search(reason, _use(fn, args, summed) or "")
