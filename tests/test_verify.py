"""A calibrated search's choice timed whole on its first call (hetspmd.runtime.verifying): kept where it runs
as predicted, its runners-up timed and the fastest measured run where it misses, exact against one device
either way, and nothing of the caller's (state buffers, NNX objects) touched by the timing.

Whether a plan misses is made certain, not left to this machine's speed: the search is given the step's own
calibration scaled 30x too fast (every plan's prediction far below what any run takes) or 900x too slow (a
group plan's several programs add milliseconds of dispatch no calibration sees). Most searches here leave group
plans out, so that their choice is a single program; the group plan's own cases make the search run it."""

import dataclasses
import gc
import re

import jax
import numpy as np
import pytest

import hetspmd as hs
from exactness import Reference
from hetspmd import models
from hetspmd.errors import InvalidValueError
from hetspmd.hardware.calibration import Calibration
from hetspmd.models.mlp import MLPConfig
from hetspmd.runtime import verifying

SCALE = 30.0
SLOW = SCALE ** 2  # a group plan's several programs add milliseconds of dispatch no calibration sees


def _workload():
  return dataclasses.replace(models.get("mlp"), name="mlp-verify", config=MLPConfig((32, 64, 10)))


def _cluster():
  return hs.Cluster.emulate(jax.devices()[:2], kinds=["V100-32GB", "P100-16GB"])


def _scaled(cal: Calibration, factor: float) -> Calibration:
  return Calibration(cal.fingerprint, tuple(dataclasses.replace(
      t, points=tuple((m, s * factor) for m, s in t.points), fixed=t.fixed * factor) for t in cal.kinds))


@pytest.fixture(scope="module")
def calibration():
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  w = _workload()
  probe = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=_cluster(), plan="search", global_batch=64)
  return probe.calibrate(w.init_state(0), w.synthetic_batch(0, batch=8))


def _run(calibration, steps=2, **options):
  """A searched step given ``calibration`` run ``steps`` times beside one device, checked exact; the step."""
  w = _workload()
  step = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=_cluster(), plan="search", global_batch=64,
                        calibrate=calibration, group_plans=False, **options)
  ref = Reference(w.make_train_step(), w.init_state(0))
  state = w.init_state(0)
  for i in range(steps):
    batch = w.synthetic_batch(i, batch=64)
    state, metrics = step(state, batch)
    ref.step(batch)
    ref.check_metrics(metrics, i)
  ref.check(state)
  return step


def test_a_plan_that_misses_its_prediction_is_replaced_by_the_fastest_measured(calibration):
  """Predicted 30x too fast: the choice misses by far more than 25%, so its runners-up are timed too (each
  whole, with its own prediction), the fastest measured runs (its programs built during the timing: the next
  calls compile nothing), and the step is exact."""
  with pytest.warns(UserWarning, match="slower than predicted"):
    step = _run(_scaled(calibration, 1 / SCALE), steps=1)
  v = step.verification
  assert len(v.timed) == verifying.PLANS and v.timed[0].off > verifying.MISS
  assert all(t.measured > 0 and 0 < t.predicted < t.measured for t in v.timed)
  assert len({t.label for t in v.timed}) == len(v.timed)  # distinct plans
  fastest = min(range(len(v.timed)), key=lambda i: v.timed[i].measured)
  assert v.runs == (fastest if v.timed[fastest].measured <= (1 - verifying.MARGIN) * v.timed[0].measured else 0)
  assert verifying.label(step.plan) == v.timed[v.runs].label
  text = step.explain()
  assert "so its runners-up were timed too and the fastest measured runs (a runner-up where 5% faster" in text
  assert text.count("<- runs") == 1 and v.timed[v.runs].label + ": predicted" in text
  compiles = []
  listen = lambda name, seconds, **_: compiles.append(name) if name.endswith("backend_compile_duration") else None
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    w = _workload()
    state = step.shard_state(w.init_state(0))
    jax.block_until_ready(step(state, w.synthetic_batch(1, batch=64)))
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert not compiles, compiles
  assert v.to_json()["timed"][v.runs]["plan"] == v.timed[v.runs].label


def test_a_plan_that_runs_as_predicted_is_kept(calibration):
  """Predicted 900x too slow: the choice runs well within its prediction, so it alone is timed and it runs."""
  step = _run(_scaled(calibration, SLOW))
  v = step.verification
  assert len(v.timed) == 1 and v.runs == 0 and not v.replanned and v.timed[0].off < 0
  assert "verified on the first call: the search's plan ran a step in" in step.explain()
  assert "within the 25% past which its runners-up are timed" in step.explain()


