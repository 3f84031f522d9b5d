"""Sharded groups (FSDP within a group, ``Group(..., shard_params=True)``) under steps written the way Flax users
write them: NNX in place, a stack of layers scanned and unrolled, a model computing in bfloat16, two processes,
orbax checkpoints moving between a sharded group plan and a single program, and ``parallelize(plan=...)``. Every
step's metrics and the final parameters and optimizer state are checked against one device, float64-referenced
(tests/exactness.py)."""

import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import hetspmd as hs
from hetspmd.plan.groups import Group, group_plan
from hetspmd.runtime.grouped import run_groups

from conftest import require_devices
from exactness import NnxReference, Reference, assert_exact

STEPS = 2
FEATURES, CLASSES = 6, 4


def sharded_beside_unsharded(tail=(0, 0), **kwargs):
  """Four devices sharding their parameters (uneven counts: the short ones masked in lockstep) beside four that
  do not; 17 examples plus ``8 x tail``."""
  groups = [Group((0, 1, 2, 3), 2, (2, 2, 1, 1), shard_params=True), ((4, 5, 6, 7), 1, (2, 1, 1, 1))]
  return group_plan(groups, 17 + 8 * tail[0] * tail[1], tail=tail, **kwargs)


def batches(size: int, seed: int = 0, steps: int = STEPS):
  rs = np.random.RandomState(seed)
  return [{"x": rs.randn(size, FEATURES).astype(np.float32), "y": rs.randint(0, CLASSES, size).astype(np.int32)}
          for _ in range(steps)]


# --- Linen: a TrainState step over a model chosen per case -------------------------------------------------------


def linen_step(state, batch):
  """The Linen step of Flax's examples: a dropout key folded from the step count, cross-entropy, Adam."""
  key = jax.random.fold_in(jax.random.key(11), state.step)

  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["x"], rngs={"dropout": key})
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), logits

  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
  return state.apply_gradients(grads=grads), {"loss": loss, "accuracy": accuracy}


def linen_state(model: nn.Module, eps: float = 1e-4):
  params = model.init(jax.random.key(0), jnp.zeros((1, FEATURES)))["params"]
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2, eps=eps))


def split_leaves(runner) -> int:
  """How many state leaves group 0 (the sharded group) takes split over its devices: a leaf the runtime cannot
  split comes into the group whole, which is exact too, so the tests count them."""
  runner = runner._runner.runtime if hasattr(runner, "_runner") else runner  # parallelize's: its group runtime
  (built,) = runner._built.values()
  return len(built.shards[0].at) if built.shards and built.shards[0] else 0


def trained(step_fn, make_state, plan, data, *, half=False, runner=None):
  """``make_state()`` trained under ``plan`` (by ``run_groups``, or ``runner``) on ``data``, every step's metrics
  and the final parameters and optimizer state checked against one device; the runner and the state."""
  ref = Reference(step_fn, make_state(), half=half).run(data)
  runner = runner or run_groups(step_fn, plan)
  state = runner.shard_state(make_state())
  for i, batch in enumerate(data):
    state, metrics = runner(state, batch)
    ref.check_metrics(metrics, i)
  ref.check(state.params, lambda s: s.params, what="params")
  ref.check(state.opt_state, lambda s: s.opt_state, what="opt_state")
  return runner, state


class Residual(nn.Module):
  """One layer of the stack, shaped for ``nn.scan``: ``(carry, x) -> (carry, out)``."""
  width: int

  @nn.compact
  def __call__(self, h, _):
    update = nn.Dense(self.width)(nn.gelu(nn.Dense(2 * self.width)(nn.LayerNorm()(h))))
    return h + nn.Dropout(0.1, deterministic=False)(update), None


