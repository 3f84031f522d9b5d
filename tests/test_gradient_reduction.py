"""How gradients cross the data axis: overlapped with the last microbatch, and in reduced precision.

Overlap changes only where the last microbatch runs (after its loop, so
that each gradient's reduction can start as soon as it is made), never the
arithmetic: the same sums in the same order, so the numbers equal the
loop's to float32 rounding.

Reduced precision casts each position's float32 partial gradient to
bfloat16 (unit roundoff ``u`` = 2^-8, float32's range), sums the ``n``
partials in that dtype, and casts back. With ``p_i`` the
partials, each rounding adds a relative error of at most ``u``, and the
``n - 1`` additions and ``n`` casts give the standard bound for a
floating-point sum:

    |reduced - exact| <= gamma(n + 1) * sum_i |p_i|,  gamma(k) = k u / (1 - k u),

elementwise. The tests compute the partials on the host and check every
gradient element against that bound (plus float32 slack).
"""

import functools
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hetspmd as hs
from conftest import require_devices
from exactness import Reference, assert_exact
from test_unmodified_steps import (_lm_state, _token_batches, lm1b_in_processes,
                                   lm1b_train_step)

KINDS = ["V100-32GB"] * 4 + ["P100-16GB"] * 4
UNIT_ROUNDOFF = 2.0 ** -8  # bfloat16


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


def _beside_the_loop(layout, counts, microbatch, lockstep=False, **plan_options):
  """Trains the lm1b step under a plain plan and under ``plan_options`` side by side, each step's metrics
  and the parameters after the run against one device's (``exactness``: the plain plan's against the
  single-device step's rounding, the other plan's against the plain plan's); returns both steps and
  states, a batch and the dropout key."""
  batch = sum(counts) * microbatch
  batches = _token_batches(batch)
  rng = jax.random.key(7)
  step_fn, plain, state0 = _lm1b(batch, layout, counts, microbatch)
  _, other, _ = _lm1b(batch, layout, counts, microbatch, **plan_options)
  ref = Reference(step_fn, _lm_state()).run(batches, dropout_rng=rng)
  a, b_ = plain.shard_state(state0), other.shard_state(_lm_state())
  other._runner._lockstep = lockstep or None  # True: as if the compiled loop held a collective-permute
  for i, b in enumerate(batches):
    a, metrics_a = plain(a, b, dropout_rng=rng)
    b_, metrics_b = other(b_, b, dropout_rng=rng)
    ref.check_metrics(metrics_a, i, what="plain plan's metrics")
    ref.check_metrics(metrics_b, i)
    assert_exact(metrics_b, metrics_a, ref.ref64_metrics[i], what=f"metrics of step {i} against the plain plan's")
  ref.check(a.params, lambda s: s.params, what="plain plan's parameters")
  ref.check(b_.params, lambda s: s.params)
  assert_exact(b_.params, a.params, ref.ref64.params, what="parameters against the plain plan's")
  return plain, a, other, b_, batches[0], rng


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
  plain, a, overlapped, b_, batch, rng = _beside_the_loop(layout, counts, microbatch, overlap_reduction=True)
  # the last microbatch's work is outside the loop: the program holds a second copy of the microbatch
  dots = [s.lower(st, batch, dropout_rng=rng).as_text().count("dot_general") for s, st in
          ((plain, a), (overlapped, b_))]
  if max(counts) > 1:
    assert dots[1] > dots[0]
  else:
    assert dots[1] == dots[0]
  assert "overlapped with the last microbatch" in overlapped.plan.summary()


FUSED_CASES = [
    # (data, model) layout, counts, microbatch, overlap_microbatches, lockstep
    ((8, 1), (4, 4, 3, 3, 2, 2, 2, 2), 2, 2, False),  # per-device trip counts before the fused pass
    ((8, 1), (4, 4, 3, 3, 2, 2, 2, 2), 2, 2, True),   # every position runs the largest loop, padding masked
    ((8, 1), (3,) * 8, 2, 3, False),                  # uniform: the loop is empty, all of it is one pass
    ((4, 2), (3, 2, 2, 2), 2, 2, False),              # with the model axis
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout,counts,microbatch,k,lockstep", FUSED_CASES,
                         ids=[f"{c[0]}-{c[1]}-mb{c[2]}-k{c[3]}{'-lockstep' if c[4] else ''}" for c in FUSED_CASES])
