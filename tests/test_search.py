"""The planner: cost model pieces, MILP counts, baselines, errors, CLI."""

import dataclasses
import json
import math

import jax
import numpy as np
import pytest

import hetspmd as hs
from hetspmd import Cluster, models
from hetspmd.cli import main
from hetspmd.planner.data_axis import (NO_TENSOR_PARALLEL, TensorParallel, ZeroSplit, _host_counts, _zero_split,
                               allreduce_seconds, gather_seconds, zero_split)
from hetspmd.hardware.devices import DEVICE_PRESETS
from hetspmd.passes.costing import step_cost as cost
from hetspmd.plan.counts import KindCost
from hetspmd.errors import PlanDoesNotFitError
from hetspmd.planner.ranking import SINGLE_PROGRAM_BASELINES, microbatch_sizes, search
from hetspmd.plan.counts import balanced_counts, divisors, even_counts, prime_factors
from hetspmd.passes.profile import profile_step
from hetspmd.planner.pricing import evaluate
from hetspmd.plan.counts import milp_counts
from hetspmd.planner.building import plan_from


@pytest.fixture(scope="module")
def gpt_profile():
  w = models.get("gpt2-tiny")
  return profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2, 64))


@pytest.fixture(scope="module")
def tiny_profile():
  w = models.get("gpt2-tiny")
  return profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))


def test_peak_live_bytes_of_a_chain():
  graph = hs.trace(lambda x: jnp_chain(x), jax.ShapeDtypeStruct((256,), np.float32))
  # x*2 then +1 then sin: at most two 1 KiB intermediates are alive together
  assert cost.peak_live_bytes(graph) == 2 * 1024


def test_microbatch_peak_counts_one_forward_and_backward():
  # a momentum step: neither the update's new state (donated in place) nor the gradients (added into
  # the step's accumulator as they are made) are a microbatch's activations
  import jax.numpy as jnp

  def step(w, m, x):
    grads = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
    m = 0.9 * m + grads
    return w - 0.1 * m, m

  w, x = jax.ShapeDtypeStruct((64, 64), np.float32), jax.ShapeDtypeStruct((8, 64), np.float32)
  graph = hs.trace(step, w, w, x)
  assert {n.phase for n in graph.nodes} >= {"forward", "backward", ""}
  whole, micro = cost.peak_live_bytes(graph), cost.microbatch_peak_bytes(graph)
  looped = [n.id for n in graph.nodes if n.phase]
  # the gradient goes straight into the accumulator: no room of its own in the microbatch
  assert micro == cost.peak_live_bytes(graph, looped, hand_on=False) < whole
  assert cost.peak_live_bytes(graph, looped) > micro  # counted when handed on
  # a value made before the forward pass and read in it is live through the microbatch
  big = jax.ShapeDtypeStruct((512, 64), np.float32)
  plain = hs.trace(step, w, w, big)
  prepared = hs.trace(lambda w, m, x: step(w, m, jnp.tanh(2.0 * x)), w, w, big)
  assert cost.microbatch_peak_bytes(prepared) == cost.microbatch_peak_bytes(plain) + 512 * 64 * 4
  # a value the microbatch also reads itself (the hidden layer, returned for a metric) takes room while it does
  def step_with_aux(w, m, x):
    loss = lambda w: (jnp.sum(jnp.tanh(x @ w)), x @ w)
    (_, hidden), grads = jax.value_and_grad(loss, has_aux=True)(w)
    return w - 0.1 * grads, m, hidden

  with_aux = hs.trace(step_with_aux, w, w, big)
  assert cost.microbatch_peak_bytes(with_aux) == cost.microbatch_peak_bytes(plain)
  # a run given by hand: the first three nodes only, the later ones reading their outputs
  first = [n.id for n in graph.nodes][:3]
  assert 0 < cost.peak_live_bytes(graph, first) <= sum(t.nbytes for n in graph.nodes[:3] for t in n.outputs)
  # no differentiated part: the whole step is one microbatch
  plain = hs.trace(lambda x: jnp_chain(x), jax.ShapeDtypeStruct((256,), np.float32))
  assert cost.microbatch_peak_bytes(plain) == cost.peak_live_bytes(plain) == 2 * 1024


