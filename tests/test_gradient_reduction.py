"""How gradients cross the data axis: overlapped with the last microbatch, and in reduced precision.

Overlap changes only where the last microbatch runs (after its loop, so
that each gradient's reduction can start as soon as it is made), never the
arithmetic: the same sums in the same order, so the numbers equal the
loop's to float32 rounding.

Reduced precision casts each position's float32 partial gradient to the
reduce dtype (unit roundoff ``u``: 2^-8 for bfloat16, 2^-11 for float16),
sums the ``n`` partials in that dtype, and casts back. With ``p_i`` the
partials, each rounding adds a relative error of at most ``u``, and the
``n - 1`` additions and ``n`` casts give the standard bound for a
floating-point sum:

    |reduced - exact| <= gamma(n + 1) * sum_i |p_i|,  gamma(k) = k u / (1 - k u),

elementwise. The tests compute the partials on the host and check every
gradient element against that bound (plus float32 slack).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hetspmd as hs
from conftest import require_devices
from test_unmodified_steps import _close, _lm_state, _metrics_close, _token_batches, lm1b_train_step

KINDS = ["V100-32GB"] * 4 + ["P100-16GB"] * 4
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


def _cluster():
  require_devices(8)
  return hs.Cluster.emulate(jax.devices()[:8], kinds=KINDS)


def gamma(k: int, u: float) -> float:
  return k * u / (1 - k * u)


def _lm1b(batch, layout, counts, microbatch, **plan_options):
  schedule = optax.linear_schedule(1e-3, 1e-4, 10)
  step_fn = functools.partial(lm1b_train_step, config=None, learning_rate_fn=schedule)
  cluster = _cluster()
  state = _lm_state()
  plan = hs.plan_for(cluster, state, global_batch=batch, layout=layout, microbatch=microbatch, counts=counts,
                     **plan_options)
  return step_fn, hs.parallelize(step_fn, cluster=cluster, plan=plan, global_batch=batch), state


OVERLAP_CASES = [
    # (data, model) layout, counts, microbatch
    ((8, 1), (3, 3, 2, 2, 1, 1, 1, 0), 2),   # a position with no microbatch runs one, masked
    ((8, 1), (2, 2, 2, 2, 2, 2, 2, 2), 2),   # uniform counts: the loop runs one fewer
    ((4, 2), (3, 2, 2, 1), 2),
    ((8, 1), (1, 1, 1, 1, 1, 1, 1, 1), 3),   # one microbatch each: nothing to peel
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout,counts,microbatch", OVERLAP_CASES,
                         ids=[f"{c[0]}-{c[1]}-mb{c[2]}" for c in OVERLAP_CASES])
def test_overlapped_reduction_gives_the_loops_numbers(layout, counts, microbatch):
  batch = sum(counts) * microbatch
  batches = _token_batches(batch)
  rng = jax.random.key(7)
  step_fn, plain, state0 = _lm1b(batch, layout, counts, microbatch)
  _, overlapped, _ = _lm1b(batch, layout, counts, microbatch, overlap_reduction=True)
  ref, ref_metrics = _lm_state(), []
  for b in batches:
    ref, m = jax.jit(step_fn)(ref, b, dropout_rng=rng)
    ref_metrics.append(m)
  a, b_ = plain.shard_state(state0), overlapped.shard_state(_lm_state())
  for b, expected in zip(batches, ref_metrics):
    a, metrics_a = plain(a, b, dropout_rng=rng)
    b_, metrics_b = overlapped(b_, b, dropout_rng=rng)
    _metrics_close(expected, metrics_b)
    _metrics_close(metrics_a, metrics_b, rtol=1e-6)
  _close(ref.params, b_.params)
  _close(a.params, b_.params, rtol=1e-6)
  # the last microbatch's work is outside the loop: the program holds a second copy of the microbatch
  dots = [s.lower(st, batches[0], dropout_rng=rng).as_text().count("dot_general") for s, st in
          ((plain, a), (overlapped, b_))]
  if max(counts) > 1:
    assert dots[1] > dots[0]
  else:
    assert dots[1] == dots[0]
  assert "overlapped with the last microbatch" in overlapped.plan.summary()


def _mlp_step(params, batch):
  def loss_fn(p):
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), {"loss": loss, "grads": grads}


def _mlp_params():
  k = jax.random.split(jax.random.key(3), 2)
  return {"w1": jax.random.normal(k[0], (12, 24)) * 0.3, "b1": jnp.zeros(24),
          "w2": jax.random.normal(k[1], (24, 4)) * 0.3}


def _partials(params, batch, counts, microbatch):
  """Each position's float32 partial gradient: its examples' share of the mean's gradient."""
  def loss_fn(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.sum((h @ p["w2"] - y) ** 2) / (batch["x"].shape[0] * batch["y"].shape[1])

  out, start = [], 0
  for c in counts:
    end = start + c * microbatch
    out.append(jax.grad(loss_fn)(params, batch["x"][start:end], batch["y"][start:end]))
    start = end
  return out


REDUCED_CASES = [
    # dtype, counts, ZeRO stage (ZeRO-1/3 reduce-scatter the gradients onto their shards, in the reduce dtype)
    ("bfloat16", (3, 3, 2, 2, 1, 1, 1, 0), 0),
    ("bfloat16", (2,) * 8, 0),
    ("float16", (3, 3, 2, 2, 1, 1, 1, 0), 0),
    ("bfloat16", (3, 3, 2, 2, 1, 1, 1, 0), 1),
    ("float16", (2,) * 8, 3),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dtype,counts,zero", REDUCED_CASES, ids=[f"{c[0]}-{c[1]}-zero{c[2]}" for c in REDUCED_CASES])
def test_reduced_precision_gradients_within_the_rounding_bound(dtype, counts, zero):
  microbatch = 4
  batch_size = sum(counts) * microbatch
  rs = np.random.RandomState(0)
  batch = {"x": rs.randn(batch_size, 12).astype(np.float32), "y": rs.randn(batch_size, 4).astype(np.float32)}
  cluster = _cluster()
  params = _mlp_params()
  loss_fn = lambda p: jnp.mean((jnp.tanh(batch["x"] @ p["w1"] + p["b1"]) @ p["w2"] - batch["y"]) ** 2)
  exact_loss, exact = jax.value_and_grad(loss_fn)(params)
  partials = _partials(params, batch, counts, microbatch)
  plan = hs.plan_for(cluster, params, global_batch=batch_size, microbatch=microbatch, counts=counts,
                     grad_reduce_dtype=dtype, zero_stage=zero)
  step = hs.parallelize(_mlp_step, cluster=cluster, plan=plan, global_batch=batch_size)
  _, metrics = step(step.shard_state(_mlp_params()), batch)
  bound_factor = gamma(len(counts) + 1, UNIT_ROUNDOFF[dtype])
  for name in exact:
    magnitude = sum(np.abs(np.asarray(p[name])) for p in partials)
    err = np.abs(np.asarray(metrics["grads"][name]) - np.asarray(exact[name]))
    slack = 1e-6 * float(np.max(np.abs(exact[name])))  # float32 accumulation order
    assert np.all(err <= bound_factor * magnitude + slack), name
  # the bound is not vacuous: reduced precision does move the gradients off float32
  assert any(float(np.max(np.abs(np.asarray(metrics["grads"][n]) - np.asarray(exact[n])))) > 0 for n in exact)
  np.testing.assert_allclose(float(metrics["loss"]), float(exact_loss), rtol=1e-5)  # the loss's sum: float32
  text = step.lower(step.shard_state(_mlp_params()), batch).as_text()
  short = {"bfloat16": "bf16", "float16": "f16"}[dtype]
  wire = re.findall(r'"stablehlo\.(?:all_reduce|reduce_scatter)".*?\}\) : \(([^)]*)\)', text, re.DOTALL)
  assert any(short in operands for operands in wire), wire  # the gradients' collective is in the reduce dtype
  assert any("f32" in operands for operands in wire), wire   # the loss's sum is not


@pytest.mark.timeout(240)
def test_reduced_precision_keeps_scalars_and_normalisers_in_float32():
  """lm1b's token count and loss sum cross the wire in float32; its metrics stay exact."""
  counts, microbatch = (3, 3, 2, 2, 1, 1, 1, 0), 2
  batch = sum(counts) * microbatch
  batches = _token_batches(batch)
  rng = jax.random.key(7)
  step_fn, step, state = _lm1b(batch, (8, 1), counts, microbatch, grad_reduce_dtype="bfloat16")
  ref = _lm_state()
  ref, expected = jax.jit(step_fn)(ref, batches[0], dropout_rng=rng)
  state, metrics = step(step.shard_state(state), batches[0], dropout_rng=rng)
  # the first step's metrics come from the forward pass and exact sums: bitwise-close to one device
  _metrics_close(expected, metrics)
  # Adam's first update is lr * g / (|g| + eps) per element: reduced gradients move it by at most 2 lr
  lr = float(expected["learning_rate"])
  for e, a in zip(jax.tree.leaves(ref.params), jax.tree.leaves(state.params)):
    assert float(np.max(np.abs(np.asarray(e) - np.asarray(a)))) <= 2 * lr * 1.0001


def test_plan_rejects_an_unknown_reduce_dtype():
  cluster = _cluster()
  with pytest.raises(hs.InvalidValueError, match="grad_reduce_dtype must be one of"):
    hs.plan_for(cluster, _mlp_params(), global_batch=16, grad_reduce_dtype="int8")


def test_plan_json_keeps_the_reduction_options(tmp_path):
  cluster = _cluster()
  plan = hs.plan_for(cluster, _mlp_params(), global_batch=16, grad_reduce_dtype="bfloat16", overlap_reduction=True)
  plan.save(tmp_path / "p.json")
  again = hs.Plan.load(tmp_path / "p.json")
  assert again.grad_reduce_dtype == "bfloat16" and again.overlap_reduction
  old = {**plan.to_json(), "schema": 2}
  del old["grad_reduce_dtype"], old["overlap_reduction"]
  legacy = hs.Plan.from_json(old)
  assert legacy.grad_reduce_dtype == "float32" and not legacy.overlap_reduction
