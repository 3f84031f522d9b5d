"""Calibrating a step that fits no one device: one layer timed on each kind.

The step's whole timing runs out of memory here by decree (as a large model's would on accelerators: each
timed device holds the whole state); the layer scan of a Linen ``nn.scan`` stack (a ``TrainState`` step), of
the scanned NNX GPT and of an NNX ``nnx.scan`` stack is then found, each scan run over two and four stacked
layers. A step that unrolls its layers (the NNX GPT's ``h_0``, ``h_1``; a Gemma-shaped ``nnx.List`` of blocks)
has its middle block's forward timed instead, in loops of two and four trips. The search prices each kind's
whole microbatch scaled by the timed part's measured over predicted seconds. Where the step runs no layer at
all, the first error stands and says so. Across processes each process times its own kinds and every process
holds the same calibration.
"""

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import hetspmd as hs
from exactness import NnxReference, Reference, assert_exact
from hetspmd import models
from hetspmd.errors import HetSpmdError, NoLayerStackError
from hetspmd.hardware.calibration import Calibration, KindTiming
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.profile import block_nodes, layer_nodes, profile_step, step_fingerprint
from hetspmd.planner.pricing import Costing, measured_timing
from hetspmd.runtime import calibrating
from hetspmd.runtime.calibrating import KindTimer
from hetspmd.runtime.layer_timing import (LayerBlock, LayerTimer, block_program, layer_scans, scan_program,
                                          step_layers, step_or_layer)

KINDS = ["V100-32GB", "P100-16GB"]


def _out_of_memory(self, *args, **kwargs):
  raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17.2GiB.")


@pytest.fixture
def fits_no_device(monkeypatch):
  """Every whole-step timing runs out of memory, and calibration is wanted on these CPU devices."""
  monkeypatch.setattr(KindTimer, "runs", _out_of_memory)
  monkeypatch.setattr(calibrating, "wanted", lambda option, cluster: option is not False)


@pytest.mark.parametrize("size", [1, 4])
def test_the_layer_scan_is_found_and_one_layer_timed(size):
  """The forward scan and its transpose of the scanned GPT, at the microbatch size (one example too, where JAX
  traces a few equations fewer); each runs over two or four stacked layers as a program of its own, and one
  layer's seconds come out positive."""
  w = models.get("gpt2-tiny-scan")
  fn = w.make_train_step(hs.value_and_grad)
  scans = layer_scans(fn, w.abstract_state(), w.example_batch(2), [size])[size]
  assert jx.aval_shape(scans.forward.invars[jx.scan_parts(scans.forward).num_consts])[0] == size
  assert scans.length == w.config.n_layer
  for eqn in (scans.forward, scans.backward):
    program, inputs = scan_program(eqn, 2)
    out = program(*inputs)
    assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in jax.tree.leaves(out)
               if np.issubdtype(np.asarray(x).dtype, np.floating))
  assert LayerTimer(tuple(jax.devices()[:2])).seconds(scans, size, repeats=2) > 0


def test_a_step_without_a_layer_scan_has_none():
  w = models.get("mlp")
  with pytest.raises(NoLayerStackError):
    layer_scans(w.make_train_step(hs.value_and_grad), w.abstract_state(), w.example_batch(2), [4])


@pytest.mark.parametrize("scale", [0.5, 1.0, 3.0])
def test_a_layer_timing_scales_the_whole_microbatch(scale):
  """A layer measured at ``scale`` times its prediction prices the kind's microbatch at ``scale`` times the
  prediction (the gradient accumulation added as the search prices it); the per-step seconds stay predicted."""
  w = models.get("gpt2-tiny-scan")
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))
  mask, length = layer_nodes(profile)
  assert mask.any() and not mask.all() and length == w.config.n_layer
  cluster = hs.Cluster.emulate(jax.devices()[:2], kinds=KINDS)
  spec = cluster.spec_of(KINDS[0])
  points = []
  for size in (2, 8):
    predicted = float(profile.node_seconds(spec, size)[mask].sum()) / length
    points.append((size, scale * predicted))
  timing = measured_timing(KindTiming(KINDS[0], tuple(points), part="layer"), profile, spec)
  for size in (2, 8):
    assert timing.micro(size) == pytest.approx(scale * profile.microbatch_seconds(spec, size)
                                               + profile.accumulate_seconds(spec), rel=1e-9)
  assert timing.fixed == profile.step_fixed_seconds(spec) and timing.part == "layer"
  costing = Costing(cluster.calibrated(Calibration("", (KindTiming(KINDS[0], tuple(points), part="layer"),))),
                    profile, 8)
  plain = Costing(cluster, profile, 8)
  assert costing.node_seconds(KINDS[0], 8).sum() == pytest.approx(scale * plain.node_seconds(KINDS[0], 8).sum())
  assert costing.node_seconds(KINDS[1], 8).sum() == pytest.approx(plain.node_seconds(KINDS[1], 8).sum())


