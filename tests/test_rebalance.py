"""Measured balance: the controller (pure), timing a kind's share of the step, and rebalancing a running step.

The controller's cases are generated over positions, kinds and noise; the running step's moves are driven by
scripted measurements (the emulated devices are one CPU, so their own times say nothing about balance), and
every rebalanced run is checked against one device in float64 (tests/exactness.py).
"""

import dataclasses
import json
import textwrap

import jax
import numpy as np
import pytest

import hetspmd as hs
from exactness import Reference
from hetspmd import models
from hetspmd.errors import HetSpmdError, InvalidValueError
from hetspmd.hardware.calibration import Calibration, KindTiming, fit_points
from hetspmd.models.mlp import MLPConfig
from hetspmd.plan.balance import Balance, Rebalance, update
from hetspmd.plan.counts import KindCost, balanced_counts
from hetspmd.runtime.rebalancing import Rebalancer

# (kinds per position, true (seconds per microbatch, per step) per kind, total microbatches)
POOLS = [
    (("a", "b"), {"a": (1.0, 0.5), "b": (2.0, 0.5)}, 32),
    (("a", "a", "b", "b", "c"), {"a": (1.0, 0.2), "b": (1.7, 0.3), "c": (3.1, 0.1)}, 32),
    (("a", "b"), {"a": (1.0, 0.05), "b": (1.6, 0.05)}, 32),
    (("a", "b", "b"), {"a": (0.4, 0.0), "b": (1.0, 0.2)}, 48),
]


def _noisy(true, rng, noise=0.1):
  return {k: (m * rng.uniform(1 - noise, 1 + noise), f * rng.uniform(1 - noise, 1 + noise))
          for k, (m, f) in true.items()}


def _balanced(kinds, true, total):
  return balanced_counts(list(kinds), {k: KindCost(*v) for k, v in true.items()}, total)


def _truth(kinds, true, counts):
  return Balance(counts, kinds, tuple((k, *v, 0.0) for k, v in true.items()))


@pytest.mark.parametrize("kinds,true,total", POOLS)
def test_noise_does_not_oscillate(kinds, true, total):
  """From the balanced counts, 200 measurements with independent +-10% noise on every time: at most two moves,
  and every split held is within 5% of the balanced step by the true times (where two splits tie, noise may
  pick the other one)."""
  start = _balanced(kinds, true, total)
  truth = _truth(kinds, true, start)
  for seed in range(10):
    rng, balance, moves = np.random.default_rng(seed), Balance(start, kinds), 0
    for _ in range(200):
      before = balance.counts
      balance = update(balance, _noisy(true, rng), Rebalance())
      moves += balance.counts != before
      assert truth.seconds(start) / truth.seconds(balance.counts) >= 0.95, (seed, balance.counts)
    assert moves <= 2, f"seed {seed}: {moves} moves"


@pytest.mark.parametrize("kinds,true,total", POOLS)
def test_wrong_counts_move_to_balance(kinds, true, total):
  """From even counts, a noisy pool reaches within 5% of the balanced step time after ``confirm`` measurements,
  and stays there."""
  even = tuple(np.diff(np.linspace(0, total, len(kinds) + 1).round().astype(int)).tolist())
  best = _balanced(kinds, true, total)
  truth = _truth(kinds, true, best)
  rng, balance = np.random.default_rng(0), Balance(even, kinds)
  history = []
  for _ in range(12):
    balance = update(balance, _noisy(true, rng), Rebalance())
    history.append(truth.seconds(best) / truth.seconds(balance.counts))
  assert min(history[Rebalance().confirm - 1:]) >= 0.95, history
  if truth.seconds(best) / truth.seconds(even) < 0.95:
    assert history[0] == truth.seconds(best) / truth.seconds(even), "one measurement must not move the counts"


@pytest.mark.parametrize("kinds,true,total", POOLS)
def test_drift_is_followed(kinds, true, total):
  """One kind slows by 1.8x: within 8 noisy measurements the counts are within 5% of the new balance."""
  slow = kinds[-1]
  drifted = {k: (m * 1.8, f) if k == slow else (m, f) for k, (m, f) in true.items()}
  best = _balanced(kinds, drifted, total)
  truth = _truth(kinds, drifted, best)
  rng = np.random.default_rng(1)
  balance = _truth(kinds, true, _balanced(kinds, true, total))
  reached = None
  for i in range(12):
    balance = update(balance, _noisy(drifted, rng), Rebalance())
    if reached is None and truth.seconds(best) / truth.seconds(balance.counts) >= 0.95:
      reached = i + 1
  assert reached is not None and reached <= 8, reached


def test_a_change_that_begins_between_measurements_is_not_averaged_with_the_old_speeds():
  """Two measurements in a row find [21, 11] off balance, the first while the slow kind was still slow (it
  proposes [22, 10]), the second after it sped up ([16, 16]): the move follows the second, not their mean."""
  balance = Balance((21, 11), ("a", "b"))
  option = Rebalance(confirm=2, threshold=0.05)
  balance = update(balance, {"a": (1.0, 0.0), "b": (2.2, 0.0)}, option)
  assert balance.counts == (21, 11) and balance.proposal == (22, 10)
  balance = update(balance, {"a": (1.0, 0.0), "b": (1.0, 0.0)}, option)
  assert balance.counts == (16, 16)


def test_the_decision_is_a_function_of_the_measurements():
  kinds, true, total = POOLS[1]
  runs = []
  for _ in range(2):
    rng, balance, seen = np.random.default_rng(5), Balance((7, 7, 6, 6, 6), kinds), []
    for _ in range(10):
      balance = update(balance, _noisy(true, rng, 0.3), Rebalance(confirm=1, threshold=0.0))
      seen.append(balance.counts)
    runs.append(seen)
  assert runs[0] == runs[1]
  assert len(set(runs[0])) > 1  # the case moves at all


