"""Pricing and searching sharded groups (FSDP inside a group of one device kind) and the fsdp baseline."""

import dataclasses
import json

import jax
import pytest

import hetspmd as hs
from hetspmd import models
from hetspmd.cli import main
from hetspmd.models.gpt2 import GPT2Config
from hetspmd.passes.profile import profile_step
from hetspmd.plan.groups import GroupPlan
from hetspmd.planner import sharding
from hetspmd.planner.grouping import _may_fit, _may_fit_sharded, _peak, price_groups, search_groups, to_group_plan
from hetspmd.planner.pricing import Costing, device_groups
from hetspmd.planner.ranking import SEARCHED_REMAT, microbatch_sizes, search
from hetspmd.report import explain_group_text

BATCH = 64


@pytest.fixture(scope="module")
def deep_profile():
  """A small GPT-2 of 16 blocks: its largest layer a small part of its parameters, as in the models FSDP is for."""
  w = dataclasses.replace(models.get("gpt2-tiny"), name="gpt2-deep",
                          config=GPT2Config(n_layer=16, n_head=4, d_model=64, vocab_size=512, n_ctx=128))
  return profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2, 64))


def _least(costing, kind_devices, sharded):
  """The least bytes a device needs at microbatch 1 under any searched policy, unsharded or in a sharded group of
  ``kind_devices``, with none of the optimizer state and none of the reduced gradients."""
  if sharded:
    return min(sharding.sharded_peak(costing.profile, kind_devices, (1, r), 0.0, 0.0, "bfloat16")
               for r in SEARCHED_REMAT)
  return min(_peak(costing, 6, (1, r), (0, r), 0.0, 0.0) for r in SEARCHED_REMAT)


def _pool(profile, memory):
  """Two roomy devices and four of the same speed with ``memory`` bytes each, in two hosts."""
  fast = dict(fp32_flops=2e12, bf16_flops=4e12, memory_bandwidth=4e11)
  specs = {"Roomy": hs.DeviceSpec("Roomy", memory_bytes=2**32, **fast),
           "Tight": hs.DeviceSpec("Tight", memory_bytes=int(memory), **fast)}
  return hs.Cluster.parse("1x2xRoomy+1x4xTight;inter=100Gbps", devices=specs)


def test_sharded_memory_falls_with_the_group(deep_profile):
  peaks = [sharding.sharded_peak(deep_profile, g, (1, "none"), None, None) for g in (2, 4, 8, 16)]
  assert all(a > b for a, b in zip(peaks, peaks[1:])), peaks
  costing = Costing(hs.Cluster.parse("1x8xV100-32GB"), deep_profile, 1)
  assert peaks[2] < _peak(costing, 8, (1, "none"), (0, "none"), None, None)  # below the unsharded group's
  # the saving is the accumulator and parameters' parts: (params + grads) * (1/4 - 1/8) between 4 and 8
  saved = (deep_profile.param_bytes + deep_profile.param_count * 4) * (1 / 4 - 1 / 8) * 1.1
  assert peaks[1] - peaks[2] == pytest.approx(saved, rel=1e-3)


def test_a_kind_that_cannot_join_joins_sharded(deep_profile):
  """A kind none of whose microbatches fits its devices whole, and that cannot take a model axis (the profile has
  no graph to split), joins the group plan as a sharded group."""
  deep_profile = dataclasses.replace(deep_profile, traces=(), strategy_spaces={})
  costing = Costing(_pool(deep_profile, 2**32), deep_profile, 1)
  plain, sharded = _least(costing, 4, False), _least(costing, 4, True)
  assert sharded < plain
  cluster = _pool(deep_profile, (plain + sharded) / 2)
  costing = Costing(cluster, deep_profile, 1)
  sizes = microbatch_sizes(BATCH)
  assert not any(_may_fit(costing, "Tight", m, 6, SEARCHED_REMAT) for m in sizes)  # unsharded it cannot join
  assert any(_may_fit_sharded(costing, "Tight", m, 4, SEARCHED_REMAT) for m in sizes)
  e = search_groups(cluster, deep_profile, BATCH, sizes, remat_policies=SEARCHED_REMAT,
                    grad_reduce_dtypes=("float32", "bfloat16"))
  tight = [i for i, k in enumerate(e.kinds) if k == "Tight"]
  assert len(tight) == 4 and all(e.group.shard_params[i] for i in tight)
  assert "parameters sharded (FSDP) on Tight" in e.name
  assert all(m <= cluster.devices[d].spec.memory_bytes for d, m in zip(e.device_positions, e.memory_bytes))
  assert sum(e.counts[i] for i in tight) > 0  # the Tight devices take part of the batch
  plan = to_group_plan(cluster, e)
  group = next(g for g in plan.groups if set(g.devices) == {cluster.devices[e.device_positions[i]].id for i in tight})
  assert group.shard_params and group.model == 1
  again = GroupPlan.from_json(json.loads(plan.dumps()))
  assert again == plan and [g.shard_params for g in again.groups] == [g.shard_params for g in plan.groups]