def test_fused_overlapped_microbatches_give_the_loops_numbers(layout, counts, microbatch, k, lockstep):
  """The last ``k`` microbatches run as one batch: the same examples, summed in a different grouping."""
  plain, a, fused, b_, batch, rng = _beside_the_loop(layout, counts, microbatch, lockstep,
                                                     overlap_reduction=True, overlap_microbatches=k)
  # the fused pass is traced at k microbatches' size: its activations have k * microbatch rows
  seq = jax.tree.leaves(batch)[0].shape[1]
  rows = rf"tensor<{k * microbatch}x{seq}x\d+xf32>"  # activations of k * microbatch sequences
  assert re.search(rows, fused.lower(b_, batch, dropout_rng=rng).as_text())
  assert not re.search(rows, plain.lower(a, batch, dropout_rng=rng).as_text())
  assert f"overlapped with the last {k} microbatches, run as one batch of {k * microbatch}" in fused.plan.summary()


@pytest.mark.parametrize("options,message", [
    (dict(overlap_microbatches=2), "needs overlap_reduction=True"),
    (dict(overlap_reduction=True, overlap_microbatches=3), "at least 3 microbatches"),
    (dict(overlap_reduction=True, overlap_microbatches=0), "positive integer"),
])
def test_fused_overlap_checks_its_options(options, message):
  cluster = _cluster()
  with pytest.raises(hs.InvalidValueError, match=message):
    hs.plan_for(cluster, _lm_state(), global_batch=24, microbatch=2, counts=(2, 2, 2, 2, 1, 1, 1, 1), **options)


def test_plan_json_keeps_a_fused_overlap_and_checks_it():
  plan = hs.plan_for(_cluster(), _lm_state(), global_batch=32, microbatch=2, counts=(2,) * 8,
                     overlap_reduction=True, overlap_microbatches=2)
  data = plan.to_json()
  assert hs.Plan.from_json(data) == plan
  for bad in (2.5, True, "2"):
    with pytest.raises(hs.InvalidValueError, match="'overlap_microbatches' must be an integer"):
      hs.Plan.from_json({**data, "overlap_microbatches": bad})


