"""Tensor-parallel strategies: the rule tables, what the ILP chooses, repeats, memory, PartitionSpecs."""

import numpy as np
import pytest

from hetspmd import Cluster, models
from hetspmd.hardware.devices import Link
from hetspmd.passes.sharding import ilp as strategy_ilp, propagation, strategies
from hetspmd.passes.costing.step_cost import LinearCost
from hetspmd.passes.profile import profile_step
from hetspmd.plan.state_layout import state_specs

FAST = "1x8xV100-32GB;intra=10000GB/s;intra_latency=0us"   # communication almost free
SLOW = "1x8xV100-32GB;intra=1Mbps"                          # communication hopeless


@pytest.fixture(scope="module")
def mlp_profile():
  w = models.get("mlp")
  return profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))


@pytest.fixture(scope="module")
def gpt_profile():
  w = models.get("gpt2-tiny")
  return profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2, 64))


def _solve(profile, spec, m=2, microbatch=64, **kwargs):
  cluster = Cluster.parse(spec)
  space = profile.strategy_spaces[m]
  seconds = profile.node_seconds(cluster.hosts[0].device, microbatch) * ~profile.per_step
  solution = strategy_ilp.choose(space, seconds, cluster.hosts[0].intra, microbatch, **kwargs)
  return space, solution, seconds


def _named(space, choice):
  return {d.name.split("/", 1)[1]: d.options[o].strategy.name for d, o in zip(space.decisions, choice)}


def test_mlp_pair_is_column_then_row_when_communication_is_cheap(mlp_profile):
  space, solution, seconds = _solve(mlp_profile, FAST)
  chosen = _named(space, solution.choice)
  assert chosen["params/layers/0/kernel"] == "column"
  assert chosen["params/layers/1/kernel"] == "row"
  assert solution.seconds < 0.7 * seconds.sum()
  dims = strategy_ilp.param_dims(space, solution.choice)
  assert dims["params/layers/0/kernel"] == 1 and dims["params/layers/0/bias"] == 0  # the bias follows the column
  assert dims["params/layers/1/kernel"] == 0 and "params/layers/1/bias" not in dims


@pytest.mark.parametrize("which", ["mlp", "gpt2"])
def test_everything_replicated_when_the_link_is_very_slow(mlp_profile, gpt_profile, which):
  profile = mlp_profile if which == "mlp" else gpt_profile
  space, solution, seconds = _solve(profile, SLOW)
  assert set(solution.choice) == {0}
  assert solution.comm_seconds == 0 and solution.compute_seconds == pytest.approx(seconds.sum())
  assert strategy_ilp.param_dims(space, solution.choice) == {}


def test_repeated_layers_share_one_choice(gpt_profile):
  space, solution, _ = _solve(gpt_profile, FAST, m=2, microbatch=8)
  assert not any("/h/1/" in d.name for d in space.decisions)  # h_1 repeats h_0: one decision each
  attn = next(d for d in space.decisions if d.name.endswith("h/0/attn/c_attn/kernel"))
  assert len(attn.params) == 2 and len(attn.sites) == 4   # forward and input-gradient matmuls of both blocks
  dims = strategy_ilp.param_dims(space, solution.choice)
  assert any(p.startswith("params/h/0/") for p in dims)
  for path, dim in dims.items():
    assert "/ln_" not in path  # only a site's own module follows it
    if "/h/0/" in path:
      assert dims.get(path.replace("/h/0/", "/h/1/")) == dim, path


def test_memory_bound_forces_splits(gpt_profile):
  space, free, _ = _solve(gpt_profile, SLOW)
  assert free.param_elements == space.param_elements
  budget = 0.8 * space.param_elements
  _, bound, _ = _solve(gpt_profile, SLOW, max_param_elements=budget)
  assert bound.param_elements <= budget and any(bound.choice)
  assert bound.seconds > free.seconds  # splitting on this link costs time; only memory makes it worth it
  _, impossible, _ = _solve(gpt_profile, SLOW, max_param_elements=0.1 * space.param_elements)
  assert impossible is None
  points = strategy_ilp.frontier(space, gpt_profile.node_seconds(Cluster.parse(SLOW).hosts[0].device, 64),
                               Cluster.parse(SLOW).hosts[0].intra, 64)
  elements = [p.param_elements for p in points]
  assert elements[0] == space.param_elements and elements == sorted(elements, reverse=True) and len(points) > 1


def test_fused_qkv_column_split_needs_a_permute_and_is_left_out(gpt_profile):
  space, solution, _ = _solve(gpt_profile, FAST, microbatch=8)
  c_attn = next(d for d in space.decisions if d.name.endswith("c_attn/kernel"))
  column = next(o for o in c_attn.options if o.strategy.name == "column")
  assert column.permute  # jnp.split(qkv, 3) cuts across the shards
  assert not solution.permute
  assert not any(d.options[o].permute for d, o in zip(space.decisions, solution.choice))


