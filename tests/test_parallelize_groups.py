"""Group plans through the front door: ``parallelize(plan=GroupPlan | its JSON | "search")`` runs the step as
one program per device group, with every way of calling a step that ``parallelize`` accepts (extra arguments,
keywords, NNX objects bound by ``nnx.cached_partial``, ``pmap``-style collectives, a batch placed ahead); the
search's group plan runs where it is priced ahead (per-example outputs too), and gives way to the single program
for a step group programs do not run. Each step is checked against one device."""

import dataclasses
import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import hetspmd as hs
import hetspmd.runtime.searching as step_module
from hetspmd.passes.profile import profile_step
from hetspmd.plan.groups import group_plan, split_by_process
from hetspmd.planner.grouping import to_group_plan
from hetspmd.planner.ranking import GROUP_PLAN_CONDITIONS, GROUP_PLAN_MARGIN, chosen_group_plan, search

from conftest import require_devices
from exactness import NnxReference, Reference, assert_exact
from test_pmap_steps import one_replica
from test_group_programs import (PLANS, SHARES_80_16, STEPS, TinyLM, _batches, _held_on_one_device, _state,
                                 dropout_step, lm1b_style_step, nnx_objects, nnx_train_step, reads_moments_step)
from test_group_per_example import with_logits


def _lm1b_batches(size, seed=5):
  rs = np.random.RandomState(seed)
  batches = []
  for _ in range(STEPS):
    tokens = rs.randint(1, 32, (size, 9)).astype(np.int32)
    tokens[rs.rand(size, 9) < 0.2] = 0  # padding
    batches.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
  return batches


def _lm1b_state():
  model = TinyLM()
  params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32), train=False)["params"]
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(3e-3))


@pytest.mark.parametrize("given", ["plan", "json"])
@pytest.mark.parametrize("keyword", [False, True], ids=["positional-rng", "keyword-rng"])
def test_parallelize_runs_a_group_plan_exactly(given, keyword, tmp_path):
  """An lm1b-style Linen step (a dropout key beside the batch, passed by position or by keyword; a loss over the
  batch's token count, so two loops) under a group plan with the optimizer state in 80:16 memory shares, given
  as a GroupPlan or as its JSON file."""
  require_devices(8)
  plan = group_plan([((0, 1, 2, 3), 4, (1, 1, 1, 1)), ((4, 5, 6, 7), 2, (1, 1, 1, 0))], 22,
                    state_shares=SHARES_80_16)
  if given == "json":
    plan.save(tmp_path / "groups.json")
  step = hs.parallelize(lm1b_style_step, plan=str(tmp_path / "groups.json") if given == "json" else plan,
                        global_batch=22)
  batches, key = _lm1b_batches(22), jax.random.key(3)
  ref = Reference(lm1b_style_step, _lm1b_state()).run(batches, key)
  state = step.shard_state(_lm1b_state())
  for i, batch in enumerate(batches):
    state, metrics = step(state, batch, dropout_rng=key) if keyword else step(state, batch, key)
    ref.check_metrics(metrics, i)
  ref.check(state.params, lambda s: s.params)
  ref.check(state.opt_state, lambda s: s.opt_state)
  _held_on_one_device(state.opt_state)
  assert step.grouped and step.plan == plan
  assert "2 group program(s)" in step.explain()
  shardings = step.state_shardings(state)  # where a checkpoint restores into: the moments on their owners
  assert any(isinstance(s, jax.sharding.SingleDeviceSharding) for s in jax.tree.leaves(shardings.opt_state))
  with pytest.raises(hs.HetSpmdError, match="no one program to lower"):
    step.lower(state, batches[0], key)


def test_an_nnx_step_bound_by_cached_partial_under_a_group_plan():
  """NNX in place, its model and optimizer bound by ``nnx.cached_partial``, a batch placed ahead with
  ``shard_batch``, ZeRO-3 shares: the caller's objects hold the one-device result."""
  from flax import nnx

  require_devices(8)
  plan = group_plan(PLANS[1], 36, state_shares=SHARES_80_16, zero_stage=3)
  batches = _batches(36)
  ref = NnxReference(nnx_train_step, nnx_objects()).run(batches)
  model, optimizer = nnx_objects()
  step = hs.parallelize(nnx.cached_partial(nnx_train_step, model, optimizer), plan=plan, global_batch=36)
  for batch in batches:
    step(step.shard_batch(batch))
  assert_exact(nnx.state(model, nnx.Param), nnx.state(ref.single[0], nnx.Param),
               nnx.state(ref.ref64[0], nnx.Param), what="params")
  _held_on_one_device(nnx.state(model, nnx.Param))