def _per_token_step(params, batch):
  """Per-example outputs with the examples on dimension 1 ([T, B]) and several rows per example ([B * T])."""
  def loss_fn(p):
    per_token = ((jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"] - batch["y"]) ** 2).mean(-1)  # [B, T]
    return per_token.mean(), per_token

  (loss, per_token), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  return new, {"loss": loss, "by_token": per_token.T, "flat": per_token.reshape(-1)}


def _per_token_case(batch: int, data_seed: int, param_seed: int, tokens: int = 3) -> tuple[dict, dict]:
  """A batch of ``batch`` sequences of ``tokens`` and the parameters of :func:`_per_token_step`."""
  rs = np.random.RandomState(data_seed)
  data = {"x": rs.randn(batch, tokens, 4).astype(np.float32), "y": rs.randn(batch, tokens, 5).astype(np.float32)}
  k = jax.random.split(jax.random.key(param_seed))
  return data, {"w1": jax.random.normal(k[0], (4, 8)) * 0.3, "w2": jax.random.normal(k[1], (8, 5)) * 0.3}


@pytest.mark.parametrize("lockstep", [False, True])
def test_fused_pass_returns_per_example_outputs_in_global_order(lockstep):
  counts, microbatch = (4, 4, 3, 3, 2, 2, 2, 2), 2
  batch = sum(counts) * microbatch
  data, params = _per_token_case(batch, 2, 0)
  ref = Reference(_per_token_step, params).run([data])
  plan = hs.plan_for(_cluster(), params, global_batch=batch, microbatch=microbatch, counts=counts,
                     overlap_reduction=True, overlap_microbatches=2)
  step = hs.parallelize(_per_token_step, cluster=_cluster(), plan=plan, global_batch=batch)
  placed = step.shard_state(params)
  step._runner._lockstep = lockstep or None
  new, out = step(placed, data)
  for key in ("by_token", "flat"):
    assert out[key].shape == ref.single_metrics[0][key].shape
  ref.check_metrics(out, 0)
  ref.check(new)


LOCKSTEP_SLOT_CASES = [
    # counts, slots, plan options
    ((1, 1, 1, 1, 0, 0, 0, 0), 0, {}),  # at most one microbatch each: two slots, one of them empty
    ((3, 3, 2, 2, 1, 1, 1, 1), 6, dict(overlap_reduction=True)),
    ((4, 4, 3, 3, 2, 2, 2, 2), 6, dict(overlap_reduction=True, overlap_microbatches=2)),
]
_PMAX_OF_COUNTS = re.compile(r"all_reduce[^\n]*\n\s*\^bb0\(%\w+: tensor<i32>, %\w+: tensor<i32>\):\s*\n\s*%\w+ = "
                             r"stablehlo\.maximum")


@pytest.mark.parametrize("counts,slots,options", LOCKSTEP_SLOT_CASES,
                         ids=[f"{c[0]}-slots{c[1]}" for c in LOCKSTEP_SLOT_CASES])
def test_a_lockstep_loop_runs_the_longest_count_not_every_slot(counts, slots, options):
  """A loop in lockstep (as if it held a collective-permute) runs the longest count over the data axis, one
  scalar ``pmax`` read when it runs, not its buffer slots: the slots past the longest count are never run, and
  the numbers are one device's."""
  microbatch = 2
  batch = sum(counts) * microbatch
  data, params = _per_token_case(batch, 5, 1)
  ref = Reference(_per_token_step, params).run([data])
  plan = hs.plan_for(_cluster(), params, global_batch=batch, microbatch=microbatch, counts=counts, **options)
  plan = plan.replace(slots=slots)
  assert plan.max_count > max(counts)
  step = hs.parallelize(_per_token_step, cluster=_cluster(), plan=plan, global_batch=batch)
  placed = step.shard_state(params)
  step._runner._lockstep = True
  new, out = step(placed, data)
  ref.check_metrics(out, 0)
  ref.check(new)
  assert len(_PMAX_OF_COUNTS.findall(step.lower(placed, data).as_text())) == 1


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
    # counts, ZeRO stage (ZeRO-1/3 reduce-scatter the gradients onto their shards, in bfloat16), overlap
    ((3, 3, 2, 2, 1, 1, 1, 0), 0, False),
    ((2,) * 8, 0, True),
    ((3, 3, 2, 2, 1, 1, 1, 0), 1, True),
    ((2,) * 8, 3, False),
]


def _wire_elements(text: str) -> dict[str, int]:
  """Elements per dtype in the operands of a lowered program's all-reduces and reduce-scatters."""
  out: dict[str, int] = {}
  for operands in re.findall(r'"stablehlo\.(?:all_reduce|reduce_scatter)".*?\}\) : \(([^)]*)\)', text, re.DOTALL):
    for dims, dtype in re.findall(r"tensor<((?:\d+x)*)(\w+)>", operands):
      out[dtype] = out.get(dtype, 0) + int(np.prod([int(d) for d in dims.split("x") if d], dtype=np.int64))
  return out


def _param_elements(tree) -> int:
  return sum(int(np.size(x)) for x in jax.tree.leaves(tree))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("counts,zero,overlap", REDUCED_CASES,
                         ids=[f"{c[0]}-zero{c[1]}{'-overlap' if c[2] else ''}" for c in REDUCED_CASES])
def test_reduced_precision_gradients_within_the_rounding_bound(counts, zero, overlap):
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
                     grad_reduce_dtype="bfloat16", zero_stage=zero, overlap_reduction=overlap)
  step = hs.parallelize(_mlp_step, cluster=cluster, plan=plan, global_batch=batch_size)
  _, metrics = step(step.shard_state(_mlp_params()), batch)
  bound_factor = gamma(len(counts) + 1, UNIT_ROUNDOFF)
  for name in exact:
    magnitude = sum(np.abs(np.asarray(p[name])) for p in partials)
    err = np.abs(np.asarray(metrics["grads"][name]) - np.asarray(exact[name]))
    slack = 1e-6 * float(np.max(np.abs(exact[name])))  # float32 accumulation order
    assert np.all(err <= bound_factor * magnitude + slack), name
  # the bound is not vacuous: reduced precision does move the gradients off float32
  assert any(float(np.max(np.abs(np.asarray(metrics["grads"][n]) - np.asarray(exact[n])))) > 0 for n in exact)
  np.testing.assert_allclose(float(metrics["loss"]), float(exact_loss), rtol=1e-5)  # the loss's sum: float32
  text = step.lower(step.shard_state(_mlp_params()), batch).as_text()
  wire = _wire_elements(text)
  assert wire["bf16"] == _param_elements(params), wire  # every gradient element crosses in bfloat16
  assert wire["f32"] >= 1, wire                         # the loss's sum does not


