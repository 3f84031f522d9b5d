"""Group programs: each device group runs its own microbatch loop (its own microbatch size and counts), joined by
one uniform program over every device; exact against one device, and bad group plans refused."""

import json
import re
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import hetspmd as hs
from hetspmd import models
from hetspmd.passes.profile import profile_step
from hetspmd.plan.counts import KindCost
from hetspmd.plan.groups import Group, GroupPlan, assign_owners, group_plan
from hetspmd.plan.options import REMAT_POLICIES
from hetspmd.planner.grouping import group_counts, search_groups, to_group_plan
from hetspmd.planner.ranking import microbatch_sizes
from hetspmd.runtime.grouped import run_groups

from conftest import require_devices
from exactness import Reference, assert_exact

STEPS = 3


class Net(nn.Module):
  hidden: int = 16

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dropout(0.2, deterministic=not train)(nn.gelu(nn.Dense(self.hidden)(x)))
    return nn.Dense(4)(nn.LayerNorm()(x))


def _state(hidden: int = 16):
  model = Net(hidden)
  params = model.init(jax.random.key(0), jnp.zeros((1, 6)), train=False)["params"]
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2, eps=1e-4))


def dropout_step(state, batch):
  key = jax.random.fold_in(jax.random.key(7), state.step)

  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["x"], rngs={"dropout": key})
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss}


def _batches(size, seed=0):
  rs = np.random.RandomState(seed)
  return [{"x": rs.randn(size, 6).astype(np.float32), "y": rs.randint(0, 4, size).astype(np.int32)}
          for _ in range(STEPS)]


def _trained(step_fn, plan, state, batches, *rest, placed=False):
  """``state`` trained under ``plan`` on ``batches`` (``rest``: the step's further arguments; ``placed``: each
  batch placed ahead with ``shard_batch``), every step's metrics checked against one device; the final state
  and the reference."""
  ref = Reference(step_fn, state()).run(batches, *rest)
  step = run_groups(step_fn, plan)
  trained = step.shard_state(state())
  for i, batch in enumerate(batches):
    trained, metrics = step(trained, step.shard_batch(batch) if placed else batch, *rest)
    ref.check_metrics(metrics, i)
  return trained, ref


# (group devices, microbatch, counts) per group: a fast pair with large microbatches beside slower devices with
# small ones, one device idle; three groups of three sizes
PLANS = [
    [((0, 1), 4, (3, 3)), ((2, 3, 4, 5, 6, 7), 2, (2, 2, 1, 1, 1, 0))],
    [((0,), 8, (2,)), ((1, 2, 3), 4, (1, 1, 1)), ((4, 5, 6, 7), 1, (3, 2, 2, 1))],
]
# (plan, tail (microbatch, count) per device: run inside the uniform program, overlapping the reduction)
# per device: four with 80 GB beside four with 16 GB, the optimizer state held in proportion
SHARES_80_16 = (80 / 384,) * 4 + (16 / 384,) * 4
CASES = [(PLANS[0], (0, 0)), (PLANS[1], (0, 0)), (PLANS[0], (1, 1)), (PLANS[1], (2, 2))]


@pytest.mark.parametrize("groups,tail", CASES, ids=["two-groups", "three-groups", "two-groups-tail-1x1",
                                                    "three-groups-tail-2x2"])
def test_group_programs_match_one_device(groups, tail):
  require_devices(8)
  plan = group_plan(groups, sum(m * sum(c) for _, m, c in groups) + 8 * tail[0] * tail[1], tail=tail)
  state, ref = _trained(dropout_step, plan, _state, _batches(plan.global_batch))
  ref.check(state.params, lambda s: s.params)
  ref.check(state.opt_state, lambda s: s.opt_state)


def test_a_zoo_language_model_under_group_programs():
  require_devices(8)
  w = models.get("gpt2-tiny")
  plan = group_plan([((0, 1, 2, 3), 2, (2, 2, 2, 1)), ((4, 5, 6, 7), 1, (2, 1, 1, 1))], 19)
  state, ref = _trained(w.make_train_step(), plan, w.init_state, token_batches(w, plan.global_batch))
  ref.check(state)


def token_batches(w, size: int, seed: int = 1, steps: int = 2):
  """``steps`` batches of ``size`` random tokens below 50 for the zoo language model ``w``."""
  rs = np.random.RandomState(seed)
  return [jax.tree.map(lambda s: rs.randint(0, 50, s.shape).astype(s.dtype), w.example_batch(size))
          for _ in range(steps)]


@pytest.mark.parametrize("groups,batch,message", [
    ([((0, 1), 2, (1, 1)), ((1, 2), 2, (1, 1))], 8, "device 1 is in group 0 and in group 1"),
    ([((0, 1), 2, (1, 1)), ((2, 3), 2, (1, 1))], 10, r"cover 8 examples \(2 x 2 \+ 2 x 2\), not the global batch of 10"),
    ([((0, 1), 2, (1,))], 2, "one count of at least 0 per device: 2 devices"),
    ([((0, 1), 0, (1, 1))], 0, "microbatch must be a positive integer"),
])
def test_bad_group_plans_say_what_is_wrong(groups, batch, message):
  with pytest.raises(hs.HetSpmdError, match=message):
    group_plan(groups, batch)


