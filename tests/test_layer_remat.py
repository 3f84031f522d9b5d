"""Remat ``"layers"``: each layer of the traced step recomputed from its saved inputs before its backward pass.

The steps differentiate with ``jax.value_and_grad`` as Flax's own examples do (lm1b's closure over the batch,
a dropout key folded with the step, token weights outside the loss), so nothing of hetspmd is in them; every
run is checked against one device and a float64 reference (tests/exactness.py).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import hetspmd as hs
from hetspmd import models
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes import remat
from hetspmd.passes.batch_axis.analysis import analyse
from hetspmd.passes.profile import profile_step
from hetspmd.plan.groups import Group, group_plan
from hetspmd.planner.data_axis import microbatch_bytes
from hetspmd.runtime.grouped import run_groups

from conftest import require_devices
from exactness import NnxReference, Reference
from test_unmodified_steps import check_nnx

VOCAB, SEQ, WIDTH = 40, 6, 16
KINDS = ["V100-32GB"] * 4 + ["P100-16GB"] * 4


# --- the pass on its own ------------------------------------------------------------------------------------------

SCOPES = [
    # module paths, the layer each belongs to (None: outside any layer)
    (["h_0/attn", "h_0/mlp", "h_1/attn", "embed", "ln_f"], {"h_0/attn": "h_0", "h_0/mlp": "h_0", "h_1/attn": "h_1"}),
    (["Model/Block_0/Dense_0", "Model/Block_1/Dense_0", "Model/Dense_0"],
     {"Model/Block_0/Dense_0": "Model/Block_0", "Model/Block_1/Dense_0": "Model/Block_1"}),
    (["layers/0/mlp", "layers/1/mlp", "head"], {"layers/0/mlp": "layers/0", "layers/1/mlp": "layers/1"}),
    (["Dense_0", "Dense_1"], {"Dense_0": "Dense_0", "Dense_1": "Dense_1"}),  # an MLP's numbered layers
    (["encoder_0/x", "decoder_0/y"], {}),  # two stems numbered once each: no repeated block
    (["", "loss"], {}),
]


@pytest.mark.parametrize("paths,expected", SCOPES, ids=[str(i) for i in range(len(SCOPES))])
def test_layers_are_the_numbered_scopes_of_a_repeated_block(paths, expected):
  assert remat.layer_scopes(paths) == expected


def test_a_segment_remakes_only_per_example_values_its_backward_pass_reads():
  S = remat.Site
  sites = [
      S("h_0", "forward", ("x", "w"), ("wc",)),            # a cast weight: example-free, read saved
      S("h_0", "forward", ("x", "wc"), ("a",)),
      S("h_0", "forward", ("a",), ("b",)),
      S("h_0", "forward", ("b",), ("out0",)),              # the layer's output: the next layer reads it
      S("h_1", "forward", ("out0", "w"), ("out1",)),
      S("h_1", "forward", ("out0",), ("noise",), recomputable=False),
      S("", "forward", ("out1", "noise"), ("loss",)),
      S("h_1", "backward", ("out0", "noise"), ("g1",)),
      S("h_0", "backward", ("g1", "a", "b", "wc"), ("g0",)),
      S("", "", ("loss", "g0"), ()),
  ]
  per_example = lambda v: v not in ("w", "wc")
  found = {s.layer: s for s in remat.segments(sites, per_example)}
  assert set(found) == {"h_0"}  # h_1's backward reads only the layer boundary and a value it may not remake
  h0 = found["h_0"]
  assert h0.members == (1, 2) and set(h0.residuals) == {"a", "b"} and h0.at == 8
  assert set(h0.inputs) == {"x", "wc"}


# --- a Linen step shaped as lm1b's ------------------------------------------------------------------------------


class Block(nn.Module):
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, mask, train: bool):
    h = nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.1, deterministic=not train, dtype=self.dtype)(
        nn.LayerNorm(dtype=self.dtype)(x), mask=mask)
    x = x + h
    h = nn.Dense(32, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))
    h = nn.Dropout(0.1, deterministic=not train)(nn.gelu(h))
    return x + nn.Dense(WIDTH, dtype=self.dtype)(h)


class Decoder(nn.Module):
  layers: int = 3
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, tokens, train: bool):
    mask = nn.combine_masks(nn.make_attention_mask(tokens > 0, tokens > 0), nn.make_causal_mask(tokens))
    x = nn.Embed(VOCAB, WIDTH, dtype=self.dtype)(tokens)
    for _ in range(self.layers):
      x = Block(self.dtype)(x, mask, train)
    return nn.Dense(VOCAB, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x)).astype(jnp.float32)


def lm_step(state, batch, dropout_rng):
  """lm1b's pattern: token weights outside the loss, a dropout key folded with the step, logits as aux."""
  inputs, targets = batch["inputs"], batch["targets"]
  weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)
  rng = jax.random.fold_in(dropout_rng, state.step)

  def loss_fn(params):
    logits = state.apply_fn({"params": params}, inputs, train=True, rngs={"dropout": rng})
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights
    return loss.sum() / weights.sum(), logits

  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  accuracy = ((jnp.argmax(logits, -1) == targets) * weights).sum()
  return state.apply_gradients(grads=grads), {"loss": loss, "accuracy": accuracy}