@pytest.mark.parametrize("field,value", [("every", 0), ("threshold", 1.0), ("smoothing", 0.0), ("confirm", 0),
                                         ("lag", -1), ("every", 1.5), ("measure", "wall")])
def test_rebalance_options_are_checked(field, value):
  with pytest.raises(InvalidValueError, match=f"Rebalance.{field} must be"):
    Rebalance(**{field: value})


def test_a_measurement_needs_every_kind_that_runs_microbatches():
  with pytest.raises(InvalidValueError, match=r"\['b'\] missing"):
    update(Balance((1, 1), ("a", "b")), {"a": (1.0, 0.0)}, Rebalance())
  # a kind that runs none is never timed: the others balance among themselves, and it keeps none
  option = Rebalance(every=1, confirm=1, smoothing=1.0)
  idle = Balance((6, 2, 0), ("a", "b", "c"))
  after = update(idle, {"a": (1.0, 0.0), "b": (1.0, 0.0)}, option)
  assert after.counts == (4, 4, 0) and after.idle() == {"c"}
  # timed anyway (a single program times idle kinds on a device), it may get work
  assert update(idle, {"a": (1.0, 0.0), "b": (1.0, 0.0), "c": (1.0, 0.0)}, option).counts[2] > 0
  # measurements over different kinds do not agree with each other (nor average together)
  two = Rebalance(every=1, confirm=2, smoothing=1.0)
  first = update(idle, {"a": (1.0, 0.0), "b": (1.0, 0.0), "c": (1.0, 0.0)}, two)
  second = update(first, {"a": (1.0, 0.0), "b": (1.0, 0.0)}, two)
  assert first.agreed == 1 and second.agreed == 1 and second.counts == idle.counts
  assert update(second, {"a": (1.0, 0.0), "b": (1.0, 0.0)}, two).counts == (4, 4, 0)
  # every kind idle (a tail runs the whole batch): nothing to balance
  assert update(Balance((0, 0), ("a", "b")), {}, option).counts == (0, 0)


# --- calibration values ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("a,b,fixed", [(0.0, 1e-3, 0.01), (2e-3, 5e-4, 0.0), (1e-4, 1e-5, 0.2)])
def test_fit_points_recovers_a_line(a, b, fixed):
  runs = [(m, c, fixed + c * (a + b * m)) for m in (8, 32) for c in (1, 3)]
  points, got_fixed = fit_points(runs)
  timing = KindTiming("k", points, got_fixed)
  assert got_fixed == pytest.approx(fixed, abs=1e-12)
  assert timing.line() == pytest.approx((a, b), rel=1e-9, abs=1e-15)
  assert timing.micro(16) == pytest.approx(a + 16 * b, rel=1e-9)


def test_calibration_round_trips_and_is_checked(tmp_path):
  cal = Calibration("f" * 64, (KindTiming("V100-32GB", ((8, 1e-3), (16, 1.8e-3)), 0.01),))
  cal.save(tmp_path / "c.json")
  assert Calibration.load(tmp_path / "c.json") == cal
  with pytest.raises(InvalidValueError, match="another step"):
    cal.check_step("0" * 64)
  with pytest.raises(InvalidValueError, match="does not have"):
    hs.Cluster.parse("2xA100-80GB").calibrated(cal)
  with pytest.raises(InvalidValueError, match="positive microbatch"):
    KindTiming("k", ((0, 1.0),))


def test_a_calibrated_cluster_prices_compute_as_measured():
  """The search prices a kind's microbatch at its measured seconds, whatever the datasheet says: a pool of two
  kinds measured equally fast splits evenly, and the P100 measured 3x faster takes three quarters."""
  from hetspmd.passes.profile import profile_step
  from hetspmd.planner.ranking import search

  w = dataclasses.replace(models.get("mlp"), name="m", config=MLPConfig((256, 512, 10)))
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))
  cluster = hs.Cluster.parse("1xA100-80GB+1xP100-16GB")
  fp = "0" * 64
  shares = {}
  for name, times in {"datasheet": None, "equal": (1e-3, 1e-3), "swapped": (3e-3, 1e-3)}.items():
    c = cluster if times is None else cluster.calibrated(Calibration(fp, (
        KindTiming("A100-80GB", ((32, times[0]),), 1e-4), KindTiming("P100-16GB", ((32, times[1]),), 1e-4))))
    best = search(c, profile, 1024, top=1, remat_policies=("none",)).plans[0]
    examples = dict.fromkeys(("A100-80GB", "P100-16GB"), 0)
    for kind, n in zip(best.kinds, best.examples):
      examples[kind] += n
    shares[name] = examples["P100-16GB"] / 1024
  assert shares["datasheet"] < 0.25
  assert shares["equal"] == pytest.approx(0.5, abs=0.04)
  assert shares["swapped"] == pytest.approx(0.75, abs=0.04)


def test_a_kind_timed_under_several_remat_policies_keeps_each():
  none, full = KindTiming("V100-32GB", ((8, 1e-3),), 0.01), KindTiming("V100-32GB", ((8, 1.6e-3),), 0.01, "full")
  dots = KindTiming("V100-32GB", ((8, 1.2e-3),), 0.01, "dots")
  cal = Calibration("f" * 64, (full, none))
  assert cal.of("V100-32GB") == none and cal.of("V100-32GB", "full") == full and cal.of("V100-32GB", "dots") is None
  assert cal.kind_names == ("V100-32GB",) and cal.remats("V100-32GB") == ("full", "none")
  assert Calibration.from_json(json.loads(json.dumps(cal.to_json()))) == cal
  assert Calibration("f" * 64, (full,)).of("V100-32GB") == full  # no timing without remat: the first scales
  merged = cal.merged(Calibration("f" * 64, (dots, dataclasses.replace(full, points=((8, 9.0),)))))
  assert merged.of("V100-32GB", "dots") == dots and merged.of("V100-32GB", "full") == full
  with pytest.raises(InvalidValueError, match="once per remat policy"):
    Calibration("f" * 64, (none, none))