def test_a_group_plan_round_trips_through_json():
  for plan in (group_plan(PLANS[1], 36), group_plan(PLANS[1], 36, state_shares=(1 / 8,) * 8, zero_stage=3)):
    assert GroupPlan.from_json(json.loads(plan.dumps())) == plan
  older = {**json.loads(group_plan(PLANS[1], 36, state_shares=(1 / 8,) * 8).dumps()), "version": 2}
  del older["zero_stage"]
  assert GroupPlan.from_json(older).zero_stage == 1  # version 2 held the optimizer state in its shares
  assert plan.starts() == ((0,), (16, 20, 24), (28, 31, 33, 35))


def test_devices_jax_does_not_have_are_refused():
  plan = GroupPlan((Group((0, 4096), 1, (1, 1)),), 2)
  with pytest.raises(hs.HetSpmdError, match=r"names devices \[4096\] that JAX does not have"):
    run_groups(dropout_step, plan)


class Normed(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.relu(nn.BatchNorm(use_running_average=False)(nn.Dense(8)(x))))


def _normed_state():
  variables = Normed().init(jax.random.key(0), jnp.zeros((2, 6)))
  return {"params": variables["params"], "stats": variables["batch_stats"]}


def normed_step(state, batch):
  def loss_fn(params):
    out, updates = Normed().apply({"params": params, "batch_stats": state["stats"]}, batch["x"],
                                  mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean(), updates
  (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
  return {"params": jax.tree.map(lambda p, g: p - 0.1 * g, state["params"], grads),
          "stats": updates["batch_stats"]}, {"loss": loss}


def test_batchnorm_statistics_over_the_global_batch_under_group_programs():
  """BatchNorm, exact: its mean and variance are reduced over every group's examples first (a loop of their own,
  combined by a uniform program), then every group's gradient loop reads them; equal to one device."""
  require_devices(8)
  plan = group_plan(PLANS[1], 36)
  state, ref = _trained(normed_step, plan, _normed_state, _batches(36))
  ref.check(state)
  names = run_groups(normed_step, plan)
  names(_normed_state(), _batches(36)[0])
  assert {"combine loop 0", "group 0, loop 1"} <= set(names.memory_analysis())


@pytest.mark.parametrize("tail", [(0, 0), (2, 1)], ids=["no-tail", "tail"])
def test_batchnorm_with_per_microbatch_statistics_under_group_programs(tail):
  """BatchNorm, local (ghost batch norm): each microbatch is normalised with its own statistics, and groups run
  microbatches of different sizes, so the statistics are over 8, 4 or 1 examples by group (2 in the tail). Each
  microbatch's results (its gradient, its running statistics) count by its examples. With SGD the step is then
  the mean of one-device steps on each microbatch, weighted by its examples, running statistics included."""
  from exactness import Float64

  require_devices(8)
  plan = group_plan(PLANS[1], 36 + 16 * tail[0] * tail[1] // 2, tail=tail)
  batch = _batches(plan.global_batch)[0]
  chunks = [(s + k * g.microbatch, g.microbatch) for g, starts in zip(plan.groups, plan.starts())
            for c, s in zip(g.counts, starts) for k in range(c)]
  chunks += [(s + k * plan.tail_microbatch, plan.tail_microbatch) for s in plan.tail_starts()
             for k in range(plan.tail_count)]
  assert sum(m for _, m in chunks) == plan.global_batch
  single, wide = jax.jit(normed_step), Float64(normed_step)

  def weighted(step):
    outs = [step(_normed_state(), jax.tree.map(lambda x: x[s:s + m], batch)) for s, m in chunks]
    return jax.tree.map(lambda *xs: sum(np.asarray(x, np.float64) * m / plan.global_batch
                                        for x, (_, m) in zip(xs, chunks)), *outs)

  got = run_groups(normed_step, plan, batch_stats="local")(_normed_state(), batch)
  assert_exact(got, weighted(single), weighted(wide), what="ghost batch norm")
  whole, _ = single(_normed_state(), batch)  # statistics over the whole batch differ
  assert not np.allclose(whole["stats"]["BatchNorm_0"]["var"], got[0]["stats"]["BatchNorm_0"]["var"], rtol=1e-5)


def test_steps_group_programs_do_not_run_are_refused_with_the_way_out():
  require_devices(8)
  plan = group_plan([((0, 1), 2, (1, 1)), ((2, 3), 1, (2, 2))], 8)
  tail = group_plan([((0, 1), 2, (1, 1)), ((2, 3), 1, (1, 1))], 10, tail=(1, 1))
  with pytest.raises(hs.HetSpmdError, match=r"needs \d microbatch loops.*without a tail"):
    run_groups(normed_step, tail)(_normed_state(), _batches(10)[0])

  with pytest.raises(hs.HetSpmdError, match="batch_stats must be 'exact' or 'local'"):
    run_groups(normed_step, plan, batch_stats="global")


def test_group_counts_cover_the_batch_exactly():
  rs = np.random.RandomState(3)
  for _ in range(200):
    kinds = [f"k{rs.randint(3)}" for _ in range(rs.randint(1, 10))]
    costs = {k: KindCost(float(rs.uniform(0.01, 1)), float(rs.uniform(0, 0.1)), first=float(rs.uniform(0, 0.05)))
             for k in set(kinds)}
    sizes = {k: int(rs.choice([1, 2, 3, 4, 8])) for k in set(kinds)}
    batch = int(rs.randint(1, 200))
    counts = group_counts(kinds, costs, sizes, batch)
    if counts is not None:
      assert sum(c * sizes[k] for k, c in zip(kinds, counts)) == batch and min(counts) >= 0
    elif 1 in sizes.values():
      raise AssertionError(f"a kind with microbatch 1 can make any batch: {kinds} {sizes} {batch}")


def test_the_searched_group_plan_runs_exactly():
  require_devices(8)
  cluster = hs.Cluster.emulate(jax.devices()[:8], kinds=["V100-32GB"] * 3 + ["P100-16GB"] * 5)
  batch = 48
  profile = profile_step(dropout_step, _state(), _batches(batch)[0])
  priced = search_groups(cluster, profile, batch, microbatch_sizes(batch))
  plan = to_group_plan(cluster, priced)
  assert len(plan.groups) == 2 and plan.global_batch == batch
  assert {g.microbatch for g in plan.groups} == set(priced.group.microbatches)
  state, ref = _trained(dropout_step, plan, _state, _batches(batch))
  ref.check(state.params, lambda s: s.params)


def test_a_checkpoint_saved_under_group_programs_restores_under_other_plans(tmp_path):
  """Two steps under one group plan (ZeRO-3: its parameters and optimizer state in memory shares, each leaf on
  one device), saved with orbax; restored under another group plan (ZeRO-1, even shares, placed before its first
  call) and under a single program (ZeRO-1), one more step each: both equal three steps on one device."""
  import orbax.checkpoint as ocp

  require_devices(8)
  first = group_plan(PLANS[0], 38, state_shares=SHARES_80_16, zero_stage=3)
  batches = _batches(first.global_batch)
  ref = Reference(dropout_step, _state()).run(batches)
  step = run_groups(dropout_step, first)
  state = step.shard_state(_state())
  for batch in batches[:2]:
    state, _ = step(state, batch)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", state)
  checkpointer.wait_until_finished()

  def restored(runner):
    template = _state()
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype, sharding=s),
                          template, runner.state_shardings(template))
    return checkpointer.restore(tmp_path / "ckpt", target)

  other = run_groups(dropout_step, group_plan([((0, 1, 2, 3), 2, (2, 2, 1, 1)), ((4, 5, 6, 7), 1, (5, 5, 4, 4))],
                                              38, tail=(1, 1), state_shares=(1 / 8,) * 8), example_batch=batches[0])
  cluster = hs.Cluster.emulate(jax.devices()[:8], kinds=["V100-32GB"] * 8)
  plan = hs.plan_for(cluster, _state(), global_batch=38, microbatch=1, counts=(5,) * 6 + (4, 4), zero_stage=1)
  single = hs.parallelize(dropout_step, cluster=cluster, plan=plan, global_batch=38)
  for runner in (other, single):
    resumed, metrics = runner(restored(runner), batches[2])
    ref.check_metrics(metrics, 2)
    ref.check(resumed.params, lambda s: s.params)
    ref.check(resumed.opt_state, lambda s: s.opt_state)


def nnx_objects():
  """An NNX model and its optimizer, as Flax's NNX examples make them."""
  from flax import nnx

  model = nnx.Sequential(nnx.Linear(6, 16, rngs=nnx.Rngs(0)), nnx.gelu, nnx.Linear(16, 4, rngs=nnx.Rngs(1)))
  return model, nnx.Optimizer(model, optax.adam(1e-2, eps=1e-4), wrt=nnx.Param)


def nnx_train_step(model, optimizer, batch):
  """An NNX step in place: the model and optimizer updated, the loss returned."""
  from flax import nnx

  def loss_fn(model):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()
  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return {"loss": loss}


@pytest.mark.parametrize("shares,zero", [((), 0), (SHARES_80_16, 1), (SHARES_80_16, 3)],
                         ids=["replicated", "memory-shares", "memory-shares-zero3"])
def test_an_nnx_step_in_place_under_group_programs(shares, zero):
  from flax import nnx

  from exactness import NnxReference

  require_devices(8)
  plan = group_plan(PLANS[1], 36, tail=(0, 0), state_shares=shares, zero_stage=zero)
  batches = _batches(plan.global_batch)
  ref = NnxReference(nnx_train_step, nnx_objects()).run(batches)
  model, optimizer = nnx_objects()
  step = run_groups(nnx_train_step, plan)
  for batch in batches:
    step(model, optimizer, batch)
  single = nnx.state(ref.single[0], nnx.Param)
  assert_exact(nnx.state(model, nnx.Param), single, nnx.state(ref.ref64[0], nnx.Param), what="params")
  if shares:
    _held_on_one_device(nnx.state(optimizer, nnx.OptState))
  if zero == 3:  # the model's parameters, updated in place, each on the one device that holds it
    _held_on_one_device(nnx.state(model, nnx.Param))


def _nbytes_of(x) -> int:
  return int(np.size(x)) * np.dtype(x.dtype).itemsize


def _held_on_one_device(state):
  """Every leaf of ``state`` with more than one element lives on exactly one device."""
  for x in jax.tree.leaves(state):
    if np.size(x) > 1:
      assert len(x.sharding.device_set) == 1, x.sharding


@pytest.mark.parametrize("groups,tail,zero", [(PLANS[0], (0, 0), 1), (PLANS[1], (2, 2), 1), (PLANS[1], (2, 2), 3)],
                         ids=["two-groups", "three-tail", "three-tail-zero3"])
def test_optimizer_state_in_memory_shares_matches_one_device(groups, tail, zero):
  """ZeRO-1 by memory: each Adam moment lives whole on one device, which updates it and sends its parameter to
  every device; ZeRO-3: the device keeps the parameter too, and sends it at the start of the next step.
  Parameters, moments and metrics equal one device's; under ZeRO-3 each device holds its share of the state's
  bytes between steps (within one leaf's bytes)."""
  require_devices(8)
  batch = sum(m * sum(c) for _, m, c in groups) + 8 * tail[0] * tail[1]
  plan = group_plan(groups, batch, tail=tail, state_shares=SHARES_80_16, zero_stage=zero)
  state, ref = _trained(dropout_step, plan, _state, _batches(batch), placed=True)
  ref.check(state.params, lambda s: s.params)
  ref.check(state.opt_state, lambda s: s.opt_state)
  _held_on_one_device(state.opt_state)
  spread = [len(x.sharding.device_set) for x in jax.tree.leaves(state.params)]
  assert spread == ([8] * len(spread) if zero == 1 else [1] * len(spread))
  explained = run_groups(dropout_step, plan).explain()
  assert plan.zero_stage == zero and f"(ZeRO-{zero}) in unpadded shares" in explained
  if zero == 3:
    step = run_groups(dropout_step, plan, example_batch=_batches(batch)[0])
    held = step.resident_bytes({"params": state.params, "opt_state": state.opt_state})
    total, largest = sum(held.values()), max(_nbytes_of(x) for x in jax.tree.leaves(state.params))
    for d, share in zip(plan.devices, plan.state_shares):
      assert abs(held[d] - share * total) <= 3 * largest, (d, held[d], share * total)


def test_two_hops_split_an_axis_with_parts():
  """Along the first axis the devices split evenly, else the one zero-padding grows least, by at most an eighth;
  never a scalar or an empty value."""
  from hetspmd.plan.groups import relay_axis, split_axis

  shapes = [(6, 16), (16,), (4,), (), (0,), (0, 8), (8, 0), (3, 5), (1, 197, 768), (3, 3, 61)]
  assert [split_axis(shape, 8) for shape in shapes] == [1, 0, None, None, None, 1, 0, None, 2, None]
  # on 5 devices padding grows (1, 197, 768)'s 768 by 0.3% (its 197 by 1.5%, its 1 by 400%), (3, 3, 61)'s 61 by 6.6%
  assert [relay_axis(shape, 5) for shape in shapes[8:]] == [2, 2]
  assert [relay_axis(shape, 8) for shape in shapes] == [1, 0, None, None, None, None, None, None, 2, 2]


@pytest.mark.parametrize("shares,relay", [(SHARES_80_16, True), ((1 / 8,) * 8, False)], ids=["80:16", "even"])
def test_parameters_reach_every_device_in_two_hops_where_one_device_holds_most(shares, relay, monkeypatch):
  """ZeRO-3 in one process: where some devices hold much more of the state than the rest
  (:func:`hetspmd.plan.groups.relays`), the parameters each holds are split evenly over the devices, then made
  whole on every device by one program; with even shares each is copied whole from its device. Exact either
  way."""
  import hetspmd.lowering.transfers as transfers

  require_devices(8)
  calls, real = [], transfers.relayed
  monkeypatch.setattr(transfers, "relayed", lambda values, mesh: calls.append(len(values)) or real(values, mesh))
  plan = group_plan(PLANS[0], 38, state_shares=shares, zero_stage=3)
  state, ref = _trained(dropout_step, plan, _state, _batches(38), placed=True)
  ref.check(state.params, lambda s: s.params)
  ref.check(state.opt_state, lambda s: s.opt_state)
  assert (sum(calls) > 0) == relay, calls  # values relayed per call (the first step's gather has none)


@pytest.mark.parametrize("shares", [SHARES_80_16, (1 / 8,) * 8], ids=["80:16", "even"])
def test_each_device_reduces_only_the_sums_of_its_share(shares):
  """In shares without a tail (one process), the uniform program reduces only what the metrics read; each device's
  update program takes only its own units' sums: with even shares every device's rows of them, copied to it; where
  some devices hold much more than the rest, the sums reduce-scattered evenly over the devices by one program, then
  made whole on their owner. No device keeps a reduced gradient it does not update, and the device holding the
  fewest bytes takes fewer into its update than the one holding the most."""
  require_devices(8)
  plan = group_plan(PLANS[0], 38, state_shares=shares)
  step = run_groups(dropout_step, plan)
  state, metrics = step(step.shard_state(_state()), _batches(38)[0])
  Reference(dropout_step, _state()).run(_batches(38)[:1]).check_metrics(metrics, 0)
  analysis = step.memory_analysis()
  grads = sum(_nbytes_of(x) for x in jax.tree.leaves(state.params))
  assert analysis["exchange"].output_size_in_bytes < grads / 10, analysis["exchange"]
  built = next(iter(step._built.values()))
  assert bool(built.relay) == ("reduce-scatter" in analysis) == (shares == SHARES_80_16), (built.relay, list(analysis))
  held = {d.id: b for d, b in zip(step.devices, built.held_bytes(step.devices)) if f"update on device {d.id}" in analysis}
  fewest, most = min(held, key=held.get), max(held, key=held.get)
  assert held[fewest] < held[most]
  taken = {d: analysis[f"update on device {d}"].argument_size_in_bytes for d in (fewest, most)}
  assert taken[fewest] < taken[most], (held, taken)


def test_state_owners_fill_each_device_to_its_share():
  """Whole units, the largest first, each to the device furthest below its share: no device exceeds its share by
  more than the largest unit, and devices without a share hold nothing."""
  rs = np.random.RandomState(3)
  for _ in range(50):
    sizes = rs.randint(1, 1000, rs.randint(1, 40)).tolist()
    shares = rs.rand(rs.randint(1, 9)) * (rs.rand(1) > 0.2)
    if shares.sum() == 0:
      shares[0] = 1.0
    shares = shares / shares.sum()
    owners = assign_owners(sizes, shares)
    held = np.bincount(owners, weights=sizes, minlength=len(shares))
    assert np.all(held <= shares * sum(sizes) + max(sizes) + 1e-9)
    assert np.all(held[shares == 0] == 0)


@pytest.mark.parametrize("shares,zero,message", [
    ((0.5, 0.5), None, "one share per device of the plan \\(8"),
    ((0.2,) * 8, None, r"adding up to 1, got .* \(sum 1.6\)"),
    ((-0.1, 0.3) + (0.8 / 6,) * 6, None, "fractions of at least 0"),
    ((1 / 8,) * 8, 2, r"zero_stage must be one of \[0, 1, 3\], got 2"),
    ((), 3, "zero_stage 3 needs state_shares"),
    ((1 / 8,) * 8, 0, "zero_stage 0 .* replicates the state"),
])
def test_bad_state_shares_say_what_is_wrong(shares, zero, message):
  with pytest.raises(hs.HetSpmdError, match=message):
    group_plan(PLANS[0], 38, state_shares=shares, zero_stage=zero)


def reads_moments_step(state, batch):
  """Per-example work on parameters moved by Adam's moments (a lookahead): every group's loop reads them."""
  def loss_fn(params):
    moved = jax.tree.map(lambda p, m: p + 1e-3 * m, params, state.opt_state[0].mu)
    logits = state.apply_fn({"params": moved}, batch["x"], train=False)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss}