def _lm_state(dtype=jnp.float32, eps=1e-4):
  model = Decoder(dtype=dtype)
  params = model.init(jax.random.key(0), jnp.zeros((2, SEQ), jnp.int32), train=False)["params"]
  return lambda: train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(3e-3, eps=eps))


def _token_batches(size, steps=2, seed=0):
  rs = np.random.RandomState(seed)
  out = []
  for _ in range(steps):
    inputs = rs.randint(0, VOCAB, (size, SEQ)).astype(np.int32)
    inputs[:, -2:] *= rs.randint(0, 2, (size, 1))  # padding at the end of some rows
    out.append({"inputs": inputs, "targets": np.roll(inputs, -1, axis=1)})
  return out


def _planned(step_fn, state, batches, ref, *, counts, microbatch=1, layout=(8, 1), remat_policy="layers",
             options=None, **call_kwargs):
  require_devices(8)
  cluster = hs.Cluster.emulate(jax.devices()[:8], kinds=KINDS)
  batch = sum(counts) * microbatch
  plan = hs.plan_for(cluster, state, global_batch=batch, layout=layout, microbatch=microbatch, counts=counts,
                     remat=remat_policy)
  step = hs.parallelize(step_fn, cluster=cluster, plan=plan, global_batch=batch, **(options or {}))
  state = step.shard_state(state)
  for i, b in enumerate(batches):
    state, metrics = step(state, b, **call_kwargs)
    ref.check_metrics(metrics, i)
  return step, state


