"""A model axis inside one group of a group plan: that group's devices, a few at a time, split each microbatch's
work (its parameters' chosen dimensions, their gradients and activations) while the other groups run data only;
exact against one device, and bad model axes refused."""

import re
import textwrap

import jax
import pytest

import hetspmd as hs
from hetspmd import models
from hetspmd.passes.profile import profile_step
from hetspmd.plan.groups import GroupPlan, group_plan, split_by_process
from hetspmd.planner.pricing import Costing
from hetspmd.runtime.grouped import run_groups

from conftest import require_devices
from test_group_programs import SHARES_80_16, _batches, _state, _trained, dropout_step, token_batches

# the test network's first layer split by its output columns, its second by its input rows (Megatron's pairing)
NET_DIMS = {"params/Dense_0/kernel": 1, "params/Dense_0/bias": 0, "params/Dense_1/kernel": 0}


# a model axis of 3: the first layer's kernel [6, 16] split by its input rows (16 columns do not split 3 ways)
NET_DIMS_3 = {"params/Dense_0/kernel": 0}
# each data position's count, repeated for each of its devices
COUNTS = {2: (2, 2, 2, 2, 1, 1), 3: (2, 2, 2, 1, 1, 1)}


def _groups(model: int, dims=None):
  """Two devices with microbatches of 4 beside six with microbatches of 2, those six ``model`` at a time."""
  dims = dims or (NET_DIMS if model == 2 else NET_DIMS_3)
  return [((0, 1), 4, (3, 3)), ((2, 3, 4, 5, 6, 7), 2, COUNTS[model], "none", model, dims)]


def _batch(groups, tail=(0, 0)) -> int:
  return sum(g[1] * sum(g[2][::(g[4] if len(g) > 4 else 1)]) for g in groups) + 8 * tail[0] * tail[1]


@pytest.mark.parametrize("model,tail,shares,zero", [
    (2, (0, 0), (), 0), (3, (0, 0), (), 0), (2, (1, 1), (), 0), (2, (0, 0), SHARES_80_16, 1),
    (2, (1, 1), SHARES_80_16, 3)], ids=["model-2", "model-3", "model-2-tail", "model-2-shares", "model-2-tail-zero3"])
def test_a_group_with_a_model_axis_matches_one_device(model, tail, shares, zero):
  """Six devices as three positions of two (or two of three) beside two data-only devices: parameters, optimizer
  state and every step's metrics equal one device's (dropout too), with a tail in the uniform program and with
  the optimizer state (and parameters) held in memory shares."""
  require_devices(8)
  groups = _groups(model)
  plan = group_plan(groups, _batch(groups, tail), tail=tail, state_shares=shares, zero_stage=zero or None)
  state, ref = _trained(dropout_step, plan, _state, _batches(plan.global_batch), placed=bool(shares))
  ref.check(state.params, lambda s: s.params)
  ref.check(state.opt_state, lambda s: s.opt_state)


def test_the_model_axis_splits_the_group_programs_work():
  """The model group's compiled loop carries each split parameter's gradient as its share ([6, 8] of the first
  layer's [6, 16] kernel), and only the uniform programs see one row per device."""
  require_devices(8)
  plan = group_plan(_groups(2), _batch(_groups(2)))
  step = run_groups(dropout_step, plan)
  state = step.shard_state(_state())
  state, _ = step(state, _batches(plan.global_batch)[0])
  program, args = step._last["group 1"]
  text = program.lower(*args).compile().as_text()
  assert "f32[6,8]" in text and re.search(r"all-reduce|all-gather|all-to-all|reduce-scatter", text)
  program, args = step._last["group 0"]
  assert "f32[6,8]" not in program.lower(*args).compile().as_text()
  assert "model axis 2 (3 parameters split over it)" in step.explain()


def test_a_zoo_language_model_with_the_searchs_model_dims_in_one_group():
  """gpt2-tiny with a model axis of 2 in the second group, its parameters split as the strategy search splits
  them for a model axis of 2 (attention by heads, the MLP by columns then rows): exact against one device."""
  require_devices(8)
  w = models.get("gpt2-tiny")
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))
  choice = max(Costing(hs.Cluster.preset("amp-t4-v100"), profile, 1).choices(2), key=lambda tp: len(tp.model_dims))
  assert len(choice.model_dims) >= 8
  plan = group_plan([((0, 1, 2, 3), 2, (2, 2, 2, 1)), ((4, 5, 6, 7), 1, (2, 2, 1, 1), "none", 2,
                                                        choice.model_dims)], 17)
  state, ref = _trained(w.make_train_step(), plan, w.init_state, token_batches(w, plan.global_batch))
  ref.check(state)