def test_a_layer_timing_needs_a_layer_scan_in_the_profile():
  w = models.get("mlp")
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))
  spec = hs.Cluster.emulate(jax.devices()[:1], kinds=KINDS[:1]).spec_of(KINDS[0])
  assert layer_nodes(profile) is None
  assert measured_timing(KindTiming(KINDS[0], ((4, 1e-3),), part="layer"), profile, spec) is None


def test_a_layer_timing_saves_and_loads(tmp_path):
  calibration = Calibration("abc", (KindTiming("V100-32GB", ((4, 1e-3), (8, 2e-3)), part="layer"),
                                    KindTiming("P100-16GB", ((4, 2e-3),), 0.01)))
  calibration.save(tmp_path / "c.json")
  assert Calibration.load(tmp_path / "c.json") == calibration
  assert "part" not in calibration.to_json()["kinds"][1]  # a step timing's JSON is as before
  assert "one layer (forward and backward)" in calibration.describe()[0]
  with pytest.raises(hs.errors.InvalidValueError, match="part must be one of"):
    KindTiming("V100-32GB", ((4, 1e-3),), part="stage")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,part,said", [("gpt2-tiny-scan", "layer", "one layer of the step timed"),
                                            ("gpt2-tiny", "unrolled", "one unrolled layer's forward and backward timed")])
def test_a_gpt_that_fits_no_device_is_searched_on_one_layer(fits_no_device, name, part, said):
  """calibrate=True on the NNX GPT, scanned or unrolled, whose whole step fits no device: each kind's layer (of
  the layer scan, or the middle block) is timed at the search's microbatch sizes, explain() says what priced each
  kind, and the plan runs exactly against one device."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  w = models.get(name)
  cluster = hs.Cluster.emulate(jax.devices()[:2], kinds=KINDS)
  step = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan="search", global_batch=16,
                        calibrate=True, example_batch=w.synthetic_batch(0, batch=4))
  state = step.shard_state(w.init_state(0))
  assert {t.part for t in step.calibration.kinds} == {part}
  assert set(step.calibration.kind_names) == set(KINDS)
  assert all(len(t.points) >= 1 and all(s > 0 for _, s in t.points) for t in step.calibration.kinds)
  assert said in step.explain()
  batches = [w.synthetic_batch(i, batch=16) for i in range(2)]
  ref = Reference(w.make_train_step(), w.init_state(0)).run(batches)
  for b in batches:
    state, _ = step(state, b)
  ref.check(state)


@pytest.mark.timeout(600)
def test_an_nnx_scan_stack_that_fits_no_device_is_searched_on_one_layer(fits_no_device):
  """The same for an NNX model stacked with nnx.vmap and run with nnx.scan (dropout rng streams per layer),
  trained in place with step(model, optimizer, batch) at the first call."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  import optax
  from flax import nnx
  from test_nnx_scan_step import ScannedMLP, WIDTH

  model = ScannedMLP(nnx.Rngs(0, dropout=1))
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

  def train_step(model, optimizer, batch):
    def loss_fn(model):
      logits = model(batch["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(16, WIDTH)).astype(np.float32), "y": rng.integers(0, 5, size=(16,))}
  cluster = hs.Cluster.emulate(jax.devices()[:2], kinds=KINDS)
  step = hs.parallelize(train_step, cluster=cluster, plan="search", global_batch=16, calibrate=True)
  loss = step(model, optimizer, batch)
  assert np.isfinite(float(loss))
  assert {t.part for t in step.calibration.kinds} == {"layer"}
  assert "one layer of the step timed" in step.explain()


class _TwoNamedLayers(nn.Module):
  """No numbered layer and no layer scan: nothing smaller than the step to time."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(5, name="out")(nn.relu(nn.Dense(32, name="hidden")(x)))


@pytest.mark.timeout(300)
def test_without_any_layer_the_first_error_stands(fits_no_device):
  """A model with no layer scan and no numbered layers: calibrate=True raises the whole step's error and says
  why no layer can be timed."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  model = _TwoNamedLayers()
  state = train_state.TrainState.create(apply_fn=model.apply, tx=optax.sgd(0.1),
                                        params=model.init(jax.random.key(0), jnp.ones((1, 12)))["params"])
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(16, 12)).astype(np.float32), "y": rng.integers(0, 5, size=(16,)).astype(np.int32)}
  cluster = hs.Cluster.emulate(jax.devices()[:2], kinds=KINDS)
  step = hs.parallelize(_linen_step, cluster=cluster, plan="search", global_batch=16, calibrate=True,
                        example_batch=batch)
  with pytest.raises(HetSpmdError, match=r"RESOURCE_EXHAUSTED.*nor can one layer be timed alone, as it runs no "
                                         r"layer scan \(.*\) and no numbered layers"):
    step.shard_state(state)


