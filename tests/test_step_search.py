"""``hetspmd.search`` takes what ``parallelize`` takes, and ``hetspmd search --step`` searches a user's own step.

Steps shaped as Flax's examples shape them (NNX in place with Rngs and metrics, a Linen ``TrainState`` with
lm1b's settings beside the batch, a ``pmap``-era step, a jitted step) are searched at abstract shapes; the
search's choice is the one ``parallelize(plan="search")`` makes and runs; its plan saved runs exactly; the table
fits a terminal; the JSON from Python and from the command line have the same keys; each bad call says what to
pass instead.
"""

import json
import os
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import hetspmd as hs
import hetspmd.runtime.searching as search_module
from hetspmd import models
from hetspmd.cli import main
from hetspmd.plan.options import STEP_REMAT_POLICIES
from hetspmd.planner.ranking import GROUP_PLAN_MARGIN, SEARCHED_REMAT

from conftest import require_devices
from exactness import Reference
from test_group_programs import _batches, _state, dropout_step
from test_parallelize_groups import TinyLM, _Config, _lm1b_batches, lm1b_signature_step
from test_pmap_steps import make_state, pmap_train_step

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")
sys.path.insert(0, EXAMPLES)
import nnx_lm  # noqa: E402  (examples/nnx_lm.py, as a user's own module)

POOL = "1x4xA100-80GB+1x4xV100-32GB;processes=1"


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)


def _lm1b_abstract_state():
  def make():
    model = TinyLM()
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32), train=False)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(3e-3))
  return jax.eval_shape(make)


def _nnx_inputs():
  step, args, kwargs = nnx_lm.tiny()
  return step, args, kwargs


def _linen_inputs():
  batch = _abstract(_lm1b_batches(24)[0])
  rng = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  return lm1b_signature_step, (_lm1b_abstract_state(), batch, _Config(0.1), lambda step: 1e-3, rng), {}


def _pmap_inputs():
  batch = {"image": jax.ShapeDtypeStruct((32, 8, 8, 3), jnp.float32), "label": jax.ShapeDtypeStruct((32,), jnp.int32)}
  return pmap_train_step, (jax.eval_shape(make_state), batch), {}


def _jitted_inputs():
  step, args, kwargs = _linen_inputs()
  return jax.jit(step, static_argnums=(2, 3)), args, kwargs


def _nnx_jitted_inputs():
  step, args, kwargs = _nnx_inputs()
  return nnx.jit(step, static_argnums=(5, 6)), args, kwargs


STEPS = {"nnx in place": _nnx_inputs, "linen lm1b": _linen_inputs, "pmap era": _pmap_inputs,
         "jitted": _jitted_inputs, "nnx jitted": _nnx_jitted_inputs}


@pytest.mark.parametrize("name", list(STEPS))
def test_steps_shaped_as_flax_writes_them_are_searched_at_abstract_shapes(name):
  """Every form is priced (single programs, baselines, the homogeneous equivalent, the group plan); the global
  batch is read from the batch; the table fits a terminal; the choice is a plan that names this pool's kinds."""
  step, args, kwargs = STEPS[name]()
  found = hs.search(step, *args, cluster=POOL, **kwargs)
  assert found.plans and found.subject.global_batch == jax.tree.leaves(args[3 if name.startswith("nnx") else 1])[0].shape[0]
  assert found.group_plan is not None and found.priced.result.homogeneous_equivalent is not None
  assert set(found.baselines) >= {"dp_even", "dp_proportional", "fastest_only", "best_homogeneous"}
  assert found.form == "single program" or found.form == "group plan"
  lines = str(found).splitlines()
  assert max(len(line) for line in lines) <= 100, max(lines, key=len)
  assert len(lines) <= 40, len(lines)
  assert set(found.best.device_kinds if isinstance(found.best, hs.Plan) else ()) <= {"A100-80GB", "V100-32GB"}
  assert "parallelize(plan='search') from 1 process runs" in " ".join(str(found).split())
  assert found.priced.remat_policies == STEP_REMAT_POLICIES  # no hetspmd.value_and_grad: none or layers only