@pytest.mark.parametrize("remat,measured", [("full", 1.7e-3), ("dots", 1.25e-3), ("all_dots", 1.05e-3)])
def test_a_remat_policy_timed_is_priced_from_its_own_times(remat, measured):
  """Where a kind was timed under a remat policy, the search prices its microbatches under it at the measured
  seconds (the step's time moves by the measured difference per microbatch); where it was not, by the
  recomputed operations' modelled share, as before."""
  from hetspmd.passes.profile import profile_step
  from hetspmd.planner.pricing import evaluate

  w = models.get("gpt2-tiny")
  profile = profile_step(w.make_train_step(hs.value_and_grad), w.abstract_state(), w.example_batch(2))
  base = KindTiming("A100-80GB", ((4, 1e-3), (8, 1.8e-3)), 1e-3)
  timed = KindTiming("A100-80GB", ((4, measured), (8, 1.8 * measured)), 1e-3, remat)
  cluster = hs.Cluster.parse("1xA100-80GB")

  def step_seconds(*timings, policy):
    c = cluster.calibrated(Calibration("0" * 64, timings))
    return evaluate(c, profile, (0,), 4, 0, policy, global_batch=16, counts_rule=(4,), name="r").step_seconds

  plain = step_seconds(base, policy="none")
  assert step_seconds(base, timed, policy=remat) - plain == pytest.approx(4 * (measured - 1e-3), rel=1e-6)
  modelled = step_seconds(base, policy=remat)
  assert modelled != pytest.approx(step_seconds(base, timed, policy=remat), rel=1e-3)
  assert step_seconds(base, timed, policy="none") == pytest.approx(plain, rel=1e-9)  # "none" keeps its own


# --- a running step -----------------------------------------------------------------------------------------------


def _workload():
  return dataclasses.replace(models.get("mlp"), name="mlp-rebalance", config=MLPConfig((32, 64, 10)))


def _scripted(times):
  """A Rebalancer.timed that returns the next of ``times`` (``{kind: (micro, fixed)}``) at each measurement."""
  it = iter(times)
  return lambda self, front, args, kwargs: next(it)


SLOW_V100 = {"V100-32GB": (3e-3, 0.0), "P100-16GB": (1e-3, 0.0)}