AXIS = "replicas"  # one_replica's default axis name


def pmap_style_step(state, batch):
  """Written for ``jax.pmap``: the gradients and the metrics averaged over the replicas' axis."""
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["x"], train=False)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  grads = jax.lax.pmean(grads, axis_name=AXIS)
  return state.apply_gradients(grads=grads), {"loss": jax.lax.pmean(loss, axis_name=AXIS)}


def test_a_pmap_style_step_under_a_group_plan():
  """``lax.pmean`` over the replicas' axis means "over the global batch" under group programs too."""
  require_devices(8)
  plan = group_plan(PLANS[0], 38)
  batches = _batches(38)
  ref = Reference(one_replica(pmap_style_step), _state()).run(batches)
  step = hs.parallelize(pmap_style_step, plan=plan, global_batch=38)
  state = _state()
  for i, batch in enumerate(batches):
    state, metrics = step(state, batch)
    ref.check_metrics(metrics, i)
  ref.check(state.params, lambda s: s.params)
  assert step.grouped and "collectives over 'replicas' (pmap style)" in step.explain()


def _emulated_pool():
  return hs.Cluster.emulate(jax.devices()[:8], kinds=["V100-32GB"] * 3 + ["P100-16GB"] * 5)


def _searched(step_fn, batches, **options):
  """``plan="search"`` on the emulated pool (``options`` to ``parallelize``), three steps of ``step_fn`` checked
  against one device: the step and its last metrics."""
  ref = Reference(step_fn, _state()).run(batches)
  step = hs.parallelize(step_fn, cluster=_emulated_pool(), plan="search", global_batch=len(batches[0]["y"]),
                        **options)
  state = _state()
  for i, batch in enumerate(batches):
    state, metrics = step(state, batch)
    ref.check_metrics(metrics, i)
  ref.check(state.params, lambda s: s.params)
  return step, metrics


def test_the_search_runs_its_group_plan_where_it_is_priced_ahead(monkeypatch):
  """With the margin lowered so that the search's group plan is taken, ``plan="search"`` runs it, exactly; at
  the default margin the same tiny step (its dispatch dwarfs its compute) runs as one program, and ``explain``
  says how the group plan was priced."""
  require_devices(8)
  batches = _batches(48)
  monkeypatch.setattr(step_module, "GROUP_PLAN_MARGIN", 0.0)
  step, _ = _searched(dropout_step, batches)
  assert step.grouped and "chosen by the search" in step.explain()
  monkeypatch.setattr(step_module, "GROUP_PLAN_MARGIN", GROUP_PLAN_MARGIN)
  step = hs.parallelize(dropout_step, cluster=_emulated_pool(), plan="search", global_batch=48)
  step(_state(), batches[0])
  assert not step.grouped and "the best group plan was priced" in step.explain()
  off = hs.parallelize(dropout_step, cluster=_emulated_pool(), plan="search", global_batch=48, group_plans=False)
  off(_state(), batches[0])
  assert not off.grouped and "group plan" not in off.explain()
  monkeypatch.setattr(step_module, "GROUP_PLAN_MARGIN", 0.0)
  # specs over the model axis (a Linen user's annotations) do not keep group plans out; one over data does
  step, _ = _searched(dropout_step, batches, specs={"Dense_0/kernel": P(None, "model"), "Dense_1/kernel": P()})
  assert step.grouped and "chosen by the search" in step.explain()
  kept = hs.parallelize(dropout_step, cluster=_emulated_pool(), plan="search", global_batch=48,
                        specs={"Dense_0/kernel": P("data")})
  kept(_state(), batches[0])
  assert not kept.grouped and f"group plans were not priced: the search prices them {GROUP_PLAN_CONDITIONS} (the " \
      "spec for 'Dense_0/kernel' (('data',)) splits over 'data', which a group's state does not follow)" in (
          kept.explain())