def test_a_step_using_hetspmd_value_and_grad_is_priced_with_every_policy_parallelize_applies():
  w = models.get("mlp-tiny")
  plain = hs.search(w.make_train_step(), w.abstract_state(), w.example_batch(32), cluster=POOL)
  ours = hs.search(w.make_train_step(hs.value_and_grad), w.abstract_state(), w.example_batch(32), cluster=POOL)
  assert plain.priced.remat_policies == STEP_REMAT_POLICIES and ours.priced.remat_policies == SEARCHED_REMAT


@pytest.mark.parametrize("margin", [GROUP_PLAN_MARGIN, 0.0], ids=["default-margin", "group-plan-taken"])
def test_the_choice_is_parallelize_s_and_its_saved_plan_runs_exactly(margin, monkeypatch, tmp_path):
  """On 8 emulated devices, ``search``'s best is the plan ``parallelize(plan="search")`` resolves for the same
  step and batch (a single program, or with the margin at 0 the group plan); saved, it runs exactly."""
  require_devices(8)
  monkeypatch.setattr(search_module, "GROUP_PLAN_MARGIN", margin)
  pool = hs.Cluster.emulate(jax.devices()[:8], kinds=["V100-32GB"] * 3 + ["P100-16GB"] * 5)
  batches = _batches(48)
  found = hs.search(dropout_step, _abstract(_state()), _abstract(batches[0]), cluster=pool)
  step = hs.parallelize(dropout_step, cluster=pool, plan="search", global_batch=48)
  step(_state(), batches[0])
  assert found.form == ("group plan" if margin == 0.0 else "single program") and step.grouped == (margin == 0.0)
  assert found.best.to_json() == step.plan.to_json()
  path = tmp_path / "plan.json"
  found.save(path)
  ref = Reference(dropout_step, _state()).run(batches)
  saved = hs.parallelize(dropout_step, plan=str(path), global_batch=48)
  state = saved.shard_state(_state())
  for i, batch in enumerate(batches):
    state, metrics = saved(state, batch)
    ref.check_metrics(metrics, i)
  ref.check(state.params, lambda s: s.params)
  explained = found.explain()
  assert explained.startswith("group plan:" if margin == 0.0 else "mesh ") and "parallelize(plan='search')" in explained