@pytest.mark.parametrize("verify,timed", [(False, False), ("auto", True), (True, True)])
def test_verify_option(calibration, verify, timed):
  """verify=False never times; "auto" and True time where the search is calibrated."""
  step = _run(_scaled(calibration, SLOW), steps=1, verify=verify)
  assert (step.verification is not None) == timed


def test_verify_auto_without_a_calibration_times_nothing_and_true_does():
  """Uncalibrated (CPU devices under calibrate="auto"), "auto" leaves the choice untimed; verify=True times it."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  assert _run("auto", steps=1).verification is None
  with pytest.warns(UserWarning, match="slower than predicted"):  # priced from V100 and P100 datasheets
    assert _run("auto", steps=1, verify=True).verification is not None


@pytest.mark.parametrize("fails", [(1,), (0,)])
def test_a_plan_that_does_not_run_beside_the_copy_is_not_chosen(calibration, monkeypatch, fails):
  """A timed plan that runs out of memory beside the state's copy: a runner-up is skipped (listed as not run);
  the choice itself leaves the step unverified, and it runs as searched."""
  from hetspmd.runtime.single import SingleRunner

  prepared, seen = SingleRunner.prepared, []

  def failing(self, *args, **kwargs):
    seen.append(self.plan)
    if len(seen) - 1 in fails:
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17.2GiB.")
    return prepared(self, *args, **kwargs)

  monkeypatch.setattr(SingleRunner, "prepared", failing)
  with pytest.warns(UserWarning) if fails == (1,) else _no_warning():
    step = _run(_scaled(calibration, 1 / SCALE), steps=1)
  v = step.verification
  if fails == (1,):
    assert len(v.timed) == verifying.PLANS and v.runs != 1 and v.to_json()["timed"][1]["measured_seconds"] is None
    assert "did not run (RESOURCE_EXHAUSTED: Out of memory" in step.explain()
  else:
    assert len(v.timed) == 1 and v.runs == 0 and step.plan == seen[0]
    assert "not verified: the search's plan did not run beside a copy of the state" in step.explain()


def test_a_plan_that_would_not_fit_beside_the_state_is_not_placed(calibration, monkeypatch):
  """Where a device says what it has free (an accelerator; patched here to one byte) and a timed plan needs more
  (its priced peak, a state among it), the plan is neither placed nor run: the choice runs unverified, and its
  error says what it needs and what is free. Where every device has room, nothing is refused."""
  from hetspmd.runtime.single import SingleRunner

  prepared, placed, needed = SingleRunner.prepared, [], []
  monkeypatch.setattr(SingleRunner, "prepared", lambda self, *a, **k: placed.append(1) or prepared(self, *a, **k))
  measure = SingleRunner.needed_bytes
  monkeypatch.setattr(SingleRunner, "needed_bytes", lambda self, *a: needed.append(measure(self, *a)) or needed[-1])
  monkeypatch.setattr(verifying, "free_bytes", lambda device: 1)
  step = _run(_scaled(calibration, 1 / SCALE), steps=1)
  v = step.verification
  assert len(v.timed) == 1 and v.runs == 0 and not placed
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(_workload().init_state(0)))
  assert needed and all(n > state_bytes for devices in needed for n in devices.values())  # a copy, and the new state
  assert re.fullmatch(r"it needs \S+ GiB on device \d, which has 9.31e-10 GiB free beside the state", v.timed[0].error)
  assert "not verified: the search's plan did not run beside a copy of the state" in step.explain()
  monkeypatch.setattr(verifying, "free_bytes", lambda device: 2**40)
  with pytest.warns(UserWarning, match="slower than predicted"):  # priced 30x too fast: every plan misses
    roomy = _run(_scaled(calibration, 1 / SCALE), steps=1).verification
  assert placed and not any(t.error for t in roomy.timed)


def test_a_donating_plan_is_timed_on_one_placed_copy_of_the_state(calibration):
  """A step that donates its state is timed on one copy placed as the plan places it (never the caller's
  buffers), not on a placed state and a copy of it besides: the verification holds the one state the plan's
  priced peak counts."""
  w = _workload()
  step = _run(calibration, steps=1)
  runner, state = step._runner, w.init_state(0)
  shape = max((x.shape for x in jax.tree.leaves(state)), key=np.prod)
  count = lambda: sum(1 for x in jax.live_arrays() if x.shape == shape)
  per_state = sum(1 for x in jax.tree.leaves(state) if x.shape == shape)
  before = count()
  run = runner.prepared((state, w.synthetic_batch(0, batch=64)), {})
  assert count() - before == per_state
  run()
  assert count() - before == per_state  # the donated copy replaced by the state it made
  del run
  gc.collect()
  assert count() == before


def _no_warning():
  import contextlib
  import warnings

  @contextlib.contextmanager
  def none():
    with warnings.catch_warnings():
      warnings.filterwarnings("error", message="the plan runs a step")
      yield

  return none()


def test_a_plan_made_at_shard_state_is_timed_on_the_example_batch(calibration):
  """step.shard_state(state) before any call (a step(state, batch) with example_batch= of 8 examples): the
  choice is timed on the state and the example batch repeated to the global batch, the caller's state is left
  whole, and the step then trains exactly."""
  w = _workload()
  step = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=_cluster(), plan="search", global_batch=64,
                        calibrate=_scaled(calibration, SLOW), group_plans=False,
                        example_batch=w.synthetic_batch(0, batch=8))
  given = jax.device_put(w.init_state(0), jax.devices()[0])
  values = jax.device_get(given)
  state = step.shard_state(given)
  assert step.verification is not None and len(step.verification.timed) == 1
  assert step.verification.on == "example_batch repeated to the global batch"
  assert "verified on example_batch repeated to the global batch" in step.explain()
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(given), values)  # read, never donated or written
  ids = {id(x) for x in jax.tree.leaves(given)}
  del given
  gc.collect()
  assert not ids & {id(x) for x in jax.live_arrays()}  # the timed programs kept none of its arrays alive
  ref = Reference(w.make_train_step(), w.init_state(0))
  batch = w.synthetic_batch(1, batch=64)
  state, metrics = step(state, batch)
  ref.step(batch)
  ref.check_metrics(metrics, 0)
  ref.check(state)


def test_under_rebalancing_only_runners_up_it_can_move_are_timed(calibration, monkeypatch):
  """With rebalance=, a runner-up with a model axis (which rebalancing refuses) is never timed, so never run."""
  from hetspmd.runtime import searching

  import types

  searched_plan = searching.searched_plan

  def with_model_axis(*args, **kwargs):  # a runner-up over (data 1, model 2); timing it would fail the test
    found = searched_plan(*args, **kwargs)
    wide = types.SimpleNamespace(stages=(), mesh_shape=(1, 2), predicted=found.plan.predicted)
    return dataclasses.replace(found, runners_up=(wide, *found.runners_up))

  monkeypatch.setattr("hetspmd.runtime.step.searched_plan", with_model_axis)
  with pytest.warns(UserWarning):
    step = _run(_scaled(calibration, 1 / SCALE), steps=1, rebalance=hs.Rebalance(every=100))
  assert all("'model': 1" in t.label for t in step.verification.timed)
  assert len(step.verification.timed) == verifying.PLANS


def test_verify_true_says_why_nothing_was_timed():
  """verify=True on a plan made from abstract arguments, with nothing to time on: explain() says why."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  w = _workload()
  step = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=_cluster(), plan="search", global_batch=64,
                        verify=True, group_plans=False)
  step.resolve(w.init_state(0), w.example_batch(64))  # abstract: ShapeDtypeStructs
  assert step.verification is None
  assert "not verified (verify=True): the plan was made from abstract arguments" in step.explain()
  assert not verifying.wanted(True, None, ((jax.ShapeDtypeStruct((2,), np.float32),), {}))