class LayerStack(nn.Module):
  """An input projection, ``layers`` residual layers (one ``nn.scan`` over stacked parameters, or a Python loop
  of separate ones) and a classifier."""
  scanned: bool
  layers: int = 3
  width: int = 16

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(self.width)(x)
    if self.scanned:
      scan = nn.scan(Residual, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                     length=self.layers)
      h, _ = scan(self.width, name="layers")(h, None)
    else:
      for i in range(self.layers):
        h, _ = Residual(self.width, name=f"layer_{i}")(h, None)
    return nn.Dense(CLASSES)(nn.LayerNorm()(h))


class NnxLayer(nnx.Module):
  def __init__(self, width: int, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.dense = nnx.Linear(width, width, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)

  def __call__(self, h):
    return h + self.drop(nnx.gelu(self.dense(self.norm(h))))


class NnxLayerStack(nnx.Module):
  """The NNX form: layers made by ``nnx.vmap`` (their parameters stacked) and run by ``nnx.scan``, each layer's
  dropout stream its own."""

  def __init__(self, rngs: nnx.Rngs, layers: int = 3, width: int = 16):
    self.embed = nnx.Linear(FEATURES, width, rngs=rngs)

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return NnxLayer(width, rngs)

    self.layers = make(rngs)
    self.head = nnx.Linear(width, CLASSES, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def through(layer, h):
      return layer(h)

    return self.head(through(self.layers, self.embed(x)))


class NnxMlp(nnx.Module):
  """A small NNX classifier with dropout, as NNX examples write one."""

  def __init__(self, rngs: nnx.Rngs, hidden: int = 32):
    self.first = nnx.Linear(FEATURES, hidden, rngs=rngs)
    self.norm = nnx.LayerNorm(hidden, rngs=rngs)
    self.drop = nnx.Dropout(0.2, rngs=rngs)
    self.last = nnx.Linear(hidden, CLASSES, rngs=rngs)

  def __call__(self, x):
    return self.last(self.drop(self.norm(nnx.relu(self.first(x)))))


def nnx_objects(model_class):
  model = model_class(nnx.Rngs(params=0, dropout=1))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2, eps=1e-4), wrt=nnx.Param)
  return model, optimizer, nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))