@pytest.mark.timeout(240)
def test_reduced_precision_keeps_scalars_and_normalisers_in_float32():
  """lm1b's token count and loss sum cross the wire in float32; its metrics stay exact."""
  counts, microbatch = (3, 3, 2, 2, 1, 1, 1, 0), 2
  batch = sum(counts) * microbatch
  batches = _token_batches(batch)
  rng = jax.random.key(7)
  step_fn, step, state = _lm1b(batch, (8, 1), counts, microbatch, grad_reduce_dtype="bfloat16")
  reference = Reference(step_fn, _lm_state()).run(batches[:1], dropout_rng=rng)
  ref, expected = reference.single, reference.single_metrics[0]
  state, metrics = step(step.shard_state(state), batches[0], dropout_rng=rng)
  # the first step's metrics come from the forward pass and exact sums: as close to one device as float32 allows
  reference.check_metrics(metrics, 0)
  # Adam's first update is lr * g / (|g| + eps) per element: reduced gradients move it by at most 2 lr
  lr = float(expected["learning_rate"])
  for e, a in zip(jax.tree.leaves(ref.params), jax.tree.leaves(state.params)):
    assert float(np.max(np.abs(np.asarray(e) - np.asarray(a)))) <= 2 * lr * 1.0001


@pytest.mark.timeout(240)
def test_transposed_gradients_are_reduced_in_bfloat16_and_forward_sums_are_not():
  """A Conv/BatchNorm/Dense step (per-microbatch statistics): its Dense kernel's gradient leaves the loop before
  its transpose; every parameter's gradient still crosses in bfloat16, the statistics in float32."""
  from test_unmodified_steps import _bn_state, bn_train_step

  counts, microbatch = (2, 2, 1, 1, 1, 1, 1, 1), 2
  batch_size = sum(counts) * microbatch
  rs = np.random.RandomState(0)
  batch = {"image": rs.randn(batch_size, 8, 8, 1).astype(np.float32),
           "label": rs.randint(0, 5, batch_size).astype(np.int32)}
  cluster = _cluster()
  plan = hs.plan_for(cluster, _bn_state(), global_batch=batch_size, microbatch=microbatch, counts=counts,
                     grad_reduce_dtype="bfloat16")
  step = hs.parallelize(bn_train_step, cluster=cluster, plan=plan, global_batch=batch_size)
  state = step.shard_state(_bn_state())
  wire = _wire_elements(step.lower(state, batch).as_text())
  # all but one BatchNorm parameter's 6 elements, whose gradient the statistics' per-microbatch region makes
  # (it leaves the loop as those statistics do, in float32); before gradients were told by the backward pass,
  # 71 of the 551 crossed in bfloat16
  assert wire["bf16"] == _param_elements(_bn_state().params) - 6, wire
  state, metrics = step(state, batch)
  assert np.isfinite(float(metrics["loss"]))


@pytest.mark.timeout(240)
def test_a_metric_shaped_like_a_parameter_stays_float32():
  """A per-class count beside a bias of the same shape is a forward sum: exact, not rounded to bfloat16."""
  def step_fn(params, batch):
    loss, grads = jax.value_and_grad(lambda p: _mlp_loss(p, batch))(params)
    logits = jnp.tanh(batch["x"] @ params["w1"] + params["b1"]) @ params["w2"]
    per_class = jnp.zeros(4).at[jnp.argmax(logits, -1)].add(1.0)  # shape (4,), like b2
    new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    return {**new, "b2": params["b2"]}, {"loss": loss, "per_class": per_class}

  counts, microbatch = (80, 80, 40, 40, 40, 40, 40, 40), 4  # 1600 examples: counts above bfloat16's 256
  batch_size = sum(counts) * microbatch
  rs = np.random.RandomState(0)
  batch = {"x": rs.randn(batch_size, 12).astype(np.float32), "y": rs.randn(batch_size, 4).astype(np.float32)}
  params = {**_mlp_params(), "b2": jnp.zeros(4)}  # a leaf of the metric's shape
  cluster = _cluster()
  plan = hs.plan_for(cluster, params, global_batch=batch_size, microbatch=microbatch, counts=counts,
                     grad_reduce_dtype="bfloat16")
  step = hs.parallelize(step_fn, cluster=cluster, plan=plan, global_batch=batch_size)
  _, expected = jax.jit(step_fn)(params, batch)
  _, metrics = step(step.shard_state({**_mlp_params(), "b2": jnp.zeros(4)}), batch)
  np.testing.assert_array_equal(np.asarray(metrics["per_class"]), np.asarray(expected["per_class"]))
  assert float(np.max(np.asarray(expected["per_class"]))) > 256