@pytest.mark.parametrize("factor", [1 / SCALE, SLOW])
def test_a_group_plan_is_timed_whole_and_replaced_where_it_misses(calibration, monkeypatch, factor):
  """The search made to run its group plan (no margin over the best single program): timed whole (its group
  programs, exchange and update, on a copy of the state), and where it misses (predicted 30x too fast), its
  best single programs are timed too and the fastest measured runs; where it does not, it runs. Exact."""
  monkeypatch.setattr("hetspmd.runtime.searching.GROUP_PLAN_MARGIN", 0.0)
  w = _workload()
  step = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=_cluster(), plan="search", global_batch=64,
                        calibrate=_scaled(calibration, factor))
  ref = Reference(w.make_train_step(), w.init_state(0))
  state = w.init_state(0)
  with pytest.warns(UserWarning, match="slower than predicted") if factor < 1 else _no_warning():
    for i in range(2):
      batch = w.synthetic_batch(i, batch=64)
      state, metrics = step(state, batch)
      ref.step(batch)
      ref.check_metrics(metrics, i)
  ref.check(state)
  v = step.verification
  assert v.timed[0].label.startswith("group plan: ") and v.timed[0].measured > 0
  if factor < 1:
    assert len(v.timed) == verifying.PLANS and not any(t.label.startswith("group") for t in v.timed[1:])
    assert step.grouped == (v.runs == 0)
  else:
    assert len(v.timed) == 1 and step.grouped
  assert "verified on the first call: the search's plan ran a step in" in step.explain()
  priced = dict(step.plan.predicted_per_device)["memory_bytes"] if step.grouped else None
  if priced:  # a group plan's programs are built by their first call: the search's priced peaks stand for them
    runner = step._runner
    assert {d.id: b for d, b in runner.needed_bytes((), {}).items()} == dict(
        zip([d for g in step.plan.groups for d in g.devices], priced))