def _scripted_step(monkeypatch, times, counts, **options):
  """The MLP on an emulated V100 beside a P100 (64 examples, microbatch 4, ``counts``), rebalanced every call on
  the scripted ``times`` (``Rebalance(every=1, smoothing=1.0, measure="device", **options)``)."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  w = _workload()
  cluster = hs.Cluster.emulate(jax.devices()[:2], kinds=["V100-32GB", "P100-16GB"])
  monkeypatch.setattr(Rebalancer, "timed", _scripted(times))
  plan = hs.plan_for(cluster, w.init_state(0), global_batch=64, microbatch=4, counts=counts)
  step = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan=plan, global_batch=64,
                        rebalance=Rebalance(every=1, smoothing=1.0, measure="device", **options))
  return w, cluster, step


def test_rebalanced_steps_stay_exact_and_compile_only_for_new_buffers(monkeypatch):
  """Scripted measurements move the counts [12, 4] -> [4, 12] -> [12, 4] -> [8, 8], each after two measurements
  agree. The first three share one program (the counts are read at run time, the buffers hold 12 microbatches
  each); [8, 8] keeps those buffers, but a uniform loop is another program, so it builds one more. Each step
  matches one device in float64, and the history says what moved."""
  slow_p100 = {"V100-32GB": (1e-3, 1e-4), "P100-16GB": (3e-3, 1e-4)}
  slow_v100 = {"V100-32GB": (3e-3, 1e-4), "P100-16GB": (1e-3, 1e-4)}
  equal = {"V100-32GB": (1e-3, 1e-4), "P100-16GB": (1e-3, 1e-4)}
  w, _, step = _scripted_step(monkeypatch, [slow_v100] * 2 + [slow_p100] * 4 + [equal] * 3, (12, 4), confirm=2)
  batches = [w.synthetic_batch(i, batch=64) for i in range(9)]
  ref = Reference(w.make_train_step(), w.init_state(0))
  state = step.shard_state(w.init_state(0))
  counts = []
  for i, batch in enumerate(batches):
    state, metrics = step(state, batch)
    counts.append(step.plan.microbatch_counts)
    ref.step(batch)
    ref.check_metrics(metrics, i)
  ref.check(state)
  assert counts == [(12, 4), (4, 12), (4, 12), (12, 4), (12, 4), (12, 4), (12, 4), (8, 8), (8, 8)]
  assert step.rebalancer.compiles == 2
  moved = [(h["call"], h["moved_to"], h["applies_at"]) for h in step.history if h["moved_to"]]
  assert moved == [(2, [4, 12], 2), (4, [12, 4], 4), (8, [8, 8], 8)]
  assert "rebalancing: every 1 call(s)" in step.explain() and "-> [12, 4] from call 4" in step.explain()


def test_counts_that_outgrow_the_buffers_get_room_and_the_moves_after_compile_nothing(monkeypatch):
  """From [8, 8] the counts move to [10, 6]: the buffers grow to 13 slots (25% room), one program; [11, 5] and
  [12, 4] then fit them and run that program. Every step matches one device; the saved plan keeps the slots."""
  times = lambda a, b: {"V100-32GB": (a * 1e-3, 0.0), "P100-16GB": (b * 1e-3, 0.0)}
  w, _, step = _scripted_step(monkeypatch, [times(1, 1)] * 2 + [times(6, 10)] * 2 + [times(5, 11)] * 2
                              + [times(4, 12)] * 2, (8, 8), confirm=2)
  ref = Reference(w.make_train_step(), w.init_state(0))
  state = step.shard_state(w.init_state(0))
  seen = []
  for i in range(8):
    batch = w.synthetic_batch(i, batch=64)
    state, metrics = step(state, batch)
    ref.step(batch)
    ref.check_metrics(metrics, i)
    seen.append((step.plan.microbatch_counts, step.plan.max_count, step.rebalancer.compiles))
  ref.check(state)
  assert seen[0] == ((8, 8), 8, 1) and seen[3] == ((10, 6), 13, 2)
  assert seen[5][:2] == ((11, 5), 13) and seen[7] == ((12, 4), 13, 2)
  assert hs.Plan.from_json(step.plan.to_json()).max_count == 13


@pytest.mark.parametrize("before,counts,slots", [
    ((8, 8, 0), (10, 6), 13),    # outgrows 8: the largest count and a quarter more
    ((10, 6, 13), (12, 4), 13),  # fits the buffers of 13: kept
    ((8, 8, 0), (15, 1), 16),    # room never above the whole batch's microbatches
])
def test_slots_for_new_counts(before, counts, slots):
  from hetspmd.runtime.rebalancing import slots_for

  plan = hs.Plan(("data", "model"), (2, 1), (0, 1), 64, 4, before[:2], slots=before[2])
  assert slots_for(plan, counts) == slots


def test_plan_slots_are_checked_and_kept():
  plan = hs.Plan(("data", "model"), (2, 1), (0, 1), 64, 4, (10, 6), slots=13)
  assert plan.max_count == 13 and hs.Plan.from_json(plan.to_json()) == plan
  assert plan.replace(slots=4).max_count == 10  # below the largest count: the largest count
  with pytest.raises(InvalidValueError, match="slots must be a non-negative integer"):
    plan.replace(slots=-1)


def test_a_program_that_orders_per_example_outputs_by_the_counts_is_not_shared():
  """A step returning per-example values (logits) puts them in global order from the counts when traced: new
  counts build their own program, and both orders are right."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  from hetspmd.runtime.single import SingleRunner

  cluster = hs.Cluster.emulate(jax.devices()[:2], kinds=["V100-32GB", "P100-16GB"])

  def step_fn(params, batch):
    logits = batch["x"] @ params
    return params, {"logits": logits, "loss": (logits ** 2).mean()}

  params = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(4, 3)
  batch = {"x": np.arange(64 * 4, dtype=np.float32).reshape(64, 4) / 100}
  outputs = {}
  for counts in ((12, 4), (4, 12)):
    plan = hs.plan_for(cluster, params, global_batch=64, microbatch=4, counts=counts)
    step = hs.parallelize(step_fn, cluster=cluster, plan=plan, global_batch=64)
    outputs[counts] = step(step.shard_state(params), batch)[1]["logits"]
    runner = step._runner
  other = SingleRunner.of(step, plan.replace(microbatch_counts=(12, 4)))
  assert not other.adopt(runner)
  x, w = batch["x"].astype(np.float64), params.astype(np.float64)
  bound = 4 * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(w))  # float32 dots of 4 terms, against float64
  for logits in outputs.values():  # each in the global batch's order
    assert np.all(np.abs(np.asarray(logits, np.float64) - x @ w) <= bound)


def test_a_restart_from_the_saved_plan_resumes_the_balance(monkeypatch, tmp_path):
  """After a move, step.plan is the plan with the counts in force: saved and given to a new parallelize, the
  restarted step runs those counts from its first call."""
  w, cluster, step = _scripted_step(monkeypatch, [SLOW_V100] * 2, (12, 4), confirm=1)
  state = step.shard_state(w.init_state(0))
  state, _ = step(state, w.synthetic_batch(0, batch=64))
  assert step.plan.microbatch_counts == (4, 12)
  step.plan.save(tmp_path / "plan.json")
  again = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan=str(tmp_path / "plan.json"),
                         global_batch=64)
  again(again.shard_state(w.init_state(0)), w.synthetic_batch(0, batch=64))
  assert again.plan.microbatch_counts == (4, 12)


def test_an_orbax_checkpoint_with_the_plan_resumes_the_balance_and_the_training(monkeypatch, tmp_path):
  """The state and step.plan.to_json() saved as one orbax checkpoint (CheckpointManager, a Composite of
  StandardSave and JsonSave); restored, plan=<the JSON object> runs the moved counts from its first call, and the
  restarted run matches one device run straight through."""
  ocp = pytest.importorskip("orbax.checkpoint")
  w, cluster, step = _scripted_step(monkeypatch, [SLOW_V100] * 2, (12, 4), confirm=1)
  batches = [w.synthetic_batch(i, batch=64) for i in range(3)]
  ref = Reference(w.make_train_step(), w.init_state(0))
  state = step.shard_state(w.init_state(0))
  for i, batch in enumerate(batches[:2]):
    state, metrics = step(state, batch)
    ref.step(batch)
    ref.check_metrics(metrics, i)
  assert step.plan.microbatch_counts == (4, 12)
  with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
    manager.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            plan=ocp.args.JsonSave(step.plan.to_json())))
    manager.wait_until_finished()
  with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
    restored = manager.restore(manager.latest_step(), args=ocp.args.Composite(
        state=ocp.args.StandardRestore(jax.tree.map(np.asarray, w.init_state(0))), plan=ocp.args.JsonRestore()))
  again = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan=restored.plan,
                         global_batch=64)
  state, metrics = again(again.shard_state(restored.state), batches[2])
  assert again.plan.microbatch_counts == (4, 12)
  ref.step(batches[2])
  ref.check_metrics(metrics, 2)
  ref.check(state)
  with pytest.raises(hs.InvalidValueError, match="plan is a dict but not a plan's JSON object"):
    hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan={"counts": [4, 12]}, global_batch=64)