def test_a_pool_of_several_processes_runs_group_plans_too(monkeypatch):
  """A pool of two hosts is run from two processes (one per host unless it says processes=1): group plans run
  there as in one process, so the choice follows the margin alone; the JSON says for how many processes it
  holds."""
  step, args, kwargs = _nnx_inputs()
  monkeypatch.setattr(search_module, "GROUP_PLAN_MARGIN", 0.0)
  two = hs.search(step, *args, cluster="1x4xA100-80GB+1x4xV100-32GB", **kwargs)
  assert two.priced.processes == 2 and two.form == "group plan" and "chosen by the search" in two.priced.note
  assert two.to_json()["choice"] == {"form": "group plan", "processes": 2, "note": two.priced.note}
  monkeypatch.setattr(search_module, "GROUP_PLAN_MARGIN", 1e9)
  single = hs.search(step, *args, cluster="1x4xA100-80GB+1x4xV100-32GB", **kwargs)
  assert single.form == "single program"
  # the table ranks plans that leave a host idle; the choice of a job of two processes gives each devices
  hosts = {d: d // 4 for d in range(8)}
  assert any({hosts[d] for d in p.device_positions} == {0} for p in single.plans)
  assert {hosts[d] for d in single.priced.choice.device_positions} == {0, 1}
  assert single.best.device_kinds and set(single.best.device_kinds) == {"A100-80GB", "V100-32GB"}
  lines = str(single).splitlines()
  assert len(lines) <= 40 and max(len(line) for line in lines) <= 100
  if all(p is not single.priced.choice for p in single.plans):  # the choice is shown, marked, below the ranking
    assert any(line.strip().startswith("runs: ") for line in lines)


def test_the_earlier_call_still_works_and_a_cluster_never_becomes_a_step_argument():
  w = models.get("mlp-tiny")
  pool = hs.Cluster.resolve(POOL)
  earlier = hs.search(w.make_train_step(), w.abstract_state(), w.example_batch(2), pool, global_batch=32)
  now = hs.search(w.make_train_step(), w.abstract_state(), w.example_batch(32), cluster=pool)
  assert earlier.plans[0] == now.plans[0]
  with pytest.raises(hs.InvalidValueError, match=r"Cluster as the step's argument 2 and cluster= too"):
    hs.search(w.make_train_step(), w.abstract_state(), w.example_batch(32), pool, cluster=pool)
  with pytest.raises(hs.InvalidValueError, match=r"needs the pool as a keyword: hetspmd.search\(step, \*args, "
                                                 r"cluster=\.\.\."):
    hs.search(w.make_train_step(), w.abstract_state(), w.example_batch(32), POOL)  # a string is never the pool
  assert earlier.homogeneous_equivalent is not None and earlier.candidates > 0 and earlier.search_seconds > 0
  with pytest.raises(hs.InvalidValueError, match=r"no longer takes homogeneous= .*hetspmd.search\(step, \*args, "):
    hs.search(w.make_train_step(), w.abstract_state(), w.example_batch(2), pool, global_batch=32, homogeneous=True)
  with pytest.raises(hs.InvalidValueError, match="a Cluster as the step's keyword argument 'pool'"):
    hs.search(w.make_train_step(), w.abstract_state(), w.example_batch(32), cluster=pool, pool=pool)
  with pytest.raises(hs.InvalidValueError, match="could not tell the batch"):
    hs.search(w.make_train_step(), w.abstract_state(), cluster=pool)
  with pytest.raises(hs.InvalidValueError, match="top .* positive integer"):
    hs.search(w.make_train_step(), w.abstract_state(), w.example_batch(32), cluster=pool, top=0)


def _cli_json(argv, capsys):
  assert main(argv + ["--json"]) == 0
  return json.loads(capsys.readouterr().out)


def test_the_cli_searches_a_step_from_a_file_with_the_keys_python_gives(tmp_path, capsys):
  path = os.path.join(EXAMPLES, "nnx_lm.py")
  report = _cli_json(["search", "--step", f"{path}:tiny", "--cluster", POOL, "--group-plan-out",
                      str(tmp_path / "g.json"), "--out", str(tmp_path / "p.json")], capsys)
  step, args, kwargs = nnx_lm.tiny()
  found = hs.search(step, *args, cluster=POOL, **kwargs)
  assert set(report) == set(found.to_json())
  assert report["global_batch"] == 16 and report["group_plan"] is not None and report["plans"]
  assert [p["microbatch_counts"] for p in report["plans"]] == [list(p.counts) for p in found.plans]
  assert hs.GroupPlan.load(tmp_path / "g.json").global_batch == 16 and hs.Plan.load(tmp_path / "p.json")
  assert main(["search", "--step", f"{path}:tiny", "--cluster", POOL]) == 0
  table = capsys.readouterr().out.splitlines()
  assert max(len(line) for line in table) <= 100 and table[0].startswith(f"{path}:tiny on")


def test_a_zoo_model_searched_by_name_and_as_a_user_s_step_gives_the_same_plans(tmp_path, capsys):
  """``--model gpt2-tiny`` and the same step written in a user's file (``--step``): the same ranked plans, the
  same remat rule, the same group plan."""
  user = tmp_path / "my_model.py"
  user.write_text(textwrap.dedent("""
      from hetspmd import models

      def inputs():
          w = models.get("gpt2-tiny")
          return w.make_train_step(), (w.abstract_state(), w.example_batch(32)), {}
  """))
  argv = ["search", "--cluster", "amp-t4-v100", "--global-batch", "32"]
  zoo = _cli_json(argv + ["--model", "gpt2-tiny"], capsys)
  mine = _cli_json(argv + ["--step", f"{user}:inputs"], capsys)
  assert set(zoo) == set(mine) and zoo["remat_policies"] == mine["remat_policies"] == list(STEP_REMAT_POLICIES)
  slow = ("search_seconds", "trace_seconds")
  for key in ("plans", "baselines", "group_plan", "homogeneous_equivalent", "choice"):
    assert zoo[key] == mine[key], key
  named = ("model", "seq", "dtype")  # the zoo's name and settings; a user's step says none
  assert {k: v for k, v in zoo.items() if k not in slow + named} == {
      k: v for k, v in mine.items() if k not in slow + named}


def _fails(argv, capsys):
  assert main(argv) == 2
  return capsys.readouterr().err


@pytest.mark.parametrize("body,spec,message", [
    ("", "nope.py:inputs", r"no file 'nope.py'"),
    ("", "no_colon", r"expected FILE.py:FUNCTION or MODULE:FUNCTION"),
    ("def other():\n  return None\n", "{file}:inputs", r"has no function 'inputs'"),
    ("raise ImportError('torch is missing')\n", "{file}:inputs", r"importing '.*user.py' failed: ImportError: torch"),
    ("def inputs():\n  return 3\n", "{file}:inputs", r"inputs\(\) returned a int; it must take no arguments and "
                                                     r"return \(step, args, kwargs\)"),
    ("def inputs(x):\n  return x\n", "{file}:inputs", r"inputs\(\) cannot be called without arguments .*must take no arguments"),
    ("def inputs():\n  return (print, (1,))\n", "{file}:inputs", r"returned a tuple of 2"),
    ("inputs = 3\n", "{file}:inputs", r"has no function 'inputs' \(it is a int\)"),
])
def test_a_bad_step_spec_names_the_file_and_function_and_says_what_was_expected(body, spec, message, tmp_path,
                                                                               capsys):
  user = tmp_path / "user.py"
  user.write_text(body)
  err = _fails(["search", "--step", spec.format(file=user), "--cluster", POOL], capsys)
  assert f"--step '{spec.format(file=user)}'" in err
  import re
  assert re.search(message, err), err


def test_step_refuses_the_zoo_s_options(capsys):
  err = _fails(["search", "--step", "x.py:f", "--model", "gpt2-tiny"], capsys)
  assert "drop --model, --seq and --dtype" in err


def test_where_no_single_program_fits_the_search_runs_the_group_plan_that_does(monkeypatch):
  """With the single programs made not to fit (the search raising as it does when none fits), ``plan="search"``
  runs the group plan that fits, exactly, and says why; ``hetspmd.search`` says the same, with ``specs`` over
  ``model`` too; with a spec over ``data``, which group plans do not keep, it says that no plan runs while
  ``best`` is the group plan."""
  require_devices(8)

  def nothing_fits(*args, **kwargs):
    raise hs.PlanDoesNotFitError("no plan fits: every single program was made not to, for this test")

  monkeypatch.setattr(search_module, "search", nothing_fits)
  pool = hs.Cluster.emulate(jax.devices()[:8], kinds=["V100-32GB"] * 3 + ["P100-16GB"] * 5)
  batches = _batches(48)
  ref = Reference(dropout_step, _state()).run(batches)
  step = hs.parallelize(dropout_step, cluster=pool, plan="search", global_batch=48)
  state = _state()
  for i, batch in enumerate(batches):
    state, metrics = step(state, batch)
    ref.check_metrics(metrics, i)
  ref.check(state.params, lambda s: s.params)
  assert step.grouped and "no single program fits, so the group plan runs" in step.explain()
  found = hs.search(dropout_step, _abstract(_state()), _abstract(batches[0]), cluster=pool)
  assert found.form == "group plan" and found.plans == () and found.to_json()["no_single_program"]
  assert "no single program fits: no plan fits" in " ".join(str(found).split())
  kept = hs.search(dropout_step, _abstract(_state()), _abstract(batches[0]), cluster=pool,
                   specs={"Dense_0/kernel": jax.sharding.PartitionSpec(None, "model")})
  assert kept.form == "group plan"
  apart = hs.search(dropout_step, _abstract(_state()), _abstract(batches[0]), cluster=pool,
                    specs={"Dense_0/kernel": jax.sharding.PartitionSpec("data")})
  assert apart.form is None and isinstance(apart.best, hs.GroupPlan)
  assert "runs no plan" in " ".join(str(apart).split())


def test_two_processes_search_and_run_a_group_plan_each_feeding_its_own_examples():
  """2 processes x 4 CPU devices over gloo, V100s on one and P100s on the other: ``plan="search"`` prices group
  plans there (the margin at 0, so the group plan runs; the model wide enough that it gives both processes work), resolved from ``example_batch`` before the first call;
  each process feeds only ``batch[step.process_examples()]``, a disjoint part of the global batch together
  covering it, and the step matches one device. The whole global batch is refused with the way to pass it."""
  from multiprocess import group_child, run_processes

  results = run_processes(group_child() + textwrap.dedent("""
      import hetspmd as hs
      import hetspmd.runtime.searching as searching

      searching.GROUP_PLAN_MARGIN = 0.0
      pool = hs.Cluster.emulate(jax.devices(), kinds=["V100-32GB"] * 4 + ["P100-16GB"] * 4)
      batches = t._batches(128)  # wide enough to be priced over both processes' devices
      ref = reference(t.dropout_step, t._state(4096), batches)
      step = hs.parallelize(t.dropout_step, cluster=pool, plan="search", global_batch=128, example_batch=batches[0])
      state = step.shard_state(t._state(4096))
      examples = step.process_examples()
      try:
        step(state, batches[0])
        refused = ""
      except hs.HetSpmdError as e:
        refused = str(e)
      for i, batch in enumerate(batches):
        state, metrics = step(state, fed(step, batch))
        ref.check_metrics(jax.tree.map(local, metrics), i)
      ref.check(jax.tree.map(local, state.params), lambda s: s.params)
      print(json.dumps({"grouped": step.grouped, "examples": examples.tolist(), "refused": refused}))
  """), num_processes=2, devices_per_process=4, timeout=240)
  assert all(r["grouped"] for r in results)
  mine = [set(r["examples"]) for r in results]
  assert not mine[0] & mine[1] and mine[0] | mine[1] == set(range(128)) and all(mine)
  assert all("batch[step.process_examples()]" in r["refused"] for r in results), results


def test_a_running_job_s_search_leaves_no_process_without_devices():
  """Under a job whose processes all run, each plan the search offers holds devices of every process (a process
  left out could not take part); without the rule the best plan leaves the slower host idle."""
  from hetspmd.passes.profile import profile_step
  from hetspmd.planner.group_execution import process_of
  from hetspmd.planner.ranking import search

  w = models.get("gpt2-tiny")
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))
  pool = hs.Cluster.parse("1x4xA100-80GB+1x4xT4")
  processes = process_of(pool)
  free = search(pool, profile, 32, top=20)
  assert any({processes[d] for d in p.device_positions} != {0, 1} for p in free.plans)
  kept = search(pool, profile, 32, top=20, every_process=processes)
  assert kept.plans and all({processes[d] for d in p.device_positions} == {0, 1} for p in kept.plans)
  assert all({processes[d] for d in b.device_positions} == {0, 1} for b in kept.baselines.values())