def jnp_chain(x):
  import jax.numpy as jnp

  return jnp.sin(x * 2.0 + 1.0)


def test_step_profile_splits_per_step_and_per_microbatch_work(gpt_profile):
  v100, p100 = DEVICE_PRESETS["V100-32GB"], DEVICE_PRESETS["P100-16GB"]
  t1, t4 = gpt_profile.microbatch_seconds(v100, 1), gpt_profile.microbatch_seconds(v100, 4)
  assert 0 < t1 < t4 < 4 * t1 + 1e-12  # weights are re-read per microbatch: sub-linear from 1 to 4
  assert gpt_profile.microbatch_seconds(p100, 4) > t4
  assert gpt_profile.step_fixed_seconds(v100) > 0  # the adam update
  assert gpt_profile.param_count == models.get("gpt2-tiny").param_count()
  assert gpt_profile.opt_state_bytes == pytest.approx(2 * gpt_profile.param_bytes, rel=0.01)
  assert gpt_profile.activation.at(8) > gpt_profile.activation.at(1) > 0


@pytest.mark.parametrize("micro,fixed,total,expected", [
    ({"A": 1.0, "B": 2.0}, {"A": 0.0, "B": 0.0}, 9, {"A": 3, "B": 1.5}),     # makespan 3 either way
    ({"A": 1.0, "B": 1.0}, {"A": 0.0, "B": 0.0}, 8, {"A": 2, "B": 2}),
    ({"A": 1.0, "B": 100.0}, {"A": 0.0, "B": 0.0}, 4, {"A": 2, "B": 0}),      # the slow kind gets nothing
])
def test_milp_counts_minimise_the_makespan(micro, fixed, total, expected):
  kinds = ["A", "A", "B", "B"]
  costs = {k: KindCost(micro[k], fixed[k]) for k in micro}
  counts = milp_counts(kinds, costs, total)
  assert sum(counts) == total
  makespan = max(costs[k].fixed + costs[k].micro * c for k, c in zip(kinds, counts))
  brute = min(max(costs[k].fixed + costs[k].micro * c for k, c in zip(kinds, cs))
              for cs in np.ndindex(*(total + 1,) * 4) if sum(cs) == total)
  assert makespan == pytest.approx(brute)


def test_balanced_counts_match_the_milp():
  rng = np.random.default_rng(0)
  for _ in range(200):
    kinds = [f"k{i}" for i in rng.integers(0, 3, size=rng.integers(1, 7))]
    costs = {k: KindCost(float(rng.uniform(0.1, 5)), float(rng.choice([0.0, rng.uniform(0, 3)]))) for k in kinds}
    total = int(rng.integers(1, 30))
    counts = balanced_counts(kinds, costs, total)
    assert sum(counts) == total and min(counts) >= 0
    for kind in set(kinds):
      mine = [c for k, c in zip(kinds, counts) if k == kind]
      assert max(mine) - min(mine) <= 1
    makespan = lambda cs: max(costs[k].fixed + costs[k].micro * c for k, c in zip(kinds, cs))
    assert makespan(counts) == pytest.approx(makespan(milp_counts(kinds, costs, total)), rel=1e-9, abs=1e-12)


def test_even_counts():
  assert even_counts(3, 8) == (3, 3, 2)


@pytest.mark.parametrize("batch", [1, 32, 128, 2048, 4096, 2 * 3 * 5 * 7])
def test_microbatch_sizes_keep_every_divisor_of_a_small_set(batch):
  """2048's 32 is the size at which 64 devices each run one overlapped microbatch: none may be skipped."""
  assert microbatch_sizes(batch) == [d for d in range(1, batch + 1) if batch % d == 0]


@pytest.mark.parametrize("n", [1, 2, 12, 97, 360, 720720, 2 ** 20, 999_983 * 2])
def test_divisors_match_trial_division(n):
  assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.timeout(10)
