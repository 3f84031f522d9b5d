"""How a group plan runs is decided once (:class:`hetspmd.plan.execution.Execution`): the value the search prices
for a plan is the value the runtime derives from the plan file and its processes, and the programs built read it."""

import itertools

import jax
import numpy as np
import pytest

import hetspmd as hs
from hetspmd.passes.profile import profile_step
from hetspmd.plan.execution import Execution
from hetspmd.plan.groups import is_hybrid
from hetspmd.planner.group_execution import process_of
from hetspmd.planner.grouping import price_groups, to_group_plan
from hetspmd.planner.pricing import Costing, device_groups
from hetspmd.runtime.grouped import GroupedStep

from conftest import require_devices
from test_group_programs import _state, dropout_step

BATCH = 48
_FAST = dict(fp32_flops=2e12, bf16_flops=4e12, memory_bandwidth=4e11)
SPECS = {"Big": hs.DeviceSpec("Big", memory_bytes=2**34, **_FAST),
         "Small": hs.DeviceSpec("Small", memory_bytes=2**33, fp32_flops=1e12, bf16_flops=2e12,
                                memory_bandwidth=2e11)}

# every form the group search returns: (pool, sharded kinds, ZeRO stage, tail)
POOLS = ("1x2xBig+1x4xSmall;processes=1", "1x2xBig+1x4xSmall", "2x4xSmall", "2x4xSmall;processes=1",
         "1x4xBig+1x4xSmall;processes=1", "1x4xBig+1x4xSmall")
FORMS = [((), 0, (0, 0)), ((), 1, (0, 0)), ((), 3, (0, 0)), ((), 0, (1, 2)), ((), 1, (1, 2)),
         (("Small",), 0, (0, 0)), (("Small",), 1, (0, 0)), (("Big", "Small"), 0, (0, 0)),
         (("Big", "Small"), 1, (0, 0)), (("Small",), 3, (0, 0))]


@pytest.fixture(scope="module")
def profile():
  batch = {"x": np.zeros((4, 6), np.float32), "y": np.zeros((4,), np.int32)}
  return profile_step(dropout_step, _state(), batch)


def _priced(pool, sharded, zero, tail, profile):
  cluster = hs.Cluster.parse(pool, devices=SPECS)
  layout = device_groups(cluster, "every device", tuple(range(cluster.num_devices)), 1)
  kinds = [k for k in dict.fromkeys(layout.kinds)]
  if not set(sharded) <= set(kinds):
    return cluster, None
  sizes = {k: 2 for k in kinds}
  return cluster, price_groups(Costing(cluster, profile, 1), layout, sizes, "none", BATCH, tail=tail, zero=zero,
                               sharded=frozenset(sharded))


def _processes(cluster) -> dict[int, int]:
  ids = cluster.jax_device_ids or tuple(range(cluster.num_devices))
  return dict(zip(ids, process_of(cluster)))


@pytest.mark.parametrize("pool,form", list(itertools.product(POOLS, FORMS)))
def test_the_priced_execution_is_the_plans(pool, form, profile):
  """The pricing's value for every plan it accepts equals the one made from the plan it writes, on the processes
  the pricing assumed: no second derivation of hybrid, owners, parts or processes."""
  cluster, priced = _priced(pool, *form, profile)
  if priced is None:
    pytest.skip(f"{pool}: no plan of the form {form} (a kind the pool lacks, or one the pricing refuses: a "
                "sharded group across processes under ZeRO-3)")
  plan = to_group_plan(cluster, priced)
  assert priced.group.execution == Execution.of(plan, _processes(cluster))
  assert priced.group.execution.hybrid == plan.hybrid  # one process per group: the file says as much as the run
  sharded, zero, tail = form
  assert priced.group.execution.tail == bool(tail[1])
  assert priced.group.execution.owners_reduce == (zero > 0 and not tail[1] and priced.group.execution.one_process)


def test_the_forms_are_all_met(profile):
  """The table reaches hybrid plans, owners reducing, parts to owners, ZeRO-3 parts and several processes."""
  seen = [p.group.execution for pool, form in itertools.product(POOLS, FORMS)
          for _, p in [_priced(pool, *form, profile)] if p is not None]
  for field in ("hybrid", "tail", "owners_reduce", "parts_to_owners", "zero3_parts", "parts_exchange"):
    assert any(getattr(e, field) for e in seen) and not all(getattr(e, field) for e in seen), field
  assert {e.processes for e in seen} == {1, 2}


def test_is_hybrid_table():
  assert is_hybrid([True], [8], shares=False, tail=False)  # one group: plain FSDP
  assert is_hybrid([True, True], [4, 4], shares=False, tail=False)
  assert not is_hybrid([True, True], [2, 4], shares=False, tail=False)
  assert not is_hybrid([True, False], [4, 4], shares=False, tail=False)
  assert not is_hybrid([True, True], [4, 4], shares=True, tail=False)
  assert not is_hybrid([True, True], [4, 4], shares=False, tail=True)
  assert not is_hybrid([], [], shares=False, tail=False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pool,form", [("2x4xSmall;processes=1", (("Small",), 0, (0, 0))),
                                       ("1x4xBig+1x4xSmall;processes=1", (("Small",), 0, (0, 0))),
                                       ("1x2xBig+1x4xSmall;processes=1", (("Small",), 1, (0, 0))),
                                       ("1x2xBig+1x4xSmall;processes=1", ((), 3, (0, 0)))])
