"""Searching group plans: the tie rule for plans priced alike, the reduce dtypes they are priced in, the
predictions they carry, and the microbatch sizes the search leaves out."""

import json

import jax
import pytest

import hetspmd as hs
from hetspmd import models
from hetspmd.passes.profile import profile_step
from hetspmd.plan.groups import GroupPlan, group_plan
from hetspmd.planner.grouping import search_groups, to_group_plan
from hetspmd.planner.ranking import microbatch_sizes, search

from conftest import require_devices
from test_group_programs import PLANS, _batches, _state, dropout_step


def test_plans_priced_alike_take_the_fewest_microbatches():
  """Of the group plans priced within TIE of the fastest, the search takes the one whose busiest device runs the
  fewest microbatches: on a fast and a slow device, microbatches of 256 where 128 prices the same."""
  import dataclasses
  import itertools

  from hetspmd.models.mlp import MLPConfig
  from hetspmd.planner.grouping import TIE, price_groups
  from hetspmd.planner.pricing import Costing, device_groups

  require_devices(2)
  w = dataclasses.replace(models.get("mlp"), name="mlp-wide", config=MLPConfig((512, 1024, 1024, 10)))
  # two CPU cores as benchmarks/emulated_hetero.py measured them, one slowed by a busy loop
  specs = {f"cpu{i}": hs.DeviceSpec(f"cpu{i}", flops, flops, 2**30, copy, measured=True, read_bandwidth=read)
           for i, (flops, copy, read) in enumerate(((104.2e9, 3.6e9, 31e9), (48.4e9, 1.5e9, 10.7e9)))}
  cluster = hs.Cluster.emulate(jax.devices()[:2], kinds=list(specs), custom=specs)
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))
  best = search_groups(cluster, profile, 8192, [128, 256])
  costing, layout = Costing(cluster, profile, 256, 1.0), device_groups(cluster, "g", (0, 1), 1)
  priced = [price_groups(costing, layout, dict(zip(specs, sizes)), "none", 8192, tail=tail, zero=zero)
            for sizes in itertools.product([128, 256], repeat=2) for tail in [(0, 0), (128, 1), (256, 1)]
            for zero in (0, 1)]
  priced = [e for e in priced if e is not None]
  fastest = min(e.step_seconds for e in priced)
  alike = [e for e in priced if e.step_seconds <= fastest * (1 + TIE)]
  busiest = lambda e: max(c + e.group.tail[1] for c in e.counts)
  assert best.step_seconds <= fastest * (1 + TIE)
  assert busiest(best) == min(busiest(e) for e in alike)
  assert any(busiest(e) > busiest(best) for e in alike)  # the rule decided something


@pytest.mark.parametrize("third", [0.5, 0.05, 0.01])
def test_the_tie_rule_spans_every_device_set(third):
  """The rule for plans priced alike is applied once over every device set the search tries (every kind, the
  fastest kinds), not within each: on a fast, a slow and a third CPU core at ``third`` of the fast one's speed,
  the search's plan is the one the rule prefers among all plans within TIE of the fastest of any set."""
  import dataclasses

  from hetspmd.models.mlp import MLPConfig
  from hetspmd.planner.grouping import TIE, _fewest_microbatches, _near_on
  from hetspmd.planner.pricing import Costing, device_groups

  require_devices(3)
  w = dataclasses.replace(models.get("mlp"), name="mlp-wide", config=MLPConfig((512, 1024, 1024, 10)))
  rates = ((104.2e9, 3.6e9, 31e9), (48.4e9, 1.5e9, 10.7e9), (104.2e9 * third, 3.6e9 * third, 31e9 * third))
  specs = {f"cpu{i}": hs.DeviceSpec(f"cpu{i}", flops, flops, 2**30, copy, measured=True, read_bandwidth=read)
           for i, (flops, copy, read) in enumerate(rates)}
  cluster = hs.Cluster.emulate(jax.devices()[:3], kinds=list(specs), custom=specs)
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))
  best = search_groups(cluster, profile, 8192, [128, 256])
  costing = Costing(cluster, profile, 256, 1.0)
  plans = [e for devices in ((0, 1, 2), (0, 1))
           for e in _near_on(costing, device_groups(cluster, "g", devices, 1), 8192, [128, 256], ("none",))]
  fastest = min(e.step_seconds for e in plans)
  alike = [e for e in plans if e.step_seconds <= fastest * (1 + TIE)]
  assert best.step_seconds <= fastest * (1 + TIE)
  assert _fewest_microbatches(best) == min(_fewest_microbatches(e) for e in alike)