@pytest.mark.timeout(300)
def test_two_processes_time_their_own_kinds_layers_and_agree():
  """2 processes x 1 CPU device over gloo, a kind per process: the whole step's timing runs out of memory, each
  process times its own kind's layer, and both hold the same calibration and search the same plan, which runs
  exactly against one device (each process feeding its own examples)."""
  import textwrap

  from multiprocess import group_child, run_processes

  results = run_processes(group_child("test_layer_timing") + textwrap.dedent("""
      import hetspmd as hs
      from exactness import assert_exact
      from hetspmd import models
      from hetspmd.runtime.calibrating import KindTimer

      KindTimer.runs = t._out_of_memory
      w = models.get("gpt2-tiny-scan")
      cluster = hs.Cluster.emulate(jax.devices(), kinds=t.KINDS)
      step = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan="search",
                            global_batch=16, calibrate=True, example_batch=w.synthetic_batch(0, batch=4))
      batches = [w.synthetic_batch(i, batch=16) for i in range(2)]
      ref = reference(w.make_train_step(), w.init_state(0), batches)
      state = step.shard_state(w.init_state(0))
      for b in batches:
        state, _ = step(state, fed(step, b))
      try:
        assert_exact(jax.tree.map(local, state), ref.single, ref.ref64, what="state")
        exact = "ok"
      except AssertionError as e:
        exact = str(e)[:500]
      print(json.dumps({"calibration": step.calibration.to_json(), "plan": step.plan.to_json(), "exact": exact}))
  """), num_processes=2, devices_per_process=1, timeout=240)
  first, second = results
  assert first["calibration"] == second["calibration"] and first["plan"] == second["plan"]
  kinds = {k["kind"]: k for k in first["calibration"]["kinds"]}
  assert set(kinds) == set(KINDS) and all(k["part"] == "layer" for k in kinds.values())
  assert first["exact"] == second["exact"] == "ok"


class _LinenBlock(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x, _):
    h = nn.Dense(self.width * 2)(nn.LayerNorm()(x))
    return x + nn.Dense(self.width)(nn.gelu(h)), None


class _LinenScanned(nn.Module):
  """Layers stacked by ``nn.scan`` over a ``params`` axis, as Flax's examples and MaxText write them."""

  layers: int = 4
  width: int = 16

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.width)(x)
    stack = nn.scan(_LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers)
    x, _ = stack(self.width, name="blocks")(x, None)
    return nn.Dense(5)(x)


def _linen_state():
  model = _LinenScanned()
  params = model.init(jax.random.key(0), jnp.ones((1, 12)))["params"]
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))


def _linen_step(state, batch):
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss}