def test_lag_tells_the_loader_ahead(monkeypatch, tmp_path):
  """With lag=2 a decision at call 2 runs from call 4; process_examples(ahead=...) and the plan say so, and the
  history is written as JSON lines."""
  w, _, step = _scripted_step(monkeypatch, [SLOW_V100] * 9, (12, 4), confirm=2, lag=2)
  state = step.shard_state(w.init_state(0))
  batch = w.synthetic_batch(0, batch=64)
  seen = []
  for _ in range(5):
    seen.append((step.plan.microbatch_counts, step.rebalancer.counts_at(1)))
    state, _ = step(state, batch)
  # before call 3 (after the decision at call 2): the next call still runs [12, 4], the one after [4, 12]
  assert seen[2] == ((12, 4), (4, 12)) and step.plan.microbatch_counts == (4, 12)
  assert len(step.process_examples()) == 64  # one process: every example, whatever the counts
  step.write_history(tmp_path / "h.jsonl")
  lines = [json.loads(line) for line in (tmp_path / "h.jsonl").read_text().splitlines()]
  assert [line["call"] for line in lines] == [1, 2, 3, 4, 5]
  assert lines[1]["moved_to"] == [4, 12] and lines[1]["applies_at"] == 4


def test_timing_a_kind_measures_and_leaves_nnx_objects_alone():
  """The real measurement: each kind timed on its device gives positive seconds, and timing an NNX step writes
  nothing back (the objects after a rebalanced call equal those after a plain one)."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  import optax
  from flax import nnx

  import nnx_toy
  from nnx_toy import train_step

  make, batch = lambda: nnx_toy.make(optax.sgd(0.1)), nnx_toy.batch()
  cluster = hs.Cluster.emulate(jax.devices()[:2], kinds=["V100-32GB", "P100-16GB"])
  runs = {}
  for name, rebalance in (("plain", None), ("timed", Rebalance(every=1, measure="device"))):
    model, optimizer = make()
    plan = hs.plan_for(cluster, nnx.state((model, optimizer)), global_batch=32, microbatch=4, counts=(4, 4))
    step = hs.parallelize(train_step, cluster=cluster, plan=plan, global_batch=32, rebalance=rebalance)
    step(model, optimizer, batch)
    runs[name] = (jax.device_get(nnx.state(model)), step)
  np.testing.assert_array_equal(*[np.concatenate([np.ravel(x) for x in jax.tree.leaves(runs[n][0])])
                                  for n in ("plain", "timed")])
  (entry,) = runs["timed"][1].history
  assert set(entry["measured"]) == {"V100-32GB", "P100-16GB"}
  assert all(v["microbatch_seconds"] > 0 and v["step_seconds"] >= 0 for v in entry["measured"].values())


def test_loops_timed_inside_the_step(monkeypatch):
  """measure='loop': each position's loop is timed by host callbacks inside the program, with no extra run; the
  first measurement follows the first call, the clocked program stays exact against one device, and the
  measurements the controller gets are each kind's seconds per microbatch."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  w = _workload()
  cluster = hs.Cluster.emulate(jax.devices()[:2], kinds=["V100-32GB", "P100-16GB"])
  timed = []
  monkeypatch.setattr(Rebalancer, "timed", lambda self, *a: timed.append(1) or pytest.fail("timed a device"))
  plan = hs.plan_for(cluster, w.init_state(0), global_batch=64, microbatch=4, counts=(10, 6))
  step = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan=plan, global_batch=64,
                        rebalance=Rebalance(every=2, measure="loop", threshold=0.9))
  ref = Reference(w.make_train_step(), w.init_state(0))
  state = step.shard_state(w.init_state(0))
  for i in range(5):
    batch = w.synthetic_batch(i, batch=64)
    state, metrics = jax.block_until_ready(step(state, batch))
    ref.step(batch)
    ref.check_metrics(metrics, i)
  ref.check(state)
  assert [h["call"] for h in step.history] == [2, 3, 5]  # due at 1 (owed until a loop ran), 3, 5
  for h in step.history:
    assert set(h["measured"]) == {"V100-32GB", "P100-16GB"}
    assert all(v["microbatch_seconds"] > 0 and v["step_seconds"] == 0 for v in h["measured"].values())
  assert not timed


def test_rebalance_refuses_what_it_cannot_move():
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices")
  w = _workload()
  cluster = hs.Cluster.emulate(jax.devices()[:4], kinds=["V100-32GB"] * 4)
  plan = hs.plan_for(cluster, w.init_state(0), global_batch=64, layout=(2, 2), microbatch=4)
  step = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan=plan, global_batch=64,
                        rebalance=True)
  with pytest.raises(HetSpmdError, match="2 devices per position: drop rebalance="):
    step(step.shard_state(w.init_state(0)), w.synthetic_batch(0, batch=64))
  with pytest.raises(InvalidValueError, match="rebalance must be"):
    hs.parallelize(w.make_train_step(), global_batch=64, rebalance="yes")


# --- calibrating before the search -------------------------------------------------------------------------------


