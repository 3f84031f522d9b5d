"""Rebalancing group plans: one-device groups, groups sharding their parameters (hybrid plans), groups of
different microbatch sizes and idle groups, moved by scripted group times (the emulated devices are one CPU, so
their own times say nothing about balance); every rebalanced run is checked against one device in float64
(tests/exactness.py)."""

import itertools

import jax
import numpy as np
import pytest

import hetspmd as hs
from exactness import Reference
from hetspmd.errors import HetSpmdError, InvalidValueError
from hetspmd.plan.balance import Balance, Rebalance, update
from hetspmd.plan.groups import Group, GroupPlan, group_plan
from hetspmd.runtime.rebalancing import Rebalancer

from test_rebalance import _workload


def _group_plan(counts, microbatch=4, global_batch=64):
  return group_plan([Group((d.id,), microbatch, (c,)) for d, c in zip(jax.devices()[:2], counts)], global_batch)


def _rebalanced(monkeypatch, plan, times, calls):
  """The MLP under ``plan`` rebalanced every call (two agreeing measurements move it) on scripted group times
  (``times``: one ``{group label: (seconds per microbatch, 0)}`` for every measurement, or a list of them in
  turn), run ``calls`` times with each call's metrics and the final state checked against one device in
  float64; the step and, after each call, ``(counts, buffer slots, programs built)``."""
  script = itertools.repeat(times) if isinstance(times, dict) else iter(times)
  monkeypatch.setattr(Rebalancer, "grouped", lambda self, front: dict(next(script)))
  w = _workload()
  step = hs.parallelize(w.make_train_step(hs.value_and_grad), plan=plan, global_batch=64,
                        rebalance=Rebalance(every=1, confirm=2, smoothing=1.0))
  ref = Reference(w.make_train_step(), w.init_state(0))
  state = step.shard_state(w.init_state(0))
  seen = []
  for i in range(calls):
    batch = w.synthetic_batch(i, batch=64)
    state, metrics = step(state, batch)
    ref.step(batch)
    ref.check_metrics(metrics, i)
    seen.append((tuple(c for g in step.plan.groups for c in g.counts), tuple(g.max_count for g in step.plan.groups),
                 step.rebalancer.compiles))
  ref.check(state)
  return step, seen


def test_group_plans_rebalance_exactly(monkeypatch):
  """A group plan of two one-device groups: scripted group times move [12 | 4] to [4 | 12]; the rebalanced steps
  match one device in float64, the examples each process feeds follow the counts, and the groups' programs are
  built once per set of counts."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  step, seen = _rebalanced(monkeypatch, _group_plan((12, 4)), {"group 0": (3e-3, 0.0), "group 1": (1e-3, 0.0)}, 4)
  assert [counts for counts, *_ in seen] == [(12, 4), (4, 12), (4, 12), (4, 12)]
  assert step.grouped and len(step.process_examples()) == 64
  assert [h["moved_to"] for h in step.history if h["moved_to"]] == [[4, 12]]


def test_group_counts_that_outgrow_the_buffers_get_room_and_the_moves_after_compile_nothing(monkeypatch):
  """A group plan moved [8 | 8] -> [10 | 6]: each group's buffers get slots (the first 13: its count and 25%
  room; the second keeps 8), and its programs read the counts when they run; [11 | 5] and [12 | 4] then fit
  and run those programs. Every step matches one device; the saved plan keeps the slots."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  times = lambda a, b: {"group 0": (a * 1e-3, 0.0), "group 1": (b * 1e-3, 0.0)}
  step, seen = _rebalanced(monkeypatch, _group_plan((8, 8)), [times(1, 1)] * 2 + [times(6, 10)] * 2
                           + [times(5, 11)] * 2 + [times(4, 12)] * 2, 8)
  assert seen[0] == ((8, 8), (8, 8), 1) and seen[3] == ((10, 6), (13, 8), 2)
  assert seen[5][:2] == ((11, 5), (13, 8)) and seen[7] == ((12, 4), (13, 8), 2)
  assert GroupPlan.from_json(step.plan.to_json()) == step.plan