@pytest.mark.parametrize("group,message", [
    (((0, 1, 2), 2, (1, 1, 1), "none", 2, NET_DIMS), "positive integer dividing its 3 devices"),
    (((0, 1), 2, (1, 1), "none", 2, ()), "needs model_dims"),
    (((0, 1), 2, (1, 1), "none", 1, NET_DIMS), "need a model axis"),
    (((0, 1, 2, 3), 2, (2, 1, 1, 1), "none", 2, NET_DIMS), r"share its count .* differ within position\(s\) \[0\]"),
    (((0, 1), 2, (1, 1), "none", 2, {"params/Dense_0/kernel": -1}), "at least 0"),
    (((0, 1), 2, (1, 1), "none", 2, (("params/a", 0), ("params/a", 1))), r"names \['params/a'\] more than once"),
    (((0, 1), 2, (1, 1), "none", 2, ("params/a",)), "must map parameter paths to dimensions"),
])
def test_bad_model_axes_say_what_is_wrong(group, message):
  with pytest.raises(hs.HetSpmdError, match=message):
    group_plan([group], 2 * sum(group[2]))


@pytest.mark.parametrize("dims,message", [
    ({"params/Dense_9/kernel": 1}, r"names \['params/Dense_9/kernel'\], which no state leaf's path ends with"),
    ({"params/Dense_1/kernel": 1}, r"params/Dense_1/kernel \(shape \(16, 4\)\) along dimension 1 .* divide by 3"),
])
def test_model_dims_that_do_not_fit_the_state_are_refused_when_traced(dims, message):
  require_devices(8)
  plan = group_plan(_groups(3, dims), _batch(_groups(3, dims)))
  step = run_groups(dropout_step, plan)
  with pytest.raises(hs.HetSpmdError, match=message):
    step(step.shard_state(_state()), _batches(plan.global_batch)[0])


