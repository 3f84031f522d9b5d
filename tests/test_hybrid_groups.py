"""Hybrid plans: every group shards its parameters over its devices and holds its parameters and optimizer state
split between steps, each group its own copy (HSDP; one group is plain FSDP). Every step checked against one
device, float64-referenced."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import hetspmd as hs
from hetspmd.plan.groups import Group, group_plan
from hetspmd.runtime.grouped import run_groups

from conftest import require_devices
from exactness import Reference
from test_group_programs import _state, dropout_step
from hetspmd.passes.profile import profile_step
from hetspmd.planner.grouping import price_groups, to_group_plan
from hetspmd.planner.pricing import Costing, device_groups
from test_sharded_groups import _batches, _layer_state, _Layers, _layers_step_rematted, _trained
from test_sharded_groups_users import (NnxMlp, batches as user_batches, linen_state, linen_step, LayerStack,
                                      moved_through_orbax, nnx_trained)


def _hybrid(groups=((0, 1, 2, 3), (4, 5, 6, 7)), microbatches=(2, 1), counts=((2, 2, 1, 1), (2, 2, 1, 1)),
            remat="none"):
  """Groups of equal size, each sharding its parameters."""
  examples = sum(m * sum(c) for m, c in zip(microbatches, counts))
  plan = group_plan([Group(tuple(d), m, tuple(c), remat, shard_params=True)
                     for d, m, c in zip(groups, microbatches, counts)], examples)
  assert plan.hybrid
  return plan


def _split_bytes(state, step) -> tuple[int, int]:
  """(bytes of the leaves held split, bytes of the others) of ``state``, by the step's trace."""
  split = step._latest.held_split
  leaves = jax.tree.leaves(state)
  return (sum(x.nbytes for i, x in enumerate(leaves) if i in split),
          sum(x.nbytes for i, x in enumerate(leaves) if i not in split))


def _check_held_split(step, state, g):
  """Every leaf the trace holds split is split over each group's ``g`` devices; each device holds ``1/g`` of them
  and the others whole."""
  split, rest = _split_bytes(state, step)
  leaves = jax.tree.leaves(state)
  assert split > 10 * rest  # the parameters and Adam's moments, not the step count
  for i, axis in step._latest.held_split.items():
    assert leaves[i].sharding.spec == P(*([None] * axis), "part"), (i, leaves[i].sharding)
  held = step.resident_bytes(state)
  assert max(held.values()) <= split / g + rest, (held, split, rest)


@pytest.mark.timeout(240)
def test_two_sharded_groups_hold_their_state_split_and_match_one_device():
  """Two groups of four, each its own microbatch and uneven counts (lockstep, masked): three steps, the second and
  third taking the state as the first left it, split over each group's devices."""
  require_devices(8)
  plan = _hybrid()
  batches = _batches(plan.global_batch) + _batches(plan.global_batch, seed=1)[:1]
  step, state = _trained(plan, lambda: _state(256), batches=batches)
  _check_held_split(step, state, 4)
  assert "split over its devices between steps" in step.explain()


@pytest.mark.timeout(240)
def test_one_sharded_group_of_every_device_is_plain_fsdp():
  require_devices(8)
  plan = _hybrid(groups=(tuple(range(8)),), microbatches=(2,), counts=((2, 2, 1, 1, 1, 1, 1, 1),))
  step, state = _trained(plan, lambda: _state(256), batches=_batches(plan.global_batch) * 2)
  _check_held_split(step, state, 8)


@pytest.mark.timeout(240)
def test_a_layer_scan_under_a_remat_policy_in_a_hybrid_plan_matches_one_device():
  """The stacked parameters (layers first) and their moments held split after the layers' axis."""
  require_devices(8)
  _, state = _layer_state(_Layers(scanned=True))
  plan = _hybrid(remat="dots")
  step, trained = _trained(plan, state, _layers_step_rematted, _batches(plan.global_batch) * 2)
  assert step._latest.held_split