def test_calibrate_times_each_kind_and_the_search_uses_it(tmp_path):
  """step.calibrate(...) times every kind of the cluster on its own device at two sizes; the calibration saves,
  loads, and a search given it (parallelize(calibrate=...)) plans on a cluster that carries it, exact against one
  device. calibrate='auto' leaves CPU devices uncalibrated (emulated kinds, or one measured CPU kind)."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  w = _workload()
  cluster = hs.Cluster.emulate(jax.devices()[:2], kinds=["V100-32GB", "P100-16GB"])
  batch = w.synthetic_batch(0, batch=64)
  probe = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan="search", global_batch=64)
  cal = probe.calibrate(w.init_state(0), w.synthetic_batch(0, batch=8))  # any batch size
  assert set(cal.kind_names) == {"V100-32GB", "P100-16GB"}
  assert all(len(t.points) == 3 and all(s > 0 for _, s in t.points) and t.fixed >= 0 for t in cal.kinds)
  assert len(cal.fingerprint) == 64 and probe.calibration is None  # asked for, not kept
  cal.save(tmp_path / "cal.json")
  step = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan="search", global_batch=64,
                        calibrate=str(tmp_path / "cal.json"))
  ref = Reference(w.make_train_step(), w.init_state(0))
  state, metrics = step(w.init_state(0), batch)
  ref.step(batch)
  ref.check_metrics(metrics, 0)
  ref.check(state)
  assert step.calibration == cal
  assert "the search priced compute from:\n    V100-32GB: the step's measured times (3 microbatch size(s)" in (
      step.explain())
  auto = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan="search", global_batch=64)
  auto(w.init_state(0), batch)
  assert auto.calibration is None
  assert "P100-16GB: datasheet peaks at gp100's fitted efficiencies (matrix 0.66" in auto.explain()
  from hetspmd.runtime import calibrating

  assert not calibrating.wanted("auto", hs.Cluster.from_devices(jax.devices()))  # measured, but CPU devices
  assert calibrating.wanted(True, cluster) and not calibrating.wanted(False, cluster)
  with pytest.raises(InvalidValueError, match="calibrate must be"):
    hs.parallelize(w.make_train_step(), global_batch=64, calibrate="sometimes")


def test_calibrate_times_each_remat_policy_asked_for():
  """step.calibrate(..., remats=...) times every kind under each policy, as the plan would run it; the search's
  pricing names the policies timed; an unknown policy is refused before anything runs."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  w = _workload()
  cluster = hs.Cluster.emulate(jax.devices()[:2], kinds=["V100-32GB", "P100-16GB"])
  step = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan="search", global_batch=64)
  cal = step.calibrate(w.init_state(0), w.synthetic_batch(0, batch=8), sizes=(4, 16), remats=("none", "full"))
  assert sorted((t.kind, t.remat) for t in cal.kinds) == [("P100-16GB", "full"), ("P100-16GB", "none"),
                                                          ("V100-32GB", "full"), ("V100-32GB", "none")]
  assert all(len(t.points) == 2 and all(s > 0 for _, s in t.points) for t in cal.kinds)
  assert "remat none, full timed" in "\n".join(cluster.calibrated(cal).pricing())
  with pytest.raises(InvalidValueError, match="remats: one or more of"):
    step.calibrate(w.init_state(0), w.synthetic_batch(0, batch=8), remats=("sometimes",))


def test_the_choices_remat_policy_is_timed_and_the_search_runs_again_on_it(monkeypatch):
  """Where the search chooses a remat policy its calibration did not time, that policy is timed on the call (at
  the sizes timed before) and the search runs again on its own times; the step stays exact. (The search is
  given only the full recomputation to choose, so its choice runs it.)"""
  from hetspmd.runtime import calibrating, searching

  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  monkeypatch.setattr(searching, "SEARCHED_REMAT", ("full",))
  w = _workload()
  cluster = hs.Cluster.emulate(jax.devices()[:2], kinds=["V100-32GB", "P100-16GB"])
  step = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan="search", global_batch=32,
                        calibrate=True, verify=False)
  batch = w.synthetic_batch(0, batch=32)
  ref = Reference(w.make_train_step(), w.init_state(0))
  state, metrics = step(w.init_state(0), batch)
  ref.step(batch)
  ref.check_metrics(metrics, 0)
  ref.check(state)
  assert step.plan.remat == "full"
  assert {(t.kind, t.remat) for t in step.calibration.kinds} == {
      (k, r) for k in ("V100-32GB", "P100-16GB") for r in ("none", "full")}
  assert {m for t in step.calibration.kinds for m, _ in t.points} == set(calibrating.sizes_for(step, cluster))
  assert "remat none, full timed" in step.explain()
  assert calibrating.untimed_remats(step.plan, step.calibration) == ()
  assert calibrating.with_remats(step, step.calibration, step.plan, ((w.init_state(0), batch), {}), cluster) is None
  plain = Calibration(step.calibration.fingerprint, tuple(t for t in step.calibration.kinds if t.remat == "none"))
  given = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan="search", global_batch=32,
                         calibrate=plain, verify=False)
  given(w.init_state(0), batch)
  assert given.plan.remat == "full" and given.calibration == plain  # given, not measured here: kept as given


