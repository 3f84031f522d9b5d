"""One layer-stack finder: the stack the planner prices is the stack the lowering cuts.

The planner finds it in the step's two traces, the lowering in the flat jaxpr of its microbatch program;
both go through :func:`hetspmd.passes.frontend.stack.find_layer_stack`, and must agree: on every zoo model
that scans its layers, on a Linen ``nn.scan`` model written here, and on steps without a stack.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

from hetspmd import models
from hetspmd.errors import HetSpmdError, NoLayerStackError
from hetspmd.lowering import staged
from hetspmd.lowering.program import Program
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.batch_axis.analysis import analyse
from hetspmd.passes.frontend import stack as layer_stack
from hetspmd.planner import stages
from hetspmd.passes.profile import profile_step

SEQ, BATCH = 16, 4


def _planner_stack(step, state, batch):
  return stages.find_stack(profile_step(step, state, batch))


def _lowering_stack(step, state, batch):
  """The lowering's stack of ``step`` at ``batch`` (its microbatch program, as hetspmd.runtime builds it)."""
  closed = jx.make_closed_jaxpr(step, jx.to_abstract(state), jx.to_abstract(batch))
  first = len(jax.tree.leaves(state))
  inputs = range(first, first + len(jax.tree.leaves(batch)))
  analysis = analyse(closed, inputs, jax.tree.leaves(batch)[0].shape[0])
  return staged.find_stack(Program(analysis, inputs, fuse=False))


def _assert_agree(step, state, batch, layers):
  planned, lowered = _planner_stack(step, state, batch), _lowering_stack(step, state, batch)
  assert planned is not None and planned.layers == layers
  assert lowered.length == layers
  assert planned.scans == lowered.scans  # the same two scans among the step's top-level scans
  assert (lowered.forward, lowered.backward) == (lowered.scans.forward, lowered.scans.backward)


SCANNED = [n for n in models.names() if getattr(models.get(n).config, "scan_layers", False)]


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if models.get(n).test_size else pytest.mark.slow)
                                  for n in SCANNED])
def test_zoo_models_with_a_layer_stack_agree(name):
  w = models.get(name)
  _assert_agree(w.make_train_step(), w.abstract_state(), w.example_batch(BATCH, SEQ), w.config.n_layer)


def test_the_zoo_has_scanned_models():
  assert "gpt2-tiny-scan" in SCANNED


def test_a_step_without_a_stack_has_none_on_both_sides():
  w = models.get("gpt2-tiny")
  step, state, batch = w.make_train_step(), w.abstract_state(), w.example_batch(BATCH, SEQ)
  assert _planner_stack(step, state, batch) is None
  with pytest.raises(NoLayerStackError, match="found 0 forward scans"):
    _lowering_stack(step, state, batch)
  assert issubclass(NoLayerStackError, HetSpmdError)


# --- a Linen classifier whose residual blocks run under nn.scan ------------------------------------------

VOCAB, WIDTH, DEPTH, CLASSES = 31, 8, 3, 5


class Residual(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    g = nn.gelu(nn.Dense(3 * WIDTH)(nn.LayerNorm()(h)))
    return h + nn.Dense(WIDTH)(g), None


class Classifier(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    h = nn.Embed(VOCAB, WIDTH)(tokens)
    tower = nn.scan(Residual, variable_axes={"params": 0}, split_rngs={"params": True}, length=DEPTH)
    h, _ = tower(name="tower")(h, None)
    return nn.Dense(CLASSES)(jnp.mean(nn.LayerNorm()(h), axis=1))


def _classifier_step():
  model = Classifier()
  tokens = jnp.zeros((BATCH, SEQ), jnp.int32)
  state = train_state.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), tokens)["params"],
                                        tx=optax.adam(1e-3))

  def step(state, batch):
    def loss(params):
      logits = state.apply_fn({"params": params}, batch["tokens"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), value

  batch = {"tokens": jnp.asarray(np.arange(BATCH * SEQ).reshape(BATCH, SEQ) % VOCAB, jnp.int32),
           "label": jnp.arange(BATCH, dtype=jnp.int32) % CLASSES}
  return step, state, batch


def test_a_linen_scan_model_agrees():
  step, state, batch = _classifier_step()
  _assert_agree(step, state, batch, DEPTH)


def test_the_finder_refuses_two_forward_stacks_and_a_transpose_of_another_length():
  def site(at, reverse, length, reads, writes, per_example, forward=True):
    return layer_stack.ScanSite(at, reverse, length, 0, 1, forward, reads, writes, per_example)

  f = site(3, False, 4, ("h", "w"), ("h2", "res"), (True, False))
  b = site(9, True, 4, ("g", "res"), ("g2", "dw"), (True, True), forward=False)
  found = layer_stack.find_layer_stack([f, b])
  assert (found.length, found.forward_scan, found.backward_scan, found.forward, found.backward) == (4, 0, 1, 3, 9)
  with pytest.raises(NoLayerStackError, match="found 2 forward scans"):
    layer_stack.find_layer_stack([f, site(5, False, 4, ("h2", "v"), ("h3", "r2"), (True, False)), b])
  with pytest.raises(NoLayerStackError, match="once per layer"):
    layer_stack.find_layer_stack([f, site(9, True, 3, ("g", "res"), ("g2",), (True, True), forward=False)])
  with pytest.raises(NoLayerStackError, match="found 0 reversed scans"):
    layer_stack.find_layer_stack([f])