@dataclasses.dataclass(frozen=True)
class _Config:
  """A config as lm1b passes one to its step: settings, not arrays."""
  label_smoothing: float
  mode: str = "train"


def lm1b_signature_step(state, batch, config, learning_rate_fn, dropout_rng):
  """lm1b's train_step signature: a config and a learning-rate schedule beside the batch (neither an array),
  then the dropout key; the config's smoothing shapes the loss, the schedule's rate is a metric."""
  inputs, targets = batch["inputs"], batch["targets"]
  weights = jnp.where(targets > 0, 1.0, 0.0)
  rng = jax.random.fold_in(dropout_rng, state.step)

  def loss_fn(params):
    logits = state.apply_fn({"params": params}, inputs, rngs={"dropout": rng}, train=config.mode == "train")
    soft = optax.smooth_labels(jax.nn.one_hot(targets, 32), config.label_smoothing)
    return (optax.softmax_cross_entropy(logits, soft) * weights).sum() / weights.sum()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss, "learning_rate": learning_rate_fn(state.step)}


@pytest.mark.parametrize("given", ["plan", "search"])
def test_a_group_plan_takes_settings_beside_the_batch_as_the_single_program_does(given, monkeypatch):
  """Arguments that are not arrays (a config, a schedule function) are bound into the group programs as the
  single program binds them, not traced, under a given group plan and a searched one: exact against one
  device, and another config builds programs of its own."""
  require_devices(8)
  plan = group_plan([((0, 1, 2, 3), 4, (1, 1, 1, 1)), ((4, 5, 6, 7), 2, (1, 1, 1, 0))], 22)
  schedule, key = optax.linear_schedule(1e-3, 1e-4, 10), jax.random.key(3)
  monkeypatch.setattr(step_module, "GROUP_PLAN_MARGIN", 0.0)
  step = (hs.parallelize(lm1b_signature_step, plan=plan, global_batch=22) if given == "plan" else
          hs.parallelize(lm1b_signature_step, cluster=_emulated_pool(), plan="search", global_batch=22))
  batches = _lm1b_batches(22)
  for config in (_Config(0.1), _Config(0.0, mode="eval")):
    ref = Reference(functools.partial(lm1b_signature_step, config=config, learning_rate_fn=schedule),
                    _lm1b_state()).run(batches, dropout_rng=key)
    state = _lm1b_state()  # the search traces the first call's arguments
    for i, batch in enumerate(batches):
      state, metrics = step(state, batch, config, schedule, key)
      ref.check_metrics(metrics, i)
    ref.check(state.params, lambda s: s.params)
  assert step.grouped and step._runner.program_count == 2


def _with_shares(monkeypatch):
  """The search's group plans given the optimizer state in equal shares (ZeRO-1)."""
  def shared(*args, **kwargs):
    plan = to_group_plan(*args, **kwargs)
    return dataclasses.replace(plan, state_shares=(1 / len(plan.devices),) * len(plan.devices), zero_stage=1)
  monkeypatch.setattr(step_module, "GROUP_PLAN_MARGIN", 0.0)
  monkeypatch.setattr(step_module, "to_group_plan", shared)


def test_a_searched_group_plan_gives_way_for_a_step_groups_do_not_run(monkeypatch):
  """A loop that reads the optimizer state does not run under group programs that hold it in shares: the
  search's group plan gives way to its best single program, which runs exactly; ``explain`` says why."""
  require_devices(8)
  _with_shares(monkeypatch)
  step, _ = _searched(reads_moments_step, _batches(48))
  assert not step.grouped and isinstance(step.plan, hs.Plan)
  assert "does not run this step" in step.explain() and "optimizer-state leaves" in step.explain()
  # a group plan the user gave is not replaced: the same step says what is wrong
  given = hs.parallelize(reads_moments_step, plan=group_plan(PLANS[0], 38, state_shares=SHARES_80_16),
                         global_batch=38)
  with pytest.raises(hs.HetSpmdError, match="optimizer-state leaves"):
    given(_state(), _batches(38)[0])


def test_the_search_runs_a_step_with_per_example_outputs_as_group_programs(monkeypatch):
  """Logits among the metrics: the search's group plan runs them (each group's examples put into the global
  order), exactly."""
  require_devices(8)
  monkeypatch.setattr(step_module, "GROUP_PLAN_MARGIN", 0.0)
  step, metrics = _searched(with_logits, _batches(48))
  assert step.grouped and metrics["logits"].shape == (48, 4)