@pytest.mark.timeout(600)
def test_a_linen_scan_step_that_fits_no_device_is_searched_on_one_layer(fits_no_device):
  """A Linen model stacked with nn.scan, its step a TrainState and jax.value_and_grad (no hetspmd marker):
  each kind's layer is timed, and the searched plan runs exactly against one device."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  rng = np.random.default_rng(0)
  batches = [{"x": rng.normal(size=(16, 12)).astype(np.float32),
              "y": rng.integers(0, 5, size=(16,)).astype(np.int32)} for _ in range(2)]
  cluster = hs.Cluster.emulate(jax.devices()[:2], kinds=KINDS)
  step = hs.parallelize(_linen_step, cluster=cluster, plan="search", global_batch=16, calibrate=True,
                        example_batch=batches[0])
  state = step.shard_state(_linen_state())
  assert {t.part for t in step.calibration.kinds} == {"layer"}
  ref = Reference(_linen_step, _linen_state()).run(batches)
  for b in batches:
    state, _ = step(state, b)
  ref.check(state.params, lambda s: s.params)


def test_step_calibrate_falls_back_to_one_layer(fits_no_device, tmp_path):
  """ParallelStep.calibrate on a step that fits no device times one layer; the saved result carries the step's
  fingerprint and a search of that step takes it."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  w = models.get("gpt2-tiny-scan")
  cluster = hs.Cluster.emulate(jax.devices()[:2], kinds=KINDS)
  probe = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan="search", global_batch=16)
  calibration = probe.calibrate(w.init_state(0), w.synthetic_batch(0, batch=4))
  assert {t.part for t in calibration.kinds} == {"layer"}
  calibration.save(tmp_path / "c.json")
  found = hs.search(w.make_train_step(hs.value_and_grad), w.abstract_state(), w.example_batch(16), cluster=cluster,
                    calibration=tmp_path / "c.json")
  assert found.best is not None


@pytest.mark.timeout(600)
def test_a_kind_too_small_for_the_state_is_not_tried_and_every_kind_times_a_layer(monkeypatch):
  """One kind's devices cannot hold the state by their spec: its whole-step timing is not even tried, and since
  a calibration that priced it from its spec beside measured kinds would be the error it is for, every kind is
  timed on one layer instead."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  import dataclasses

  from hetspmd.hardware.devices import preset_spec

  tried = []
  real = KindTimer.runs
  monkeypatch.setattr(KindTimer, "runs", lambda self, *a, **k: tried.append(self.device.id) or real(self, *a, **k))
  tiny = dataclasses.replace(preset_spec("T4"), name="tiny", memory_bytes=1 << 16)
  w = models.get("gpt2-tiny-scan")
  cluster = hs.Cluster.emulate(jax.devices()[:2], kinds=["V100-32GB", "tiny"], custom={"tiny": tiny})
  probe = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan="search", global_batch=16)
  calibration = probe.calibrate(w.init_state(0), w.synthetic_batch(0, batch=4))
  assert {t.part for t in calibration.kinds} == {"layer"} and set(calibration.kind_names) == {"V100-32GB", "tiny"}
  assert tried and set(tried) == {jax.devices()[0].id}


def test_the_fingerprint_tells_steps_apart_but_not_batch_sizes():
  """Another size of a model or another sequence length is another step; a batch of another size is not."""
  def of(name, batch, seq=None):
    w = models.get(name)
    return step_fingerprint(lambda s, b: w.make_train_step()(s, b), w.abstract_state(), w.example_batch(batch, seq))

  tiny = of("gpt2-tiny-scan", 8)
  assert tiny == of("gpt2-tiny-scan", 1) == of("gpt2-tiny-scan", 64)
  assert tiny != of("gpt2-tiny-scan", 8, seq=16)
  assert tiny != of("gpt2-tiny", 8)


def test_only_a_step_that_cannot_be_timed_whole_falls_back_to_a_layer():
  """A user's mistake raised while timing the whole step stands as it is; no layer is timed."""
  def mistake():
    raise HetSpmdError("calibrate=True times the step on a call's arguments")

  def never():
    raise AssertionError("a layer was timed")

  with pytest.raises(HetSpmdError, match="calibrate=True times the step on a call's arguments"):
    step_or_layer(mistake, never, None, None, (4,))


# --- steps that unroll their layers: one block's forward ---------------------------------------------------