def test_a_loop_that_reads_optimizer_state_is_refused_with_the_way_out():
  require_devices(8)
  plan = group_plan(PLANS[0], 38, state_shares=SHARES_80_16)
  with pytest.raises(hs.HetSpmdError, match="microbatch loop reads optimizer-state leaves.*without state_shares"):
    run_groups(reads_moments_step, plan)(_state(), _batches(38)[0])


def test_an_update_that_reads_every_moment_holds_them_together():
  """A penalty on every moment (outside the loop) ties the whole update into one unit, held by one device;
  still exact."""
  require_devices(8)

  def step(state, batch):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, batch["x"], train=False)
      pull = sum(jnp.sum(m * p) for m, p in zip(jax.tree.leaves(state.opt_state[0].mu), jax.tree.leaves(params)))
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean() + 1e-3 * pull
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  plan = group_plan(PLANS[0], 38, state_shares=SHARES_80_16)
  state, ref = _trained(step, plan, _state, _batches(38))
  ref.check(state.params, lambda s: s.params)
  ref.check(state.opt_state, lambda s: s.opt_state)
  held = {d for x in jax.tree.leaves(state.opt_state) if np.size(x) > 1 for d in x.sharding.device_set}
  assert len(held) == 1


def test_the_search_holds_state_in_shares_where_replicated_state_does_not_fit():
  """Five devices too small for the replicated Adam state beside three large ones: the searched group plan holds
  the optimizer state in shares by free memory (smaller on the small devices), and runs exactly."""
  import dataclasses

  from hetspmd.hardware.profiler import device_spec
  from hetspmd.planner.data_axis import memory_per_device

  require_devices(8)
  batch = 48
  profile = profile_step(dropout_step, _state(), _batches(batch)[0])
  without = memory_per_device(profile, 8, 1, 0, "none", optimizer_share=0.0)
  replicated = memory_per_device(profile, 8, 1, 0, "none")
  small = dataclasses.replace(device_spec("P100-16GB"), name="P100-small", memory_bytes=(without + replicated) // 2)
  cluster = hs.Cluster.emulate(jax.devices()[:8], kinds=["V100-32GB"] * 3 + ["P100-small"] * 5,
                               custom={"P100-small": small})
  priced = search_groups(cluster, profile, batch, microbatch_sizes(batch)[:1])
  assert priced.zero_stage == 1 and all(m <= small.memory_bytes for m in priced.memory_bytes[3:])
  plan = to_group_plan(cluster, priced)
  assert plan.state_shares[3] < plan.state_shares[0] and abs(sum(plan.state_shares) - 1) < 1e-9
  state, ref = _trained(dropout_step, plan, _state, _batches(batch))
  ref.check(state.params, lambda s: s.params)
  ref.check(state.opt_state, lambda s: s.opt_state)
  _held_on_one_device(state.opt_state)


@pytest.mark.timeout(300)
def test_two_processes_each_run_their_own_group():
  """2 processes x 4 CPU devices over jax.distributed (gloo), one group per process (microbatches of 4 and of 1)
  and a uniform tail, the state replicated, then the optimizer state in memory shares (ZeRO-1), then the
  parameters too (ZeRO-3, each sent to every device by one uniform program at the start of the next step): each
  process dispatches only its group's program (and its devices' updates); the parameters and moments each
  process holds and the metrics equal one device's."""
  from multiprocess import group_child, run_processes

  results = run_processes(group_child() + textwrap.dedent(f"""
      from hetspmd.plan.groups import group_plan
      from hetspmd.runtime.grouped import run_groups

      batches = t._batches(42)
      ref = reference(t.dropout_step, t._state(), batches)
      report = {{}}
      for name, shares, zero in (("replicated", (), 0), ("shares", {SHARES_80_16!r}, 1),
                                 ("zero3", {SHARES_80_16!r}, 3)):
        plan = group_plan([(ids[0], 4, (2, 2, 1, 1)), (ids[1], 1, (3, 3, 2, 2))], 42, tail=(1, 1),
                          state_shares=shares, zero_stage=zero)
        step = run_groups(t.dropout_step, plan)
        state = step.shard_state(t._state())
        for i, batch in enumerate(batches):
          state, metrics = step(state, step.shard_batch(fed(step, batch)) if shares else fed(step, batch))
          ref.check_metrics(jax.tree.map(local, metrics), i)
        mine = jax.tree.map(local, (state.params, state.opt_state))
        held = [m is not None for m in jax.tree.leaves(mine, is_leaf=lambda x: x is None)]
        ref.check(jax.tree.map(lambda m, r: r if m is None else m, mine, (ref.single.params, ref.single.opt_state),
                               is_leaf=lambda x: x is None), lambda s: (s.params, s.opt_state))
        report[name] = {{"held": held,
                         "groups": sum(1 for n in step.memory_analysis() if n.startswith("group"))}}
      print(json.dumps(report))
  """), num_processes=2, devices_per_process=4, timeout=240)
  params = 6  # leaves of (params, opt_state): the model's 6 parameters, then the step count and the moments
  for name in ("replicated", "shares", "zero3"):
    assert [r[name]["groups"] for r in results] == [1, 1]
    held = np.array([r[name]["held"] for r in results])
    assert held.any(axis=0).all()  # every leaf is checked by a process that holds it
  assert np.array([r["shares"]["held"] for r in results])[:, :params].all()  # ZeRO-1: parameters everywhere
  for name, first in (("shares", params), ("zero3", 0)):  # each large leaf lives in one process only
    held = np.array([r[name]["held"] for r in results])
    large = np.arange(held.shape[1]) >= first
    large[params] = False  # the step count, on every device
    assert not held.all(axis=0)[large].any() and held[:, params].all()


class TinyLM(nn.Module):
  """A language model shaped like Flax's lm1b example: embeddings, a dropout'd MLP block, logits tied to the
  embedding."""

  @nn.compact
  def __call__(self, tokens, train: bool = True):
    embed = nn.Embed(32, 16)
    x = embed(tokens)
    x = x + nn.Dropout(0.1, deterministic=not train)(nn.Dense(16)(nn.gelu(nn.Dense(32)(nn.LayerNorm()(x)))))
    return embed.attend(nn.LayerNorm()(x))


def lm1b_style_step(state, batch, dropout_rng):
  """As lm1b's train_step: padding weights, label smoothing, the loss normalised by the batch's token count, a
  per-step dropout key, metrics as sums with their denominator."""
  inputs, targets = batch["inputs"], batch["targets"]
  weights = jnp.where(targets > 0, 1.0, 0.0)
  rng = jax.random.fold_in(dropout_rng, state.step)

  def loss_fn(params):
    logits = state.apply_fn({"params": params}, inputs, rngs={"dropout": rng})
    soft = optax.smooth_labels(jax.nn.one_hot(targets, 32), 0.1)
    loss = optax.softmax_cross_entropy(logits, soft) * weights
    return loss.sum() / weights.sum(), logits

  (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  new_state = state.apply_gradients(grads=grads)
  correct = (jnp.argmax(logits, -1) == targets) * weights
  return new_state, {"accuracy": correct.sum(), "denominator": weights.sum()}


def test_an_lm1b_style_linen_step_under_group_programs_with_state_shares():
  """A Linen TrainState whose apply_fn closes over its module, a loss normalised by the global token count (two
  loops), dropout keyed by the step, Adam moments in memory shares: equal to one device."""
  require_devices(8)
  model = TinyLM()
  params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32), train=False)["params"]
  make = lambda: train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(3e-3))
  plan = group_plan([((0, 1, 2, 3), 4, (1, 1, 1, 1)), ((4, 5, 6, 7), 2, (1, 1, 1, 0))], 22,
                    state_shares=SHARES_80_16)
  rs = np.random.RandomState(5)
  batches = []
  for _ in range(STEPS):
    tokens = rs.randint(1, 32, (22, 9)).astype(np.int32)
    tokens[rs.rand(22, 9) < 0.2] = 0  # padding
    batches.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
  state, ref = _trained(lm1b_style_step, plan, make, batches, jax.random.key(3))
  ref.check(state.params, lambda s: s.params)
  ref.check(state.opt_state, lambda s: s.opt_state)
  _held_on_one_device(state.opt_state)


