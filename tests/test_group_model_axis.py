"""A model axis inside one group of a group plan: that group's devices, a few at a time, split each microbatch's
work (its parameters' chosen dimensions, their gradients and activations) while the other groups run data only;
exact against one device, and bad model axes refused."""

import re

import jax
import numpy as np
import pytest

import hetspmd as hs
from hetspmd import models
from hetspmd.passes.profile import profile_step
from hetspmd.plan.groups import GroupPlan, group_plan, split_by_process
from hetspmd.planner.pricing import Costing
from hetspmd.runtime.grouped import run_groups

from conftest import require_devices
from test_group_programs import SHARES_80_16, _batches, _state, _trained, dropout_step

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
  rs = np.random.RandomState(1)
  batches = [jax.tree.map(lambda s: rs.randint(0, 50, s.shape).astype(s.dtype), w.example_batch(plan.global_batch))
             for _ in range(2)]
  state, ref = _trained(w.make_train_step(), plan, w.init_state, batches)
  ref.check(state)


@pytest.mark.parametrize("group,message", [
    (((0, 1, 2), 2, (1, 1, 1), "none", 2, NET_DIMS), "positive integer dividing its 3 devices"),
    (((0, 1), 2, (1, 1), "none", 2, ()), "needs model_dims"),
    (((0, 1), 2, (1, 1), "none", 1, NET_DIMS), "need a model axis"),
    (((0, 1, 2, 3), 2, (2, 1, 1, 1), "none", 2, NET_DIMS), r"share its count .* differ within position\(s\) \[0\]"),
    (((0, 1), 2, (1, 1), "none", 2, {"params/Dense_0/kernel": -1}), "at least 0"),
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
  assert plan.to_json()["version"] == 5
  cut = split_by_process(plan, {d: d // 4 for d in range(8)})  # positions (2, 3) | (4, 5), (6, 7)
  assert [g.devices for g in cut.groups] == [(0, 1), (2, 3), (4, 5, 6, 7)]
  with pytest.raises(hs.HetSpmdError, match="spans processes"):
    split_by_process(plan, {d: int(d >= 3) for d in range(8)})