@pytest.mark.timeout(300)
def test_two_processes_time_each_plan_and_agree():
  """2 processes x 2 CPU devices over gloo, V100s on one and P100s on the other, the search made to run its
  group plan and priced from datasheets (so it misses): each process times its share of the group plan and of
  two single programs, and every process gets the same times and so runs the same plan, planned at
  shard_state from example_batch and fed only its own examples; exact against one device."""
  import textwrap

  from multiprocess import group_child, run_processes

  results = run_processes(group_child() + textwrap.dedent("""
      import warnings
      import hetspmd as hs
      import hetspmd.runtime.searching as searching
      from hetspmd.runtime import verifying

      searching.GROUP_PLAN_MARGIN = 0.0
      pool = hs.Cluster.emulate(jax.devices(), kinds=["V100-32GB"] * 2 + ["P100-16GB"] * 2)
      batches = t._batches(128)
      ref = reference(t.dropout_step, t._state(4096), batches)
      step = hs.parallelize(t.dropout_step, cluster=pool, plan="search", global_batch=128, example_batch=batches[0],
                            verify=True)
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # priced from datasheets: even the fastest misses
        state = step.shard_state(t._state(4096))
      for i, batch in enumerate(batches):
        state, metrics = step(state, fed(step, batch))
        ref.check_metrics(jax.tree.map(local, metrics), i)
      ref.check(jax.tree.map(local, state.params), lambda s: s.params)
      v = step.verification
      print(json.dumps({"labels": [x.label for x in v.timed], "measured": [x.measured for x in v.timed],
                        "runs": v.runs, "plan": verifying.label(step.plan), "on": v.on}))
  """), num_processes=2, devices_per_process=2, timeout=240)
  first, second = results
  assert first == second, results  # the same times, so the same choice, on every process
  assert first["labels"][0].startswith("group plan: ") and len(first["labels"]) == verifying.PLANS
  assert first["plan"] == first["labels"][first["runs"]] and all(m > 0 for m in first["measured"])
  assert first["on"] == verifying.ON_EXAMPLES