def test_processes_that_search_different_plans_are_refused_not_left_waiting():
  """2 processes told different pools (the kinds swapped on one): each finds another plan, and each is refused
  with the way out before any program runs, instead of waiting in a collective."""
  from multiprocess import group_child, run_processes

  results = run_processes(group_child() + textwrap.dedent("""
      import hetspmd as hs

      kinds = ["V100-32GB"] * 2 + ["P100-16GB"] * 2
      if jax.process_index() == 1:
        kinds = kinds[::-1]
      pool = hs.Cluster.emulate(jax.devices(), kinds=kinds)
      batches = t._batches(64)
      step = hs.parallelize(t.dropout_step, cluster=pool, plan="search", global_batch=64, example_batch=batches[0])
      try:
        step.shard_state(t._state())
        said = ""
      except hs.HetSpmdError as e:
        said = str(e)
      print(json.dumps({"said": said}))
  """), num_processes=2, devices_per_process=2, timeout=180)
  assert all("the processes searched different plans" in r["said"] and "plan='plan.json'" in r["said"]
             for r in results), results


def test_a_step_bound_by_cached_partial_is_searched_with_a_small_example_batch():
  """``nnx.cached_partial(step, model, optimizer, ...)``: its objects are the state, so the first argument of
  the call is the batch, here a small example batch read for its shapes at ``global_batch``."""
  step, args, kwargs = _nnx_inputs()
  model, optimizer, rngs, batch, metrics, smoothing, pad = args
  bound = nnx.cached_partial(step, model, optimizer, rngs)
  small = jax.tree.map(lambda x: jax.ShapeDtypeStruct((2,) + x.shape[1:], x.dtype), batch)
  found = hs.search(bound, small, metrics, smoothing, pad, cluster=POOL, global_batch=16)
  assert found.subject.global_batch == 16 and found.plans
  whole = hs.search(step, *args, cluster=POOL, **kwargs)
  assert [p.counts for p in found.plans] == [p.counts for p in whole.plans]