def test_a_hybrid_plan_rebalances_between_its_sharded_groups_exactly(monkeypatch):
  """Two groups of two devices, each sharding its parameters (FSDP in the group, the groups joined: a hybrid
  plan). The scripted times find the first group three times slower: its devices, which run in lockstep, move
  from 4 microbatches each to 2, the second group's from 4 to 6; every step matches one device in float64."""
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices")
  ids = [d.id for d in jax.devices()[:4]]
  plan = group_plan([Group(tuple(ids[:2]), 4, (4, 4), shard_params=True),
                     Group(tuple(ids[2:]), 4, (4, 4), shard_params=True)], 64)
  step, seen = _rebalanced(monkeypatch, plan, {"group 0": (3e-3, 0.0), "group 1": (1e-3, 0.0)}, 4)
  assert step.grouped and step.plan.hybrid
  assert seen[0][0] == (4, 4, 4, 4) and seen[-1][0] == (2, 2, 6, 6)
  assert [g.max_count for g in step.plan.groups] == [4, 8]  # room past 6: the lockstep loop runs 6 of 8 slots


def test_groups_of_different_microbatch_sizes_rebalance_by_examples(monkeypatch):
  """Group 0 runs microbatches of 8, group 1 of 4. Group 0 is found three times as fast per example (2 ms a
  microbatch of 8 against 3 ms one of 4): the examples move 32 | 32 -> 48 | 16, as 6 microbatches of 8 and 4 of 4
  (the counts a MILP finds), and every step matches one device in float64."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  ids = [d.id for d in jax.devices()[:2]]
  plan = group_plan([Group((ids[0],), 8, (4,)), Group((ids[1],), 4, (8,))], 64)
  step, _ = _rebalanced(monkeypatch, plan, {"group 0": (2e-3, 0.0), "group 1": (3e-3, 0.0)}, 4)
  assert [g.counts for g in step.plan.groups] == [(6,), (4,)]


def test_a_group_running_no_microbatch_stays_idle_while_the_others_rebalance(monkeypatch):
  """A group plan whose third group runs nothing (a kind the search left out): its program is never timed, so
  the controller balances the other two groups alone, exactly, and leaves it idle."""
  if jax.device_count() < 3:
    pytest.skip("needs 3 devices")
  ids = [d.id for d in jax.devices()[:3]]
  plan = group_plan([Group((ids[0],), 4, (12,)), Group((ids[1],), 4, (4,)), Group((ids[2],), 4, (0,))], 64)
  step, _ = _rebalanced(monkeypatch, plan, {"group 0": (3e-3, 0.0), "group 1": (1e-3, 0.0)}, 3)
  assert [g.counts for g in step.plan.groups] == [(4,), (12,), (0,)]


def test_a_group_plan_returning_logits_keeps_their_order_across_moves(monkeypatch):
  """A step returning per-example logits, whose exchange program puts them in global order from the counts it
  was built for: after the moves [8 | 8] -> [10 | 6] -> [11 | 5] (the last fits the slots of the second), each
  step's logits are in the global batch's order, within float32 rounding of a float64 reference."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")

  def step_fn(params, batch):
    logits = batch["x"] @ params
    return params - 0.0 * params, {"logits": logits, "loss": (logits ** 2).mean()}

  times = lambda a, b: {"group 0": (a * 1e-3, 0.0), "group 1": (b * 1e-3, 0.0)}
  script = iter([times(1, 1)] * 2 + [times(6, 10)] * 2 + [times(5, 11)] * 2)
  monkeypatch.setattr(Rebalancer, "grouped", lambda self, front: next(script))
  params = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(4, 3)
  batch = {"x": np.arange(64 * 4, dtype=np.float32).reshape(64, 4) / 100}
  step = hs.parallelize(step_fn, plan=_group_plan((8, 8)), global_batch=64,
                        rebalance=Rebalance(every=1, confirm=2, smoothing=1.0))
  x, w = batch["x"].astype(np.float64), params.astype(np.float64)
  bound = 4 * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(w))  # float32 dots of 4 terms, against float64
  state, seen = step.shard_state(params), []
  for _ in range(6):
    state, metrics = step(state, batch)
    seen.append(tuple(c for g in step.plan.groups for c in g.counts))
    assert np.all(np.abs(np.asarray(metrics["logits"], np.float64) - x @ w) <= bound)
  assert seen[-1] == (11, 5) and (10, 6) in seen