def test_group_plans_reduce_in_the_dtype_the_search_allows():
  """A search allowed only bfloat16 prices its group plan with bfloat16 gradients, and the plan it writes reduces
  in bfloat16 (through JSON too); by default group plans reduce in float32. The same plan priced both ways
  spends less on its reduction in bfloat16."""
  from hetspmd.planner.grouping import price_groups
  from hetspmd.planner.pricing import Costing, device_groups

  require_devices(8)
  cluster = hs.Cluster.emulate(jax.devices()[:8], kinds=["P100-16GB"] * 5 + ["V100-32GB"] * 3)
  profile = profile_step(dropout_step, _state(), _batches(48)[0])
  narrow = search(cluster, profile, 48, top=1, remat_policies=("none",), grad_reduce_dtypes=("bfloat16",),
                  groups=True)
  assert narrow.plans[0].grad_reduce_dtype == "bfloat16" and narrow.group_plan.grad_reduce_dtype == "bfloat16"
  plan = to_group_plan(cluster, narrow.group_plan)
  assert plan.grad_reduce_dtype == "bfloat16" and GroupPlan.from_json(json.loads(plan.dumps())) == plan
  assert "cross devices in bfloat16" in plan.summary()
  assert to_group_plan(cluster, search_groups(cluster, profile, 48, microbatch_sizes(48))).grad_reduce_dtype == "float32"
  layout = device_groups(cluster, "g", tuple(range(8)), 1)
  priced = {d: price_groups(Costing(cluster, profile, 2, 1.0), layout, {"P100-16GB": 2, "V100-32GB": 4}, "none", 48,
                            dtype=d) for d in ("float32", "bfloat16")}
  assert 0 < priced["bfloat16"].comm_seconds < priced["float32"].comm_seconds
  with pytest.raises(hs.HetSpmdError, match="reduce_dtype must be one of"):
    group_plan(PLANS[0], 38, grad_reduce_dtype="float16")


def test_a_searched_group_plan_carries_its_predictions():
  """The plan the search writes says what it predicted: the step, and per device (in the plan's device order)
  its peak bytes beside its memory and its compute seconds; they survive JSON, show in the summary, and do not
  take part in equality; a per-device list of the wrong length is refused."""
  import dataclasses

  require_devices(8)
  cluster = hs.Cluster.emulate(jax.devices()[:8], kinds=["P100-16GB"] * 5 + ["V100-32GB"] * 3)
  profile = profile_step(dropout_step, _state(), _batches(48)[0])
  priced = search_groups(cluster, profile, 48, microbatch_sizes(48))
  plan = to_group_plan(cluster, priced, ideal=2 * priced.throughput)
  predicted, per_device = dict(plan.predicted), dict(plan.predicted_per_device)
  assert predicted["step_seconds"] == pytest.approx(priced.step_seconds) and predicted["efficiency"] == 0.5
  kind_of = {d.id: k for d, k in zip(jax.devices()[:8], ["P100-16GB"] * 5 + ["V100-32GB"] * 3)}
  assert [cluster.spec_of(kind_of[d]).memory_bytes for d in plan.devices] == list(per_device["memory_capacity_bytes"])
  assert all(0 < m <= c for m, c in zip(per_device["memory_bytes"], per_device["memory_capacity_bytes"]))
  assert len(per_device["compute_seconds"]) == 8
  again = GroupPlan.from_json(json.loads(plan.dumps()))
  assert again == plan and again.predicted == plan.predicted and again.predicted_per_device == plan.predicted_per_device
  assert "predicted memory_bytes by device" in plan.summary()
  assert dataclasses.replace(plan, predicted=()) == plan
  with pytest.raises(hs.HetSpmdError, match="predicted 'memory_bytes' has 2 values for the plan's 8 devices"):
    dataclasses.replace(plan, predicted_per_device=(("memory_bytes", (1.0, 2.0)),))