def test_one_kind_pool_has_a_sharded_group_plan_and_the_fsdp_baseline(deep_profile):
  cluster = hs.Cluster.parse("1x4xV100-32GB")
  e = search_groups(cluster, deep_profile, BATCH, microbatch_sizes(BATCH), remat_policies=SEARCHED_REMAT)
  assert e is not None and e.group.shard_params == (True,) * 4  # unsharded, one group would be the single program
  plan = to_group_plan(cluster, e)
  assert len(plan.groups) == 1 and plan.groups[0].shard_params
  result = search(cluster, deep_profile, BATCH)
  fsdp = result.baselines["fsdp"]
  assert fsdp.name == "fsdp" and sum(fsdp.counts) * fsdp.microbatch == BATCH
  assert max(fsdp.counts) - min(fsdp.counts) <= 1  # an even batch
  # the parameters, gradients and optimizer state held in quarters: below ZeRO-1's single program at its microbatch
  held = sharding.sharded_peak(deep_profile, 4, (fsdp.microbatch, fsdp.remat), None, None, fsdp.grad_reduce_dtype,
                               state_sharded=True)
  assert fsdp.memory_bytes == (held,) * 4
  assert held < Costing(cluster, deep_profile, 1).memory(4, fsdp.microbatch, 1, fsdp.remat)