def nnx_step(model, optimizer, metrics, batch):
  """NNX in place, no ``nnx.jit``: gradients by ``nnx.value_and_grad``, the optimizer and the metrics updated in
  place, nothing returned."""
  def loss_fn(model):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), logits

  (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  metrics.update(loss=loss, logits=logits, labels=batch["y"])
  optimizer.update(model, grads)


def check_nnx_objects(ref: NnxReference, mine: tuple) -> None:
  """Every piece of state of ``mine`` (parameters, Adam's moments and count, the metrics' sums, the dropout
  streams' counters) against one device; the metrics' values too."""
  ref64 = ref.ref64
  for what, kind in (("params", nnx.Param), ("opt_state", nnx.OptState), ("rng counters", nnx.RngCount)):
    assert_exact(nnx.state(mine, kind), nnx.state(ref.single, kind), nnx.state(ref64, kind), what=what)
  assert_exact(mine[2].compute(), ref.single[2].compute(), ref64[2].compute(), what="metrics")


def nnx_trained(model_class, plan, data, run=None):
  ref = NnxReference(nnx_step, nnx_objects(model_class)).run(data)
  mine = nnx_objects(model_class)
  step = run or run_groups(nnx_step, plan)
  for batch in data:
    assert step(*mine, batch) is None
  check_nnx_objects(ref, mine)
  return step


# --- 1. NNX in place ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tail", [(0, 0), (1, 1)], ids=["no-tail", "tail-1x1"])
def test_an_nnx_step_in_place_with_a_sharded_group_matches_one_device(tail):
  require_devices(8)
  plan = sharded_beside_unsharded(tail=tail)
  step = nnx_trained(NnxMlp, plan, batches(plan.global_batch))
  assert "group 0 shards its parameters over its 4 devices" in step.explain()
  assert split_leaves(step) == 6  # both kernels and biases, the LayerNorm's scale and bias


# --- 2. a scanned stack of layers and an unrolled one --------------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scanned", [True, False], ids=["nn.scan", "unrolled"])
def test_a_linen_layer_stack_under_a_sharded_group_matches_one_device(scanned):
  """The scanned stack's parameters lead with the layer axis (3, which 4 devices do not split: each is split along
  its next axis); the unrolled stack's are separate leaves."""
  require_devices(8)
  plan = sharded_beside_unsharded()
  runner, state = trained(linen_step, lambda: linen_state(LayerStack(scanned)), plan, batches(plan.global_batch))
  kernel = state.params["layers"]["Dense_1"]["kernel"] if scanned else state.params["layer_0"]["Dense_1"]["kernel"]
  assert kernel.shape == ((3, 16, 32) if scanned else (16, 32))
  assert split_leaves(runner) == len(jax.tree.leaves(state.params))  # every parameter, the stacked ones too


@pytest.mark.timeout(240)
def test_an_nnx_scanned_layer_stack_under_a_sharded_group_matches_one_device():
  require_devices(8)
  plan = sharded_beside_unsharded()
  step = nnx_trained(NnxLayerStack, plan, batches(plan.global_batch))
  # every leaf: the embedding's and the head's, and the stacked layers' (the scan's PRNG counters, made before the
  # loop by a copy of the scan pruned to them, do not read the parameters)
  assert split_leaves(step) == 8


# --- 3. bfloat16 casts ---------------------------------------------------------------------------------------------


class HalfPrecision(nn.Module):
  """float32 parameters, the work in bfloat16 (``dtype=jnp.bfloat16``), the logits back in float32."""

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(32, dtype=jnp.bfloat16)(x))
    h = nn.Dropout(0.1, deterministic=False)(nn.LayerNorm(dtype=jnp.bfloat16)(h))
    return nn.Dense(CLASSES, dtype=jnp.bfloat16)(h).astype(jnp.float32)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shares,zero,split,casts", [((), None, 6, 0), ((1 / 8,) * 8, 3, 6, 4)],
                         ids=["replicated", "zero-3"])
def test_a_bfloat16_step_under_a_sharded_group_matches_one_device(shares, zero, split, casts):
  """Adam's ``eps`` above the gradients' rounding noise and the float64 reference widening the bfloat16 work too,
  as tests/exactness.py derives the half-precision bound. The group splits all 6 float32 parameters; under ZeRO-3
  the Dense layers' 4 come as the bfloat16 casts their holders send, split as the casts (the LayerNorm's 2 as
  float32: its statistics read them so)."""
  require_devices(8)
  plan = sharded_beside_unsharded(state_shares=shares, zero_stage=zero)
  runner, state = trained(linen_step, lambda: linen_state(HalfPrecision(), eps=1e-3), plan,
                          batches(plan.global_batch), half=True)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
  (built,) = runner._built.values()
  assert (split_leaves(runner), len(built.casts)) == (split, casts)


# --- 5. orbax: a sharded group plan to a single program and back ---------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize("saved_under", ["sharded-group", "single-program"])
def test_an_orbax_checkpoint_moves_between_a_sharded_group_and_a_single_program(saved_under, tmp_path):
  """One step under one, saved with orbax (``CheckpointManager``), restored into the other's shardings, one more
  step: both steps' metrics and the final state equal two steps on one device."""
  require_devices(8)
  plan = sharded_beside_unsharded()
  make = lambda: linen_state(LayerStack(scanned=True))
  grouped = run_groups(linen_step, plan)
  single = hs.parallelize(linen_step, global_batch=plan.global_batch)
  first, second = (grouped, single) if saved_under == "sharded-group" else (single, grouped)
  _, state = moved_through_orbax(first, second, make, batches(plan.global_batch), tmp_path)
  assert split_leaves(grouped) == len(jax.tree.leaves(state.params))


