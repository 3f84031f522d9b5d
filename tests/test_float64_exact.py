"""A float64 step stays float64: hetspmd casts nothing on the way (no float32 accumulator, constant, rebuilt mask
or collective), so an attention model trained on 8 devices matches one device to float64's precision, and
``explain()`` names the dtype its gradients really cross the devices in.

The model's attention runs its softmax in float64 (``attention_fn``): ``nnx.MultiHeadAttention``'s default, through
``jax.nn.dot_product_attention``, rounds its logits to float32 on one device as well ("Softmax is always carried out
in fp32", jax._src.nn.functions._dot_product_attention_core), so a logit that a microbatch's shape computes one
float64 ulp apart can round to the other float32 neighbour: ~1e-10 here, 1e-7 and more with Adam, in plain JAX too
(a per-example gradient loop on one device differs by as much), not an error of hetspmd's. SGD, not Adam: the
key projection's bias gets a zero gradient (softmax ignores it), whose rounding noise Adam would scale to the
learning rate."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.nnx.nn.attention import dot_product_attention_weights

import hetspmd as hs
from hetspmd.plan.groups import group_plan

from conftest import require_devices

pytestmark = pytest.mark.timeout(300)

B, L, D = 24, 6, 16
TOLERANCE = 1e-10  # float64's sums in another order: ~1e-16 measured; one float32 rounding would be ~1e-8


def f64_attention(query, key, value, **kwargs):
  """Flax's attention with its softmax in the inputs' dtype (no ``jax.nn.dot_product_attention``)."""
  weights = dot_product_attention_weights(query, key, dtype=query.dtype)
  return jnp.einsum("...hqk,...khd->...qhd", weights, value)


class Attention(nnx.Module):
  def __init__(self, rngs):
    self.att = nnx.MultiHeadAttention(num_heads=2, in_features=D, qkv_features=D, decode=False,
                                      dtype=jnp.float64, param_dtype=jnp.float64, attention_fn=f64_attention,
                                      rngs=rngs)
    self.out = nnx.Linear(D, 3, dtype=jnp.float64, param_dtype=jnp.float64, rngs=rngs)

  def __call__(self, x):
    return self.out(self.att(x)).mean(axis=1)


def objects():
  model = Attention(nnx.Rngs(0))
  return model, nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)


def train_step(model, optimizer, batch):
  def loss_fn(model):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()
  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return {"loss": loss}


def batches(n=3):
  rs = np.random.default_rng(0)
  return [{"x": rs.normal(size=(B, L, D)), "y": rs.integers(0, 3, B).astype(np.int32)} for _ in range(n)]


PLANS = {
    "auto": "auto",
    "search": "search",  # the search traces the first call
    # 4 + 4 devices, microbatches of 4 and 2: 16 + 8 examples
    "groups": lambda: group_plan([((0, 1, 2, 3), 4, (1, 1, 1, 1)), ((4, 5, 6, 7), 2, (1, 1, 1, 1))], B),
}


def _run(plan_name):
  model, optimizer = objects()
  cluster = hs.Cluster.emulate(jax.devices(), kinds=["V100-32GB"] * 4 + ["P100-16GB"] * 4)
  plan = PLANS[plan_name]
  plan = plan() if callable(plan) else plan
  step = hs.parallelize(nnx.jit(train_step), cluster=cluster, global_batch=B, plan=plan)
  for batch in batches():
    metrics = step(model, optimizer, batch)
  return model, step, metrics


@pytest.mark.parametrize("plan_name", sorted(PLANS))
def test_a_float64_attention_step_matches_one_device(plan_name):
  require_devices(8)
  with jax.enable_x64(True):
    ref_model, ref_optimizer = objects()
    single = nnx.jit(train_step)
    for batch in batches():
      ref_metrics = single(ref_model, ref_optimizer, batch)
    model, step, metrics = _run(plan_name)
    got, want = nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param)
    assert {str(x.dtype) for x in jax.tree.leaves(got)} == {"float64"}
    diffs = {jax.tree_util.keystr(path): float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
             for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want))}
    assert max(diffs.values()) <= TOLERANCE, diffs
    assert abs(float(metrics["loss"]) - float(ref_metrics["loss"])) <= TOLERANCE


def test_a_float64_step_lowers_without_float32():
  """The single program of a float64 step holds no float32 value: nothing narrows it on the way."""
  require_devices(8)
  with jax.enable_x64(True):
    model, step, _ = _run("auto")
    text = step.lower(model, nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param), batches(1)[0]).as_text()
    assert "f64" in text and "f32" not in text, [line for line in text.splitlines() if "f32" in line][:5]


def test_explain_names_the_dtype_float64_gradients_cross_in():
  """``grad_reduce_dtype="float32"`` casts nothing: a float64 step's gradients cross the devices in float64."""
  require_devices(8)
  with jax.enable_x64(True):
    _, step, _ = _run("auto")
    assert step.plan.grad_reduce_dtype == "float32"
    first = step.explain().splitlines()[0]
    assert "gradients reduced in float64" in first and "float32" not in first, first