def test_search_json_reports_the_fsdp_baseline(capsys):
  assert main(["search", "--model", "gpt2-tiny", "--cluster", "1x4xV100-32GB", "--global-batch", "32", "--seq", "64",
               "--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  fsdp = report["baselines"]["fsdp"]
  assert fsdp["name"] == "fsdp" and fsdp["throughput"] > 0 and fsdp["mesh"]["data"] == 4


def test_where_every_kind_shards_the_plan_is_hybrid_and_holds_its_state_split(deep_profile):
  """Two kinds in three hosts of four devices, one kind (two hosts) too tight to hold the model whole: every kind
  sharded makes a hybrid plan (a group per host, each its state split over its devices, the groups' parts added
  across hosts), priced with a quarter of the state per device and no parameters sent after the update."""
  deep_profile = dataclasses.replace(deep_profile, traces=(), strategy_spaces={})
  costing = Costing(_pool(deep_profile, 2**32), deep_profile, 1)
  plain, sharded = _least(costing, 4, False), _least(costing, 4, True)
  fast = dict(fp32_flops=2e12, bf16_flops=4e12, memory_bandwidth=4e11)
  specs = {"Roomy": hs.DeviceSpec("Roomy", memory_bytes=2**32, **fast),
           "Tight": hs.DeviceSpec("Tight", memory_bytes=int((plain + sharded) / 2), **fast)}
  cluster = hs.Cluster.parse("1x4xRoomy+2x4xTight;inter=10Gbps", devices=specs)
  e = search_groups(cluster, deep_profile, BATCH, microbatch_sizes(BATCH), remat_policies=SEARCHED_REMAT,
                    grad_reduce_dtypes=("float32", "bfloat16"))
  assert "hybrid" in e.name and all(e.group.shard_params) and not e.zero_stage
  plan = to_group_plan(cluster, e)
  assert plan.hybrid and not plan.state_shares and [len(g.devices) for g in plan.groups] == [4, 4, 4]
  assert "hybrid: each group holds its parameters and optimizer state split" in explain_group_text(plan)
  held = [sharding.sharded_peak(deep_profile, 4, (m, r), None, None, e.grad_reduce_dtype, state_sharded=True)
          for m, r in zip(e.group.microbatches, e.group.remats)]
  assert list(e.memory_bytes) == held
  # the exchange: the groups' quarters added across the hosts, nothing sent back
  exchange = sharding.hybrid_exchange_seconds(cluster, [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)], deep_profile,
                                              e.grad_reduce_dtype)
  assert e.comm_seconds == pytest.approx(exchange)


def test_kinds_of_their_own_remat_policies_are_priced_handing_over_parts(deep_profile):
  """A sharded kind beside an unsharded one of its size, each under its own remat policy, is priced as the runtime
  runs it (:attr:`~hetspmd.plan.execution.Execution.parts_exchange`): the sharded devices hand over their parts,
  not whole-shaped rows, whatever policy each kind runs."""
  deep_profile = dataclasses.replace(deep_profile, traces=(), strategy_spaces={})
  fast = dict(fp32_flops=2e12, bf16_flops=4e12, memory_bandwidth=4e11)
  specs = {k: hs.DeviceSpec(k, memory_bytes=2**32, **fast) for k in ("Roomy", "Tight")}
  cluster = hs.Cluster.parse("1x4xRoomy+1x4xTight;inter=100Gbps", devices=specs)
  costing = Costing(cluster, deep_profile, 1)
  layout = device_groups(cluster, "group programs by kind", tuple(range(8)), 1)
  for remats in ({"Roomy": "dots", "Tight": "dots"}, {"Roomy": "none", "Tight": "full"}):
    e = price_groups(costing, layout, {"Roomy": 2, "Tight": 2}, remats, BATCH, sharded=frozenset({"Tight"}))
    assert e.group.execution.parts_exchange and set(e.group.remats) == set(remats.values())
    tight = e.kinds.index("Tight")
    assert e.memory_bytes[tight] == sharding.sharded_peak(deep_profile, 4, (2, remats["Tight"]), None, None,
                                                          part_row=True)


@pytest.mark.parametrize("processes,size,spans", [
    (8, 4, 4),  # one process per device: a group per host, each spanning its host's four processes
    (4, 4, 2),  # two processes per host
    (2, 4, 1),  # a process per host
    (1, 8, 1),  # one process driving both hosts (an emulated pool): its devices are one group
])
def test_sharded_groups_are_a_hosts_devices_whatever_processes_run_them(deep_profile, processes, size, spans):
  """A sharded group runs as one program over its devices, every process holding some calling it, so the search
  cuts a sharded kind per host, not per process: one process per GPU still shards over the host (the plan's file
  as the runtime runs it)."""
  from hetspmd.plan.execution import Execution
  from hetspmd.planner.grouping import price_groups
  from hetspmd.planner.pricing import device_groups

  deep_profile = dataclasses.replace(deep_profile, traces=(), strategy_spaces={})
  cluster = hs.Cluster.parse(f"2x4xV100-32GB;processes={processes}")
  layout = device_groups(cluster, "group programs by kind", tuple(range(8)), 1)
  e = price_groups(Costing(cluster, deep_profile, 1), layout, {"V100-32GB": 1}, "none", BATCH,
                   sharded=frozenset({"V100-32GB"}))
  assert "hybrid" in e.name  # every group shards (one group of every device: plain FSDP)
  held = sharding.sharded_peak(deep_profile, size, (1, "none"), None, None, state_sharded=True)
  assert e.memory_bytes == (held,) * 8
  plan = to_group_plan(cluster, e)
  assert plan.hybrid and [len(g.devices) for g in plan.groups] == [size] * (8 // size)
  run = 8 // processes
  execution = Execution.of(plan, {d: d // run for d in range(8)})
  assert execution.groups == e.group.execution.groups
  assert all(len(p) == spans for p, _, _ in execution.groups)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pool", ["2x4xV100-32GB;inter=100Gbps", "1x8xA100-80GB"])
def test_the_fsdp_baseline_is_a_group_plan_that_runs_exactly(pool):
  """The ``fsdp`` baseline the search prints is a plan: the group plan it writes (one group of every device, its
  parameters and optimizer state split over them; over two hosts too) runs the step, checked against one device."""
  from conftest import require_devices
  from test_group_programs import _batches, _state, _trained, dropout_step

  require_devices(8)
  cluster = hs.Cluster.parse(pool)
  cluster = cluster.replace(jax_device_ids=tuple(d.id for d in jax.devices()[:8]))
  profile = profile_step(dropout_step, _state(), _batches(4)[0])
  result = search(cluster, profile, 48, top=1, remat_policies=("none",), groups=True)
  fsdp = result.baselines["fsdp"]
  assert result.fastest.throughput >= fsdp.throughput and result.group_plan.throughput >= fsdp.throughput
  plan = to_group_plan(cluster, fsdp)
  assert len(plan.groups) == 1 and plan.groups[0].shard_params and plan.hybrid and len(plan.devices) == 8
  assert fsdp.group.execution.hybrid and len(fsdp.group.execution.groups) == 1
  trained, ref = _trained(dropout_step, plan, _state, _batches(48))
  ref.check(trained)


@pytest.fixture(scope="module")
def medium_profile():
  w = models.get("gpt2-medium")
  return profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))


@pytest.mark.parametrize("pool", ["1x8xA100-80GB", "2x8xA100-80GB;inter=100Gbps;processes=1", "1x8xV100-16GB"])
def test_one_price_for_plain_fsdp(pool, medium_profile):
  """Plain FSDP (one group of every device sharding its parameters) has one price: where the group search's plan is
  that group, it costs what the fsdp baseline costs, to the second and the byte."""
  profile = medium_profile
  cluster = hs.Cluster.parse(pool)
  fsdp = search(cluster, profile, BATCH, top=1, remat_policies=("none", "layers"), groups=True).baselines["fsdp"]
  grouped = search_groups(cluster, profile, BATCH, microbatch_sizes(BATCH), remat_policies=("none", "layers"))
  assert len(grouped.group.execution.groups) == 1 and grouped.group.execution == fsdp.group.execution
  assert (grouped.microbatch, grouped.remat) == (fsdp.microbatch, fsdp.remat)
  assert grouped.step_seconds == pytest.approx(fsdp.step_seconds, rel=1e-9)
  assert grouped.memory_bytes == fsdp.memory_bytes


@pytest.mark.parametrize("remat", ["none", "layers"])
def test_on_cpu_devices_a_sharded_group_pays_a_latency_per_collective_it_issues(deep_profile, remat):
  """XLA:CPU combines no collectives, so a sharded group there pays a link latency for each all-gather and
  reduce-scatter its program issues (one per reader of each leaf, one per leaf: 16 blocks give over a hundred),
  where a GPU's combiners leave one per layer; the bytes moved are the same order either way."""
  fast = dict(fp32_flops=2e12, bf16_flops=4e12, memory_bandwidth=4e11, memory_bytes=2**32)
  specs = {name: hs.DeviceSpec(name, **fast) for name in ("cpu-like", "gpu-like")}
  assert not sharding.combines("cpu-like") and sharding.combines("gpu-like")
  cluster = hs.Cluster.parse("1x8xgpu-like", devices=specs)
  devices, latency = tuple(range(8)), cluster.hosts[0].intra.latency
  leaves = sum(size > 1 for size in deep_profile.param_leaf_sizes)
  reads = sum(f * (2 if remat == "layers" else 1) + b for f, b, _ in deep_profile.param_reads)
  issued = reads + leaves
  assert reads >= 2 * 16 and issued > 100  # every block's matmuls gathered forward and backward
  combined, uncombined = (sharding.microbatch_comm_seconds(cluster, devices, deep_profile, "float32", remat,
                                                           combined=c) for c in (True, False))
  assert uncombined >= issued * 7 * latency > combined
  free = dataclasses.replace(deep_profile, param_reads=())  # a profile that does not say: priced per layer
  assert sharding.microbatch_comm_seconds(cluster, devices, free, "float32", remat, combined=False) == combined
