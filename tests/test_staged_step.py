"""Pipeline stages derived from an unmodified train step whose model scans its layers.

A Linen decoder in the shape of Flax's lm1b example (token embedding, a
padding-and-causal attention mask, pre-LayerNorm blocks with dropout
stacked with ``nn.scan``, a weighted cross-entropy normalised by the token count, a
``TrainState`` updated from ``jax.value_and_grad`` of a closure) trains 3
steps under plans of 2 and 4 uneven stages with a data axis inside each,
against the same step on one device: parameters within 1e-4 of the
largest entry of their leaf, metrics within 1e-5.

The optimizer is SGD with momentum: the attention's key bias has a zero
gradient in exact arithmetic (softmax ignores a shift shared by every
key), so under Adam its update is the sign of rounding noise, different
on every summation order.
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
from hetspmd.errors import HetSpmdError

from conftest import require_devices
from exactness import NnxReference, Reference, assert_exact
from test_unmodified_steps import KINDS, _cluster, check_nnx

VOCAB, SEQ, WIDTH, LAYERS, STEPS = 23, 8, 16, 4, 3


class Block(nn.Module):
  deterministic: bool = False

  @nn.compact
  def __call__(self, h, mask):
    y = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=WIDTH, deterministic=True)(
        nn.LayerNorm()(h), mask=mask)
    h = h + nn.Dropout(0.1)(y, deterministic=self.deterministic)
    y = nn.Dense(2 * WIDTH)(nn.LayerNorm()(h))
    return h + nn.Dense(WIDTH)(nn.relu(y)), None


class Decoder(nn.Module):
  deterministic: bool = False

  @nn.compact
  def __call__(self, tokens):
    mask = nn.combine_masks(nn.make_attention_mask(tokens > 0, tokens > 0), nn.make_causal_mask(tokens))
    h = nn.Embed(VOCAB, WIDTH)(tokens)
    layers = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                     in_axes=nn.broadcast, length=LAYERS)
    h, _ = layers(self.deterministic, name="blocks")(h, mask)
    return nn.Dense(VOCAB)(nn.LayerNorm()(h))


def train_step(state, batch, dropout_rng):
  inputs, targets = batch["inputs"], batch["targets"]
  weights = jnp.where(targets > 0, 1.0, 0.0)
  dropout_rng = jax.random.fold_in(dropout_rng, state.step)

  def loss_fn(params):
    logits = state.apply_fn({"params": params}, inputs, rngs={"dropout": dropout_rng})
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights
    return loss.sum() / weights.sum(), logits

  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  accuracy = ((jnp.argmax(logits, -1) == targets) * weights).sum() / weights.sum()
  return state.apply_gradients(grads=grads), {"loss": loss, "accuracy": accuracy}


def _state():
  model = Decoder()
  params = Decoder(deterministic=True).init(jax.random.key(0), jnp.ones((1, SEQ), jnp.int32))["params"]
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.3, momentum=0.9))


def _batches(batch):
  rs = np.random.RandomState(1)
  out = []
  for _ in range(STEPS):
    tokens = rs.randint(1, VOCAB, (batch, SEQ + 1)).astype(np.int32)
    tokens[:, -3:] *= rs.randint(0, 2, (batch, 1))  # padding at the end of some rows
    out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
  return out


@functools.cache
def _reference(batch: int) -> Reference:
  """``train_step`` on one device over ``_batches(batch)``, in float32 and float64; built once per batch size and
  shared by the cases of that size (read only after its run)."""
  return Reference(train_step, _state()).run(_batches(batch), jax.random.key(7))


CASES = [  # (layers per stage, microbatch, microbatches per data position: one count for all, or one each)
    ((3, 1), 2, 3),
    ((1, 3), 1, 2),
    ((1, 2, 1), 1, 1),
    ((1, 1, 1, 1), 2, 2),
    ((3, 1), 2, (3, 1, 2, 2)),     # uneven data counts: a position runs its own microbatches, skips the rest
    ((1, 2, 1), 1, (2, 0)),        # a position with none
    ((1, 1, 1, 1), 1, (3, 2)),
]


def _case_id(c):
  counts = c[2] if isinstance(c[2], int) else "-".join(map(str, c[2]))
  return f"{'-'.join(map(str, c[0]))}-mb{c[1]}x{counts}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stages,microbatch,count", CASES, ids=[_case_id(c) for c in CASES])
def test_stages_train_like_one_device(stages, microbatch, count):
  devices = 8 - 8 % len(stages)  # 3 stages of 2 on 6 of the 8 devices
  require_devices(devices)
  cluster = hs.Cluster.emulate(jax.devices()[:devices], kinds=KINDS[:devices // 2] + KINDS[-(devices // 2):])
  positions = devices // len(stages)
  counts = (count,) * positions if isinstance(count, int) else count
  batch = sum(counts) * microbatch
  batches = _batches(batch)
  rng = jax.random.key(7)
  ref = _reference(batch)

  plan = hs.plan_for(cluster, _state(), global_batch=batch, microbatch=microbatch, stages=stages,
                     counts=None if isinstance(count, int) else counts)
  assert plan.mesh_shape == (positions, len(stages)) and plan.stages == stages
  assert plan.microbatch_counts == counts
  step = hs.parallelize(train_step, cluster=cluster, plan=plan, global_batch=batch)
  state = step.shard_state(_state())
  for i, b in enumerate(batches):
    state, metrics = step(state, b, rng)
    ref.check_metrics(metrics, i)
  ref.check(state.params, lambda s: s.params)
  ref.check(state.opt_state, lambda s: s.opt_state)
  assert step._runner.lockstep is False  # the ticks are lockstep already: uneven counts compile one program, not two
  kernel = state.params["blocks"]["Dense_0"]["kernel"]  # [layers, ...]: split over the stages when they divide it
  split = LAYERS % len(stages) == 0
  assert kernel.sharding.spec == (jax.sharding.PartitionSpec("stage") if split else jax.sharding.PartitionSpec())
  assert state.params["Embed_0"]["embedding"].sharding.is_fully_replicated
  assert f"pipeline stages of {list(stages)} layers" in step.explain()


def test_a_step_without_a_layer_scan_is_refused():
  from test_unmodified_steps import _lm_state, lm1b_train_step  # an MLP block, no scan over layers

  cluster = _cluster()
  state = _lm_state()
  step_fn = functools.partial(lm1b_train_step, config=None, learning_rate_fn=lambda s: 1e-3)
  plan = hs.plan_for(cluster, state, global_batch=8, microbatch=1, stages=(1, 1))
  step = hs.parallelize(step_fn, cluster=cluster, plan=plan, global_batch=8)
  tokens = np.ones((8, 6), np.int32)
  with pytest.raises(HetSpmdError, match="one scan over stacked parameters"):
    step(step.shard_state(state), {"inputs": tokens, "targets": tokens}, dropout_rng=jax.random.key(1))


def test_stage_plans_check_their_shape():
  cluster = _cluster()
  with pytest.raises(hs.InvalidValueError, match="do not form 3 stages"):
    hs.plan_for(cluster, _state(), global_batch=8, stages=(1, 2, 1))
  plan = hs.plan_for(cluster, _state(), global_batch=8, microbatch=1, stages=(3, 1))
  assert hs.Plan.from_json(plan.to_json()) == plan
  from hetspmd.report import explain_text
  text = explain_text(plan)
  assert "stage[0] devices [0, 1, 2, 3] (V100-32GB): 3 layers" in text and "stage[1]" in text
  assert plan.replace(microbatch_counts=(3, 1, 2, 2)).microbatch_counts == (3, 1, 2, 2)  # lockstep, skipped ticks


NNX_CASES = [  # (model, layers per stage): 3 layers stacked with nnx.vmap, run with nnx.scan, dropout in each
    ("ScannedMLP", (2, 1)),
    ("ScannedMLP", (1, 1, 1)),
    ("RematScannedMLP", (1, 2)),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model_name,stages", NNX_CASES, ids=[f"{c[0]}-{'-'.join(map(str, c[1]))}" for c in NNX_CASES])
def test_nnx_stages_train_in_place_like_one_device(model_name, stages):
  """NNX in place (``nnx.Optimizer``, ``nnx.MultiMetric``): parameters, metrics and each layer's rng counter."""
  from flax import nnx

  import test_nnx_scan_step as t
  from test_unmodified_steps import _image_batches

  devices = 8 - 8 % len(stages)
  require_devices(devices)
  cluster = hs.Cluster.emulate(jax.devices()[:devices], kinds=KINDS[:devices // 2] + KINDS[-(devices // 2):])
  model_class = getattr(t, model_name)
  microbatch = 2
  batch = devices // len(stages) * microbatch * 2
  batches = _image_batches(batch, shape=(t.WIDTH,), classes=t.CLASSES)
  reference = NnxReference(t.train_step, t._objects(model_class, "adam")).run(batches)
  ref = reference.single
  mine = t._objects(model_class, "adam")
  plan = hs.plan_for(cluster, nnx.state(mine), global_batch=batch, microbatch=microbatch, stages=stages)
  step = hs.parallelize(t.train_step, cluster=cluster, plan=plan, global_batch=batch)
  for b in batches:
    assert step(*mine, b) is None
  check_nnx(reference, mine)
  for e, a in zip(jax.tree.leaves(nnx.state(ref[0], nnx.RngCount)), jax.tree.leaves(nnx.state(mine[0], nnx.RngCount))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


@pytest.mark.timeout(300)
def test_stages_on_two_processes():
  """Each process holds one stage (4 devices, the data axis inside it) and feeds the whole batch, as
  ``process_examples()`` says (every data position spans both stages); the
  activations and cotangents between the stages cross gloo. 7 examples: the last data position runs one
  microbatch fewer."""
  import textwrap

  from multiprocess import run_processes

  results = run_processes(textwrap.dedent(f"""
      import json, types
      import numpy as np, jax
      import hetspmd as hs
      sys.modules["conftest"] = types.SimpleNamespace(require_devices=lambda n: None)
      sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
      import test_staged_step as t
      rng = jax.random.key(7)
      batches = t._batches(7)
      from exactness import Reference, excess
      local = jax.local_devices()[0]
      ref = Reference(t.train_step, t._state(), jit=jax.jit(t.train_step, device=local)).run(batches, rng)
      cluster = hs.Cluster.emulate(jax.devices(), kinds=t.KINDS)
      plan = hs.plan_for(cluster, t._state(), global_batch=7, microbatch=1, stages=(3, 1))
      assert plan.microbatch_counts == (2, 2, 2, 1)
      stage_of = {{d: s for s in range(2) for d in np.asarray(plan.device_ids).reshape(4, 2)[:, s]}}
      assert {{stage_of[d.id] for d in jax.local_devices()}} == {{jax.process_index()}}
      step = hs.parallelize(t.train_step, cluster=cluster, plan=plan, global_batch=7)
      state, losses = step.shard_state(t._state()), []
      for b in batches:
        state, m = step(state, b, rng)
        losses.append(m["loss"])
      from jax.experimental import multihost_utils
      params = multihost_utils.process_allgather(state.params, tiled=True)
      over = excess(params, ref.single.params, ref.ref64.params)
      over.update(excess(losses, [m["loss"] for m in ref.single_metrics], [m["loss"] for m in ref.ref64_metrics]))
      print(json.dumps({{"over": {{k: v[0] for k, v in over.items() if v[0] > 0}},
                        "examples": step.process_examples().tolist()}}))
  """), num_processes=2, devices_per_process=4, timeout=240)
  for r in results:  # parameters and losses as close to float64 as exactness asks
    assert r["over"] == {}, r
    assert r["examples"] == list(range(7))  # every stage sees every example: process_examples() says so


@pytest.mark.parametrize("kinds,layers,expected", [
    (["V100-32GB"] * 4 + ["P100-16GB"] * 4, 12, None),
    (["P100-16GB"] * 4 + ["V100-32GB"] * 4, 12, None),
    (["V100-32GB"] * 8, 7, (4, 3)),
])
def test_stage_layers_follow_the_stages_speed(kinds, layers, expected):
  require_devices(8)
  cluster = hs.Cluster.emulate(jax.devices()[:8], kinds=kinds)
  split = hs.stage_layers(cluster, 2, layers)
  assert sum(split) == layers and min(split) >= 1
  speed = [cluster.devices[0].spec.peak_flops("float32"), cluster.devices[4].spec.peak_flops("float32")]
  if expected is not None:
    assert split == expected
  # no other split has a faster slowest stage
  best = min(max(n / speed[0], (layers - n) / speed[1]) for n in range(1, layers))
  assert max(split[0] / speed[0], split[1] / speed[1]) == pytest.approx(best)
  if speed[0] != speed[1]:
    assert (split[0] > split[1]) == (speed[0] > speed[1])
  with pytest.raises(hs.InvalidValueError, match="cannot fill 4 stages"):
    hs.stage_layers(cluster, 4, 2)


@pytest.mark.parametrize("layers", [(3, 1), (1, 3), (2, 2), (5, 1, 2, 4), (1, 1, 1, 5)])
def test_rows_move_between_even_blocks_and_uneven_stages(layers):
  """Each stage gets exactly its layers from the even blocks, and gradients go back added into their block."""
  from jax.sharding import Mesh, PartitionSpec as P

  from hetspmd.lowering.exchange import Exchange

  S = len(layers)
  require_devices(S)
  mesh = Mesh(np.array(jax.devices()[:S]), ("stage",))
  total = sum(layers)
  rows = np.arange(total * 3, dtype=np.float32).reshape(total, 3) + 1
  exchange = Exchange(layers, "stage")

  def both(block):
    s = jax.lax.axis_index("stage")
    mine = exchange.gather(block, s)
    return mine[None], exchange.scatter(mine * 2, s)

  mine, back = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=P("stage"), out_specs=(P("stage"), P("stage")),
                                     check_vma=False))(rows)
  starts = np.cumsum((0,) + layers[:-1])
  for s, n in enumerate(layers):
    np.testing.assert_array_equal(np.asarray(mine)[s, :n], rows[starts[s]:starts[s] + n])
    assert not np.asarray(mine)[s, n:].any()
  np.testing.assert_array_equal(np.asarray(back), rows * 2)


@functools.cache
def _zoo_gpt2_scan_reference() -> Reference:
  """The zoo's gpt2-tiny-scan step on one device over its synthetic batches 0-2 of 16, in float32 and float64;
  shared by every stage plan of it (read only after its run)."""
  from hetspmd import models

  w = models.get("gpt2-tiny-scan")
  return Reference(w.make_train_step(), w.init_state(0)).run([w.synthetic_batch(seed, batch=16) for seed in range(STEPS)])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stages,counts", [((3, 1), None), ((1, 1, 1, 1), None), ((3, 1), (3, 1, 2, 2)),
                                           ((1, 1, 1, 1), (5, 3))])