@pytest.mark.timeout(240)
def test_leaves_the_groups_do_not_divide_stay_whole_and_exact():
  """Hidden 5 over four devices: the kernels and biases of width 5 are padded in the loop and held whole between
  steps (a jax.Array cannot be split unevenly); the rest are held split."""
  require_devices(8)
  plan = _hybrid()
  step, state = _trained(plan, lambda: _state(5), batches=_batches(plan.global_batch) * 2)
  leaves, split = jax.tree.leaves(state), step._latest.held_split
  whole = [i for i, x in enumerate(leaves) if np.ndim(x) and i not in split]
  assert split and whole  # the (4,) bias and (5, 4) kernel of the head split; the width-5 leaves whole
  assert all(leaves[i].sharding.is_fully_replicated for i in whole)
  assert all(not leaves[i].sharding.is_fully_replicated for i in split)


@pytest.mark.timeout(240)
def test_a_priced_hybrid_plan_runs_as_priced():
  """The search's pricing of two kinds both sharding (each kind its microbatch), made a plan and run: hybrid, and
  exact against one device."""
  require_devices(8)
  pool = hs.Cluster.emulate(jax.devices()[:8], kinds=["V100-32GB"] * 4 + ["P100-16GB"] * 4)
  batches = _batches(24)
  profile = profile_step(dropout_step, _state(), {k: v[:2] for k, v in batches[0].items()})
  layout = device_groups(pool, "group programs by kind", tuple(range(8)), 1)
  priced = price_groups(Costing(pool, profile, 2), layout, {"V100-32GB": 2, "P100-16GB": 1}, "none", 24,
                        sharded=frozenset({"V100-32GB", "P100-16GB"}))
  assert "hybrid" in priced.name
  plan = to_group_plan(pool, priced)
  assert plan.hybrid
  _trained(plan, _state, batches=batches)


@pytest.mark.timeout(240)
def test_an_nnx_step_in_place_under_a_hybrid_plan_matches_one_device():
  require_devices(8)
  plan = _hybrid(counts=((2, 2, 1, 1), (2, 1, 1, 1)))
  step = nnx_trained(NnxMlp, plan, user_batches(plan.global_batch, steps=3))
  assert step._latest.held_split


@pytest.mark.timeout(240)
@pytest.mark.parametrize("saved_under", ["hybrid", "single-program"])
def test_an_orbax_checkpoint_moves_between_a_hybrid_plan_and_a_single_program(saved_under, tmp_path):
  """A step under one, saved with orbax, restored into the other's shardings (the hybrid plan's: split, known from
  ``example_batch``), one more step: equal to two steps on one device."""
  require_devices(8)
  plan = _hybrid(counts=((2, 2, 1, 1), (2, 1, 1, 1)))
  make = lambda: linen_state(LayerStack(scanned=True))
  data = user_batches(plan.global_batch)
  hybrid = run_groups(linen_step, plan, example_batch=data[0])
  single = hs.parallelize(linen_step, global_batch=plan.global_batch)
  first, second = (hybrid, single) if saved_under == "hybrid" else (single, hybrid)
  restored, _ = moved_through_orbax(first, second, make, data, tmp_path)
  if saved_under == "single-program":
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(restored))  # restored split