LM_CASES = [((3, 3, 2, 2, 2, 2, 1, 1), 1, (8, 1), False), ((2, 2, 1, 1), 2, (4, 2), True)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("counts,microbatch,layout,jitted", LM_CASES, ids=["8x1-weighted", "4x2-mb2-jit"])
def test_a_linen_lm1b_step_recomputes_each_block_and_matches_one_device(counts, microbatch, layout, jitted):
  step_fn = jax.jit(lm_step) if jitted else lm_step
  batches = _token_batches(sum(counts) * microbatch)
  rng = jax.random.key(3)
  ref = Reference(step_fn, _lm_state()()).run(batches, dropout_rng=rng)
  step, state = _planned(step_fn, _lm_state()(), batches, ref, counts=counts, microbatch=microbatch, layout=layout,
                         dropout_rng=rng)
  ref.check(state.params, lambda s: s.params)
  text = step.explain()
  assert "remat layers" in text and "3 layers recomputed" in text, text
  # one barrier per recomputed block, as jax.checkpoint lowers: XLA cannot merge the recomputation back
  assert step.lower(state, batches[0], dropout_rng=rng).as_text().count("optimization_barrier") == 3


@pytest.mark.timeout(300)
def test_a_bfloat16_step_recomputes_exactly():
  # Adam's eps above the gradients' rounding noise (tests/exactness.py: half-precision steps)
  state = _lm_state(jnp.bfloat16, eps=1e-3)
  counts = (2, 2, 2, 2, 1, 1, 1, 1)
  batches = _token_batches(sum(counts))
  rng = jax.random.key(5)
  ref = Reference(lm_step, state(), half=True).run(batches, dropout_rng=rng)
  _, trained = _planned(lm_step, state(), batches, ref, counts=counts, dropout_rng=rng)
  ref.check(trained.params, lambda s: s.params)


def test_the_forward_pass_keeps_its_values_for_the_metrics_and_the_recomputation_feeds_only_the_backward():
  """The logits the metrics read come from the forward pass (counted once); the recomputed values feed
  only backward equations."""
  state = _lm_state()()
  batch = _token_batches(8, steps=1)[0]
  closed = jx.make_closed_jaxpr(functools.partial(lm_step, dropout_rng=jax.random.key(0)), jx.to_abstract(state),
                                jx.to_abstract(batch))
  n = len(jax.tree.leaves(state))
  analysis = analyse(closed, range(n, n + 2), 8, remat="layers")
  eqns = jx.equations(analysis.jaxpr)
  calls = [i for i, e in enumerate(eqns) if jx.primitive_name(e) == "remat2"]
  assert len(calls) == 3
  made = {v: i for i in calls for v in eqns[i].outvars}
  readers = [e for e in eqns if any(not jx.is_literal(v) and v in made for v in e.invars)]
  assert readers and all(jx.phase(e) == "backward" for e in readers)
  assert all(jx.phase(eqns[i]) == "backward" for i in calls)


# --- the zoo's unrolled GPT and a Linen BatchNorm step --------------------------------------------------------


def _zoo_trained(w, step_fn, counts=(2, 2, 2, 2, 1, 1, 1, 1)):
  """A zoo model's step trained under remat "layers" for two steps, checked against one device."""
  rs = np.random.RandomState(1)
  batches = [jax.tree.map(lambda s: rs.randint(0, 50, s.shape).astype(s.dtype), w.example_batch(sum(counts)))
             for _ in range(2)]
  ref = Reference(step_fn, w.init_state()).run(batches)
  step, state = _planned(step_fn, w.init_state(), batches, ref, counts=counts)
  ref.check(state)
  return step, state, batches


@pytest.mark.timeout(300)
def test_the_zoo_gpt_with_jax_value_and_grad_recomputes_each_block_exactly():
  w = models.get("gpt2-tiny")
  step_fn = w.make_train_step()  # jax.value_and_grad
  step, _, _ = _zoo_trained(w, step_fn)
  assert "2 layers recomputed from their inputs" in step.explain()


class NormedBlock(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    h = nn.Dense(WIDTH)(x)
    h = nn.BatchNorm(use_running_average=not train, momentum=0.9)(h)
    return x + nn.relu(h)


class NormedNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(WIDTH)(x)
    for _ in range(3):
      x = NormedBlock()(x, train)
    return nn.Dense(4)(x)


class BnState(train_state.TrainState):
  batch_stats: dict


def bn_step(state, batch):
  """imagenet's pattern: batch statistics as a mutable collection, updated beside the gradients."""
  def loss_fn(params):
    logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, batch["x"],
                                     mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), updates

  (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  state = state.apply_gradients(grads=grads).replace(batch_stats=updates["batch_stats"])
  return state, {"loss": loss}


@pytest.mark.timeout(300)
def test_a_recomputed_batchnorm_normalises_with_the_saved_global_statistics():
  model = NormedNet()
  variables = model.init(jax.random.key(0), jnp.zeros((2, 6)))
  make = lambda: BnState.create(apply_fn=model.apply, params=variables["params"],
                                batch_stats=variables["batch_stats"], tx=optax.sgd(0.1))
  counts = (2, 2, 2, 2, 1, 1, 1, 1)
  rs = np.random.RandomState(0)
  batches = [{"x": rs.randn(12, 6).astype(np.float32), "y": rs.randint(0, 4, 12).astype(np.int32)}
             for _ in range(2)]
  ref = Reference(bn_step, make()).run(batches)
  step, state = _planned(bn_step, make(), batches, ref, counts=counts, options={"batch_stats": "exact"})
  ref.check(state.params, lambda s: s.params)
  ref.check(state.batch_stats, lambda s: s.batch_stats)
  assert "3 layers recomputed" in step.explain()


# --- group programs -------------------------------------------------------------------------------------------


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.gelu(nn.Dense(WIDTH)(nn.LayerNorm()(x)))


class _Stack(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(WIDTH)(x)
    for _ in range(4):
      x = _Block()(x)
    return nn.Dense(4)(x)


def stack_step(state, batch):
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss}


GROUP_CASES = {
    "layers-beside-none": [Group((0, 1, 2, 3), 2, (2, 2, 1, 1), "layers"), Group((4, 5, 6, 7), 1, (2, 1, 1, 1))],
    "sharded-layers": [Group((0, 1, 2, 3), 2, (2, 2, 1, 1), "layers", shard_params=True),
                       Group((4, 5, 6, 7), 1, (1, 1, 2, 2), "layers")],
}
MODELS = {"unrolled": lambda: _Stack(), "layer-scan": lambda: _ScannedStack()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(GROUP_CASES))
@pytest.mark.parametrize("form", list(MODELS))
def test_group_programs_recompute_their_layers_exactly(case, form):
  require_devices(8)
  groups = GROUP_CASES[case]
  plan = group_plan(groups, sum(g.microbatch * sum(g.counts) for g in groups))
  model = MODELS[form]()
  params = model.init(jax.random.key(0), jnp.zeros((1, 6)))["params"]
  make = lambda: train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
  rs = np.random.RandomState(0)
  batches = [{"x": rs.randn(plan.global_batch, 6).astype(np.float32),
              "y": rs.randint(0, 4, plan.global_batch).astype(np.int32)} for _ in range(2)]
  ref = Reference(stack_step, make()).run(batches)
  step = run_groups(stack_step, plan)
  state = step.shard_state(make())
  for i, b in enumerate(batches):
    state, metrics = step(state, b)
    ref.check_metrics(metrics, i)
  ref.check(state.params, lambda s: s.params)
  ref.check(state.opt_state, lambda s: s.opt_state)


# --- priced and searched ---------------------------------------------------------------------------------------


def test_the_cost_model_prices_the_layer_inputs_and_one_layer_recomputed():
  w = models.get("gpt2-small")
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))
  for m in (1, 8):
    none, layers, dots = (microbatch_bytes(profile, m, r) for r in ("none", "layers", "dots"))
    assert layers < dots < none
  assert profile.recomputed("layers").sum() > 0
  # the recomputed nodes are forward nodes of the numbered blocks only
  small = profile.traces[0]
  paths = {small.nodes[i].module_path.split("/")[0] for i in np.flatnonzero(profile.recomputed("layers"))}
  assert paths and all(p.startswith("h_") for p in paths), paths
  assert all(small.nodes[i].phase == "forward" for i in np.flatnonzero(profile.recomputed("layers")))