def test_a_model_axis_round_trips_through_json_and_stays_whole_across_processes():
  plan = group_plan(_groups(2), _batch(_groups(2)))
  again = GroupPlan.from_json(plan.to_json())
  assert again == plan and again.groups[1].model == 2 and dict(again.groups[1].model_dims) == NET_DIMS
  assert plan.to_json()["version"] == 7  # 7 names grad_reduce_dtype; a version 6 or 5 file (no shard_params) reads
  old = plan.to_json()
  old["version"], old["reduce_dtype"] = 6, old.pop("grad_reduce_dtype")
  assert GroupPlan.from_json(old) == plan
  as_pairs = plan.to_json()
  as_pairs["groups"][1]["model_dims"] = [list(pair) for pair in NET_DIMS.items()]  # pairs read as a mapping does
  assert GroupPlan.from_json(as_pairs) == plan
  cut = split_by_process(plan, {d: d // 4 for d in range(8)})  # positions (2, 3) | (4, 5), (6, 7)
  assert [g.devices for g in cut.groups] == [(0, 1), (2, 3), (4, 5, 6, 7)]
  with pytest.raises(hs.HetSpmdError, match="spans processes"):
    split_by_process(plan, {d: int(d >= 3) for d in range(8)})


@pytest.mark.timeout(300)
def test_the_search_gives_a_model_axis_to_the_kind_that_cannot_hold_a_microbatch_alone():
  """Four devices too small to run gpt2-tiny's microbatch data-only (whole parameters, a whole accumulator and a
  whole microbatch's activations) beside four large ones: the group search gives the small kind a model axis,
  prices its devices within their memory, and the plan it writes runs exactly."""
  import dataclasses

  from hetspmd.hardware.profiler import device_spec
  from hetspmd.planner import grouping
  from hetspmd.planner.data_axis import NO_TENSOR_PARALLEL
  from hetspmd.planner.grouping import search_groups, to_group_plan
  from hetspmd.planner.pricing import device_groups
  from hetspmd.planner.ranking import microbatch_sizes

  require_devices(8)
  w, batch = models.get("gpt2-tiny"), 16
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))
  base = hs.Cluster.emulate(jax.devices()[:8], kinds=["V100-32GB"] * 8)
  costing = Costing(base, profile, 1)
  alone = grouping._peak(costing, 8, (1, "none"), (0, "none"), 0.0, 0.0, tp=NO_TENSOR_PARALLEL)
  split = min(grouping._peak(costing, 8, (1, "none"), (0, "none"), 0.0, 0.0, tp=tp) for tp in costing.choices(2))
  assert split < alone
  small = dataclasses.replace(device_spec("P100-16GB"), name="P100-small", memory_bytes=(split + alone) // 2)
  cluster = hs.Cluster.emulate(jax.devices()[:8], kinds=["V100-32GB"] * 4 + ["P100-small"] * 4,
                               custom={"P100-small": small})
  priced = search_groups(cluster, profile, batch, microbatch_sizes(batch), remat_policies=("none",))
  assert priced is not None and [tp.m for tp in priced.group.group_models] == [1] * 4 + [2] * 2
  assert len(priced.memory_bytes) == len(priced.device_positions) == 8  # per device, as a single program's
  assert "model axis 2 on P100-small" in priced.name
  plan = to_group_plan(cluster, priced)
  assert [g.model for g in plan.groups] == [1, 2] and plan.groups[1].model_dims
  memory = dict(plan.predicted_per_device)["memory_bytes"]
  assert all(m <= small.memory_bytes for m in memory[4:]) and len(memory) == 8
  assert device_groups(cluster, "", tuple(range(8)), 1).memory == small.memory_bytes
  state, ref = _trained(w.make_train_step(), plan, w.init_state, token_batches(w, batch, seed=2))
  ref.check(state)


@pytest.mark.parametrize("models,blocks", [
    ({"A100-80GB": 1, "V100-16GB": 2}, [(0,), (1,), (2,), (3,), (4, 5), (6, 7)]),
    ({"A100-80GB": 4, "V100-16GB": 2}, [(0, 1, 2, 3), (4, 5), (6, 7)]),
    ({"A100-80GB": 1, "V100-16GB": 4}, None),  # two V100s to a host: no position of four
])
def test_model_axis_positions_take_one_kinds_devices_of_one_host(models, blocks):
  from hetspmd.planner.grouping import _blocked
  from hetspmd.planner.pricing import device_groups

  cluster = hs.Cluster.parse("4xA100-80GB+2x2xV100-16GB")
  layout = device_groups(cluster, "", tuple(range(8)), 1)
  got = _blocked(cluster, layout, models)
  assert (got.groups if got is not None else None) == (tuple(blocks) if blocks else None)


@pytest.mark.timeout(300)
def test_two_processes_one_with_a_model_axis_group():
  """2 processes x 4 CPU devices over jax.distributed (gloo): one process's group runs data-only, the other's as
  two positions of a model axis of 2; the state replicated, then the optimizer state in memory shares (across
  processes the uniform program reduces every sum onto every device, and the parameters return through it): the
  metrics, and the parameters and moments each process holds, equal one device's."""
  from multiprocess import group_child, run_processes

  results = run_processes(group_child() + textwrap.dedent(f"""
      from hetspmd.plan.groups import group_plan
      from hetspmd.runtime.grouped import run_groups

      batches = t._batches(24)
      ref = reference(t.dropout_step, t._state(), batches)
      report = {{}}
      for name, shares in (("replicated", ()), ("shares", {SHARES_80_16!r})):
        plan = group_plan([(ids[0], 4, (1, 1, 1, 1)), (ids[1], 2, (2, 2, 2, 2), "none", 2, {NET_DIMS!r})], 24,
                          state_shares=shares)
        step = run_groups(t.dropout_step, plan)
        state = step.shard_state(t._state())
        for i, batch in enumerate(batches):
          state, metrics = step(state, fed(step, batch))
          ref.check_metrics(jax.tree.map(local, metrics), i)
        mine = jax.tree.map(local, (state.params, state.opt_state))
        ref.check(jax.tree.map(lambda m, r: r if m is None else m, mine, (ref.single.params, ref.single.opt_state),
                               is_leaf=lambda x: x is None), lambda s: (s.params, s.opt_state))
        report[name] = sum(1 for n in step.memory_analysis() if n.startswith("group"))
      print(json.dumps(report))
  """), num_processes=2, devices_per_process=4, timeout=240)
  assert [r["replicated"] for r in results] == [1, 1] and [r["shares"] for r in results] == [1, 1]


def test_specs_a_linen_user_gives_lay_out_the_model_group():
  """``parallelize(specs=...)``, as annotations over ``model`` read by ``annotated_specs``, keeps them in a
  searched group plan's model group: the planner split the first layer by columns and the second by rows; the
  user's specs split the second layer by columns instead and keep the first layer's kernel whole. The group plan
  runs exactly, its model group laid out as the specs say."""
  from hetspmd.runtime.searching import kept_specs

  require_devices(8)
  groups = _groups(2)
  plan = group_plan(groups, _batch(groups))
  specs = {"Dense_0/kernel": (None, None), "Dense_1/kernel": (None, "model")}
  kept = kept_specs(plan, _state(), specs)
  assert dict(kept.groups[1].model_dims) == {"params/Dense_0/bias": 0, "params/Dense_1/kernel": 1}
  assert kept.groups[0] == plan.groups[0] and kept_specs(plan, _state(), None) == plan
  state, ref = _trained(dropout_step, kept, _state, _batches(kept.global_batch))
  ref.check(state.params, lambda s: s.params)
  with pytest.raises(hs.HetSpmdError, match="the specs leave every parameter whole"):
    kept_specs(plan, _state(), {"kernel": (), "bias": ()})