@pytest.mark.parametrize("remats", [("none", "full"), ("dots", "all_dots")], ids=["none-full", "dots-all_dots"])
def test_groups_with_their_own_remat_policies_match_one_device(remats):
  """The zoo's GPT-2 with hetspmd.value_and_grad: a group of large microbatches that saves its forward pass
  beside a group of small ones that recomputes it (each group's program its own trace, its sums matched to the
  exchange program's by where the update reads them), a tail under the policy that recomputes most."""
  require_devices(8)
  w = models.get("gpt2-tiny")
  plan = group_plan([((0, 1, 2, 3), 2, (2, 2, 1, 1), remats[0]), ((4, 5, 6, 7), 1, (2, 1, 1, 1), remats[1])], 25,
                    tail=(1, 1))
  assert plan.tail_remat == max(remats, key=REMAT_POLICIES.index)
  rs = np.random.RandomState(2)
  batches = [jax.tree.map(lambda s: rs.randint(0, 50, s.shape).astype(s.dtype), w.example_batch(plan.global_batch))
             for _ in range(2)]
  step_fn = w.make_train_step(hs.value_and_grad)
  state, ref = _trained(step_fn, plan, w.init_state, batches)
  ref.check(state)
  runner = run_groups(step_fn, plan)
  runner(w.init_state(), batches[0])
  lowered = {name: program.lower(*args).as_text() for name, (program, args) in runner._last.items()
             if name.startswith("group")}
  dots = [lowered[f"group {g}"].count("stablehlo.dot_general") for g in range(2)]
  if remats[0] == "none":  # the group that recomputes its forward pass runs its matmuls again in the backward
    assert dots[0] < dots[1]


