"""Sharding annotations written in Flax NNX and Linen models, respected by plans."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import hetspmd as hs
from hetspmd import models
from hetspmd.plan.annotations import match

from conftest import require_devices

RULES = [("batch", "data"), ("embed", None), ("mlp", "model")]


class _Annotated(nnx.Module):
  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.up = nnx.Linear(8, 16, kernel_init=nnx.with_partitioning(init, (None, "model")), rngs=rngs)
    self.down = nnx.Linear(16, 8, kernel_init=nnx.with_partitioning(init, ("model", None)), rngs=rngs)
    self.head = nnx.Linear(8, 4, rngs=rngs)


def _nnx_params():
  with nnx.use_eager_sharding(False):
    return nnx.state(nnx.eval_shape(lambda: _Annotated(nnx.Rngs(0))), nnx.Param)


class _LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")))(x)
    return nn.Dense(8, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed")))(x)


def test_nnx_annotations_are_read_by_path():
  specs = hs.annotated_specs(_nnx_params())
  assert specs == {"up/kernel": (None, "model"), "down/kernel": ("model", None)}


def test_linen_logical_annotations_map_through_rules():
  boxed = jax.eval_shape(_LinenMLP().init, jax.random.key(0), jnp.zeros((2, 8)))
  specs = hs.annotated_specs(boxed, RULES)
  assert specs == {"params/Dense_0/kernel": (None, "model"), "params/Dense_1/kernel": ("model", None)}
  with pytest.raises(hs.InvalidValueError, match="logical axis 'mlp' has no rule; rules cover"):
    hs.annotated_specs(boxed, [("embed", None)])


@pytest.mark.parametrize("path,rank,expected", [
    ("params/up/kernel", 2, (None, "model")),                 # suffix of the state path
    ("opt_state/0/mu/up/kernel", 2, (None, "model")),         # the optimizer state mirrors it
    ("params/xup/kernel", 2, ("model",)),                     # whole components only: falls to "kernel"
    ("params/up/bias", 1, None),
    ("opt_state/0/count", 0, None),                           # a spec longer than the rank never matches
])
def test_specs_match_state_paths_by_longest_suffix(path, rank, expected):
  assert match(path, rank, {"up/kernel": (None, "model"), "kernel": ("model",)}) == expected


def test_plan_keeps_annotated_leaves_and_chooses_the_rest():
  require_devices(8)
  workload = models.get("mlp-tiny")
  state = workload.abstract_state()
  cluster = hs.Cluster.emulate(jax.devices()[:8], ["V100-32GB"] * 8)
  # Row-split the first layer (hetspmd's own rule would split its last dimension).
  plan = hs.plan_for(cluster, state, global_batch=16, layout=(4, 2), zero_stage=1,
                     specs={"layers/0/kernel": ("model", None)})
  specs = dict(plan.state_specs)
  assert specs["params/layers/0/kernel"] == ("model",)
  mu = [p for p in specs if p.startswith("opt_state") and p.endswith("layers/0/kernel")]
  assert mu and all(specs[p] == ("model", "data") for p in mu)     # annotation + ZeRO-1 over data
  assert specs["params/layers/1/kernel"] == (None, "model")         # not annotated: hetspmd's rule
  with pytest.raises(hs.InvalidValueError, match="names mesh axis 'mlp'.*axes are \\('data', 'model'\\)"):
    hs.plan_for(cluster, state, global_batch=16, layout=(4, 2), specs={"layers/0/kernel": ("mlp", None)})


def test_annotated_plan_trains_like_one_device():
  require_devices(8)
  workload = dataclasses.replace(models.get("mlp-tiny"), make_optimizer=lambda: optax.adam(1e-3, eps=1e-4))
  cluster = hs.Cluster.emulate(jax.devices()[:8], ["V100-32GB"] * 4 + ["P100-16GB"] * 4)
  batches = [workload.synthetic_batch(seed=i, batch=16) for i in range(3)]
  from exactness import Reference

  ref = Reference(workload.make_train_step(), workload.init_state(0)).run(batches)

  specs = {"layers/0/kernel": ("model", None), "layers/1/kernel": (None, "model")}
  plan = hs.plan_for(cluster, workload.abstract_state(), global_batch=16, layout=(4, 2), microbatch=2,
                     counts=(3, 3, 1, 1), specs=specs)
  step = hs.parallelize(workload.make_train_step(hs.value_and_grad), cluster=cluster, plan=plan, global_batch=16)
  state = step.shard_state(workload.init_state(0))
  assert state["params"]["layers"][0]["kernel"].sharding.spec == jax.sharding.PartitionSpec("model")
  for batch in batches:
    state, _ = step(state, batch)
  ref.check(state["params"], lambda s: s["params"])


def test_parallelize_passes_specs_to_auto_plans():
  require_devices(8)
  workload = models.get("mlp-tiny")
  cluster = hs.Cluster.emulate(jax.devices()[:8], ["V100-32GB"] * 8)
  step = hs.parallelize(workload.make_train_step(hs.value_and_grad), cluster=cluster, global_batch=16,
                        specs={"layers/0/kernel": ("data", None)})
  step.shard_state(workload.init_state(0))
  assert dict(step.plan.state_specs)["params/layers/0/kernel"] == ("data",)


@pytest.mark.parametrize("specs,conflict", [
    (None, ""),
    ({}, ""),
    ({"Dense_0/kernel": (None, "model"), "Dense_0/bias": ("model",), "Dense_1/kernel": ()}, ""),
    ({"kernel": (None, None)}, ""),
    ({"Dense_0/kernel": ("data", None)}, "splits over 'data'"),
    ({"Dense_0/kernel": (("data", "model"), None)}, "splits over 'data'"),
    ({"Dense_0/kernel": ("model", "model")}, "splits 2 dimensions over 'model'"),
])
def test_which_specs_a_group_keeps(specs, conflict):
  from hetspmd.plan.state_layout import group_conflict

  found = group_conflict(specs)
  assert (conflict in found and found) if conflict else found == ""


def test_group_model_dims_keep_the_specs_over_the_planners_choice():
  from hetspmd.plan.state_layout import group_model_dims

  state = {"params": {"a": {"kernel": np.zeros((4, 6)), "bias": np.zeros(6)}, "b": {"kernel": np.zeros((6, 4))}},
           "opt_state": {"mu": {"a": {"kernel": np.zeros((4, 6))}}}}
  planned = {"params/a/kernel": 1, "params/a/bias": 0, "params/b/kernel": 0}
  assert group_model_dims(state, None, planned) == planned
  assert group_model_dims(state, {"a/kernel": ("model", None), "b/kernel": ()}, planned) == {
      "params/a/kernel": 0, "params/a/bias": 0}
  # a suffix names every leaf it ends; the optimizer state follows its parameter in the group, never named itself
  assert group_model_dims(state, {"kernel": (None, "model")}, {}) == {"params/a/kernel": 1, "params/b/kernel": 1}
