"""Vision models: exact reference sizes, shapes, batch norm in the train state, abstract traces."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hetspmd as hs
from hetspmd import models
from exactness import Float64, assert_exact
from hetspmd.cli import main
from hetspmd.models import cnn

from conftest import require_devices

# timm (ViT) and torchvision (VGG, ResNet) counts, each with a 1000-class head.
REFERENCE_PARAMS = {"vit-b16": 86_567_656, "vit-l16": 304_326_632, "vgg19": 143_667_240, "resnet50": 25_557_032}
TINY = ["vit-tiny", "vgg-tiny", "resnet-tiny"]


def _small_resnet() -> cnn.BatchNormWorkload:
  """Two bottleneck stages on 16x16 images: quick to compile."""
  config = cnn.ResNetConfig(blocks=(1, 1), widths=(4, 8), stem_width=4, num_classes=10, image_size=16)
  return dataclasses.replace(models.get("resnet-tiny"), name="resnet-2stage", config=config)


@pytest.fixture(scope="module")
def small_resnet():
  """The small ResNet workload and its initial state (built once; tests must not donate it)."""
  workload = _small_resnet()
  return workload, workload.init_state(0)


def _is_abstract(tree) -> bool:
  return all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", REFERENCE_PARAMS)
def test_parameter_count_equals_the_reference_implementation(name):
  workload = models.get(name)
  assert workload.published_params == REFERENCE_PARAMS[name]
  assert workload.param_count() == REFERENCE_PARAMS[name]


@pytest.mark.parametrize("name,path,shape", [
    ("vit-b16", ("pos_embed",), (1, 197, 768)),  # 14 x 14 patches + class token
    ("vit-b16", ("patch_embed", "kernel"), (16, 16, 3, 768)),
    ("vit-l16", ("blocks", 23, "mlp", "fc1", "kernel"), (1024, 4096)),
    ("vgg19", ("classifier", 0, "kernel"), (7 * 7 * 512, 4096)),
    ("resnet50", ("fc", "kernel"), (2048, 1000)),
    ("resnet50", ("layers", 3, 0, "downsample", "layers", 1, "scale"), (2048,)),
])
def test_abstract_parameter_shapes(name, path, shape):
  params = models.get(name).abstract_state()["params"]
  for key in path:
    params = params[key]
  assert params.shape == shape


@pytest.mark.parametrize("name", TINY + ["vit-b16", "vgg19", "resnet50"])
def test_models_map_images_to_logits(name):
  workload = models.get(name)
  images = workload.example_batch(3)["inputs"]
  size = workload.config.image_size
  assert images.shape == (3, size, size, 3) and images.dtype == jnp.float32
  logits = nnx.eval_shape(lambda: workload.build(workload.config, nnx.Rngs(0))(jnp.zeros(images.shape)))
  assert logits.shape == (3, workload.config.num_classes) and logits.dtype == jnp.float32


def test_synthetic_batches_are_images_and_labels():
  batch = models.get("resnet-tiny").synthetic_batch(seed=0, batch=3)
  assert batch["inputs"].shape == (3, 32, 32, 3) and batch["inputs"].dtype == np.float32
  assert batch["labels"].dtype == np.int32 and 0 <= batch["labels"].min() and batch["labels"].max() < 10


def test_resnet_state_holds_batch_stats_apart_from_params(small_resnet):
  assert isinstance(models.get("resnet50"), cnn.BatchNormWorkload)
  workload, state = small_resnet
  assert set(state) == {"params", "batch_stats", "opt_state", "step"}
  stats = jax.tree.leaves(state["batch_stats"], is_leaf=lambda x: isinstance(x, nnx.Variable))
  assert stats and all(type(v) is nnx.BatchStat for v in stats)
  params = jax.tree.leaves(state["params"], is_leaf=lambda x: isinstance(x, nnx.Variable))
  assert all(type(v) is nnx.Param for v in params)
  assert workload.param_count() == sum(v.size for v in jax.tree.leaves(state["params"]))
  assert jax.tree.structure(workload.abstract_state()) == jax.tree.structure(state)


def test_resnet_step_updates_running_statistics_from_the_batch(small_resnet):
  workload, state = small_resnet
  batch = workload.synthetic_batch(seed=0, batch=4)
  new_state, metrics = jax.jit(workload.make_train_step())(state, batch)
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  assert int(new_state["step"]) == 1 and set(metrics) == {"loss", "accuracy"}
  for old, new in zip(jax.tree.leaves(state["batch_stats"]), jax.tree.leaves(new_state["batch_stats"])):
    assert not np.allclose(old, new)
  # The stem's statistics: r <- 0.9 r + 0.1 (biased batch statistic), from (mean 0, var 1).
  model = nnx.merge(workload.graphdef(), state["params"], state["batch_stats"])
  stem = np.asarray(model.conv1(jnp.asarray(batch["inputs"])))
  bn1 = new_state["batch_stats"]["bn1"]
  np.testing.assert_allclose(bn1["mean"][...], 0.1 * stem.mean((0, 1, 2)), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(bn1["var"][...], 0.9 + 0.1 * stem.var((0, 1, 2)), rtol=1e-4)


def test_resnet_eval_mode_uses_running_statistics():
  workload = _small_resnet()
  model = workload.build(workload.config, nnx.Rngs(0))
  images = jnp.asarray(workload.synthetic_batch(seed=0, batch=4)["inputs"])
  first = nnx.jit(lambda m, x: m(x)[:1])  # the first example's logits
  assert not np.allclose(first(model, images[:1]), first(model, images), atol=1e-4)  # batch statistics
  evaluate = nnx.view(model, use_running_average=True)
  np.testing.assert_allclose(first(evaluate, images[:1]), first(evaluate, images), rtol=1e-4, atol=1e-5)


def test_batch_stats_get_the_other_role_not_param():
  workload = models.get("resnet-tiny")
  graph = hs.trace(workload.make_train_step(), workload.abstract_state(), workload.example_batch(4))
  stats = [i for i in graph.inputs if i.path.startswith("state/batch_stats/")]
  assert len(stats) == len(jax.tree.leaves(workload.abstract_state()["batch_stats"]))
  assert {i.role for i in stats} == {hs.Role.OTHER}
  assert not any("batch_stats" in i.path for i in graph.inputs_with_role("param"))
  assert graph.elements_with_role("param") == workload.param_count()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vit-b16", "resnet50"])
def test_abstract_trace_of_full_models(name):
  workload = models.get(name)
  state = workload.abstract_state()
  assert _is_abstract(state)  # nothing allocated
  graph = hs.trace(workload.make_train_step(), state, workload.example_batch(2))
  assert graph.elements_with_role("param") == workload.param_count() == REFERENCE_PARAMS[name]
  assert graph.elements_with_role("opt_state") >= workload.param_count()
  if name == "resnet50":  # mean and variance of every batch-normalised channel, 26,560 of them
    assert graph.elements_with_role("other") == 2 * 26_560 + 1  # + the step counter


def test_trace_cli_on_resnet_tiny(capsys):
  assert main(["trace", "--model", "resnet-tiny", "--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["params"] == models.get("resnet-tiny").param_count()
  assert report["batch"] == {"inputs": [8, 32, 32, 3], "labels": [8]}
  assert {"stem", "layer4_0/conv2", "head"} <= {l["name"] for l in report["layers"]}


def test_microbatched_batch_norm_is_ghost_batch_norm(small_resnet):
  """Each microbatch is normalised with its own statistics, wherever it runs.

  With SGD (linear in the gradients, zero momentum at the start) the whole
  step is then the mean of single-device steps on each microbatch, running
  statistics included; it is not the step on the whole batch at once.
  """
  require_devices(4)
  workload, state0 = small_resnet
  microbatch, counts = 2, (2, 1, 0, 1)
  global_batch = microbatch * sum(counts)
  batch = workload.synthetic_batch(seed=1, batch=global_batch)

  single = jax.jit(workload.make_train_step())
  chunks = [jax.tree.map(lambda x: x[k:k + microbatch], batch) for k in range(0, global_batch, microbatch)]
  outs = [single(state0, chunk) for chunk in chunks]
  expected = jax.tree.map(lambda *xs: np.mean([np.asarray(x) for x in xs], axis=0), *[s for s, _ in outs])
  expected_loss = np.mean([float(m["loss"]) for _, m in outs])
  float64_step = Float64(workload.make_train_step())
  outs64 = [float64_step(state0, chunk) for chunk in chunks]  # the same means, of float64 steps
  expected64 = jax.tree.map(lambda *xs: np.mean(xs, axis=0), *[s for s, _ in outs64])
  expected64_loss = np.mean([m["loss"] for _, m in outs64])

  cluster = hs.Cluster.emulate(jax.devices()[:4], kinds=["V100-32GB"] * 2 + ["P100-16GB"] * 2)
  plan = hs.plan_for(cluster, state0, global_batch=global_batch, layout=(4, 1), microbatch=microbatch, counts=counts)
  step = hs.parallelize(workload.make_train_step(hs.value_and_grad), cluster=cluster, plan=plan,
                        global_batch=global_batch, donate_state=False)
  state, metrics = step(step.shard_state(state0), batch)
  got = jax.tree.map(np.asarray, jax.device_get(state))
  assert_exact((metrics["loss"], got), (np.float32(expected_loss), expected), (expected64_loss, expected64))

  whole, _ = single(state0, batch)  # one batch-norm batch of 8: different running variances
  assert not np.allclose(whole["batch_stats"]["bn1"]["var"][...], got["batch_stats"]["bn1"]["var"][...], rtol=1e-6)