def test_the_search_gives_each_kind_the_remat_it_needs():
  """Small devices whose memory holds a microbatch only when its forward pass is recomputed, beside large ones
  that need not: the searched group plan recomputes on the small kind alone, and runs exactly."""
  import dataclasses

  from hetspmd.hardware.profiler import device_spec
  from hetspmd.planner.data_axis import memory_per_device

  require_devices(8)
  w = models.get("gpt2-tiny")
  step_fn = w.make_train_step(hs.value_and_grad)
  batch, m = 96, 8
  rs = np.random.RandomState(4)
  batches = [jax.tree.map(lambda s: rs.randint(0, 50, s.shape).astype(s.dtype), w.example_batch(batch))
             for _ in range(2)]
  profile = profile_step(step_fn, w.init_state(), batches[0])
  saved, recomputed = (memory_per_device(profile, 8, m, 0, r, optimizer_share=0.0) for r in ("none", "all_dots"))
  assert recomputed < saved
  small = dataclasses.replace(device_spec("P100-16GB"), name="P100-small", memory_bytes=(saved + recomputed) // 2)
  cluster = hs.Cluster.emulate(jax.devices()[:8], kinds=["V100-32GB"] * 4 + ["P100-small"] * 4,
                               custom={"P100-small": small})
  priced = search_groups(cluster, profile, batch, [m], remat_policies=REMAT_POLICIES)
  assert priced.group.remats[0] == "none" and priced.group.remats[-1] != "none", priced.group.remats
  plan = to_group_plan(cluster, priced)
  assert [g.remat for g in plan.groups] == ["none", priced.group.remats[-1]]
  state, ref = _trained(step_fn, plan, w.init_state, batches)
  ref.check(state)


def test_the_cli_writes_a_group_plan_that_runs_exactly(tmp_path, capsys):
  """hetspmd search --group-plan-out on a V100 + P100 spec of 8 devices; the file, loaded, runs the zoo's MLP
  on 8 CPU devices (devices by cluster position) exactly; a missing or foreign file says what is wrong."""
  from hetspmd.cli import main

  require_devices(8)
  path = tmp_path / "groups.json"
  assert main(["search", "--model", "mlp-tiny", "--cluster", "1x4xV100-32GB+1x4xP100-16GB", "--global-batch", "32",
               "--group-plan-out", str(path), "--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  from hetspmd.planner.ranking import GROUP_PLAN_CONDITIONS, GROUP_PLAN_MARGIN
  grouped = report["group_plan"]
  assert grouped["parallelize"] == {"margin": GROUP_PLAN_MARGIN, "conditions": GROUP_PLAN_CONDITIONS,
                                    "priced_past_margin": grouped["speedup_over_best"] >= GROUP_PLAN_MARGIN}
  plan = GroupPlan.load(path)
  assert plan.global_batch == 32 and sorted(plan.devices) == list(range(8))
  assert [g.microbatch for g in plan.groups] == sorted(set(report["group_plan"]["microbatches"]),
                                                       key=report["group_plan"]["microbatches"].index)
  w = models.get("mlp-tiny")
  rs = np.random.RandomState(6)
  batches = [jax.tree.map(lambda s: rs.standard_normal(s.shape).astype(s.dtype) if s.dtype.kind == "f"
                          else rs.randint(0, 2, s.shape).astype(s.dtype), w.example_batch(32)) for _ in range(2)]
  state, ref = _trained(w.make_train_step(), plan, w.init_state, batches)
  ref.check(state)
  with pytest.raises(hs.HetSpmdError, match="does not exist"):
    GroupPlan.load(tmp_path / "missing.json")
  (tmp_path / "other.json").write_text("[1, 2]")
  with pytest.raises(hs.HetSpmdError, match="holds no groups"):
    GroupPlan.load(tmp_path / "other.json")


def _mlp_train_state():
  k = jax.random.split(jax.random.key(3), 2)
  params = {"w1": jax.random.normal(k[0], (12, 24)) * 0.3, "b1": jnp.zeros(24),
            "w2": jax.random.normal(k[1], (24, 4)) * 0.3}
  return train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))


def _mlp_loss(params, x, y):
  return jnp.mean((jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] - y) ** 2)