# the second process cannot cut its batch for the first runner-up, or finds it would not fit its devices' free memory
_CANNOT_CUT = """
      cut, seen = verifying.examples, []

      def failing(*args, **kwargs):
        seen.append(1)
        if jax.process_index() == 1 and len(seen) == 3:  # after example_call and the choice: the first runner-up
          raise hs.HetSpmdError("cannot cut this batch here")
        return cut(*args, **kwargs)

      verifying.examples = failing
"""
_SHORT_OF_MEMORY = """
      checked, seen = verifying.short_of_memory, []

      def counted(*args, **kwargs):
        seen.append(1)
        return checked(*args, **kwargs)

      verifying.short_of_memory = counted  # the first runner-up is the second plan checked
      verifying.free_bytes = lambda device: 1 if jax.process_index() == 1 and len(seen) == 2 else 2**40
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("failure", [_CANNOT_CUT, _SHORT_OF_MEMORY], ids=["cannot-cut", "short-of-memory"])
def test_a_plan_one_process_cannot_prepare_runs_on_none(failure):
  """2 processes: the second cannot cut its batch for the first runner-up, or finds that its priced peak is more
  than its devices have free (an error before anything is placed or runs). Both agree that it did
  not run, neither waits in its collectives, and both run the same plan, exact against one device."""
  import textwrap

  from multiprocess import group_child, run_processes

  results = run_processes(group_child() + textwrap.dedent("""
      import warnings
      import hetspmd as hs
      from hetspmd.runtime import verifying
  """) + textwrap.dedent(failure) + textwrap.dedent("""
      pool = hs.Cluster.emulate(jax.devices(), kinds=["V100-32GB"] * 2 + ["P100-16GB"] * 2)
      batches = t._batches(64)
      ref = reference(t.dropout_step, t._state(), batches)
      step = hs.parallelize(t.dropout_step, cluster=pool, plan="search", global_batch=64, example_batch=batches[0],
                            verify=True, group_plans=False)
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = step.shard_state(t._state())
      for i, batch in enumerate(batches):
        state, metrics = step(state, fed(step, batch))
        ref.check_metrics(jax.tree.map(local, metrics), i)
      ref.check(jax.tree.map(local, state.params), lambda s: s.params)
      v = step.verification
      print(json.dumps({"measured": [x.measured for x in v.timed], "runs": v.runs, "errors": [x.error for x in v.timed]}))
  """), num_processes=2, devices_per_process=2, timeout=240)
  first, second = results
  assert first["measured"] == second["measured"] and first["runs"] == second["runs"] != 1, results
  assert len(first["measured"]) == verifying.PLANS, results
  assert first["measured"][1] == float("inf") == second["measured"][1]
  if failure is _CANNOT_CUT:
    assert second["errors"][1] == "cannot cut this batch here"
  else:
    assert re.fullmatch(r"it needs \S+ GiB on device \d+, which has 9.31e-10 GiB free beside the state",
                        second["errors"][1]), results
  assert first["errors"][1] == "it did not run on another process"
  assert not any(first["errors"][i] or second["errors"][i] for i in (0, 2)), results


def test_bad_verify_is_refused():
  with pytest.raises(InvalidValueError, match="verify must be True, False or 'auto'"):
    hs.parallelize(lambda s, b: s, global_batch=8, verify="sometimes")


@pytest.mark.parametrize("form", ["single program", "group plan"])
def test_verifying_an_nnx_step_writes_nothing_into_its_objects(monkeypatch, form):
  """An NNX step trained in place, its search's choice (a single program, or a group plan) missing and
  re-planned: the timing runs on copies of the objects' state, so after one call the objects hold exactly one
  step's update (equal to a step whose plan was not verified)."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  import optax
  from flax import nnx

  import nnx_toy
  from nnx_toy import train_step

  make, batch = lambda: nnx_toy.make(optax.adam(1e-2)), nnx_toy.batch()
  probe = hs.parallelize(train_step, cluster=_cluster(), plan="search", global_batch=32)
  fast = _scaled(probe.calibrate(*make(), batch), 1 / SCALE)
  model, optimizer = make()
  if form == "group plan":
    monkeypatch.setattr("hetspmd.runtime.searching.GROUP_PLAN_MARGIN", 0.0)
  step = hs.parallelize(train_step, cluster=_cluster(), plan="search", global_batch=32, calibrate=fast,
                        group_plans=form == "group plan")
  with pytest.warns(UserWarning, match="slower than predicted"):
    loss = step(model, optimizer, batch)
  assert step.verification is not None and len(step.verification.timed) > 1
  assert step.verification.timed[0].label.startswith("group plan") == (form == "group plan")
  ref_model, ref_optimizer = make()
  ref_loss = nnx.jit(train_step)(ref_model, ref_optimizer, batch)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
  got = np.concatenate([np.ravel(x) for x in jax.tree.leaves(jax.device_get(nnx.state(model)))])
  want = np.concatenate([np.ravel(x) for x in jax.tree.leaves(jax.device_get(nnx.state(ref_model)))])
  before = np.concatenate([np.ravel(x) for x in jax.tree.leaves(jax.device_get(nnx.state(make()[0])))])
  # one Adam step of lr 1e-2 moves each parameter by about 1e-2; several steps would move it several times
  assert np.max(np.abs(got - want)) < 1e-3 < np.max(np.abs(want - before))