def test_a_layer_scan_is_priced_with_its_layer_inputs_stacked_and_its_body_run_again():
  w = models.get("gpt2-tiny-scan")
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))
  assert profile.layer_activation is not None
  for m in (1, 8):
    assert microbatch_bytes(profile, m, "layers") < microbatch_bytes(profile, m, "none")
  small = profile.traces[0]
  again = np.flatnonzero(profile.recomputed("layers"))
  assert again.size and all(small.nodes[i].phase == "forward" and small.nodes[i].loops for i in again)


@pytest.mark.timeout(300)
def test_the_zoo_layer_scan_recomputes_in_its_transpose_exactly():
  w = models.get("gpt2-tiny-scan")
  step_fn = w.make_train_step()
  step, _, batches = _zoo_trained(w, step_fn)
  assert "the layer scan's" in step.explain() and "layers recomputed in its transpose" in step.explain()
  # the forward scan stacks each layer's input, not its residuals: fewer stacked outputs than without remat
  plain = hs.parallelize(step_fn, cluster=step.cluster, plan=step.plan.replace(remat="none"),
                         global_batch=step.plan.global_batch)
  plain(plain.shard_state(w.init_state()), batches[0])
  scans = [[e for e in jx.equations(s._runner.analysis.jaxpr) if jx.primitive_name(e) == "scan"] for s in (step, plain)]
  assert len(scans[0][0].outvars) < len(scans[1][0].outvars)


