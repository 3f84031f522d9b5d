"""BERT and BERT-MoE: the masked loss, MoE routing and capacity, and abstract traces."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hetspmd
from hetspmd import models
from exactness import Float64, assert_exact
from hetspmd.models import bert

TINY = bert.CONFIGS["bert-tiny"][0]


def _moe_config(**moe) -> bert.BertConfig:
  return dataclasses.replace(TINY, moe=bert.MoEConfig(num_experts=4, **moe))


def _moe_layer(**moe) -> bert.MoEMLP:
  return bert.MoEMLP(_moe_config(**moe), nnx.Rngs(0))


_route = jax.jit(bert.route, static_argnums=1)
_apply = nnx.jit(lambda layer, x: layer(x))


def _router_probs(layer: bert.MoEMLP, x: jax.Array) -> jax.Array:
  return jax.nn.softmax(jnp.einsum("bsd,de->bse", x, layer.router[...]), axis=-1)


def _tokens(batch=3, seq=32, seed=0) -> jax.Array:
  return jax.random.normal(jax.random.key(seed), (batch, seq, TINY.d_model))


# --- the masked-LM loss -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_loss():
  workload = models.get("bert-tiny")
  model = workload.build(workload.config, nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  return jax.jit(lambda batch: workload.loss(nnx.merge(graphdef, params), batch)[0]), workload


def test_masked_loss_ignores_targets_at_unmasked_positions(tiny_loss):
  loss, workload = tiny_loss
  batch = workload.synthetic_batch(seed=1)
  unmasked = batch["mask"] == 0
  other_targets = np.where(unmasked, (batch["targets"] + 7) % TINY.vocab_size, batch["targets"])
  assert float(loss(batch)) == float(loss({**batch, "targets": other_targets}))
  masked_changed = np.where(unmasked, batch["targets"], (batch["targets"] + 7) % TINY.vocab_size)
  assert float(loss(batch)) != float(loss({**batch, "targets": masked_changed}))


def test_synthetic_batch_masks_about_15_percent_with_one_per_row():
  workload = models.get("bert-tiny")
  batch = workload.synthetic_batch(seed=0, batch=64, seq=64)
  assert batch["inputs"].dtype == batch["targets"].dtype == np.int32 and batch["mask"].dtype == np.float32
  assert 0 <= batch["targets"].min() and batch["targets"].max() < TINY.vocab_size
  assert set(np.unique(batch["mask"])) <= {0.0, 1.0}
  assert (batch["mask"].sum(axis=1) >= 1).all()
  assert 0.12 < batch["mask"].mean() < 0.18
  masked = batch["mask"] == 1
  assert (batch["inputs"][masked] == TINY.mask_token_id).all()
  assert (batch["inputs"][~masked] == batch["targets"][~masked]).all()


def test_weighted_loss_needs_hetspmd_value_and_grad_and_agrees_with_the_mean():
  """``Weighted`` is a pytree, not a scalar: plain ``jax.value_and_grad`` refuses it."""
  plain = models.get("bert-moe-tiny")
  cfg = dataclasses.replace(plain.config, weighted_loss=True)
  model = bert.Bert(cfg, nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  batch = plain.synthetic_batch(seed=0)

  def loss_fn(params, batch):
    return bert.mlm_loss(nnx.merge(graphdef, params), batch)

  with pytest.raises(TypeError, match="scalar-output"):
    jax.eval_shape(jax.value_and_grad(loss_fn, has_aux=True), params, batch)
  (loss, aux), _ = jax.eval_shape(hetspmd.value_and_grad(loss_fn, has_aux=True), params, batch)
  assert loss.shape == () and set(aux) == {"mlm_loss", "moe_aux_loss"}
  value, metrics = jax.jit(loss_fn)(params, batch)
  plain_graphdef = plain.graphdef()
  plain_loss = lambda p, b: plain.loss(nnx.merge(plain_graphdef, p), b)
  mean, mean_metrics = jax.jit(plain_loss)(params, batch)
  mean64, mean64_metrics = Float64(plain_loss)(params, batch)
  assert isinstance(value, hetspmd.Weighted)
  assert_exact((value.total / value.weight, metrics["moe_aux_loss"].total / metrics["moe_aux_loss"].weight),
               (mean, mean_metrics["moe_aux_loss"]), (mean64, mean64_metrics["moe_aux_loss"]))


# --- MoE routing -----------------------------------------------------------------


def test_capacity_formula():
  assert bert.MoEConfig(num_experts=8, capacity_factor=1.25).capacity(512) == 80
  assert bert.MoEConfig(num_experts=8, top_k=2, capacity_factor=1.25).capacity(512) == 160
  assert bert.MoEConfig(num_experts=4, capacity_factor=0.3).capacity(10) == 1


@pytest.mark.parametrize("top_k", [1, 2])
def test_tokens_over_capacity_are_dropped_to_the_residual(top_k):
  layer = _moe_layer(top_k=top_k, capacity_factor=0.25)  # 32 tokens, 4 experts: capacity 2 * top_k
  x = _tokens()
  y, _ = _apply(layer, x)
  routing = _route(_router_probs(layer, x), layer.moe)
  capacity = layer.moe.capacity(x.shape[1])
  assert routing.dispatch.shape == (3, 32, 4, capacity)
  assert float(jnp.max(jnp.sum(routing.dispatch, axis=1))) <= 1  # one token per (expert, slot)
  slots_per_token = jnp.sum(routing.dispatch, axis=(2, 3))
  dropped = slots_per_token == 0
  assert int(jnp.sum(dropped)) > 0
  assert float(jnp.max(slots_per_token)) <= top_k
  np.testing.assert_array_equal(y[dropped], 0.0)  # the block adds nothing: LN(x + 0)
  assert bool(jnp.all(jnp.any(y[~dropped] != 0, axis=-1)))


def test_top2_routes_kept_tokens_to_two_experts_with_weights_summing_to_one():
  layer = _moe_layer(top_k=2, capacity_factor=4.0)  # capacity = every token: nothing dropped
  x = _tokens()
  probs = _router_probs(layer, x)
  routing = _route(probs, layer.moe)
  experts_per_token = jnp.sum(routing.dispatch, axis=(2, 3))
  np.testing.assert_array_equal(experts_per_token, 2.0)
  np.testing.assert_array_equal(jnp.max(jnp.sum(routing.dispatch, axis=3), axis=-1), 1.0)  # two distinct experts
  np.testing.assert_allclose(jnp.sum(routing.combine, axis=(2, 3)), 1.0, rtol=1e-6)
  squeezed = _route(probs, dataclasses.replace(layer.moe, capacity_factor=0.5))
  assert float(jnp.max(jnp.sum(squeezed.combine, axis=(2, 3)))) <= 1 + 1e-6


def test_top1_combine_weight_is_the_router_probability():
  moe = bert.MoEConfig(num_experts=4, capacity_factor=4.0)
  probs = jax.nn.softmax(_tokens(seq=16)[..., :4] * 3, axis=-1)
  routing = _route(probs, moe)
  np.testing.assert_allclose(jnp.sum(routing.combine, axis=(2, 3)), jnp.max(probs, axis=-1), rtol=1e-6)


def test_balanced_routing_has_aux_loss_one():
  probs = jnp.tile(jnp.eye(4), (1, 8, 1))  # each expert first choice of a quarter of the tokens
  routing = _route(probs, bert.MoEConfig(num_experts=4))
  np.testing.assert_allclose(routing.aux_loss, 1.0, rtol=1e-6)
  skewed = _route(jnp.tile(jnp.array([[[1.0, 0, 0, 0]]]), (1, 32, 1)), bert.MoEConfig(num_experts=4))
  np.testing.assert_allclose(skewed.aux_loss, 4.0, rtol=1e-6)


def test_routing_groups_are_sequences():
  """One sequence's output does not depend on the others (microbatching keeps the step)."""
  layer = _moe_layer(capacity_factor=0.5)
  x = _tokens()
  np.testing.assert_allclose(_apply(layer, x)[0][1:2], _apply(layer, x[1:2])[0], rtol=1e-5, atol=1e-6)


def test_expert_weights_have_a_leading_expert_dimension():
  workload = models.get("bert-moe-base")
  params = workload.abstract_state()["params"]
  layers = params["layers"]
  for i in range(workload.config.n_layer):
    if i % 2:
      assert layers[i]["mlp"]["wi"].shape == (8, 768, 3072)
      assert layers[i]["mlp"]["wo"].shape == (8, 3072, 768)
      assert layers[i]["mlp"]["router"].shape == (768, 8)
    else:
      assert layers[i]["mlp"]["intermediate"]["kernel"].shape == (768, 3072)


# --- full-size configs, abstractly ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert-base", "bert-moe-base"])
def test_abstract_trace_counts_every_parameter(name):
  workload = models.get(name)
  graph = hetspmd.trace(workload.make_train_step(), workload.abstract_state(), workload.example_batch())
  assert graph.elements_with_role("param") == workload.param_count()
  assert any(layer.name == "layer_1/attn" for layer in graph.layers)
