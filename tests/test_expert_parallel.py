"""Expert parallelism on the model axis: the ``expert`` split of a stacked expert weight, chosen and exact.

An MoE block applies a stack of expert weights ``[E, ...]`` batch-wise
(``einsum("ebcd,edf->ebcf")``). Splitting the stack's expert dimension over
``model`` gives each device of a group its own experts; the tokens of the
group's microbatch are dispatched on every device alike, each device keeps
the slots of its experts, and the combine contracts the expert dimension,
so one all-reduce over the group adds the experts' outputs (and one adds
the dispatch's input gradients in the backward pass). No all-to-all: the
microbatch loop keeps its per-device trip counts.
"""

import dataclasses

import jax
import optax
import pytest

import hetspmd as hs
from hetspmd import Cluster, models
from hetspmd.passes.sharding import ilp as strategy_ilp
from hetspmd.report import explain_text
from hetspmd.planner.building import plan_from
from hetspmd.passes.profile import profile_step
from hetspmd.planner.ranking import search

from conftest import require_devices
from exactness import Reference

# a link on which splitting the tiny model pays, and the experts' all-reduces beat Megatron splits inside each expert
FAST = "1x8xV100-32GB;intra=100GB/s;intra_latency=0us"
SLOW = "1x8xV100-32GB;intra=1Mbps"                          # communication hopeless
EXPERTS = ("params/layers/1/mlp/wi", "params/layers/1/mlp/wo")
STEPS = 3


def _workload():
  # eps=1e-4: parameters whose true gradient is zero would otherwise turn rounding noise into full adam steps
  return dataclasses.replace(models.get("bert-moe-tiny"), make_optimizer=lambda: optax.adam(1e-3, eps=1e-4))


@pytest.fixture(scope="module")
def moe_profile():
  w = _workload()
  return profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))


def _chosen(profile, spec, m, microbatch=8):
  cluster = Cluster.parse(spec)
  space = profile.strategy_spaces[m]
  seconds = profile.node_seconds(cluster.hosts[0].device, microbatch) * ~profile.per_step
  solution = strategy_ilp.choose(space, seconds, cluster.hosts[0].intra, microbatch)
  return space, solution


def _decision(space, path):
  return next(d for d in space.decisions if d.name.endswith(path))


@pytest.mark.parametrize("m", [2, 4])
def test_experts_split_along_their_stack_when_communication_is_cheap(moe_profile, m):
  space, solution = _chosen(moe_profile, FAST, m)
  named = {d.name.split("/", 1)[1]: d.options[o].strategy.name for d, o in zip(space.decisions, solution.choice)}
  assert named["params/layers/1/mlp/wi"] == "expert" and named["params/layers/1/mlp/wo"] == "expert"
  dims = strategy_ilp.param_dims(space, solution.choice)
  for path in EXPERTS + ("params/layers/1/mlp/bi", "params/layers/1/mlp/bo"):   # the biases follow their experts
    assert dims[path] == 0, path
  expert = next(o for o in _decision(space, "mlp/wo").options if o.strategy.name == "expert")
  assert not expert.permute                      # no all-to-all or permute: the group's tokens are on every device
  assert expert.traffic.all_reduces >= 1         # the combine contracts the expert dimension: one all-reduce
  graph = moe_profile.traces[0]
  dots = [n for n in expert.scaled if graph.nodes[n].primitive == "dot_general"]
  assert len(dots) >= 3                          # forward, input-gradient and weight-gradient matmuls divide by m


def test_experts_stay_whole_when_the_link_is_hopeless(moe_profile):
  space, solution = _chosen(moe_profile, SLOW, 2)
  assert set(solution.choice) == {0}
  assert "expert" in {o.strategy.name for o in _decision(space, "mlp/wi").options}  # offered, not taken


def _reference(w, batches):
  return Reference(w.make_train_step(), w.init_state(0)).run(batches)


# (model-axis size, microbatch counts per data position, microbatch): uneven counts inside the planned layout
CASES = [(2, (3, 2, 2, 1), 2), (4, (5, 3), 2), (2, (2, 2, 2, 2), 2)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("m,counts,microbatch", CASES)
def test_searched_expert_parallel_plan_matches_single_device(moe_profile, m, counts, microbatch):
  require_devices(8)
  w = _workload()
  cluster = Cluster.parse(FAST)
  best = search(cluster, moe_profile, 16, top=1, models=(m,), remat_policies=("none",)).plans[0]
  assert dict(best.tensor_parallel.model_dims)["params/layers/1/mlp/wi"] == 0
  global_batch = sum(counts) * microbatch
  planned = dataclasses.replace(best, counts=counts, microbatch=microbatch, global_batch=global_batch,
                                device_positions=tuple(range(len(counts) * m)), kinds=("V100-32GB",) * len(counts),
                                zero_stage=0)
  plan = plan_from(planned, cluster, w.abstract_state())
  specs = dict(plan.state_specs)
  assert specs["params/layers/1/mlp/wi"] == ("model",) and specs["params/layers/1/mlp/bo"] == ("model",)
  assert specs["opt_state/0/mu/layers/1/mlp/wi"] == ("model",)   # Adam's moments live with their experts
  assert "layers/*/mlp/wi (dim 0)" in explain_text(plan)            # hetspmd explain names the split
  batches = [w.synthetic_batch(i, batch=global_batch) for i in range(STEPS)]
  ref = _reference(w, batches)

  step = hs.parallelize(w.make_train_step(), plan=plan, global_batch=global_batch)
  state = step.shard_state(w.init_state(0))
  wi = state["params"]["layers"][1]["mlp"]["wi"]
  assert wi.addressable_shards[0].data.shape[0] == wi.shape[0] // m   # each device holds its own experts
  for i, batch in enumerate(batches):
    state, metrics = step(state, batch)
    ref.check_metrics({"loss": metrics["loss"]}, i)
  ref.check(jax.device_get(state))
  assert "per-device trip counts" in step.explain()   # no all-to-all forced the loop into lockstep