@pytest.mark.parametrize("policies", [("none",), ("none", "dots", "full")])
def test_the_group_search_leaves_out_only_sizes_no_plan_fits(policies, monkeypatch):
  """Per-kind microbatch sizes that a device of the kind cannot hold even without optimizer state or reduced
  gradients are left out before the per-kind product (on three kinds at a large batch the product was most of a
  search's time): the search's plan is the one it finds over the whole product, with fewer plans priced."""
  import dataclasses

  from hetspmd.planner.data_axis import memory_per_device
  from hetspmd.models.mlp import MLPConfig
  from hetspmd.planner import grouping

  require_devices(3)
  w = dataclasses.replace(models.get("mlp"), name="mlp-wide", config=MLPConfig((512, 1024, 1024, 10)))
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))
  holds = {"small": 256, "middle": 512, "large": 2048}  # the largest microbatch each kind holds with no state
  least = lambda m: min(memory_per_device(profile, 3, m, 0, r, optimizer_share=0.0, reduced_share=0.0)
                        for r in policies) + 1
  specs = {k: hs.DeviceSpec(k, 1e11 * (i + 1), 1e11 * (i + 1), least(m), 3e9 * (i + 1), measured=True)
           for i, (k, m) in enumerate(holds.items())}
  cluster = hs.Cluster.emulate(jax.devices()[:3], kinds=list(specs), custom=specs)
  sizes = microbatch_sizes(4096)
  priced = []
  price = grouping.price_groups
  monkeypatch.setattr(grouping, "price_groups", lambda *a, **k: priced.append(a[2]) or price(*a, **k))
  pruned = search_groups(cluster, profile, 4096, sizes, remat_policies=policies)
  calls = len(priced)
  assert all(s[k] <= holds[k] for s in priced for k in s)
  monkeypatch.setattr(grouping, "_may_fit", lambda *a: True)
  whole = search_groups(cluster, profile, 4096, sizes, remat_policies=policies)
  assert pruned == whole and pruned is not None
  assert calls < len(priced) - calls


@pytest.mark.parametrize("processes,shares,factor", [
    (1, [1 / 8] * 8, 1.0),              # even shares, copies: each device sends 7/8, as a ring all-gather does
    # one device holds 65%: it splits its share over 8 (7/8 of it leave), then an all-gather (1.65 rings), where
    # copies would send 7 x 65% from it (5.2 rings); the (4,) bias, which zero-padding to 8 would double, is copied
    (1, [0.65] + [0.05] * 7, 208 / 212 * 1.65 + 4 / 212 * 5.2),
    (2, [1 / 8] * 8, 2.0),              # across processes: one uniform program adds every device's row
])
def test_the_parameters_made_in_shares_are_priced_as_they_are_sent(processes, shares, factor):
  """ZeRO-1 group plans send each parameter an update program made from its device: in one process as copies
  from that device (the busiest device's bytes, against a ring all-gather's) or, where one device holds much more
  than the rest, split over the devices then gathered; across processes as an all-reduce of rows that are zeros
  but on the owner."""
  from hetspmd.plan.groups import copy_factor, relay_factor, relays

  assert relays(shares) == (shares[0] == 0.65)
  assert copy_factor([0.65] + [0.05] * 7) == pytest.approx(5.2) and relay_factor([0.65] + [0.05] * 7) == 1.65
  from hetspmd.planner.data_axis import NO_TENSOR_PARALLEL, whole_gather_seconds
  from hetspmd.planner.group_shares import gather_seconds as _gather_seconds
  from hetspmd.planner.pricing import Costing, device_groups

  cluster = hs.Cluster.parse(f"2x4xV100-32GB;inter=100Gbps;processes={processes}")
  profile = profile_step(dropout_step, _state(), _batches(48)[0])
  costing = Costing(cluster, profile, 2, 1.0)
  layout = device_groups(cluster, "g", tuple(range(8)), 1)
  ring = whole_gather_seconds(cluster, layout.hosts, profile)  # every leaf whole, over all 8 devices
  assert ring > costing.gradient_seconds(layout, NO_TENSOR_PARALLEL, 1, "float32")[1]  # not only ZeRO's split leaves
  assert _gather_seconds(costing, layout, shares, 1) == pytest.approx(factor * ring)