def moved_through_orbax(first, second, make, data, tmp_path):
  """One step of ``make()`` under ``first``, saved with orbax (``CheckpointManager``), restored into ``second``'s
  shardings, one more step under ``second``: both steps' metrics and the final state checked against two steps
  on one device. The restored state and the final one."""
  import orbax.checkpoint as ocp

  ref = Reference(linen_step, make()).run(data[:2])
  state, metrics = first(first.shard_state(make()), data[0])
  ref.check_metrics(metrics, 0)
  with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
    manager.save(1, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
    template = make()
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype, sharding=s),
                          template, second.state_shardings(template))
    restored = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(target))
  state, metrics = second(restored, data[1])
  ref.check_metrics(metrics, 1)
  ref.check(state.params, lambda s: s.params, what="params")
  ref.check(state.opt_state, lambda s: s.opt_state, what="opt_state")
  return restored, state


# --- 6. parallelize(plan=<a group plan with a sharded group>) ------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize("given", ["plan", "json"])
def test_parallelize_runs_a_sharded_group_plan(given, tmp_path):
  """A Linen step, the plan given as a GroupPlan or as its JSON file."""
  require_devices(8)
  plan = sharded_beside_unsharded(tail=(1, 1))
  if given == "json":
    plan.save(tmp_path / "groups.json")
  step = hs.parallelize(linen_step, plan=plan if given == "plan" else str(tmp_path / "groups.json"),
                        global_batch=plan.global_batch)
  trained(linen_step, lambda: linen_state(LayerStack(scanned=False)), plan, batches(plan.global_batch), runner=step)
  assert step.grouped and step.plan == plan and split_leaves(step) == 24


@pytest.mark.timeout(240)
def test_parallelize_runs_an_nnx_step_bound_by_cached_partial_under_a_sharded_group():
  require_devices(8)
  plan = sharded_beside_unsharded()
  data = batches(plan.global_batch)
  ref = NnxReference(nnx_step, nnx_objects(NnxMlp)).run(data)
  mine = nnx_objects(NnxMlp)
  step = hs.parallelize(nnx.cached_partial(nnx_step, *mine), plan=plan, global_batch=plan.global_batch)
  for batch in data:
    step(step.shard_batch(batch))
  check_nnx_objects(ref, mine)
  assert step.grouped and split_leaves(step) == 6


# --- 4. two processes, one group each, one sharded -----------------------------------------------------------------


@pytest.mark.timeout(300)
def test_two_processes_one_sharded_group_each_match_one_device():
  """2 processes x 4 CPU devices (gloo): process 0's group shards its parameters, process 1's does not; each
  process checks the metrics and the state it holds against one device."""
  from multiprocess import group_child, run_processes

  results = run_processes(group_child("test_sharded_groups_users") + textwrap.dedent("""
      from hetspmd.plan.groups import Group, group_plan
      from hetspmd.runtime.grouped import run_groups

      make = lambda: t.linen_state(t.LayerStack(scanned=True))
      plan = group_plan([Group(tuple(ids[0]), 2, (2, 2, 1, 1), shard_params=True), (ids[1], 1, (3, 3, 2, 2))], 22)
      data = t.batches(22)
      ref = reference(t.linen_step, make(), data)
      step = run_groups(t.linen_step, plan)
      state = step.shard_state(make())
      for i, batch in enumerate(data):
        state, metrics = step(state, fed(step, batch))
        ref.check_metrics(jax.tree.map(local, metrics), i)
      mine = jax.tree.map(local, (state.params, state.opt_state))
      ref.check(mine, lambda s: (s.params, s.opt_state))
      print(json.dumps({"explain": step.explain(), "split": t.split_leaves(step)}))
  """), num_processes=2, devices_per_process=4, timeout=240)
  assert all("group 0 shards its parameters over its 4 devices" in r["explain"] for r in results)
  assert [r["split"] for r in results] == [12, 12]  # every parameter of the scanned stack