def test_divisors_of_huge_numbers_without_a_loop_to_them():
  """A global batch of 10**9 (100 divisors), a large prime and large composites: factored, not counted to."""
  assert len(divisors(10 ** 9)) == 100 and divisors(10 ** 9)[:6] == [1, 2, 4, 5, 8, 10]
  assert prime_factors(10 ** 9) == {2: 9, 5: 9}
  for prime in (1_000_000_007, 2 ** 61 - 1):
    assert divisors(prime) == [1, prime] and prime_factors(prime) == {prime: 1}
  composite = 1_000_000_007 * 998_244_353  # two primes near 10**9: no factor below 10**9
  assert divisors(composite) == [1, 998_244_353, 1_000_000_007, composite]
  assert divisors(2 ** 64) == [2 ** e for e in range(65)]
  assert divisors(2 ** 10 * 3 ** 5 * 7 ** 2 * 1_000_003) == sorted(
      2 ** a * 3 ** b * 7 ** c * 1_000_003 ** d for a in range(11) for b in range(6) for c in range(3) for d in (0, 1))
  with pytest.raises(hs.errors.InvalidValueError):
    divisors(0)


@pytest.mark.timeout(30)
def test_microbatch_sizes_of_a_batch_of_a_billion_are_quick():
  import time

  start = time.perf_counter()
  sizes = microbatch_sizes(10 ** 9)
  assert time.perf_counter() - start < 0.5
  assert len(sizes) == 16 and sizes[0] == 1 and sizes[-1] == 10 ** 9 and all(10 ** 9 % d == 0 for d in sizes)


@pytest.mark.parametrize("batch", [720720, 1680, 5040])
def test_microbatch_sizes_of_a_composite_batch_spread_evenly_in_log_size(batch):
  sizes = microbatch_sizes(batch)
  assert len(sizes) == 16 and sizes[0] == 1 and sizes[-1] == batch
  assert all(batch % d == 0 for d in sizes) and sizes == sorted(set(sizes))
  step = math.log(batch) / 15
  assert max(np.diff(np.log(sizes))) < 2.5 * step  # no gap far wider than the even spacing


def test_allreduce_is_bounded_by_the_slowest_link():
  fast = Cluster.parse("2x8xA100-80GB;inter=400Gbps")
  slow = Cluster.parse("2x8xA100-80GB;inter=10Gbps")
  one_host = list(range(8))
  both = list(range(16))
  nbytes = 1e9
  assert allreduce_seconds(fast, one_host, nbytes) == allreduce_seconds(slow, one_host, nbytes)
  assert allreduce_seconds(slow, both, nbytes) > 10 * allreduce_seconds(fast, both, nbytes) / 2
  assert allreduce_seconds(fast, [0], nbytes) == 0.0
  lopsided = Cluster.parse("1x1xV100-32GB+1x8xV100-32GB")
  balanced = Cluster.parse("1x1xV100-32GB+1x1xV100-32GB")
  assert allreduce_seconds(lopsided, list(range(9)), nbytes) > allreduce_seconds(balanced, [0, 1], nbytes)


@pytest.mark.parametrize("preset", ["amp-t4-v100", "t4-heavy-v100", "a100-v100-mix", "h100-a100-l4-mix", "v100x16"])
def test_best_plan_never_loses_to_a_baseline(gpt_profile, preset):
  result = search(Cluster.preset(preset), gpt_profile, global_batch=64)
  best = result.plans[0]
  assert set(result.baselines) - {"fsdp"} == set(SINGLE_PROGRAM_BASELINES)
  for name, baseline in result.baselines.items():
    if name in SINGLE_PROGRAM_BASELINES:  # fsdp is no single program: the ranked plans may fall below it
      assert best.step_seconds <= baseline.step_seconds * (1 + 1e-9), name
  assert 0 < best.throughput <= result.ideal_throughput * (1 + 1e-9)
  assert sum(best.counts) * best.microbatch == 64


def test_homogeneous_cluster_matches_best_uniform_plan(gpt_profile):
  result = search(Cluster.preset("v100x16"), gpt_profile, global_batch=64)
  assert result.plans[0].step_seconds == pytest.approx(result.baselines["dp_even"].step_seconds, rel=1e-9) or \
      result.plans[0].step_seconds < result.baselines["dp_even"].step_seconds