@pytest.mark.parametrize("step_fn, grouped", [(dropout_step, True), (reads_moments_step, False)],
                         ids=["group-plan", "gives-way"])
def test_the_searched_plan_is_final_before_anything_is_placed(step_fn, grouped, monkeypatch):
  """State and batch placed before the first call (``shard_state``, ``shard_batch``, from ``example_batch``)
  land where the step then runs: the search's group plan builds its programs when it is chosen, so a step that
  group programs do not run is on its single program before anything is placed. Exact against one device."""
  require_devices(8)
  _with_shares(monkeypatch)
  batches = _batches(48)
  ref = Reference(step_fn, _state()).run(batches)
  step = hs.parallelize(step_fn, cluster=_emulated_pool(), plan="search", global_batch=48,
                        example_batch=batches[0])
  state = step.shard_state(_state())
  assert step.grouped == grouped
  for i, batch in enumerate(batches):
    state, metrics = step(state, step.shard_batch(batch))
    ref.check_metrics(metrics, i)
  ref.check(state.params, lambda s: s.params)
  assert step.grouped == grouped


def test_the_search_traces_a_step_called_with_keywords(monkeypatch):
  """``plan="search"`` on an lm1b-style step whose dropout key comes by keyword: the search and the group plan
  it chooses see the key as an input, and the step is exact."""
  require_devices(8)
  monkeypatch.setattr(step_module, "GROUP_PLAN_MARGIN", 0.0)
  batches, key = _lm1b_batches(24), jax.random.key(3)
  ref = Reference(lm1b_style_step, _lm1b_state()).run(batches, key)
  step = hs.parallelize(lm1b_style_step, cluster=_emulated_pool(), plan="search", global_batch=24)
  state = _lm1b_state()
  for i, batch in enumerate(batches):
    state, metrics = step(state, batch, dropout_rng=key)
    ref.check_metrics(metrics, i)
  ref.check(state.params, lambda s: s.params)
  assert step.grouped


@pytest.mark.parametrize("margin", [0.0, 0.5, 1.0, GROUP_PLAN_MARGIN, 50.0])
def test_a_group_plan_is_chosen_only_at_its_margin(margin):
  profile = profile_step(dropout_step, _state(), _batches(48)[0])
  result = search(_emulated_pool(), profile, 48, top=1, groups=True)
  ratio = result.group_plan.throughput / result.plans[0].throughput
  chosen = chosen_group_plan(result, margin)
  assert (chosen is result.group_plan) == (ratio >= margin)
  assert chosen_group_plan(search(_emulated_pool(), profile, 48, top=1), 0.0) is None  # none priced


def _layout(plan):
  """Each device's examples: ``{device: (first example, examples)}``."""
  return {d: (start, c * g.microbatch) for g, starts in zip(plan.groups, plan.starts())
          for d, start, c in zip(g.devices, starts, g.counts)}