def test_zoo_gpt2_with_scanned_layers_trains_as_stages(stages, counts):
  """The zoo's GPT-2 (tied embedding: its lookup on the first stage, its output projection on the last) with
  ``scan_layers``, its own ``jax.value_and_grad`` step and Adam; even data counts, and uneven ones (its loss
  counts every token, so a padded microbatch that was not skipped would show)."""
  from hetspmd import models

  cluster = _cluster()
  w = models.get("gpt2-tiny-scan")
  step_fn = w.make_train_step()
  batch, microbatch = 16, 2
  batches = [w.synthetic_batch(seed, batch=batch) for seed in range(STEPS)]
  ref = _zoo_gpt2_scan_reference()
  plan = hs.plan_for(cluster, w.init_state(0), global_batch=batch, microbatch=microbatch, stages=stages, counts=counts)
  assert counts is None or plan.microbatch_counts == counts
  step = hs.parallelize(step_fn, cluster=cluster, plan=plan, global_batch=batch)
  state = step.shard_state(w.init_state(0))
  for i, b in enumerate(batches):
    state, metrics = step(state, b)
    ref.check_metrics(metrics, i)
  # the key third of c_attn's bias has a zero gradient in exact arithmetic (softmax ignores a shift shared by
  # every key): Adam turns its rounding noise into updates of its own size, different for every summation order
  d = w.config.d_model

  def without_key_bias(params):
    params = jax.tree.map(np.array, params)  # writable copies
    params["h"]["attn"]["c_attn"]["bias"][:, d:2 * d] = 0
    return params

  assert_exact(without_key_bias(state["params"]), without_key_bias(ref.single["params"]),
               without_key_bias(ref.ref64["params"]), what="parameters")