@pytest.mark.parametrize("size", [1, 4])
def test_an_unrolled_step_times_its_middle_block(size):
  """The unrolled NNX GPT has no layer scan: its middle block (h_1 of h_0, h_1) is found, at one example too;
  its forward, and its forward and backward, run in loops of two and four trips as programs of their own (the
  backward's values the gradients of every floating input), and one block's seconds come out positive."""
  w = models.get("gpt2-tiny")
  fn = w.make_train_step(hs.value_and_grad)
  with pytest.raises(NoLayerStackError):
    layer_scans(fn, w.abstract_state(), w.example_batch(2), [size])
  block = step_layers(fn, w.abstract_state(), w.example_batch(2), [size])[size]
  assert isinstance(block, LayerBlock) and block.part == "unrolled" and block.segment.layer.endswith("h_1")
  assert any(jx.aval_shape(v)[:1] == (max(size, 2),) for v in block.segment.inputs)
  floats = [v for v in block.segment.inputs if jnp.issubdtype(jx.aval_dtype(v), jnp.floating)]
  for backward, made in ((False, block.segment.residuals), (True, floats)):
    program, inputs = block_program(block.eqns, block.segment, 2, backward=backward)
    out = program(*inputs)
    assert [np.shape(x) for x in out] == [jx.aval_shape(v) for v in made]
    assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in jax.tree.leaves(out)
               if np.issubdtype(np.asarray(x).dtype, np.floating))
  assert any(np.any(np.asarray(x) != 0) for x in out)  # the gradients are not all zero
  assert LayerTimer(tuple(jax.devices()[:2])).seconds(block, max(size, 2), repeats=2) > 0


def test_a_step_with_no_layer_at_all_says_why():
  model = _TwoNamedLayers()
  state = train_state.TrainState.create(apply_fn=model.apply, tx=optax.sgd(0.1),
                                        params=model.init(jax.random.key(0), jnp.ones((1, 12)))["params"])
  batch = {"x": np.ones((4, 12), np.float32), "y": np.zeros((4,), np.int32)}
  with pytest.raises(NoLayerStackError, match=r"no layer scan \(.*\) and no numbered layers \(no repeated"):
    step_layers(_linen_step, state, batch, [4])


@pytest.mark.parametrize("part", ["unrolled", "block"])
@pytest.mark.parametrize("scale", [0.5, 1.0, 3.0])
def test_a_block_timing_scales_the_whole_microbatch(scale, part):
  """A block's forward and backward (or, as earlier versions timed it, its forward alone) measured at ``scale``
  times its prediction prices the kind's whole microbatch (the embedding and the head too) at ``scale`` times
  the prediction. The backward is tied to no block: a block's is predicted as its forward times the
  microbatch's predicted seconds over its forward's, which is between 2 and 4 for a GPT."""
  w = models.get("gpt2-tiny")
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))
  mask = block_nodes(profile)
  assert layer_nodes(profile) is None and mask.any() and mask.sum() < 0.2 * mask.size
  spec = hs.Cluster.emulate(jax.devices()[:1], kinds=KINDS[:1]).spec_of(KINDS[0])
  each = ~profile.per_step
  passes = {size: float(nodes[each].sum()) / float(nodes[each & profile.forward].sum())
            for size in (2, 8) for nodes in [profile.node_seconds(spec, size)]}
  assert all(2 < p < 4 for p in passes.values()), passes
  points = tuple((size, scale * float(profile.node_seconds(spec, size)[mask].sum())
                  * (passes[size] if part == "unrolled" else 1)) for size in (2, 8))
  timing = measured_timing(KindTiming(KINDS[0], points, part=part), profile, spec)
  for size in (2, 8):
    assert timing.micro(size) == pytest.approx(scale * profile.microbatch_seconds(spec, size)
                                               + profile.accumulate_seconds(spec), rel=1e-9)
  assert timing.part == part
  said = "one unrolled layer's forward" + (" and backward" if part == "unrolled" else " per")
  assert said in Calibration("", (KindTiming(KINDS[0], points, part=part),)).describe()[0]