def _mlp_loss(p, batch):
  h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)


def test_plan_rejects_an_unknown_reduce_dtype():
  cluster = _cluster()
  with pytest.raises(hs.InvalidValueError, match="grad_reduce_dtype must be one of"):
    hs.plan_for(cluster, _mlp_params(), global_batch=16, grad_reduce_dtype="int8")
  with pytest.raises(hs.InvalidValueError, match="float16 has too little range"):
    hs.plan_for(cluster, _mlp_params(), global_batch=16, grad_reduce_dtype="float16")
  with pytest.raises(hs.InvalidValueError, match="needs plan='search'"):
    hs.parallelize(_mlp_step, cluster=cluster, global_batch=16, grad_reduce_dtype="search")
  plan = hs.plan_for(cluster, _mlp_params(), global_batch=16)
  with pytest.raises(hs.InvalidValueError, match="a given plan carries its own"):
    hs.parallelize(_mlp_step, cluster=cluster, plan=plan, global_batch=16, grad_reduce_dtype="bfloat16")
  with pytest.raises(hs.InvalidValueError, match="needs a data-only mesh"):
    hs.plan_for(cluster, _mlp_params(), global_batch=16, layout=(4, 2), grad_reduce_dtype="bfloat16")


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
  with pytest.raises(hs.InvalidValueError, match="'overlap_reduction' must be true or false"):
    hs.Plan.from_json({**plan.to_json(), "overlap_reduction": "false"})


# --- what the search costs ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_profile():
  from hetspmd import models
  from hetspmd.passes.profile import profile_step

  w = models.get("gpt2-tiny")
  return profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))


SLOW_NETWORK = "2x4xV100-32GB+2x4xP100-16GB;inter=1Gbps"


@pytest.mark.parametrize("zero", [0, 1])
def test_reduced_precision_halves_the_gradient_bytes(zero, tiny_profile):
  from hetspmd.planner.data_axis import NO_TENSOR_PARALLEL, _host_counts, gather_seconds
  from hetspmd.planner.pricing import evaluate

  cluster = hs.Cluster.parse(SLOW_NETWORK)
  positions = tuple(range(16))
  args, kw = (cluster, tiny_profile, positions, 2, zero, "none"), dict(global_batch=64, counts_rule=(2,) * 16, name="x")
  full, half = evaluate(*args, **kw), evaluate(*args, **kw, reduce_dtype="bfloat16")
  hosts = _host_counts(cluster, positions)
  gather = gather_seconds(cluster, hosts, tiny_profile, NO_TENSOR_PARALLEL) if zero else 0.0
  # bandwidth-bound over a 1 Gbps link: the gradients' time halves; latencies, the loss's float32 sum and
  # ZeRO's parameter gather do not change
  ratio = (half.comm_seconds - gather) / (full.comm_seconds - gather)
  assert 0.5 <= ratio < 0.55  # ZeRO-1 reduce-scatters each of the 28 leaves on its own: 28 latencies
  assert half.compute_seconds == full.compute_seconds and half.grad_reduce_dtype == "bfloat16"


def test_one_bucket_cannot_overlap(tiny_profile):
  from hetspmd.planner.pricing import evaluate

  # GPT-tiny's gradients are all small leaves, reduced as one bucket once every one is ready
  cluster = hs.Cluster.parse(SLOW_NETWORK)
  e = evaluate(cluster, tiny_profile, tuple(range(16)), 2, 0, "none", global_batch=64, counts_rule=(3,) * 8 + (1,) * 8, name="x", overlap=True)
  assert not e.overlap and e.hidden_seconds == 0  # so the plan keeps its loop whole