def test_the_programs_are_built_from_it(pool, form, profile):
  """The runtime's value for the plan, on this process's devices, is the priced one, and the built programs follow
  it: the held-split leaves exactly where hybrid, each owner's own sums exactly where owners reduce."""
  cluster, priced = _priced(pool, *form, profile)
  require_devices(cluster.num_devices)
  plan = to_group_plan(cluster.replace(jax_device_ids=tuple(d.id for d in jax.devices()[:cluster.num_devices])),
                       priced)
  runtime = GroupedStep.across_processes(dropout_step, plan)
  assert runtime.execution == priced.group.execution
  batch = {"x": np.zeros((BATCH, 6), np.float32), "y": np.zeros((BATCH,), np.int32)}
  built = runtime.prepare(dropout_step, _state(), batch, ())
  assert bool(built.held_split) == priced.group.execution.hybrid
  assert (built.needs is not None) == priced.group.execution.owners_reduce
  execution = priced.group.execution
  assert bool(built.part_sums) == (execution.parts_to_owners or execution.hybrid or execution.parts_exchange)


def test_every_feature_entry_names_what_exists():
  """Each group plan feature's entry (hetspmd.lowering.group_features) names stages of the group programs' chain,
  a held-leaf role, transfer functions and pricing functions that exist."""
  import importlib

  from hetspmd.lowering.group_features import FEATURES

  chain = {"loop", "constrain", "widen", "hold", "reorder", "narrow", "spread"}
  assert len({f.name for f in FEATURES}) == len(FEATURES)
  for f in FEATURES:
    assert set(f.stages) <= chain, f.name
    assert f.role in (None, "opt_state", "param"), f.name
    for package, names in (("lowering", f.transfers), ("planner", f.price)):
      for name in names:
        module, function = name.split(".")
        assert hasattr(importlib.import_module(f"hetspmd.{package}.{module}"), function), (f.name, name)


def test_the_forms_reach_every_feature(profile):
  """Every feature entry applies to some plan the pricing makes (but three its own tests price)."""
  from hetspmd.lowering.group_features import FEATURES

  made = [(to_group_plan(cluster, p), p.group.execution) for pool, form in itertools.product(POOLS, FORMS)
          for cluster, p in [_priced(pool, *form, profile)] if p is not None]
  for f in FEATURES:
    if f.name in ("model axis", "remat per group", "narrow reduction"):  # priced elsewhere (their own tests)
      continue
    assert any(f.applies(plan, ex) for plan, ex in made), f.name


def test_the_priced_peak_of_a_sharded_group_holds_its_part_where_groups_exchange_parts(profile):
  """Beside an unsharded group of its size, a sharded group's device hands the exchange its part of the sums,
  not a whole-sized row: its priced peak is lower by three quarters of a row (groups of 4), and nothing else
  about it changes; beside a group of another size it still holds the whole row."""
  import dataclasses

  from hetspmd.planner.data_axis import REDUCE_BYTES, WORKSPACE

  # the step's parameters made large enough that the rows after the loop, not a microbatch, set the peak
  profile = dataclasses.replace(profile, param_count=10**8, param_bytes=4 * 10**8)
  _, parts = _priced("1x4xBig+1x4xSmall;processes=1", ("Small",), 0, (0, 0), profile)
  _, rows = _priced("1x2xBig+1x4xSmall;processes=1", ("Small",), 0, (0, 0), profile)
  assert parts.group.execution.parts_exchange and not rows.group.execution.parts_exchange
  small = lambda p: max(m for m, k in zip(p.memory_bytes, p.kinds) if k == "Small")
  row = profile.param_count * REDUCE_BYTES["float32"] * WORKSPACE
  assert small(rows) - small(parts) == pytest.approx(row * 3 / 4, abs=2) and small(parts) > row


def test_a_sharded_group_s_masked_microbatches_take_their_share_of_a_shared_host(profile):
  """A group that shards its parameters runs in lockstep: a device with fewer microbatches than the group's
  most runs the rest masked, so on a host whose devices share compute (emulated CPU devices: alone_speedup)
  it frees no share for the others. Priced so, a sharded group of 8 with only 2 microbatches to run costs
  what it costs where devices do not share compute (it was priced up to 4x faster)."""
  import dataclasses

  plain = hs.Cluster.parse("1x8xSmall;processes=1", devices=SPECS)
  shared = plain.replace(hosts=(dataclasses.replace(plain.hosts[0], alone_speedup=8.0),))
  layout = device_groups(plain, "every device", tuple(range(8)), 1)

  def priced(cluster, sharded):
    return price_groups(Costing(cluster, profile, 1), layout, {"Small": 16}, "none", 32,
                        sharded=frozenset(sharded))

  lockstep, alone = priced(shared, {"Small"}), priced(plain, {"Small"})
  assert sum(c > 0 for c in lockstep.counts) < 8  # devices with nothing of their own to run
  assert lockstep.compute_seconds == pytest.approx(alone.compute_seconds)