class _Block(nnx.Module):
  """A decoder block as Gemma's: RMS norms, attention without a mask, a gated MLP."""

  def __init__(self, width: int, rngs):
    self.norm1, self.norm2 = nnx.RMSNorm(width, rngs=rngs), nnx.RMSNorm(width, rngs=rngs)
    self.qkv = nnx.Linear(width, 3 * width, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(width, width, use_bias=False, rngs=rngs)
    self.gate, self.up = (nnx.Linear(width, 2 * width, use_bias=False, rngs=rngs) for _ in range(2))
    self.down = nnx.Linear(2 * width, width, use_bias=False, rngs=rngs)

  def __call__(self, x):
    q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
    weights = jax.nn.softmax(q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1]), axis=-1)
    x = x + self.out(weights @ v)
    h = self.norm2(x)
    return x + self.down(jax.nn.gelu(self.gate(h)) * self.up(h))


class _UnrolledLM(nnx.Module):
  """Blocks held in an ``nnx.List`` and run in a Python loop, as Flax's Gemma example holds its layers."""

  def __init__(self, rngs, vocab: int = 32, width: int = 16, layers: int = 3):
    self.embed = nnx.Embed(vocab, width, rngs=rngs)
    self.layers = nnx.List([_Block(width, rngs) for _ in range(layers)])
    self.final_norm = nnx.RMSNorm(width, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for layer in self.layers:
      x = layer(x)
    return self.embed.attend(self.final_norm(x))


def _lm_train_step(model, optimizer, batch):
  def loss_fn(model):
    logits = model(batch["tokens"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


@pytest.mark.timeout(600)
def test_a_gemma_shaped_nnx_list_model_that_fits_no_device_is_searched_on_one_block(fits_no_device):
  """An NNX model whose blocks sit in an nnx.List (no name scopes: the blocks are found from the parameters'
  paths), trained in place with step(model, optimizer, batch): its middle block is timed on each kind, and the
  trained model matches the same steps run on one device, each in float32 rounding of a float64 run."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  rng = np.random.default_rng(0)
  batches = [{"tokens": rng.integers(0, 32, size=(16, 9)).astype(np.int32)} for _ in range(2)]
  ref = NnxReference(_lm_train_step, _lm_objects()).run(batches)
  cluster = hs.Cluster.emulate(jax.devices()[:2], kinds=KINDS)
  step = hs.parallelize(_lm_train_step, cluster=cluster, plan="search", global_batch=16, calibrate=True)
  mine = _lm_objects()
  for b in batches:
    step(*mine, b)
  assert {t.part for t in step.calibration.kinds} == {"unrolled"}
  assert "one unrolled layer's forward and backward timed" in step.explain()
  for what, kind in (("params", nnx.Param), ("opt_state", nnx.OptState)):
    assert_exact(nnx.state(mine, kind), nnx.state(ref.single, kind), nnx.state(ref.ref64, kind), what=what)


def _lm_objects():
  model = _UnrolledLM(nnx.Rngs(0))
  return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


# the only operations a timed block's program may run outside its loop: nothing of the block's work
OUTSIDE_THE_LOOP = {"parameter", "constant", "broadcast", "copy", "get-tuple-element", "tuple", "while", "bitcast"}


def _blocks():
  """(name, step, abstract state, batch) of steps that unroll their layers: the NNX GPT, and a Linen stack whose
  layers draw dropout from a key (work that reads no floating input)."""
  from test_sharded_groups_users import LayerStack, batches, linen_state, linen_step

  w = models.get("gpt2-tiny")
  return {"gpt2-tiny": (w.make_train_step(hs.value_and_grad), w.abstract_state(), w.example_batch(2)),
          "linen dropout": (linen_step, jax.eval_shape(lambda: linen_state(LayerStack(scanned=False))),
                            batches(4, steps=1)[0])}


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward-and-backward"])
@pytest.mark.parametrize("name", ["gpt2-tiny", "linen dropout"])
def test_a_timed_block_runs_all_its_work_in_every_trip(name, backward):
  """XLA hoists nothing of the block out of the timing loop (not its matmuls, not the dropout bits drawn from a
  key) and keeps every matmul of the block in the loop's body: each trip is one block's forward (and backward:
  at least one more matmul per forward one, for its operands' gradients)."""
  import re

  fn, state, batch = _blocks()[name]
  block = step_layers(fn, state, batch, [4])[4]
  program, inputs = block_program(block.eqns, block.segment, 2, block.per_example, backward=backward)
  text = program.lower(*inputs).compile().as_text()
  entry = text[text.index("ENTRY"):]
  entry = entry[:entry.index("\n}\n")]
  assert set(re.findall(r"= \S+ ([a-z-]+)\(", entry)) <= OUTSIDE_THE_LOOP, entry
  matmuls = sum(jx.primitive_name(block.eqns[i]) == "dot_general" for i in block.segment.members)
  assert matmuls > 0 and (text.count(" dot(") >= 2 * matmuls if backward else text.count(" dot(") == matmuls)


def test_a_block_of_one_example_is_timed_at_two():
  """At one example JAX traces the step with a few equations fewer: the block is traced and timed at two, and the
  calibration's point says two, so the search prices one example from the line through it."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  w = models.get("gpt2-tiny")
  fn = w.make_train_step(hs.value_and_grad)
  layers = step_layers(fn, w.abstract_state(), w.example_batch(2), [1, 2])
  assert layers[1] is layers[2] and layers[1].size == 2
  cluster = hs.Cluster.emulate(jax.devices()[:2], kinds=KINDS)
  from hetspmd.runtime.layer_timing import layer_calibration

  calibration = layer_calibration(fn, w.abstract_state(), w.example_batch(2), cluster, [1])
  assert all([size for size, _ in t.points] == [2] and t.part == "unrolled" for t in calibration.kinds)


@pytest.mark.parametrize("scalable", [True, False])
def test_a_small_block_runs_more_trips_until_it_shows(monkeypatch, scalable):
  """A block whose trips take 0.1 ms runs 128 and 256 trips (the most allowed) instead of 2 and 4, and its
  seconds are the difference over the trips between; a layer scan keeps its two and four layers."""
  from hetspmd.runtime import layer_timing

  rounds = []

  def medians(self, key, build, rows, repeats, scalable=False):
    rounds.append(rows)
    return rows[0] * 1e-4 + 0.003, rows[1] * 1e-4 + 0.003  # 0.1 ms a trip, 3 ms of dispatch

  monkeypatch.setattr(LayerTimer, "_medians", medians)
  fake = type("Fake", (), {"scalable": scalable, "programs": lambda self: (("forward", None),)})()
  seconds = LayerTimer(()).seconds(fake, 4)
  assert seconds == pytest.approx(1e-4)
  top = layer_timing.MAX_TRIPS
  assert rounds == ([(2, 4), (top // 2, top)] if scalable else [(2, 4)])


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny", "vit-tiny"])
def test_the_timed_block_is_the_priced_block(name):
  """The block the timing finds (on the step's jaxpr) and the block the pricing scales from (on the profile's
  graph) are the same one: as many layers found on each side, the same layer's forward, of about as many
  equations."""
  from hetspmd.passes import remat
  from hetspmd.passes.costing.step_cost import layer_segments

  w = models.get(name)
  fn = w.make_train_step(hs.value_and_grad)
  block = step_layers(fn, w.abstract_state(), w.example_batch(2), [2])[2]
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))
  graph = layer_segments(*profile.traces)
  priced = remat.timed_segment(graph)
  assert priced.layer.split("/")[-1] == block.segment.layer.split("/")[-1]
  assert abs(len(priced.members) - len(block.segment.members)) <= 0.1 * len(priced.members)
  assert block_nodes(profile).sum() == len(priced.members)


def test_a_timed_programs_outputs_reuse_the_last_calls_buffers():
  """A layer scan's stacked outputs are as large as its layers: each timed call writes them into the buffers of
  the call before (donated), as the step writes into buffers it reuses, so the timing holds no fresh allocation's
  page faults; the values are the program's."""
  from hetspmd.runtime.layer_timing import recycling

  w = models.get("gpt2-tiny-scan")
  scans = layer_scans(w.make_train_step(hs.value_and_grad), w.abstract_state(), w.example_batch(2), [4])[4]
  program, inputs = scan_program(scans.forward, 2)
  args = [jax.device_put(x, jax.devices()[0]) for x in inputs]
  call = recycling(program, args)
  before = call()
  pointers = sorted(x.unsafe_buffer_pointer() for x in before)
  after = call()
  assert sorted(x.unsafe_buffer_pointer() for x in after) == pointers
  for got, want in zip(after, jax.tree.leaves(program(*args))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