@pytest.mark.parametrize("counts,slots,error", [
    ((3,), 0, None), ((3,), 8, None), ((3,), -1, "slots must be a non-negative integer"),
    ((3,), 2.5, "slots must be a non-negative integer")])
def test_group_slots_are_checked(counts, slots, error):
  from hetspmd.plan.groups import Group

  if error:
    with pytest.raises(InvalidValueError, match=error):
      Group((0,), 4, counts, slots=slots)
  else:
    assert Group((0,), 4, counts, slots=slots).max_count == max(max(counts), slots)


def test_group_programs_are_timed_as_they_run():
  """The group clock times each group's program from its inputs ready to its outputs ready: every group gets a
  positive time each call after a program's first (which runs beside the compiles of the programs after it)."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  w = _workload()
  step = hs.parallelize(w.make_train_step(hs.value_and_grad), plan=_group_plan((8, 8)), global_batch=64,
                        rebalance=Rebalance(every=1, threshold=0.9))
  state = step.shard_state(w.init_state(0))
  for i in range(4):
    state, _ = jax.block_until_ready(step(state, w.synthetic_batch(i, batch=64)))
  assert [h["call"] for h in step.history] == [3, 4]  # the first call runs beside compiles: not timed
  for h in step.history:
    assert set(h["measured"]) == {"group 0", "group 1"}
    assert all(v["microbatch_seconds"] > 0 for v in h["measured"].values())


@pytest.mark.parametrize("kinds,counts,sizes,times,moved", [
    (("g0", "g1"), (4, 8), (8, 4), (2e-3, 3e-3), (6, 4)),                # examples 32 | 32 -> 48 | 16
    (("g0", "g1"), (4, 8), (8, 4), (2e-3, 1e-3), (4, 8)),                # balanced per example: stays
    (("g0", "g0", "g1"), (2, 2, 8), (8, 8, 4), (2e-3, 2e-3, 1e-3), None),  # a group's devices within one
    (("g0", "g1", "g2"), (4, 4, 4), (8, 4, 2), (1e-3, 1e-3, 1e-3), None),  # three sizes
])
def test_balance_over_microbatches_of_different_sizes_keeps_the_examples(kinds, counts, sizes, times, moved):
  """The controller keeps the step's examples where kinds run microbatches of different sizes, and its counts
  are no slower on the measured times than the counts before."""
  balance = Balance(counts, kinds, sizes=sizes)
  measured = {k: (t, 0.0) for k, t in zip(kinds, times)}
  option = Rebalance(every=1, confirm=1, smoothing=1.0)
  after = update(update(balance, measured, option), measured, option)
  assert sum(c * m for c, m in zip(after.counts, sizes)) == sum(c * m for c, m in zip(counts, sizes))
  if moved is not None:
    assert after.counts == moved
  assert after.seconds(after.counts) <= after.seconds(counts)
  for kind in set(kinds):
    mine = [c for k, c in zip(kinds, after.counts) if k == kind]
    assert max(mine) - min(mine) <= 1


def test_group_plans_that_cannot_move_are_refused():
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices")
  w = _workload()
  ids = [d.id for d in jax.devices()[:4]]
  plan = group_plan([Group(tuple(ids[:2]), 4, (4, 4), model=2, model_dims={"params/layers/0/kernel": 1}),
                     Group(tuple(ids[2:]), 4, (6, 6))], 64)
  step = hs.parallelize(w.make_train_step(hs.value_and_grad), plan=plan, global_batch=64, rebalance=True)
  with pytest.raises(HetSpmdError, match=r"groups \[0\] do not: drop rebalance="):
    step(step.shard_state(w.init_state(0)), w.synthetic_batch(0, batch=64))