class _ScannedBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return x + nn.gelu(nn.Dense(WIDTH)(nn.LayerNorm()(x))), None


class _ScannedStack(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(WIDTH)(x)
    x, _ = nn.scan(_ScannedBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)()(x, None)
    return nn.Dense(4)(x)


def test_the_cli_prices_only_the_policies_the_zoo_step_gets(capsys):
  from hetspmd import cli

  assert cli.main(["search", "--model", "gpt3-2.7b", "--cluster", "1x8xV100-16GB", "--dtype", "float16",
                   "--seq", "2048", "--global-batch", "64", "--json"]) == 0
  import json

  report = json.loads(capsys.readouterr().out)
  remats = {p["remat"] for p in report["plans"]} | {report["group_plan"]["remat"]}
  assert remats <= {"none", "layers"}, remats
  # with each layer recomputed, FSDP over the host holds GPT-3 2.7B at sequence 2048 (no plan fitted without)
  assert report["group_plan"]["efficiency"] >= 0.65, report["group_plan"]


@pytest.mark.timeout(300)
def test_search_chooses_layer_remat_where_memory_needs_it_and_runs_it_exactly():
  import dataclasses

  from hetspmd.hardware.profiler import device_spec
  from hetspmd.planner.data_axis import memory_per_device

  require_devices(8)
  state = _lm_state()()
  batch = 16
  batches = _token_batches(batch)
  rng = jax.random.key(3)
  fn = functools.partial(lm_step, dropout_rng=rng)
  profile = profile_step(fn, state, batches[0])
  saved, recomputed = (memory_per_device(profile, 8, 2, 0, r, optimizer_share=0.0) for r in ("none", "layers"))
  assert recomputed < saved
  # a device that holds a microbatch of 2 only with its layers recomputed (and no larger one at all)
  small = dataclasses.replace(device_spec("V100-32GB"), name="V100-small", memory_bytes=(saved + recomputed) // 2)
  cluster = hs.Cluster.emulate(jax.devices()[:8], kinds=["V100-small"] * 8, custom={"V100-small": small})
  ref = Reference(lm_step, _lm_state()()).run(batches, dropout_rng=rng)
  step = hs.parallelize(lm_step, cluster=cluster, plan="search", global_batch=batch, group_plans=False)
  trained = _lm_state()()  # the first call searches on its batch, then places the state
  for i, b in enumerate(batches):
    trained, metrics = step(trained, b, dropout_rng=rng)
    ref.check_metrics(metrics, i)
  ref.check(trained.params, lambda s: s.params)
  assert step.plan.remat == "layers", step.plan.summary()


# --- an NNX step in place (the mnist pattern): NNX names no scope, the layers are read from the parameters --------


class NnxBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.dropout = nnx.Dropout(0.2, rngs=rngs)

  def __call__(self, x):
    return x + self.dropout(nnx.gelu(self.linear(self.norm(x))))


class NnxNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Linear(12, WIDTH, rngs=rngs)
    self.blocks = nnx.List([NnxBlock(rngs) for _ in range(3)])
    self.head = nnx.Linear(WIDTH, 5, rngs=rngs)

  def __call__(self, x):
    x = self.embed(x)
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def nnx_step(model, optimizer, metrics, batch):
  def loss_fn(model):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean(), logits

  (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])
  optimizer.update(model, grads)


def _nnx_objects():
  model = NnxNet(nnx.Rngs(params=0, dropout=1))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2, eps=1e-4), wrt=nnx.Param)
  metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
  return model, optimizer, metrics