def gradients_step(state, batch):
  loss, grads = jax.value_and_grad(_mlp_loss)(state.params, batch["x"], batch["y"])
  return state.apply_gradients(grads=grads), {"loss": loss, "grads": grads}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tail,shares,parts", [((0, 0), (), False), ((1, 1), (), False), ((0, 0), SHARES_80_16, False),
                                              ((0, 0), (), True), ((0, 0), (), "layers")],
                         ids=["exchange", "tail", "owners", "parts", "parts-own-remat"])
def test_bfloat16_gradients_under_group_programs_within_the_rounding_bound(tail, shares, parts):
  """With ``grad_reduce_dtype="bfloat16"`` each device's partial gradient leaves its group program in bfloat16 (half
  the bytes the exchange reduces, or that are copied to the devices owning state shares) and is summed over the
  8 devices in bfloat16, the loss's sum in float32: every gradient element is within the bound of that
  rounding, gamma(n + 1) of the sum of the examples' gradients' magnitudes (no smaller than the devices'
  partials'), of the float32 gradient; the bound is not vacuous, and the loss is float32's. ``parts``: a group
  sharding its parameters beside an unsharded one of its size, which reduce-scatters its gradients in bfloat16
  onto the sharded group's parts (``"layers"``: the sharded group under that remat policy, its sums matched to the
  unsharded group's)."""
  require_devices(8)
  remat = parts if isinstance(parts, str) else "none"
  groups = ([((0, 1, 2, 3), 2, (2, 2, 1, 1), remat, 1, (), True), ((4, 5, 6, 7), 2, (2, 1, 1, 1))] if parts
            else PLANS[0])
  size = sum(g[1] * sum(g[2]) for g in groups) + 8 * tail[0] * tail[1]
  plan = group_plan(groups, size, tail=tail, state_shares=shares, grad_reduce_dtype="bfloat16")
  rs = np.random.RandomState(0)
  batch = {"x": rs.randn(size, 12).astype(np.float32), "y": rs.randn(size, 4).astype(np.float32)}
  params = _mlp_train_state().params
  exact_loss, exact = jax.value_and_grad(_mlp_loss)(params, batch["x"], batch["y"])
  # each example's share of the mean's gradient
  per_example = jax.vmap(lambda x, y: jax.grad(_mlp_loss)(params, x[None], y[None]))(batch["x"], batch["y"])
  step = run_groups(gradients_step, plan)
  new, metrics = step(step.shard_state(_mlp_train_state()), batch)
  # Adam's first moment is 0.1 g, made by the devices that own it (under shares, from their own reduction of
  # the rows copied to them): within the same bound, scaled
  mu = new.opt_state[0].mu
  u = 2.0 ** -8  # bfloat16's unit roundoff
  bound = 9 * u / (1 - 9 * u)
  moved = 0.0
  for name in exact:
    magnitude = np.sum(np.abs(np.asarray(per_example[name])), axis=0) / size
    err = np.abs(np.asarray(metrics["grads"][name]) - np.asarray(exact[name]))
    slack = 1e-6 * float(np.max(np.abs(exact[name])))  # float32 accumulation order
    assert np.all(err <= bound * magnitude + slack), name
    held = np.abs(np.asarray(mu[name]) - 0.1 * np.asarray(exact[name]))
    assert np.all(held <= 0.1 * (bound * magnitude + slack) * (1 + 1e-6) + 1e-9), name
    moved = max(moved, float(np.max(err)))
  assert moved > 1e-4 * max(float(np.max(np.abs(g))) for g in jax.tree.leaves(exact))  # float32 moves ~1e-7
  np.testing.assert_allclose(float(metrics["loss"]), float(exact_loss), rtol=1e-5)
  grouped = [name for name in step._last if name.startswith("group")]
  rows = {str(x.dtype) for name in grouped for x in jax.tree.leaves(step._last[name][0].lower(
      *step._last[name][1]).out_info)}
  assert ("bfloat16" in rows) == (not tail[1])  # with a tail, the tail's reduction narrows them
  if parts:  # the unsharded group's reduce-scatters after its loop, of bfloat16 (XLA:CPU may widen them itself)
    text = step._last["group 1"][0].lower(*step._last["group 1"][1]).as_text()
    scatters = re.findall(r'"stablehlo\.reduce_scatter".*?\}\) : \((.*?)\) ->', text, re.DOTALL)
    assert len(scatters) == 3 and all("bf16" in operand for operand in scatters), scatters
  exchange = step._last["exchange"][0].lower(*step._last["exchange"][1]).as_text()
  narrowed = re.findall(r'"stablehlo\.all_reduce".*?\}\) : \(([^)]*)\)', exchange, re.DOTALL) if tail[1] else (
      re.findall(r"stablehlo\.reduce\(.*?: \(([^)]*)\)", exchange))
  # the three gradients: reduced one by one over the rows, or in one bucket by the tail's all-reduce
  assert sum("bf16" in operands for operands in narrowed) == (1 if tail[1] else 3), narrowed