def test_overlap_hides_at_most_the_last_backward_pass():
  from hetspmd import models
  from hetspmd.planner.pricing import OVERLAP_EFFICIENCY, evaluate
  from hetspmd.passes.profile import profile_step

  w = models.get("gpt2-small")
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2, 64))
  cluster = hs.Cluster.parse(SLOW_NETWORK)
  positions = tuple(range(16))
  args, kw = (cluster, profile, positions, 2, 0, "none"), dict(global_batch=64, counts_rule=(3,) * 8 + (1,) * 8, name="x")
  plain, overlapped = evaluate(*args, **kw), evaluate(*args, **kw, overlap=True)
  assert plain.hidden_seconds == 0 and not plain.overlap
  assert overlapped.overlap and 0 < overlapped.hidden_seconds < overlapped.comm_seconds
  assert overlapped.comm_seconds == plain.comm_seconds and overlapped.compute_seconds == plain.compute_seconds
  assert overlapped.step_seconds == pytest.approx(plain.step_seconds - overlapped.hidden_seconds)
  one_microbatch = plain.compute_seconds / 3  # the busiest position runs 3 (and a small fixed update)
  assert overlapped.hidden_seconds <= OVERLAP_EFFICIENCY * one_microbatch
  # a position with no microbatch would run one, masked: the search then keeps the loop whole
  idle_kw = dict(kw, counts_rule=(4,) * 8 + (0,) * 8)
  idle = evaluate(*args, **idle_kw, overlap=True)
  assert idle.step_seconds <= evaluate(*args, **idle_kw).step_seconds


@pytest.fixture(scope="module")
def small_profile():
  from hetspmd import models
  from hetspmd.passes.profile import profile_step

  w = models.get("gpt2-small")
  return w, profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2, 64))


def test_search_fuses_the_last_pass_where_its_longer_backward_hides_more(small_profile):
  from hetspmd.planner.pricing import OVERLAP_EFFICIENCY, evaluate
  from hetspmd.planner.building import plan_from
  from hetspmd.planner.ranking import search

  w, profile = small_profile
  cluster = hs.Cluster.parse("2x4xV100-32GB+2x4xP100-16GB;inter=40Gbps")
  result = search(cluster, profile, 1024)
  best, k = result.plans[0], result.plans[0].overlap_microbatches
  assert best.overlap and k > 1 and min(best.counts) >= k and sum(best.counts) * best.microbatch == 1024
  assert len(set(best.counts)) > 1  # the loop's microbatches weight V100s against P100s
  # the same counts with a last pass of one microbatch: less hidden, a slower step
  one = evaluate(cluster, profile, best.device_positions, best.microbatch, best.zero_stage, best.remat, global_batch=1024,
                 counts_rule=best.counts, name="x", overlap=True)
  assert one.overlap_microbatches == 1 and one.hidden_seconds < best.hidden_seconds
  assert best.step_seconds < one.step_seconds and best.step_seconds < result.baselines["dp_even"].step_seconds
  # what hides is at most the efficiency times the busiest position's fused pass (its k * microbatch examples)
  fused_pass = evaluate(cluster, profile, best.device_positions, k * best.microbatch, best.zero_stage, best.remat,
                        global_batch=k * best.microbatch * len(best.counts), counts_rule=(1,) * len(best.counts), name="x")
  assert best.hidden_seconds <= OVERLAP_EFFICIENCY * fused_pass.compute_seconds
  plan = plan_from(best, cluster, w.abstract_state())
  assert plan.overlap_reduction and plan.overlap_microbatches == k
  assert hs.Plan.from_json(plan.to_json()).overlap_microbatches == k


def test_search_takes_reduced_precision_only_when_allowed(tiny_profile):
  from hetspmd.planner.ranking import search

  cluster = hs.Cluster.parse(SLOW_NETWORK)
  exact = search(cluster, tiny_profile, 64)
  either = search(cluster, tiny_profile, 64, grad_reduce_dtypes=("float32", "bfloat16"))
  assert all(p.grad_reduce_dtype == "float32" for p in exact.plans)
  assert all(b.grad_reduce_dtype == "float32" for b in exact.baselines.values())
  assert either.plans[0].grad_reduce_dtype == "bfloat16"
  assert either.plans[0].step_seconds < exact.plans[0].step_seconds
  # baselines are the same search with choices pinned: they may reduce in bfloat16 too
  assert either.baselines["dp_even"].grad_reduce_dtype == "bfloat16"
  with pytest.raises(hs.HetSpmdError, match="grad_reduce_dtypes must name"):
    search(cluster, tiny_profile, 64, grad_reduce_dtypes=("int8",))