@pytest.mark.parametrize("donate", [True, False])
def test_a_kind_is_timed_as_the_step_runs_and_the_callers_state_stays(donate):
  """Where the step donates its state, a kind is timed on a program that donates too, fed each call's new state
  (a donated state's program runs slower on CPU than one that keeps it), on a copy: the caller's state, whole on
  the timed device, is never donated and still trains after the timing."""
  from hetspmd.runtime.calibrating import KindTimer

  w = _workload()
  cluster = hs.Cluster.emulate(jax.devices()[:1], kinds=["V100-32GB"])
  front = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan="search", global_batch=16,
                         donate_state=donate)
  state = w.init_state(0)
  timer = KindTimer(front, jax.devices()[0])
  runs = timer.runs((state, w.synthetic_batch(0, batch=8)), {}, [4], counts=(2, 3), repeats=3)
  assert [c for _, c, _ in runs] == [2, 3] and all(s > 0 for _, _, s in runs)
  runner = timer._runners[4, 2]
  lowered = runner.lower((state, w.synthetic_batch(0, batch=8)), {}).as_text()
  assert runner.front.donate_state == donate and ("tf.aliasing_output" in lowered) == donate
  assert not any(x.is_deleted() for x in jax.tree.leaves(state) if isinstance(x, jax.Array))
  # every program was compiled by the first timing, before its timed calls (for the placed copy of the state,
  # and for the state it hands back): a second timing compiles nothing
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda name, seconds, **_: compiles.append(name) if name.endswith("backend_compile_duration") else None)
  timer.runs((state, w.synthetic_batch(0, batch=8)), {}, [4], counts=(2, 3), repeats=3)
  assert not compiles, compiles
  new, _ = w.make_train_step()(state, w.synthetic_batch(1, batch=8))  # the caller's state still trains
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(new))


@pytest.mark.parametrize("batch,devices,sizes", [(64, 2, (1, 8, 32)), (128, 8, (1, 4, 16)), (8, 8, (1,)),
                                                 (48, 4, (1, 3, 12)), (6, 4, (1,))])
def test_calibration_sizes_reach_the_smallest_size_the_search_may_choose(batch, devices, sizes):
  from hetspmd.planner.ranking import microbatch_sizes
  from hetspmd.runtime.calibrating import calibration_sizes

  assert calibration_sizes(batch, devices, microbatch_sizes(batch)) == sizes


@pytest.mark.parametrize("size,expected", [(1, 1.0), (2, 1.5), (4, 2.5), (8, 4.0), (10, 4.75), (16, 7.0),
                                           (32, None)])
def test_a_microbatch_between_timed_sizes_is_interpolated_between_its_neighbours(size, expected):
  """Points at 1, 4 and 16 that no one line fits: between two sizes the line through those two; beyond the
  largest the least-squares line (with its floor)."""
  timing = KindTiming("V100-32GB", ((1, 1.0), (4, 2.5), (16, 7.0)))
  if expected is not None:
    assert timing.micro(size) == pytest.approx(expected)
  else:
    a, b = timing.line()  # no lower than the smallest size's seconds scaled down by size, halved
    assert timing.micro(size) == pytest.approx(max(a + b * size, 1.0 * size / 1 * 0.5))


def test_calibrate_true_measures_before_the_search():
  """calibrate=True on emulated kinds: the first call times both kinds, then searches on the measured cluster."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  w = _workload()
  cluster = hs.Cluster.emulate(jax.devices()[:2], kinds=["V100-32GB", "P100-16GB"])
  step = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan="search", global_batch=64,
                        calibrate=True, example_batch=w.synthetic_batch(0, batch=8))
  step.shard_state(w.init_state(0))  # the plan is made here, from step(state, example_batch)
  assert step.calibration is not None and set(step.calibration.kind_names) == {"V100-32GB", "P100-16GB"}


@pytest.mark.parametrize("calibrate", ["auto", True])
def test_a_step_that_fits_no_one_device_is_searched_uncalibrated_under_auto(monkeypatch, calibrate):
  """Where every timing runs out of memory (the whole state and a microbatch fit no one device of a kind, nor
  does one of its layers, as a very large model on accelerators), calibrate="auto" (here as on accelerators)
  searches on the devices' specs and explain() says why; calibrate=True raises, naming the kind and the size."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  from hetspmd.runtime import calibrating
  from hetspmd.runtime.calibrating import KindTimer
  from hetspmd.runtime.layer_timing import LayerTimer

  def out_of_memory(self, *args, **kwargs):
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17.2GiB.")

  monkeypatch.setattr(KindTimer, "runs", out_of_memory)
  monkeypatch.setattr(LayerTimer, "seconds", out_of_memory)
  monkeypatch.setattr(calibrating, "wanted", lambda option, cluster: option is not False)
  w = _workload()
  cluster = hs.Cluster.emulate(jax.devices()[:2], kinds=["V100-32GB", "P100-16GB"])
  step = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan="search", global_batch=64,
                        calibrate=calibrate, example_batch=w.synthetic_batch(0, batch=8))
  if calibrate is True:
    with pytest.raises(HetSpmdError, match=r"no microbatch size of .* ran .*at microbatch \d+: RESOURCE_EXHAUSTED.*; "
                                           r"nor did one layer of it run alone: no layer of the step ran on"):
      step.shard_state(w.init_state(0))
    return
  state = step.shard_state(w.init_state(0))
  state, _ = step(state, w.synthetic_batch(0, batch=64))
  assert step.calibration is None
  assert "not calibrated (calibrate='auto'): no microbatch size of" in step.explain()
  assert "RESOURCE_EXHAUSTED" in step.explain()
  # planned at the first call (no example_batch): timed once, and explain() still says why
  tries = []
  monkeypatch.setattr(KindTimer, "runs", lambda self, *a, **k: tries.append(1) or out_of_memory(self))
  later = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan="search", global_batch=64,
                         calibrate=calibrate)
  later(w.init_state(0), w.synthetic_batch(0, batch=64))
  assert "RESOURCE_EXHAUSTED" in later.explain() and 0 < len(tries) <= 6  # two kinds at up to three sizes, once