@pytest.mark.parametrize("zero", [1, 3])
def test_each_held_leaf_is_one_record(zero):
  """Where the state lives is one record per held leaf (its device, role, the output that makes it and its cast),
  the devices following the shares; the group program's stages are named, innermost first."""
  from hetspmd.lowering.group_build import HeldLeaf

  require_devices(8)
  plan = group_plan(PLANS[0], 38, state_shares=SHARES_80_16, zero_stage=zero)
  step = run_groups(dropout_step, plan)
  built = step.prepare(dropout_step, _state(), _batches(38)[0], ())
  assert built.held and all(isinstance(h, HeldLeaf) for h in built.held)
  assert len({h.index for h in built.held}) == len(built.held)  # one record per leaf
  roles = {h.role for h in built.held}
  assert roles == ({"opt_state", "param"} if zero == 3 else {"opt_state"})
  assert all((h.output is not None) == (h.role == "param") for h in built.held)
  assert set(built.owner_paths) == {h.path for h in built.held}
  held = built.held_bytes(step.devices)
  assert sum(held) == sum(h.nbytes for h in built.held)
  assert max(held[:4]) > max(held[4:])  # the 80 GB devices hold more than the 16 GB ones
  assert built.stages[0] == "loop" and "hold" in built.stages  # every group reads less than the whole state
  explained = step.explain()
  assert "each group's program: loop -> " in explained and "held per device" in explained