@pytest.mark.timeout(300)
@pytest.mark.parametrize("second", ["sharded", "unsharded"])
def test_two_processes_one_group_each_match_one_device(second):
  """2 processes x 2 CPU devices (gloo), each process one group; process 0's shards its parameters.
  ``sharded``: so does process 1's, a hybrid plan: the exchange adds the groups' parts across processes, and each
  group holds its own copy of the state split over its devices. ``unsharded``: process 1's group reduce-scatters
  its sums onto the sharded group's parts after its loop, the exchange adds the parts across processes, and the
  state comes back whole on every device."""
  from multiprocess import group_child, run_processes

  results = run_processes(group_child("test_sharded_groups_users") + textwrap.dedent(f"""
      from hetspmd.plan.groups import Group, group_plan
      from hetspmd.runtime.grouped import run_groups

      def here(x):  # this process's devices hold every part of a leaf: the whole value
        out = np.zeros(x.shape, x.dtype)
        for s in x.addressable_shards:
          out[s.index] = np.asarray(s.data)
        return out

      make = lambda: t.linen_state(t.LayerStack(scanned=True))
      plan = group_plan([Group(tuple(ids[0]), 2, (2, 1), shard_params=True),
                         Group(tuple(ids[1]), 1, (3, 2), shard_params={second == "sharded"})], 11)
      data = t.batches(11, steps=3)
      ref = reference(t.linen_step, make(), data)
      step = run_groups(t.linen_step, plan)
      state = step.shard_state(make())
      for i, batch in enumerate(data):
        state, metrics = step(state, fed(step, batch))
        ref.check_metrics(jax.tree.map(here, metrics), i)
      ref.check(jax.tree.map(here, (state.params, state.opt_state)), lambda s: (s.params, s.opt_state))
      split = sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(state))
      print(json.dumps({{"hybrid": plan.hybrid, "split": split, "parts": step.execution.parts_exchange,
                        "sums": len(step._latest.part_sums)}}))
  """), num_processes=2, devices_per_process=2, timeout=240)
  if second == "sharded":
    assert all(r["hybrid"] and r["split"] > 0 and not r["parts"] for r in results), results
  else:
    assert all(not r["hybrid"] and r["split"] == 0 and r["parts"] and r["sums"] > 0 for r in results), results


@pytest.mark.timeout(300)
def test_plain_fsdp_over_two_processes_is_one_group_and_matches_one_device():
  """2 processes x 2 CPU devices (gloo): one group over all four devices that shards its parameters (plain FSDP
  over two hosts) is one program both processes call, not cut per process; uneven counts (lockstep, masked), a
  layer scan, two steps, the state split across both processes and checked whole against one device."""
  from multiprocess import group_child, run_processes

  results = run_processes(group_child("test_sharded_groups_users") + textwrap.dedent("""
      from jax.experimental import multihost_utils
      from hetspmd.plan.groups import Group, group_plan
      from hetspmd.runtime.grouped import GroupedStep

      whole = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
      make = lambda: t.linen_state(t.LayerStack(scanned=True))
      plan = group_plan([Group(tuple(ids[0] + ids[1]), 2, (2, 1, 2, 1), shard_params=True)], 12)
      data = t.batches(12, steps=2)
      ref = reference(t.linen_step, make(), data)
      step = GroupedStep.across_processes(t.linen_step, plan)
      state = step.shard_state(make())
      for i, batch in enumerate(data):
        state, metrics = step(state, fed(step, batch))
        ref.check_metrics(jax.tree.map(whole, metrics), i)
      ref.check(jax.tree.map(whole, (state.params, state.opt_state)), lambda s: (s.params, s.opt_state))
      spans = [len({d.process_index for d in x.sharding.device_set}) for x in jax.tree.leaves(state.params)]
      print(json.dumps({"groups": len(step.plan.groups), "processes": step.execution.processes,
                        "hybrid": step.execution.hybrid, "spans": min(spans)}))
  """), num_processes=2, devices_per_process=2, timeout=240)
  assert all(r == {"groups": 1, "processes": 2, "hybrid": True, "spans": 2} for r in results), results


@pytest.mark.timeout(240)
def test_a_hybrid_plan_takes_the_state_buffers_it_is_given():
  """``donate_state=True``: the exchange writes the new state into the split buffers of the old (XLA warns of any
  donated buffer it cannot use: none here, the first call splitting the state before any program takes it)."""
  import warnings

  require_devices(8)
  plan = _hybrid()
  batches = _batches(plan.global_batch) * 2
  ref = Reference(dropout_step, _state(256)).run(batches)
  step = run_groups(dropout_step, plan, donate_state=True)
  state = step.shard_state(_state(256))
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message="Some donated buffers were not usable")
    for i, batch in enumerate(batches):
      given = jax.tree.leaves(state.params)[0]
      state, metrics = step(state, batch)
      ref.check_metrics(metrics, i)
      if i:  # the held split buffers were taken
        assert given.is_deleted()
  ref.check(state.params, lambda s: s.params)
  ref.check(state.opt_state, lambda s: s.opt_state)