def test_row_split_after_the_fused_qkv_split_needs_a_permute(gpt_profile):
  """c_proj ``row`` needs the attention output sharded by head; XLA carries that back to jnp.split(qkv, 3)."""
  space = gpt_profile.strategy_spaces[2]
  by_name = {d.name.split("/", 2)[2]: d for d in space.decisions}
  option = lambda name, strategy: next(o for o in by_name[name].options if o.strategy.name == strategy)
  assert option("h/0/attn/c_proj/kernel", "row").permute
  # a row split whose activation comes from an unsplit producer chain (the MLP's input) is fine
  assert not option("h/0/mlp/c_fc/kernel", "row").permute and not option("h/0/mlp/c_proj/kernel", "row").permute


def test_vocab_split_conflicts_with_a_choice_that_shards_the_residual_stream(gpt_profile):
  space = gpt_profile.strategy_spaces[2]
  index = {d.name.split("/", 2)[2]: i for i, d in enumerate(space.decisions)}
  choice = [0] * len(space.decisions)
  wte, proj = space.decisions[index["wte/embedding"]], space.decisions[index["h/0/attn/c_proj/kernel"]]
  choice[index["wte/embedding"]] = [o.strategy.name for o in wte.options].index("vocab")
  choice[index["h/0/attn/c_proj/kernel"]] = [o.strategy.name for o in proj.options].index("column")
  assert proj.options[choice[index["h/0/attn/c_proj/kernel"]]].spreads
  seconds = np.ones(len(gpt_profile.counts))
  assert strategy_ilp.assess(space, choice, seconds, Link("l", 1e9, 0), 1).permute
  choice[index["h/0/attn/c_proj/kernel"]] = 0
  assert not strategy_ilp.assess(space, choice, seconds, Link("l", 1e9, 0), 1).permute


def test_split_region_divides_elementwise_work(mlp_profile):
  space = mlp_profile.strategy_spaces[4]
  first = space.decisions[0]
  column = next(o for o in first.options if o.strategy.name == "column")
  graph = mlp_profile.traces[0]
  assert {graph.nodes[n].primitive for n in column.scaled} >= {"dot_general", "max", "add"}  # matmul, relu, bias
  assert column.traffic.all_reduces == 0 and column.traffic.all_gathers == 0  # input is the batch: no backward
  row = next(o for o in space.decisions[1].options if o.strategy.name == "row")
  assert row.traffic.all_reduces >= 2  # its output and its repeat's are partial sums


def test_traffic_is_alpha_beta():
  traffic = strategies.Traffic(all_reduces=2, all_reduce_bytes=LinearCost(0, 1e6),
                               all_gathers=1, all_gather_bytes=LinearCost(4e6, 0))
  link = Link("l", 1e9, 1e-5)
  m, batch = 4, 2
  expected = (2 * 3 / 4 * 2e6 / 1e9 + 2 * 3 * 1e-5 * 2) + (3 / 4 * 4e6 / 1e9 + 3 * 1e-5)
  assert traffic.seconds(link, m, batch) == pytest.approx(expected)
  assert traffic.seconds(link, 1, batch) == 0.0


@pytest.mark.parametrize("in_shape,out_shape,dim,m,expected", [
    ((2, 32, 64), (2, 32, 4, 16), 2, 2, 2),     # features -> heads
    ((2, 32, 4, 16), (2, 32, 64), 2, 2, 2),     # heads -> features
    ((2, 32), (2, 32, 1), 1, 2, 1),             # a size-1 axis added
    ((1, 8, 100), (1, 8, 25, 4), 2, 2, None),   # 25 heads do not split in two
    ((2, 32, 64), (64, 64), 2, 2, 1),           # batch and sequence merged: features still whole
    ((2, 32, 64), (2, 2048), 2, 2, None),       # features the minor part of a merge: not contiguous
])
def test_reshape_carries_a_split_where_it_can(in_shape, out_shape, dim, m, expected):
  assert propagation.reshape_dim(in_shape, out_shape, dim, m) == expected


def test_rule_tables_have_documented_defaults():
  assert set(strategies.SITE_RULES) == {"dot_general", "gather"}
  assert propagation.PROPAGATION_RULES["add"] is propagation.PROPAGATION_RULES["mul"]
  assert "sort" not in propagation.PROPAGATION_RULES  # default: all-gather and go on whole


def test_state_specs_follow_the_choice_and_add_zero_over_data(mlp_profile):
  space, solution, _ = _solve(mlp_profile, FAST)
  w = models.get("mlp")
  specs = dict(state_specs(w.abstract_state(), ("data", "model"), (4, 2), 1,
                           strategy_ilp.param_dims(space, solution.choice)))
  assert specs["params/layers/0/kernel"] == (None, "model")
  assert specs["params/layers/0/bias"] == ("model",)
  assert specs["params/layers/1/kernel"] == ("model",)
  assert specs["opt_state/0/mu/layers/0/kernel"] == ("data", "model")   # follows its parameter; ZeRO-1 on top
  assert specs["opt_state/0/nu/layers/1/kernel"] == ("model", "data")
  assert specs["params/layers/2/bias"] == ()