@pytest.mark.parametrize("process_of", [
    {d: d // 4 for d in range(8)},
    {d: d % 2 for d in range(8)},
    {d: 0 for d in range(8)},
], ids=["halves", "interleaved", "one-process"])
def test_groups_spanning_processes_are_cut_without_moving_an_example(process_of):
  plan = group_plan([((0, 4, 1, 5), 2, (1, 2, 0, 1)), ((2, 3, 6, 7), 1, (3, 1, 1, 2))], 15,
                    state_shares=(1 / 8,) * 8)
  cut = split_by_process(plan, process_of)
  assert all(len({process_of[d] for d in g.devices}) == 1 for g in cut.groups)
  assert _layout(cut) == _layout(plan) and cut.devices == plan.devices and cut.state_shares == plan.state_shares
  assert len(cut.groups) == len(plan.groups) + sum(
      sum(process_of[a] != process_of[b] for a, b in zip(g.devices, g.devices[1:])) for g in plan.groups)


@pytest.mark.timeout(300)
def test_two_processes_run_a_group_plan_whose_groups_span_them():
  """2 processes x 4 CPU devices (gloo): each group of the plan given to ``parallelize`` holds devices of both
  processes, so each is cut into one group per process; the optimizer state in shares; the metrics and the
  parameters every process holds equal one device's."""
  from multiprocess import group_child, run_processes

  results = run_processes(group_child() + textwrap.dedent("""
      import hetspmd as hs
      from hetspmd.plan.groups import group_plan

      batches = t._batches(30)
      ref = reference(t.dropout_step, t._state(), batches)
      plan = group_plan([(ids[0][:2] + ids[1][:2], 4, (1, 2, 1, 1)), (ids[0][2:] + ids[1][2:], 1, (3, 2, 2, 3))],
                        30, state_shares=(1 / 8,) * 8)
      step = hs.parallelize(t.dropout_step, plan=plan, global_batch=30)
      state = t._state()
      for i, batch in enumerate(batches):
        state, metrics = step(state, fed(step, batch))
        ref.check_metrics(jax.tree.map(local, metrics), i)
      ref.check(jax.tree.map(local, state.params), lambda s: s.params)
      print(json.dumps({"groups": len(step.plan.groups),
                        "mine": sum(1 for n in step.memory_analysis() if n.startswith("group"))}))
  """), num_processes=2, devices_per_process=4, timeout=240)
  assert [r["groups"] for r in results] == [4, 4] and [r["mine"] for r in results] == [2, 2]


def test_state_shardings_before_the_first_call_from_example_batch():
  """With ``example_batch``, a group plan with state shares says where each optimizer-state leaf lives before
  the step has run (to restore a checkpoint into), as it does after; a step that takes more than
  ``(state, batch)`` says to call it first."""
  require_devices(8)
  plan = group_plan(PLANS[1], 36, state_shares=SHARES_80_16)
  batch = _batches(36)[0]
  step = hs.parallelize(dropout_step, plan=plan, global_batch=36, example_batch={k: v[:2] for k, v in batch.items()})
  before = step.state_shardings(jax.eval_shape(_state))
  held = [s for s in jax.tree.leaves(before.opt_state) if isinstance(s, jax.sharding.SingleDeviceSharding)]
  assert held and len({next(iter(s.device_set)) for s in held}) > 1
  state, _ = step(step.shard_state(_state()), batch)
  after = step.state_shardings(state)
  assert [s.device_set for s in jax.tree.leaves(before)] == [s.device_set for s in jax.tree.leaves(after)]
  lm1b = hs.parallelize(lm1b_style_step, plan=group_plan([((0, 1, 2, 3), 4, (1, 1, 1, 1)),
                                                          ((4, 5, 6, 7), 2, (1, 1, 1, 0))], 22,
                                                         state_shares=SHARES_80_16),
                        global_batch=22, example_batch=_lm1b_batches(22)[0])
  with pytest.raises(hs.HetSpmdError, match=r"step\(state, batch\), which this step is not"):
    lm1b.state_shardings(_lm1b_state())


def _shifted_step(state, batch, shift=None, scale=None, mode="train"):
  """A step whose array may come by either of two parameters, beside a setting."""
  x = batch["x"] * (scale if scale is not None else 1.0) + (shift if shift is not None else 0.0)
  return dropout_step(state, {**batch, "x": x})


def test_programs_are_told_apart_by_where_each_argument_was():
  """The same array passed as another parameter (the same leaves and the same setting) builds programs of its
  own, each exact against one device; an unhashable setting keys the programs by itself, held."""
  require_devices(8)
  plan = group_plan(PLANS[0], 38)
  step = hs.parallelize(_shifted_step, plan=plan, global_batch=38)
  batch, three = _batches(38)[0], jnp.float32(3.0)
  for args, kwargs in (((None, three), {"mode": "x"}), ((), {"shift": three, "mode": "x"})):
    ref = Reference(lambda s, b: _shifted_step(s, b, *args, **kwargs), _state()).run([batch])
    _, metrics = step(_state(), batch, *args, **kwargs)
    ref.check_metrics(metrics, 0)
  assert step._runner.program_count == 2
  from hetspmd.runtime.binding import hashable
  setting = {"mode": "x"}
  assert hashable(((0, setting),)) == hashable(((0, setting),)) != hashable(((0, {"mode": "x"}),))


@pytest.mark.parametrize("shares,zero", [((), 0), (SHARES_80_16, 1), (SHARES_80_16, 3)],
                         ids=["replicated", "zero1", "zero3"])
@pytest.mark.parametrize("donate", [True, False])
def test_a_group_plan_donates_the_state_it_replaces(shares, zero, donate):
  """``donate_state`` (parallelize's default) under a group plan: the uniform program writes a replicated new
  state into the old one's buffers; under state shares each device's update program writes its optimizer-state
  leaves into their old buffers. The state passed in is then deleted (kept alive without donation); exact
  either way."""
  require_devices(8)
  plan = group_plan(PLANS[0], 38, tail=(0, 0), state_shares=shares, zero_stage=zero or None)
  batches = _batches(38)
  ref = Reference(dropout_step, _state()).run(batches)
  step = hs.parallelize(dropout_step, plan=plan, global_batch=38, donate_state=donate)
  state = step.shard_state(_state())
  for i, batch in enumerate(batches):
    given, (state, metrics) = state, step(state, batch)
    ref.check_metrics(metrics, i)
  ref.check(state.params, lambda s: s.params)
  ref.check(state.opt_state, lambda s: s.opt_state)
  moments = [x for x in jax.tree.leaves(given.opt_state) if np.size(x) > 1]
  params = jax.tree.leaves(given.params)
  assert all(x.is_deleted() == donate for x in moments)
  assert all(x.is_deleted() == (donate and not shares) for x in params)  # shares: each device's update makes them
  programs = step.memory_analysis()
  written = programs["update on device 0" if shares else "exchange"].alias_size_in_bytes
  assert (written > 0) == donate


def test_an_update_that_fails_to_compile_leaves_the_donated_state_whole(monkeypatch):
  """Under state shares every device's update program is compiled before any runs and donates its leaves: one
  that fails (here the second device's, failing as it is traced) leaves the state it was given whole, and the
  same state then trains exactly."""
  require_devices(8)
  from hetspmd.lowering import groups as group_lowering

  def failing_second(make):
    made = []

    def build(prog, outs, *rest):
      run = make(prog, outs, *rest)
      made.append(outs)

      def broken(*args):
        raise hs.HetSpmdError("a program that does not compile")
      return broken if len(made) == 2 else run
    return build

  for name in ("update_program", "owner_update_program"):
    monkeypatch.setattr(group_lowering, name, failing_second(getattr(group_lowering, name)))
  plan = group_plan(PLANS[0], 38, state_shares=SHARES_80_16)
  state = hs.parallelize(dropout_step, plan=plan, global_batch=38).shard_state(_state())
  with pytest.raises(hs.HetSpmdError, match="does not compile"):
    hs.parallelize(dropout_step, plan=plan, global_batch=38)(state, _batches(38)[0])
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))
  monkeypatch.undo()
  batches = _batches(38)
  ref = Reference(dropout_step, _state()).run(batches)
  step = hs.parallelize(dropout_step, plan=plan, global_batch=38)
  for i, batch in enumerate(batches):
    state, metrics = step(state, batch)
    ref.check_metrics(metrics, i)
  ref.check(state.opt_state, lambda s: s.opt_state)