def _scanned_mlp_step(state, batch):
  """A ``lax.scan`` over stacked layers whose loss divides by a sum over the batch that reads the stacked weights:
  that sum runs in an earlier loop, every stage alike, and needs all the layers there."""
  tx = optax.sgd(0.1, momentum=0.9)

  def loss_fn(p):
    h = p["emb"][batch["x"]]
    h, _ = jax.lax.scan(lambda h, wb: (h + jnp.tanh(h @ wb[0] + wb[1]), None), h, (p["w"], p["b"]))
    ce = optax.softmax_cross_entropy_with_integer_labels(h @ p["out"], batch["y"])
    scale = jax.nn.sigmoid(jnp.einsum("btd,lde->btle", p["emb"][batch["x"]], p["w"])).sum()
    return ce.sum() / jax.lax.stop_gradient(scale)

  loss, grads = jax.value_and_grad(loss_fn)(state["params"])
  updates, opt = tx.update(grads, state["opt"], state["params"])
  return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}


def _scanned_mlp_state(layers=4, vocab=13, width=8):
  keys = jax.random.split(jax.random.key(0), 4)
  params = {"emb": jax.random.normal(keys[0], (vocab, width)), "w": jax.random.normal(keys[1], (layers, width, width)) * 0.3,
            "b": jax.random.normal(keys[2], (layers, width)) * 0.1, "out": jax.random.normal(keys[3], (width, vocab))}
  return {"params": params, "opt": optax.sgd(0.1, momentum=0.9).init(params)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("batch,counts", [(12, (3, 3, 3, 3)), (10, (3, 3, 2, 2))])
def test_an_earlier_loop_reading_the_stacked_layers_sees_them_all(batch, counts):
  """Also a batch the data positions do not divide: the plan spreads its microbatches as evenly as they go."""
  cluster = _cluster()
  rs = np.random.RandomState(0)
  batches = [{"x": rs.randint(0, 13, (batch, 4)).astype(np.int32), "y": rs.randint(0, 13, (batch, 4)).astype(np.int32)}
             for _ in range(2)]
  ref = Reference(_scanned_mlp_step, _scanned_mlp_state()).run(batches)
  plan = hs.plan_for(cluster, _scanned_mlp_state(), global_batch=batch, microbatch=1, stages=(3, 1))
  assert plan.microbatch_counts == counts
  step = hs.parallelize(_scanned_mlp_step, cluster=cluster, plan=plan, global_batch=batch)
  state = step.shard_state(_scanned_mlp_state())
  for i, b in enumerate(batches):
    state, metrics = step(state, b)
    ref.check_metrics(metrics, i)
  ref.check(state)


def test_stage_plans_refuse_options_they_do_not_take():
  cluster = _cluster()
  with pytest.raises(hs.InvalidValueError, match=r"drop \['layout', 'zero_stage'\] or drop stages"):
    hs.plan_for(cluster, _state(), global_batch=8, microbatch=1, stages=(3, 1), layout=(4, 2), zero_stage=1)
  with pytest.raises(hs.InvalidValueError, match="at least one for each of the 4 data positions"):
    hs.plan_for(cluster, _state(), global_batch=6, microbatch=2, stages=(3, 1))
  with pytest.raises(hs.InvalidValueError, match="cover 10 examples, not the global batch of 8"):
    hs.plan_for(cluster, _state(), global_batch=8, microbatch=1, stages=(3, 1), counts=(4, 2, 2, 2))
  # counts given may leave positions empty; counts that hold more microbatches than examples say so
  plan = hs.plan_for(cluster, _state(), global_batch=4, microbatch=2, stages=(3, 1), counts=(2, 0, 0, 0))
  assert plan.microbatch_counts == (2, 0, 0, 0)
  for stages in ((3, 1), ()):
    with pytest.raises(hs.InvalidValueError, match="hold 6 microbatches, more than the global batch of 4"):
      hs.plan_for(cluster, _state(), global_batch=4, stages=stages, counts=(3, 3) + (0,) * (2 if stages else 6))


@pytest.mark.timeout(600)
def test_stage_gradients_cross_in_bfloat16_within_the_derived_bound():
  """``grad_reduce_dtype="bfloat16"`` under stages: every gradient within the bound for a bfloat16 sum.

  Each data position's float32 partial gradient ``p_i`` is cast to bfloat16
  (unit roundoff ``u = 2^-8``), the partials summed in bfloat16 and cast
  back, so ``|reduced - exact| <= gamma(n + 1) * sum_i |p_i|`` elementwise,
  ``gamma(k) = k u / (1 - k u)``, with ``n`` the summands: the data
  positions for the stacked layers' gradients, every device for the
  embedding's and the final norm's (stages that do not run them add
  zeros). One SGD step at learning rate 1 writes the gradient into the
  parameters; the partials are computed on the host from each position's
  slice of the batch. The tied embedding is two summands per position,
  whose sizes the host does not see: it gets a plain check against its
  largest entry instead of the bound.
  """
  from hetspmd import models
  from test_gradient_reduction import UNIT_ROUNDOFF, gamma

  cluster = _cluster()
  w = models.get("gpt2-tiny-scan")
  w = w.__class__(**{**w.__dict__, "make_optimizer": lambda: optax.sgd(1.0)})
  stages, batch, microbatch = (3, 1), 16, 2
  positions = 8 // len(stages)
  b = w.synthetic_batch(0, batch=batch)
  plan = hs.plan_for(cluster, w.init_state(0), global_batch=batch, microbatch=microbatch, stages=stages,
                     grad_reduce_dtype="bfloat16")
  assert plan.grad_reduce_dtype == "bfloat16"
  step = hs.parallelize(w.make_train_step(), cluster=cluster, plan=plan, global_batch=batch)
  state, _ = step(step.shard_state(w.init_state(0)), b)
  params0 = w.init_state(0)["params"]
  reduced = jax.tree.map(lambda p0, p1: np.asarray(p0) - np.asarray(p1), params0, jax.device_get(state["params"]))

  loss = lambda p, sub: w.loss(w.binder()(p), sub)[0]
  per = batch // positions
  partials = [jax.tree.map(lambda g: np.asarray(g, np.float64) * per / batch,
                           jax.grad(loss)(params0, {k: v[i * per:(i + 1) * per] for k, v in b.items()}))
              for i in range(positions)]
  exact = jax.tree.map(lambda g: np.asarray(g, np.float64), jax.grad(loss)(params0, b))
  summed = jax.tree.map(lambda *p: sum(p), *partials)
  for e, s in zip(jax.tree.leaves(exact), jax.tree.leaves(summed)):   # the partials add up to the full gradient
    np.testing.assert_allclose(s, e, rtol=1e-4, atol=1e-6)
  magnitude = jax.tree.map(lambda *p: sum(np.abs(x) for x in p), *partials)
  flat = jax.tree_util.tree_flatten_with_path(exact)[0]
  narrowed = 0
  for (path, e), r, mag in zip(flat, jax.tree.leaves(reduced), jax.tree.leaves(magnitude)):
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    if name.startswith("wte"):
      # the tied embedding's gradient is two summands per position (its lookup on the first stage, its output
      # projection on the last), whose magnitudes the host's per-position partials do not show, so no bound is
      # derived for it; it is held to 8 bfloat16 roundings of its largest entry, a check, not a bound
      assert np.max(np.abs(r - e)) <= 8 * UNIT_ROUNDOFF * np.max(np.abs(e)), name
      continue
    n = positions if "/h/" in f"/{name}" else 8
    bound = gamma(n + 1, UNIT_ROUNDOFF) * mag + 1e-5 * np.max(np.abs(e)) + 1e-7
    assert np.all(np.abs(r - e) <= bound), jax.tree_util.keystr(path)
    narrowed += int(np.any(np.abs(r - e) > 1e-5 * np.max(np.abs(e)) + 1e-7))
  assert narrowed > 0   # the bfloat16 rounding shows: the reduction really ran narrow