def test_a_running_job_s_group_plans_leave_no_process_without_devices():
  """Three kinds on three processes: the group search's device sets of the fastest kinds only are skipped in a
  running job, so the group plan offered holds devices of each process."""
  from hetspmd.passes.profile import profile_step
  from hetspmd.planner.group_execution import process_of
  from hetspmd.planner.ranking import search

  w = models.get("gpt2-tiny")
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))
  pool = hs.Cluster.parse("1x2xA100-80GB+1x2xV100-32GB+1x2xT4")
  processes = process_of(pool)
  kept = search(pool, profile, 48, top=3, groups=True, every_process=processes)
  assert kept.group_plan is not None
  assert {processes[d] for d in kept.group_plan.device_positions} == {0, 1, 2}


def test_two_processes_resolve_an_nnx_step_s_plan_before_the_first_call():
  """An NNX step in place across 2 processes: ``plan="search"`` is made from a call's arguments without running
  it (``step.resolve(model, optimizer, abstract batch)``), so each process knows its examples before the first
  call, then feeds only those; the parameters match one device."""
  from multiprocess import group_child, run_processes

  results = run_processes(group_child() + textwrap.dedent("""
      import hetspmd as hs
      from flax import nnx
      from exactness import NnxReference, assert_exact

      pool = hs.Cluster.emulate(jax.devices(), kinds=["V100-32GB"] * 2 + ["P100-16GB"] * 2)
      batches = t._batches(48)
      ref = NnxReference(t.nnx_train_step, t.nnx_objects()).run(batches)
      model, optimizer = t.nnx_objects()
      step = hs.parallelize(t.nnx_train_step, cluster=pool, plan="search", global_batch=48)
      shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batches[0])
      step.resolve(model, optimizer, shapes)
      examples = step.process_examples()
      for batch in batches:
        step(model, optimizer, fed(step, batch))
      params = lambda m: nnx.state(m, nnx.Param)
      assert_exact(jax.tree.map(local, params(model)), params(ref.single[0]), params(ref.ref64[0]), what="params")
      print(json.dumps({"examples": examples.tolist()}))
  """), num_processes=2, devices_per_process=2, timeout=240)
  mine = [set(r["examples"]) for r in results]
  assert not mine[0] & mine[1] and mine[0] | mine[1] == set(range(48)) and all(mine)