def test_slow_network_can_leave_slow_devices_out(gpt_profile):
  cluster = Cluster.parse("1x8xH100-80GB+1x8xT4;inter=100Mbps")
  best = search(cluster, gpt_profile, global_batch=64).plans[0]
  assert set(best.kinds) == {"H100-80GB"}


def test_nothing_fits_names_the_device_and_the_way_out(gpt_profile):
  small = hs.DeviceSpec("Small", 1e12, 2e12, 2**20, 1e11)
  with pytest.raises(PlanDoesNotFitError, match=r"on a Small with 0.00 GiB, .* too much.*more devices.*ZeRO splits the optimizer state"):
    search(Cluster.parse("2xSmall", devices={"Small": small}), gpt_profile, global_batch=8)


def test_plan_from_a_search_runs(tmp_path):
  w = models.get("mlp-tiny")
  cluster = Cluster.emulate(jax.devices()[:8], kinds=["V100-32GB"] * 4 + ["P100-16GB"] * 4)
  result = hs.search(w.make_train_step(hs.value_and_grad), w.abstract_state(), w.example_batch(4), cluster,
                     global_batch=32)
  plan = plan_from(result.plans[0], cluster, w.abstract_state(), result.ideal_throughput)
  assert dict(plan.predicted)["step_seconds"] == pytest.approx(result.plans[0].step_seconds)
  step = hs.parallelize(w.make_train_step(hs.value_and_grad), plan=plan, global_batch=32)
  state = step.shard_state(w.init_state(0))
  state, metrics = step(state, w.synthetic_batch(0, batch=32))
  assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("room", ["none", "all_dots", "dots"])
def test_remat_is_chosen_only_where_it_makes_room_and_never_full(gpt_profile, room):
  # devices with just the memory of one policy at microbatch 1 (ZeRO-1 over 2 positions): that policy is
  # among the plans; "full" (the whole loss checkpointed) lowers no peak, so it is never a way out
  from hetspmd.planner.data_axis import memory_per_device

  need = memory_per_device(gpt_profile, 2, 1, 1, room)
  device = hs.DeviceSpec("Room", 1e12, 2e12, need, 1e11)
  cluster = Cluster.parse("2xRoom", devices={"Room": device})
  plans = search(cluster, gpt_profile, global_batch=8, top=50).plans
  assert plans and all(p.remat != "full" for p in plans)
  assert room in {p.remat for p in plans}
  with pytest.raises(PlanDoesNotFitError):
    search(Cluster.parse("2xRoom", devices={"Room": dataclasses.replace(device, memory_bytes=need // 2)}),
           gpt_profile, global_batch=8)


def test_search_cli_json(capsys, tmp_path):
  out = tmp_path / "plan.json"
  assert main(["search", "--model", "gpt2-tiny", "--cluster", "amp-t4-v100", "--global-batch", "32", "--seq", "64",
               "--json", "--out", str(out)]) == 0
  report = json.loads(capsys.readouterr().out)
  for key in ("plans", "baselines", "ideal_throughput", "search_seconds"):
    assert key in report
  for plan in report["plans"]:
    for key in ("throughput", "predicted_step_seconds", "efficiency", "mesh", "microbatch_counts", "memory_bytes"):
      assert key in plan
  assert set(report["baselines"]) - {"fsdp"} == set(SINGLE_PROGRAM_BASELINES)
  assert all("throughput" in b for b in report["baselines"].values())
  best, same = report["plans"][0], report["homogeneous_equivalent"]
  assert report["throughput_vs_homogeneous"] == pytest.approx(best["throughput"] / same["throughput"], rel=1e-9)
  own = report["homogeneous_ideal_throughput"]  # the equivalent's own ideal: its mean devices' throughputs added
  assert own > 0
  assert report["heterogeneity_tax"] == pytest.approx(
      1 - (best["throughput"] / report["ideal_throughput"]) / (same["throughput"] / own), rel=1e-9)
  assert all(best["throughput"] >= b["throughput"] * (1 - 1e-12) for name, b in report["baselines"].items()
             if name in SINGLE_PROGRAM_BASELINES)
  assert hs.Plan.load(out).global_batch == 32
  assert main(["explain", str(out)]) == 0
  assert "microbatches" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["search", "--cluster", "nope"], "malformed cluster spec|unknown device kind"),
    (["search", "--model", "gpt5"], "unknown model 'gpt5'"),
])
def test_search_cli_errors(capsys, argv, message):
  assert main(argv) == 2
  import re

  assert re.search(message, capsys.readouterr().err)