@pytest.mark.timeout(240)
def test_batchnorm_over_the_global_batch_in_a_hybrid_plan_matches_one_device():
  """Two loops (BatchNorm's statistics over every group's examples, then the gradients): every group takes its
  held parameters split in both; the update, on the parts, after the second."""
  from test_group_programs import _normed_state, _trained as group_trained, normed_step

  require_devices(8)
  plan = _hybrid(counts=((2, 2, 1, 1), (2, 1, 1, 2)))
  state, ref = group_trained(normed_step, plan, _normed_state, _batches(plan.global_batch) * 2)
  ref.check(state)
  assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(state["params"]))


@pytest.mark.timeout(240)
def test_a_bfloat16_step_under_a_hybrid_plan_matches_one_device():
  """float32 parameters held split, the work in bfloat16: each reader gathers the bfloat16 cast of its part."""
  from test_sharded_groups_users import HalfPrecision, trained

  require_devices(8)
  plan = _hybrid(counts=((2, 2, 1, 1), (2, 1, 1, 1)))
  runner, state = trained(linen_step, lambda: linen_state(HalfPrecision(), eps=1e-3), plan,
                          user_batches(plan.global_batch, steps=3), half=True)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
  assert runner._latest.held_split


def _clipped_state():
  """Adam with weight decay after clipping by the global norm (what language-model recipes run)."""
  import optax
  from flax.training import train_state
  from test_group_programs import Net

  model = Net(256)
  params = model.init(jax.random.key(0), jnp.zeros((1, 6)), train=False)["params"]
  tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2, eps=1e-4, weight_decay=0.1))
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def _clipped_step(state, batch):
  """Logs the gradients' norm and returns the logits (an output per example) beside the loss."""
  import optax

  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["x"], train=False)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), logits

  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss, "grad_norm": optax.tree.norm(grads), "logits": logits}


@pytest.mark.timeout(240)
def test_clipping_by_the_global_norm_under_a_hybrid_plan_matches_one_device():
  """The update on the parts needs the norm over every part of every gradient: XLA's partitioner adds it up across
  each group's devices. The logits come back in the global batch's order."""
  require_devices(8)
  plan = _hybrid()
  step, _ = _trained(plan, _clipped_state, _clipped_step, _batches(plan.global_batch) * 2)
  assert step._latest.part_sums and step._latest.held_split


@pytest.mark.timeout(240)
def test_parallelize_places_a_hybrid_plans_state_split_before_the_first_call():
  """With ``example_batch``, ``state_shardings`` and ``shard_state`` know the split layout before any call (a
  state that fits only split is never whole on every device); the steps stay exact."""
  require_devices(8)
  plan = _hybrid()
  batches = _batches(plan.global_batch) * 2
  step = hs.parallelize(dropout_step, plan=plan, global_batch=plan.global_batch, example_batch=batches[0])
  shardings = jax.tree.leaves(step.state_shardings(_state(256)))
  state = step.shard_state(_state(256))
  split = [x for x in jax.tree.leaves(state) if not x.sharding.is_fully_replicated]
  assert split and len(split) == sum(s.spec != P() for s in shardings)
  ref = Reference(dropout_step, _state(256)).run(batches)
  for i, batch in enumerate(batches):
    state, metrics = step(state, batch)
    ref.check_metrics(metrics, i)
  ref.check(state.params, lambda s: s.params)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout,processes", [("fsdp", 4), ("hybrid", 4), ("beside", 4), ("fsdp", 8)])