def _ema_step(state, batch):
  """A moving average of the weights beside them; a state that starts with both the same array."""
  def loss_fn(w):
    return jnp.mean((batch["x"] @ w - jax.nn.one_hot(batch["y"], 4)) ** 2)
  loss, grad = jax.value_and_grad(loss_fn)(state["w"])
  w = state["w"] - 0.1 * grad
  return {"w": w, "ema": 0.9 * state["ema"] + 0.1 * w}, {"loss": loss}


@pytest.mark.parametrize("plan", ["auto", "groups"])
def test_a_state_holding_one_array_twice_is_donated_once(plan):
  """``{"w": w, "ema": w}``: the same buffers twice, which XLA cannot take donated twice; the step copies the
  second and stays exact, under a single program and a group plan."""
  require_devices(8)
  w = jnp.asarray(np.random.RandomState(0).randn(6, 4).astype(np.float32))
  batches = _batches(38)
  ref = Reference(_ema_step, {"w": w, "ema": w}).run(batches)
  step = hs.parallelize(_ema_step, plan=group_plan(PLANS[0], 38) if plan == "groups" else "auto", global_batch=38)
  state = {"w": w, "ema": w}
  for i, batch in enumerate(batches):
    state, metrics = step(state, batch)
    ref.check_metrics(metrics, i)
  ref.check(state)