# --- tensor parallelism in the search ---------------------------------------------------

SLOW_KINDS = {"SlowA": hs.DeviceSpec("SlowA", 2e9, 2e9, 2**30, 2e9),
              "SlowB": hs.DeviceSpec("SlowB", 1e9, 1e9, 2**30, 1e9)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["mlp-tiny", "gpt2-tiny"])
def test_tensor_parallel_plan_from_the_search_matches_single_device(name):
  """A (4, 2) plan with split weights, searched for slow emulated devices (compute-bound, so splitting pays)."""
  import dataclasses

  import optax

  from conftest import require_devices

  require_devices(8)
  w = dataclasses.replace(models.get(name), make_optimizer=lambda: optax.adam(1e-3, eps=1e-4))
  cluster = Cluster.emulate(jax.devices()[:8], kinds=["SlowA"] * 4 + ["SlowB"] * 4, custom=SLOW_KINDS)
  result = search(cluster, profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2)), 16,
                  top=50, models=(2,))
  best = next(p for p in result.plans if len(p.counts) == 4)
  assert best.model == 2 and best.tensor_parallel.model_dims and best.model_comm_seconds > 0
  plan = plan_from(best, cluster, w.abstract_state())
  assert plan.mesh_shape == (4, 2) and any("model" in str(spec) for _, spec in plan.state_specs)
  batches = [w.synthetic_batch(seed=i, batch=16) for i in range(3)]
  from exactness import Reference

  ref = Reference(w.make_train_step(), w.init_state(0)).run(batches)
  step = hs.parallelize(w.make_train_step(hs.value_and_grad), plan=plan, global_batch=16)
  state = step.shard_state(w.init_state(0))
  for i, batch in enumerate(batches):
    state, metrics = step(state, batch)
    ref.check_metrics({"loss": metrics["loss"]}, i)
  ref.check(jax.tree.map(np.asarray, jax.device_get(state)))
  # the planner keeps collective-permutes (and with them lockstep execution) out of the loop
  assert "per-device trip counts" in step.explain() and not step._runner.lockstep


@pytest.fixture(scope="module")
def large_profile():
  w = models.get("gpt2-large")
  return profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2, 256))


def test_large_model_splits_over_model_when_data_parallelism_does_not_fit(large_profile):
  small = {"V100-6GB": hs.DeviceSpec("V100-6GB", 15.7e12, 125e12, 6 * 2**30, 900e9)}
  cluster = Cluster.parse("2x8xV100-6GB;inter=100Gbps", devices=small)
  with pytest.raises(PlanDoesNotFitError):
    search(cluster, large_profile, global_batch=32, models=(1,))
  result = search(cluster, large_profile, global_batch=32)
  best = result.plans[0]
  assert best.model > 1 and max(best.memory_bytes) <= 6 * 2**30
  assert best.tensor_parallel.param_share < 1 and "mlp/c_fc/kernel x36" in best.tensor_parallel.description