@pytest.mark.timeout(300)
@pytest.mark.parametrize("wrap", ["none", "nnx.jit"])
def test_an_nnx_step_in_place_recomputes_its_blocks_exactly(wrap):
  require_devices(8)
  counts, microbatch = (3, 3, 2, 2, 2, 1, 1, 0), 2
  batch = sum(counts) * microbatch
  rs = np.random.RandomState(3)
  batches = [{"image": rs.randn(batch, 12).astype(np.float32), "label": rs.randint(0, 5, batch).astype(np.int32)}
             for _ in range(2)]
  ref = NnxReference(nnx_step, _nnx_objects()).run(batches)
  mine = _nnx_objects()
  cluster = hs.Cluster.emulate(jax.devices()[:8], kinds=KINDS)
  plan = hs.plan_for(cluster, nnx.state(mine), global_batch=batch, layout=(8, 1), microbatch=microbatch,
                     counts=counts, remat="layers")
  step = hs.parallelize(nnx.jit(nnx_step) if wrap == "nnx.jit" else nnx_step, cluster=cluster, plan=plan,
                        global_batch=batch)
  for b in batches:
    assert step(*mine, b) is None
  check_nnx(ref, mine)
  assert "3 layers recomputed" in step.explain(), step.explain()


# --- jax.grad, and a custom_vjp inside each block -----------------------------------------------------------------


@jax.custom_vjp
def clipped_gelu(x):
  return jnp.clip(nn.gelu(x), -3.0, 3.0)


def _clipped_gelu_fwd(x):
  return clipped_gelu(x), x


def _clipped_gelu_bwd(x, g):
  y, vjp = jax.vjp(lambda u: jnp.clip(nn.gelu(u), -3.0, 3.0), x)
  return vjp(g)


clipped_gelu.defvjp(_clipped_gelu_fwd, _clipped_gelu_bwd)


class _CustomBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(WIDTH)(clipped_gelu(nn.Dense(2 * WIDTH)(nn.LayerNorm()(x))))


class _CustomStack(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(WIDTH)(x)
    for _ in range(3):
      x = _CustomBlock()(x)
    return nn.Dense(4)(x)


def grad_step(state, batch):
  """``jax.grad`` alone, the loss recomputed for the metrics outside it."""
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  grads = jax.grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss_fn(state.params)}


@pytest.mark.timeout(300)
def test_a_jax_grad_step_with_a_custom_vjp_in_each_block_recomputes_exactly():
  model = _CustomStack()
  params = model.init(jax.random.key(0), jnp.zeros((1, 6)))["params"]
  make = lambda: train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
  counts = (2, 2, 2, 2, 1, 1, 1, 1)
  rs = np.random.RandomState(0)
  batches = [{"x": rs.randn(12, 6).astype(np.float32), "y": rs.randint(0, 4, 12).astype(np.int32)}
             for _ in range(2)]
  ref = Reference(grad_step, make()).run(batches)
  step, state = _planned(grad_step, make(), batches, ref, counts=counts)
  ref.check(state.params, lambda s: s.params)
  assert "3 layers recomputed" in step.explain(), step.explain()


@pytest.mark.timeout(300)
def test_layers_beside_none_under_hs_value_and_grad_line_up_their_sums():
  """The zoo's GPT with ``hs.value_and_grad``: a group recomputing its layers beside one saving everything, a tail
  under "layers"; "none" is traced as it is (no loss checkpoint), so both groups' sums line up."""
  require_devices(8)
  w = models.get("gpt2-tiny")
  plan = group_plan([((0, 1, 2, 3), 2, (2, 2, 1, 1), "layers"), ((4, 5, 6, 7), 1, (2, 1, 1, 1), "none")], 25,
                    tail=(1, 1))
  rs = np.random.RandomState(2)
  batches = [jax.tree.map(lambda s: rs.randint(0, 50, s.shape).astype(s.dtype), w.example_batch(plan.global_batch))
             for _ in range(2)]
  step_fn = w.make_train_step(hs.value_and_grad)
  ref = Reference(step_fn, w.init_state()).run(batches)
  step = run_groups(step_fn, plan)
  state = step.shard_state(w.init_state())
  for i, b in enumerate(batches):
    state, metrics = step(state, b)
    ref.check_metrics(metrics, i)
  ref.check(state)