def test_search_cli_reports_the_reduction(tmp_path, capsys):
  from hetspmd.cli import main

  plan_path = tmp_path / "plan.json"
  assert main(["search", "--model", "gpt2-small", "--seq", "64", "--cluster", SLOW_NETWORK, "--global-batch", "64",
               "--grad-reduce-dtype", "search", "--out", str(plan_path), "--json"]) == 0
  report = __import__("json").loads(capsys.readouterr().out)
  best = report["plans"][0]
  assert best["grad_reduce_dtype"] == "bfloat16" and best["overlap_reduction"]
  assert 0 < best["hidden_communication_seconds"] < best["communication_seconds"]
  plan = hs.Plan.load(plan_path)
  assert plan.grad_reduce_dtype == "bfloat16" and plan.overlap_reduction
  assert main(["explain", str(plan_path)]) == 0
  text = capsys.readouterr().out
  assert "gradients reduced over data in bfloat16" in text and "overlapped" in text and "hidden" in text
  assert main(["search", "--model", "gpt2-tiny", "--cluster", SLOW_NETWORK, "--global-batch", "64",
               "--no-overlap", "--json"]) == 0
  assert not __import__("json").loads(capsys.readouterr().out)["plans"][0]["overlap_reduction"]


def test_zoo_models_take_a_compute_dtype():
  from hetspmd import models

  w = models.get("gpt2-tiny").with_dtype("bfloat16")
  assert w.config.dtype == "bfloat16" and w.name == "gpt2-tiny-bfloat16"
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(w.abstract_state()["params"]))  # master weights
  with pytest.raises(hs.InvalidValueError, match="computes in float32 only"):
    models.get("mlp-tiny").with_dtype("float16")


WIDTH = 512


def _wide_params():  # w1 is 2 MiB: a bucket of its own, whose reduction can overlap the rest of the backward pass
  k = jax.random.split(jax.random.key(3), 2)
  return {"w1": jax.random.normal(k[0], (WIDTH, 1024)) * 0.05, "b1": jnp.zeros(1024),
          "w2": jax.random.normal(k[1], (1024, 4)) * 0.05}


def _wide_batches(batch_size):
  rs = np.random.RandomState(1)
  return [{"x": rs.randn(batch_size, WIDTH).astype(np.float32), "y": rs.randn(batch_size, 4).astype(np.float32)}
          for _ in range(3)]


def _slow_pair_cluster():
  """Two slow kinds, one twice the other; every device a host of its own, so no model axis."""
  require_devices(8)
  slow = {k: hs.DeviceSpec(k, flops, flops, 2**30, 1e10) for k, flops in (("SlowA", 2e9), ("SlowB", 1e9))}
  return hs.Cluster.emulate(jax.devices()[:8], kinds=["SlowA", "SlowB"] * 4, custom=slow)


@pytest.mark.timeout(240)
def test_searched_plan_with_reduced_precision_trains_like_one_device():
  """parallelize(plan="search", grad_reduce_dtype="search"): bfloat16, overlapped, and close to one device."""
  batch_size = 4096
  step = hs.parallelize(_mlp_step, cluster=_slow_pair_cluster(), plan="search", global_batch=batch_size,
                        grad_reduce_dtype="search")
  params, ref = _wide_params(), _wide_params()
  for b in _wide_batches(batch_size):
    params, metrics = step(params, b)
    ref, ref_metrics = jax.jit(_mlp_step)(ref, b)
    # the loss is computed before the step's reduction, from parameters that differ by the earlier steps'
    # rounding (each gradient element within gamma(9) ~ 3.6% of the positions' magnitudes, times lr 0.1)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-2)
  plan = step.plan
  assert plan.data_size > 1 and plan.grad_reduce_dtype == "bfloat16" and plan.overlap_reduction, plan.summary()


@pytest.mark.timeout(300)
def test_searched_plan_fuses_the_overlapped_pass_and_trains_like_one_device():
  """The search runs each position's last microbatches as one batch: weighted counts of small microbatches
  in the loop, a large pass to hide the reduction under, and the single-device numbers."""
  batch_size = 4096
  step = hs.parallelize(_mlp_step, cluster=_slow_pair_cluster(), plan="search", global_batch=batch_size)
  params, ref = _wide_params(), Reference(_mlp_step, _wide_params())
  for i, b in enumerate(_wide_batches(batch_size)):
    params, metrics = step(params, b)
    ref.step(b)
    ref.check_metrics(metrics, i)
  ref.check(params)
  plan, k = step.plan, step.plan.overlap_microbatches
  assert plan.overlap_reduction and k > 1 and min(plan.microbatch_counts) >= k, plan.summary()
  assert len(set(plan.microbatch_counts)) > 1  # the loop still weights the kinds
  assert f"last {k} microbatches, run as one batch of {k * plan.microbatch}" in step.explain()