def test_large_model_splits_over_model_when_the_batch_is_smaller_than_the_cluster(large_profile):
  cluster = Cluster.parse("1x8xV100-32GB")
  data_only = search(cluster, large_profile, global_batch=4, models=(1,)).plans[0]
  best = search(cluster, large_profile, global_batch=4).plans[0]
  assert sum(1 for c in data_only.counts if c) == 4  # half the devices idle
  assert best.model > 1 and len(best.device_positions) == 8 and all(best.counts)
  assert best.step_seconds < 0.8 * data_only.step_seconds
  assert best.to_json(1.0)["mesh"] == {"data": len(best.counts), "model": best.model}


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_reduce_scatters_gathers_every_parameter_leaf_and_writes_the_gathered_parameters(zero, tiny_profile):
  profile = tiny_profile
  cluster = Cluster.parse("1x8xV100-32GB")
  positions = tuple(range(8))
  plain = evaluate(cluster, profile, positions, 2, 0, "none", global_batch=64, counts_rule=(4,) * 8, name="x")
  sharded = evaluate(cluster, profile, positions, 2, zero, "none", global_batch=64, counts_rule=(4,) * 8, name="x")
  gather = gather_seconds(cluster, _host_counts(cluster, positions), profile, NO_TENSOR_PARALLEL)
  link = cluster.hosts[0].intra
  leaves = len(profile.param_leaf_sizes)
  assert leaves == 28 and zero_split(profile, 8) == ZeroSplit(profile.param_leaf_sizes, 0, (), ())  # all split
  # a ring all-gather: 7/8 of the parameter bytes over the link and 7 latencies, per leaf
  assert gather == pytest.approx(7 / 8 * profile.param_bytes / link.bandwidth + 7 * link.latency * leaves)
  grads = profile.param_count * 4
  ring = lambda nbytes: 2 * 7 / 8 * nbytes / link.bandwidth + 2 * 7 * link.latency  # noqa: E731  one bucket
  # ZeRO-0: one all-reduce bucket (gradients, loss and weight); ZeRO-1/3: the gradients reduce-scattered in
  # one bucket (half a ring), the loss and weight all-reduced on their own
  assert plain.comm_seconds == pytest.approx(ring(grads + 8))
  assert sharded.comm_seconds == pytest.approx(ring(grads) / 2 + ring(8) + gather)
  spec = cluster.spec_of("V100-32GB")
  update = profile.step_fixed_seconds(spec)
  write = profile.param_bytes / spec.write_rate
  assert sharded.compute_seconds - plain.compute_seconds == pytest.approx(update / 8 - update + write)


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_over_positions_that_split_no_leaf_costs_as_zero_0(zero, tiny_profile):
  profile = tiny_profile
  # GPT-tiny has no dimension divisible by 7: ZeRO keeps every leaf whole, so nothing is scattered,
  # gathered or saved (the runtime then all-reduces every gradient, as without ZeRO)
  cluster = Cluster.parse("1x7xV100-32GB")
  positions = tuple(range(7))
  assert zero_split(profile, 7) == ZeroSplit((), 0, (), profile.param_leaf_sizes)
  plain = evaluate(cluster, profile, positions, 2, 0, "none", global_batch=28, counts_rule=(2,) * 7, name="x")
  sharded = evaluate(cluster, profile, positions, 2, zero, "none", global_batch=28, counts_rule=(2,) * 7, name="x")
  assert sharded.comm_seconds == pytest.approx(plain.comm_seconds)
  assert sharded.compute_seconds == pytest.approx(plain.compute_seconds)
  assert sharded.memory_bytes == plain.memory_bytes


def test_zero_split_follows_divisibility():
  shapes = tuple((s, math.prod(s)) for s in ((16, 3), (5, 8), (7,), (12,)))
  assert _zero_split(shapes, 4) == ZeroSplit((48, 40, 12), 0, (), (7,))
  # (12,) does not divide by 8: split over groups of 4 (saving 9 elements; groups of 2 would save 6)
  assert _zero_split(shapes, 8) == ZeroSplit((48, 40), 4, (12,), (7,))
  # over 6: groups of 2 save 44 elements, groups of 3 only 32
  assert _zero_split(shapes, 6) == ZeroSplit((12,), 2, (48, 40), (7,))
  assert _zero_split(shapes, 1) == ZeroSplit((), 0, (), (48, 40, 7, 12))
  assert _zero_split(shapes, 6).kept(6) == pytest.approx((12 / 6 + 88 / 2 + 7) / 107)