@pytest.mark.timeout(30)
def test_group_counts_end_where_per_step_work_dwarfs_a_microbatch():
  """The least makespan moves on past a finish time that rounding would not count (per-step work 1e11 times a
  microbatch's): the kind that starts first takes the whole batch."""
  from hetspmd.plan.counts import KindCost
  from hetspmd.planner.grouping import group_counts

  costs = {"a": KindCost(1e-9, 100.0), "b": KindCost(1.7e-9, 90.0)}
  assert group_counts(["a", "a", "b"], costs, {"a": 2, "b": 1}, 1000) == (0, 0, 1000)


@pytest.mark.parametrize("sharded", [False, True], ids=["unsharded", "sharded"])
def test_a_group_of_one_microbatch_per_device_runs_no_loop(sharded, monkeypatch):
  """As a single program (test_cost_model), a group whose every device runs one microbatch neither zeros a
  gradient accumulator nor adds into one: priced so, it saves the zeros and the add; a group sharding its
  parameters over its 4 devices, a quarter of them. Two microbatches a device are a loop, priced as before."""
  from hetspmd.planner.grouping import price_groups
  from hetspmd.planner.pricing import Costing, device_groups

  w = models.get("mlp-tiny")
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))
  pool = hs.Cluster.parse("1x4xV100-32GB")
  layout = device_groups(pool, "one kind", tuple(range(4)), 1)
  kind = frozenset({"V100-32GB"} if sharded else ())

  def priced(c):
    return price_groups(Costing(pool, profile, 8), layout, {"V100-32GB": 8}, "none", 8 * 4 * c, sharded=kind)

  once, twice = priced(1), priced(2)
  assert once.counts == (1,) * 4 and twice.counts == (2,) * 4
  monkeypatch.setattr(Costing, "one_pass", lambda self, kind, cost, share: cost)
  looped_once, looped_twice = priced(1), priced(2)
  spec = pool.spec_of("V100-32GB")
  saved = (profile.accumulate_seconds(spec) + profile.zeroing_seconds(spec)) * (1 / 4 if sharded else 1.0)
  assert looped_once.compute_seconds - once.compute_seconds == pytest.approx(saved, rel=1e-6) and saved > 0
  assert looped_twice.compute_seconds == twice.compute_seconds


@pytest.mark.parametrize("form", ["state shares", "fsdp baseline"])
def test_every_group_form_pays_the_accumulators_zeros_once_and_only_with_a_loop(form, monkeypatch):
  """Groups holding the optimizer state in shares (ZeRO-1) zero their whole accumulator every step of a loop,
  their update's share aside; the ``fsdp`` baseline zeros its ``1/n`` part, and with one microbatch a device it
  runs no loop and zeros nothing."""
  from hetspmd.passes.costing.step_cost import StepProfile
  from hetspmd.planner import sharding
  from hetspmd.planner.grouping import price_groups
  from hetspmd.planner.pricing import Costing, device_groups

  w = models.get("mlp-tiny")
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))
  pool = hs.Cluster.parse("1x2xV100-32GB+1x2xP100-16GB")
  zeros = {k: profile.zeroing_seconds(pool.spec_of(k)) for k in pool.kinds}

  def priced(count):
    costing = Costing(pool, profile, 8)
    if form == "fsdp baseline":
      return sharding.fsdp_baseline(costing, 8 * 4 * count, [8], ["none"])
    layout = device_groups(pool, "by kind", tuple(range(4)), 1)
    return price_groups(costing, layout, {"V100-32GB": 8, "P100-16GB": 8}, "none", 8 * 4 * count, zero=1)

  paying = [priced(c) for c in (1, 2)]
  monkeypatch.setattr(StepProfile, "zeroing_seconds", lambda self, spec: 0.0)
  free = [priced(c) for c in (1, 2)]
  paid = [a.compute_seconds - b.compute_seconds for a, b in zip(paying, free)]
  assert [p.counts for p in paying] == [p.counts for p in free]
  if form == "fsdp baseline":
    assert paid == [pytest.approx(0.0, abs=1e-15), pytest.approx(zeros["P100-16GB"] / 4, rel=1e-6)]
  else:  # the busiest position's own kind's whole accumulator (its counts run a loop)
    busy = paying[1].position_seconds.index(max(paying[1].position_seconds))
    assert max(paying[1].counts) >= 2 and paid[1] == pytest.approx(zeros[paying[1].kinds[busy]], rel=1e-6)