def test_groups_spanning_processes_of_one_device_shard_their_parameters(layout, processes):
  """4 or 8 processes x 1 CPU device (one process per device, as one process per GPU runs): plain FSDP as one
  group over all of them, a hybrid plan of two groups each spanning half of them, or a sharded group spanning
  half of them beside unsharded devices (one group each: a group that runs its own trip counts stays in one
  process); every process feeds only its own examples, and the metrics (and FSDP's whole state) match one
  device."""
  from multiprocess import group_child, run_processes

  batch = 3 * processes  # counts of 2 and 1 microbatches of 2, alternating
  results = run_processes(group_child("test_sharded_groups_users") + textwrap.dedent(f"""
      from jax.experimental import multihost_utils
      from hetspmd.plan.groups import Group, group_plan
      from hetspmd.runtime.grouped import GroupedStep

      whole = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
      make = lambda: t.linen_state(t.LayerStack(scanned=True))
      every = tuple(i for p in ids for i in p)
      half = len(every) // 2
      counts = (2, 1) * half
      groups = ([Group(every, 2, counts, shard_params=True)] if {layout!r} == "fsdp" else
                [Group(every[:half], 2, counts[:half], shard_params=True),
                 Group(every[half:], 2, counts[half:][::-1], shard_params={layout!r} == "hybrid")])
      plan = group_plan(groups, {batch})
      data = t.batches({batch}, steps=2)
      ref = reference(t.linen_step, make(), data)
      step = GroupedStep.across_processes(t.linen_step, plan)
      state = step.shard_state(make())
      for i, batch in enumerate(data):
        state, metrics = step(state, fed(step, batch))
        ref.check_metrics(jax.tree.map(whole, metrics), i)
      if {layout!r} == "fsdp":
        ref.check(jax.tree.map(whole, (state.params, state.opt_state)), lambda s: (s.params, s.opt_state))
      print(json.dumps({{"groups": len(step.plan.groups), "hybrid": step.execution.hybrid,
                        "examples": len(step.process_examples())}}))
  """), num_processes=processes, devices_per_process=1, timeout=60 * processes)
  groups = {"fsdp": 1, "hybrid": 2, "beside": 1 + processes // 2}[layout]
  assert all(r["groups"] == groups and r["hybrid"] == (layout != "beside") for r in results), results
  assert sum(r["examples"] for r in results) == batch and all(0 < r["examples"] < batch for r in results)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("saved_under", ["single program", "hybrid"])
def test_an_orbax_checkpoint_moves_between_forms_across_processes(saved_under, tmp_path):
  """2 processes x 2 CPU devices: one step under one form (the single program over all four devices, or a hybrid
  plan of one FSDP group per process), saved with orbax by both processes into one checkpoint, restored into the
  other form's shardings, one more step there; both steps' metrics and the final state match one device."""
  from multiprocess import group_child, run_processes

  results = run_processes(group_child("test_sharded_groups_users") + textwrap.dedent(f"""
      import orbax.checkpoint as ocp
      import jax.numpy as jnp
      from jax.experimental import multihost_utils
      import hetspmd as hs
      from hetspmd.plan.groups import Group, group_plan

      whole = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
      make = lambda: t.linen_state(t.LayerStack(scanned=True))
      data = t.batches(12, steps=2)
      ref = reference(t.linen_step, make(), data)
      hybrid = group_plan([Group(tuple(ids[0]), 2, (2, 1), shard_params=True),
                           Group(tuple(ids[1]), 2, (1, 2), shard_params=True)], 12)
      example = {{k: v[:2] for k, v in data[0].items()}}
      single = hs.parallelize(t.linen_step, plan="auto", global_batch=12, example_batch=example)
      grouped = hs.parallelize(t.linen_step, plan=hybrid, global_batch=12, example_batch=example)
      first, second = (single, grouped) if {saved_under!r} == "single program" else (grouped, single)
      state, metrics = first(first.shard_state(make()), fed(first, data[0]))
      ref.check_metrics(jax.tree.map(whole, metrics), 0)
      with ocp.CheckpointManager({str(tmp_path / "ckpt")!r}) as manager:
        manager.save(1, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
        template = make()
        target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype, sharding=s),
                              template, second.state_shardings(template))
        restored = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(target))
      state, metrics = second(restored, fed(second, data[1]))
      ref.check_metrics(jax.tree.map(whole, metrics), 1)
      ref.check(jax.tree.map(whole, (state.params, state.opt_state)), lambda s: (s.params, s.opt_state))
      print(json.dumps({{"grouped": grouped.grouped, "single": not single.grouped,
                        "examples": [len(single.process_examples()), len(grouped.process_examples())]}}))
  """), num_processes=2, devices_per_process=2, timeout=240)
  assert all(r["grouped"] and r["single"] for r in results), results
  assert [sum(r["examples"][i] for r in results) for i in (0, 1)] == [12, 12]


def _tight_pool_memory() -> int:
  """The least memory (a power of two) per device of two hosts of two at which ``plan="search"`` of the scanned
  Linen stack picks a hybrid plan: too little to hold the model whole, enough to shard it over a host."""
  from hetspmd.plan.groups import GroupPlan

  state = jax.eval_shape(lambda: linen_state(LayerStack(scanned=True)))
  for memory in (2 ** k for k in range(12, 24)):
    try:
      found = hs.search(linen_step, state, user_batches(16, steps=1)[0], cluster=_tight_pool(memory),
                        global_batch=16)
    except hs.errors.HetSpmdError:  # nothing fits yet
      continue
    if isinstance(found.best, GroupPlan) and found.best.hybrid:
      return memory
  raise AssertionError("no memory makes the search pick a hybrid plan: the test's premise is gone")


def _tight_pool(memory: int) -> hs.Cluster:
  spec = hs.DeviceSpec("Tight", memory_bytes=memory, fp32_flops=2e12, bf16_flops=4e12, memory_bandwidth=4e11)
  return hs.Cluster.parse("2x2xTight;inter=10Gbps;processes=4", devices={"Tight": spec})


@pytest.mark.timeout(600)
def test_the_search_shards_over_a_hosts_processes_of_one_device_each():
  """4 processes x 1 CPU device described as two hosts of two (one process per GPU), each device too small to
  hold the model whole: plan="search" picks a hybrid plan of a group per host, each group one program spanning
  its host's two processes, which runs exactly against one device, each process feeding only its own examples.
  (Groups cut per process would have one device each, nothing to shard over.)"""
  memory = _tight_pool_memory()
  from multiprocess import group_child, run_processes

  results = run_processes(group_child("test_sharded_groups_users") + textwrap.dedent(f"""
      from jax.experimental import multihost_utils
      import hetspmd as hs
      import test_hybrid_groups as h

      whole = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
      make = lambda: t.linen_state(t.LayerStack(scanned=True))
      cluster = h._tight_pool({memory}).replace(jax_device_ids=tuple(d.id for d in jax.devices()))
      data = t.batches(16, steps=2)
      step = hs.parallelize(t.linen_step, cluster=cluster, plan="search", global_batch=16,
                            example_batch=data[0])
      ref = reference(t.linen_step, make(), data)
      state = step.shard_state(make())
      for i, batch in enumerate(data):
        state, metrics = step(state, fed(step, batch))
        ref.check_metrics(jax.tree.map(whole, metrics), i)
      ref.check(jax.tree.map(whole, state.params), lambda s: s.params)
      groups = [sorted({{d.process_index for d in jax.devices() if d.id in g.devices}})
                for g in step.plan.groups]
      print(json.dumps({{"groups": groups, "hybrid": step.plan.hybrid, "examples": len(step.process_examples())}}))
  """), num_processes=4, devices_per_process=1, timeout=300)
  assert all(r["hybrid"] and r["groups"] == [[0, 1], [2, 3]] for r in results), results
  assert sum(r["examples"] for r in results) == 16 and all(0 < r["examples"] < 16 for r in results)