def test_zero_split_leaves_the_model_dimension_alone(tiny_profile):
  profile = tiny_profile
  # a matrix with one dimension divisible by 6, split over the model axis along it: ZeRO cannot split it 6 ways
  path, shape, dim = next((p, s, d) for p, s in zip(profile.param_leaf_paths, profile.param_leaf_shapes)
                          if len(s) == 2 for d in range(2) if s[d] % 6 == 0 and s[1 - d] % 6)
  assert path.startswith("params/")
  tp = TensorParallel(m=2, model_dims=((path, dim),))
  plain, split = zero_split(profile, 6), zero_split(profile, 6, tp)
  assert len(split.split) == len(plain.split) - 1
  assert sum(split.split) == sum(plain.split) - math.prod(shape)
  # on each device it holds half its elements, split over groups of 2 (its other dimension is even) or whole
  assert sum(split.grouped) + sum(split.whole) == sum(plain.grouped) + sum(plain.whole) + math.prod(shape) // 2


@pytest.mark.parametrize("n,zero", [(6, 1), (6, 3), (24, 1), (7, 1), (8, 3)])
def test_search_and_plans_choose_the_same_zero_groups(n, zero, tiny_profile):
  from hetspmd.plan.state_layout import zero_shards_for

  profile, w = tiny_profile, models.get("gpt2-tiny")
  assert zero_shards_for(w.abstract_state(), ("data", "model"), (n, 1), zero) == zero_split(profile, n).shards


def test_a_model_with_scanned_layers_is_searched_like_its_unrolled_twin():
  """A stacked parameter's layer dimension is read one layer at a time: no split of it is offered (the search
  once failed on it), and the step costs the FLOPs of every layer."""
  scanned = models.get("gpt2-tiny-scan")
  unrolled = dataclasses.replace(scanned, name="gpt2-tiny-unrolled",
                                 config=dataclasses.replace(scanned.config, scan_layers=False))
  profiles = [profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2, 32))
              for w in (scanned, unrolled)]
  assert profiles[0].param_count == profiles[1].param_count
  assert profiles[0].flops.per_example == pytest.approx(profiles[1].flops.per_example, rel=0.01)
  result = search(Cluster.preset("hap-v100-p100"), profiles[0], 64)
  assert result.plans and result.plans[0].step_seconds > 0


def test_progress_covers_every_phase_of_the_search(tiny_profile):
  """The single program, the homogeneous equivalent and the group plans each report as they go, in that order."""
  cluster = Cluster.parse("1x2xV100-32GB+1x2xP100-16GB")
  lines: list[str] = []
  search(cluster, tiny_profile, 32, progress=lines.append, homogeneous=True, groups=True)
  phases = [("homogeneous equivalent: " if line.startswith("homogeneous equivalent: ") else
             "group plans on " if line.startswith("group plans on ") else "single") for line in lines]
  assert [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p] == [
      "single", "homogeneous equivalent: ", "group plans on "]
  sizes = len(microbatch_sizes(32))
  assert lines[sizes - 1].startswith(f"microbatch 32 ({sizes}/{sizes})")
  assert lines[2 * sizes - 1].startswith(f"homogeneous equivalent: microbatch 32 ({sizes}/{sizes})")
  assert "microbatch combinations" in lines[-1] and lines[-1].split(": ")[1].split()[0].count("/") == 1
  done, total = lines[-1].split(": ")[1].split()[0].split("/")
  assert done == total  # the group phase reports its last combination


@pytest.mark.timeout(120)
def test_cli_progress_goes_to_stderr_through_every_phase(capsys):
  """``hetspmd search`` prints a timed line per step of every phase to stderr (stage plans too, for a step that
  scans its layers on two hosts), and nothing of it under --json, whose stdout is the JSON alone."""
  argv = ["search", "--model", "gpt2-tiny-scan", "--cluster", "1x2xV100-32GB+1x2xP100-16GB", "--global-batch", "16"]
  assert main(argv) == 0
  captured = capsys.readouterr()
  lines = captured.err.splitlines()
  assert all(line.startswith("[") and "s] " in line for line in lines)
  for phase in ("tracing the step", "] microbatch 16 (", "] homogeneous equivalent: microbatch 16 (",
                "] group plans on group programs by kind: ", "] stage plans: 2 stages"):
    assert any(phase in line for line in lines), phase
  assert "microbatch combinations" not in captured.out
  assert main(argv + ["--json"]) == 0
  captured = capsys.readouterr()
  assert captured.err == "" and json.loads(captured.out)["plans"]