@pytest.mark.timeout(300)
def test_mixed_precision_model_runs_weighted_and_reduced_in_bfloat16():
  """A zoo transformer computing in bfloat16 with float32 master weights, uneven counts, bfloat16 reduction.

  One device computes each weight gradient as one bfloat16 dot over the whole batch; the plan as bfloat16
  dots over microbatches, accumulated in float32 and reduced in bfloat16. Both round at bfloat16's
  2^-8, so losses agree to a few of its units, and no parameter moves further from the reference than two
  Adam steps can: each moves an element by at most lr (1 - b1) / sqrt(1 - b2) (3.2 lr for optax's
  defaults).
  """
  from hetspmd import models

  w = models.get("gpt2-tiny").with_dtype("bfloat16")
  cluster = _cluster()
  counts, microbatch = (3, 3, 2, 2, 1, 1, 1, 1), 2
  batch_size = sum(counts) * microbatch
  batches = [w.synthetic_batch(seed=i, batch=batch_size) for i in range(3)]
  plan = hs.plan_for(cluster, w.abstract_state(), global_batch=batch_size, microbatch=microbatch, counts=counts,
                     grad_reduce_dtype="bfloat16", overlap_reduction=True)
  step = hs.parallelize(w.make_train_step(), cluster=cluster, plan=plan, global_batch=batch_size)
  state, ref = step.shard_state(w.init_state(0)), w.init_state(0)
  ref_step = jax.jit(w.make_train_step())
  for b in batches:
    state, metrics = step(state, b)
    ref, expected = ref_step(ref, b)
    np.testing.assert_allclose(float(metrics["loss"]), float(expected["loss"]), rtol=4 * 2.0 ** -8)
  lr, bound = 3e-4, 3.2  # the zoo's GPT-2 trains with optax.adam(3e-4)
  for e, a in zip(jax.tree.leaves(ref["params"]), jax.tree.leaves(state["params"])):
    assert a.dtype == jnp.float32
    assert float(np.max(np.abs(np.asarray(e) - np.asarray(a)))) <= 2 * bound * lr * len(batches)


@pytest.mark.timeout(300)
def test_overlapped_and_bfloat16_reductions_in_two_processes():
  """2 processes x 4 CPU devices over gloo: the lm1b-style step overlapped (exact), and reduced in bfloat16."""
  from multiprocess import run_processes

  results = run_processes(lm1b_in_processes((3, 2, 2, 1, 1, 1, 1, 0), 2) + textwrap.dedent("""
      out = {"ref_loss": float(ref_metrics["loss"])}
      for name, options in (("overlap", dict(overlap_reduction=True)),
                            ("bfloat16", dict(overlap_reduction=True, grad_reduce_dtype="bfloat16"))):
        loss, diff, over = train_planned(**options)
        out[name] = {"loss": loss, "diff": diff, "over": over}
      print(json.dumps(out))
  """), num_processes=2, devices_per_process=4, timeout=240)
  for r in results:
    assert r["overlap"]["over"] == {}  # exact: as close to float64 as exactness asks
    np.testing.assert_allclose(r["bfloat16"]["loss"], r["ref_loss"], rtol=1e-2)
    assert r["bfloat16"]["diff"] > 0  # reduced precision does round


@pytest.mark.timeout(300)
def test_fused_overlapped_pass_in_two_processes():
  """2 processes x 4 CPU devices over gloo: the last 2 microbatches of every position run as one batch."""
  from multiprocess import run_processes

  results = run_processes(lm1b_in_processes((4, 4, 3, 3, 2, 2, 2, 2), 2) + textwrap.dedent("""
      loss, diff, over = train_planned(overlap_reduction=True, overlap_microbatches=2)
      print(json.dumps({"over": over}))
  """), num_processes=2, devices_per_process=4, timeout=240)
  for r in results:
    assert r["over"] == {}