# --- across processes -------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_two_processes_rebalance_alike_and_exactly():
  """2 processes x 1 CPU device over gloo, each position's loop timed inside the step. Each process's reading is
  fixed (process 0's device three times slower) and gathered for real: both processes move [8, 8] to the same
  counts at the same call, one call after the decision; each feeds batch[step.process_examples()], which follows
  the counts; every step matches one device in float64."""
  from multiprocess import group_child, run_processes

  results = run_processes(group_child("test_rebalance") + textwrap.dedent("""
      import hetspmd as hs
      from exactness import assert_exact
      from hetspmd.runtime.rebalancing import LoopClock

      slow = {0: 3e-3, 1: 1e-3}[jax.process_index()]
      LoopClock.per_microbatch = lambda self: {p: slow for p in self.sums}  # this process's position, as read
      w = t._workload()
      cluster = hs.Cluster.emulate(jax.devices(), kinds=["V100-32GB", "P100-16GB"])
      plan = hs.plan_for(cluster, w.init_state(0), global_batch=64, microbatch=4, counts=(8, 8))
      step = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan=plan, global_batch=64,
                            rebalance=hs.Rebalance(every=1, confirm=1, smoothing=1.0, lag=1, measure="loop"))
      batches = [w.synthetic_batch(i, batch=64) for i in range(4)]
      ref = reference(w.make_train_step(), w.init_state(0), batches)
      state = step.shard_state(w.init_state(0))
      counts, fed_sizes = [], []
      for b in batches:
        mine = fed(step, b)
        fed_sizes.append(len(mine["x"]) if "x" in mine else len(jax.tree.leaves(mine)[0]))
        state, metrics = step(state, mine)
        counts.append(list(step.plan.microbatch_counts))
      got = jax.tree.map(local, state)
      try:
        assert_exact(got, ref.single, ref.ref64, what="state")
        exact = "ok"
      except AssertionError as e:
        exact = str(e)[:500]
      print(json.dumps({"counts": counts, "fed": fed_sizes, "exact": exact,
                        "moves": [(h["call"], h["moved_to"], h["applies_at"]) for h in step.history if h["moved_to"]]}))
  """), num_processes=2, devices_per_process=1, timeout=240)
  assert results[0]["counts"] == results[1]["counts"] == [[8, 8], [8, 8], [4, 12], [4, 12]]
  assert results[0]["moves"] == results[1]["moves"] == [[2, [4, 12], 3]]
  assert results[0]["fed"] == [32, 32, 16, 16] and results[1]["fed"] == [32, 32, 48, 48]
  assert results[0]["exact"] == results[1]["exact"] == "ok"


@pytest.mark.parametrize("fits", [True, False])
def test_an_idle_kind_beside_timed_loops_is_timed_on_a_device_once(monkeypatch, fits):
  """measure='loop' with a kind that runs no microbatch (a device the plan leaves out): the running kinds' loops
  are read inside the step, the idle kind is timed on its device once and that time kept while it stays idle;
  where its device cannot hold the step (out of memory) it stays idle, unmeasured. Every step is exact."""
  if jax.device_count() < 3:
    pytest.skip("needs 3 devices")
  from hetspmd.runtime.calibrating import KindTimer

  w = _workload()
  kinds = ["V100-32GB", "P100-16GB", "T4"]
  cluster = hs.Cluster.emulate(jax.devices()[:3], kinds=kinds)
  device_timings = []

  def timing(self, kind, *args, **kwargs):
    device_timings.append(kind)
    if not fits:
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17.2GiB.")
    return KindTiming(kind, ((4, 1.0),), 0.0)  # far slower than any loop here: it stays idle

  monkeypatch.setattr(KindTimer, "timing", timing)
  plan = hs.plan_for(cluster, w.init_state(0), global_batch=64, microbatch=4, counts=(10, 6, 0))
  step = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan=plan, global_batch=64,
                        rebalance=Rebalance(every=1, measure="loop", threshold=0.9))
  ref = Reference(w.make_train_step(), w.init_state(0))
  state = step.shard_state(w.init_state(0))
  for i in range(4):
    batch = w.synthetic_batch(i, batch=64)
    state, metrics = jax.block_until_ready(step(state, batch))
    ref.step(batch)
    ref.check_metrics(metrics, i)
  ref.check(state)
  assert device_timings == ["T4"]  # once, only the idle kind
  assert len(step.history) == 3 and all(h["counts"][2] == 0 for h in step.history)
  for h in step.history:
    assert {"V100-32GB", "P100-16GB"} <= set(h["measured"])
    assert ("T4" in h["measured"]) == fits


def test_a_calibration_of_another_step_is_refused(tmp_path):
  """A saved calibration carries its step's fingerprint: given to the search of another step it is refused, with
  what to do; given to its own step (a batch of another size, another wrapper) it is taken."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  w = _workload()
  cluster = hs.Cluster.emulate(jax.devices()[:2], kinds=["V100-32GB", "P100-16GB"])
  probe = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan="search", global_batch=64)
  cal = probe.calibrate(w.init_state(0), w.synthetic_batch(0, batch=8))
  cal.save(tmp_path / "cal.json")
  other = models.get("gpt2-tiny")
  step = hs.parallelize(other.make_train_step(hs.value_and_grad), cluster=cluster, plan="search", global_batch=16,
                        calibrate=str(tmp_path / "cal.json"))
  with pytest.raises(InvalidValueError, match="the calibration was measured on another step"):
    step(other.init_state(0), other.synthetic_batch(0, batch=16))
  found = hs.search(w.make_train_step(hs.value_and_grad), w.abstract_state(), w.example_batch(64), cluster=cluster,
                    calibration=str(tmp_path / "cal.json"))
  assert found.best is not None
  with pytest.raises(InvalidValueError, match="the calibration was measured on another step"):
    hs.search(other.make_train_step(), other.abstract_state(), other.example_batch(16), cluster=cluster,
              calibration=cal)
