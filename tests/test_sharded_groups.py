"""Groups that shard their parameters over their devices (FSDP within a group), beside unsharded groups: every step
checked against one device, float64-referenced."""

import collections
import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import hetspmd as hs
from hetspmd import models
from hetspmd.errors import InvalidValueError
from hetspmd.lowering import transfers
from hetspmd.passes.profile import profile_step
from hetspmd.planner.grouping import price_groups, to_group_plan
from hetspmd.planner.pricing import Costing, device_groups
from hetspmd.report import explain_group_text, group_devices
from hetspmd.plan.groups import Group, GroupPlan, group_plan, shard_axis
from hetspmd.runtime.grouped import run_groups

from conftest import require_devices
from exactness import Reference
from test_group_programs import (_normed_state, _state, _trained as group_trained, dropout_step, normed_step,
                                 token_batches)

STEPS = 2


def _batches(size, seed=0):
  rs = np.random.RandomState(seed)
  return [{"x": rs.randn(size, 6).astype(np.float32), "y": rs.randint(0, 4, size).astype(np.int32)}
          for _ in range(STEPS)]


def _trained(plan, state, step_fn=dropout_step, batches=None, *, before=lambda i: None, opt_state=True):
  """``state()`` trained by ``step_fn`` under ``plan`` on ``batches`` (default: ``_batches``), every step's metrics
  and the final parameters (and optimizer state) checked against one device; ``before(i)`` runs before call
  ``i``. The step and the final state."""
  batches = _batches(plan.global_batch) if batches is None else batches
  ref = Reference(step_fn, state()).run(batches)
  step = run_groups(step_fn, plan)
  trained = step.shard_state(state())
  for i, batch in enumerate(batches):
    before(i)
    trained, metrics = step(trained, batch)
    ref.check_metrics(metrics, i)
  ref.check(trained.params, lambda s: s.params)
  if opt_state:
    ref.check(trained.opt_state, lambda s: s.opt_state)
  return step, trained


def _layer_state(model, example=None):
  """``model``'s parameters, and a fresh Adam ``TrainState`` of them per call."""
  params = model.init(jax.random.key(0), jnp.zeros((1, 6)) if example is None else example)["params"]
  return params, lambda: train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))


def _sharded(devices, microbatch, counts):
  return Group(devices, microbatch, counts, shard_params=True)


@pytest.mark.timeout(240)
def test_a_sharded_group_beside_an_unsharded_one_matches_one_device():
  require_devices(8)
  # four devices sharding their parameters, counts uneven (lockstep, the missing microbatches masked), beside
  # four unsharded ones
  plan = group_plan([_sharded((0, 1, 2, 3), 2, (3, 2, 2, 1)), ((4, 5, 6, 7), 1, (2, 2, 1, 1))], 22)
  step, _ = _trained(plan, _state)
  text = step.explain()
  assert "group 0 shards its parameters over its 4 devices" in text
  assert "group 1 shards" not in text


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tail,shares,zero", [((1, 1), (), None), ((0, 0), (1 / 8,) * 8, 3)],
                         ids=["tail", "zero-3-shares"])
def test_a_sharded_group_with_a_tail_or_state_shares_matches_one_device(tail, shares, zero):
  require_devices(8)
  groups = [_sharded((0, 1, 2), 2, (2, 1, 1)), ((3, 4, 5, 6, 7), 1, (1, 1, 1, 1, 0))]
  plan = group_plan(groups, 12 + 8 * tail[0] * tail[1], tail=tail, state_shares=shares, zero_stage=zero)
  _trained(plan, _state)


@pytest.mark.timeout(240)
def test_parameters_the_group_size_does_not_divide_are_padded_and_stay_exact():
  require_devices(8)
  # hidden 5 over 4 devices: the first kernel (6, 5), its bias and the LayerNorm's (5,) are zero-padded to 8 along
  # one axis; the second kernel (5, 4) and bias (4,) split evenly
  assert [shard_axis(s, 4) for s in ((6, 5), (5,), (5, 4), (4,))] == [0, 0, 1, 0]
  plan = group_plan([_sharded((0, 1, 2, 3), 2, (2, 2, 2, 1)), ((4, 5), 4, (1, 1))], 22)
  _trained(plan, lambda: _state(5))


@pytest.mark.timeout(240)
def test_the_sharded_group_program_takes_its_parameters_split():
  require_devices(8)
  hidden, n = 256, 8  # parameters large beside the batch: 13 KiB of them, 1 example per device
  state, batch = _state(hidden), _batches(n)[0]
  params = jax.tree.leaves(state.params)
  whole = sum(x.size * x.dtype.itemsize for x in params)
  # per device: its part of every parameter, padding adding at most one slice along the split axis; its example;
  # its count and first example (int32 each); scalars the loop may read whole (the step count)
  padding = sum(x.size // min(x.shape) * x.dtype.itemsize for x in params)
  example = sum(v[:1].nbytes for v in batch.values())
  scalars = sum(np.asarray(x).dtype.itemsize for x in jax.tree.leaves(state) if np.ndim(x) == 0)
  bound = whole / n + padding + example + 2 * 4 + scalars

  def arguments(plan):
    step = run_groups(dropout_step, plan)
    step(step.shard_state(state), batch)
    return step.memory_analysis()["group 0"].argument_size_in_bytes

  sharded = arguments(group_plan([_sharded(tuple(range(n)), 1, (1,) * n)], n))
  unsharded = arguments(group_plan([(tuple(range(n)), 1, (1,) * n)], n))
  assert sharded <= bound, (sharded, bound, whole)
  assert unsharded - sharded >= whole * (1 - 1 / n) - padding, (unsharded, sharded, whole)


def test_shard_params_round_trips_through_json_and_needs_a_data_only_group():
  plan = group_plan([_sharded((0, 1), 2, (1, 1)), ((2,), 4, (1,))], 8)
  again = GroupPlan.from_json(json.loads(plan.dumps()))
  assert again == plan and again.groups[0].shard_params and not again.groups[1].shard_params
  assert "parameters sharded over its devices" in plan.summary()
  text = explain_group_text(plan).splitlines()  # what `hetspmd explain groups.json` prints
  assert "parameters sharded over its devices" in text[1] and "sharded" not in text[2]
  assert [r["shard_params"] for r in group_devices(plan)] == [True, True, False]
  older = json.loads(plan.dumps())  # version 5, before shard_params: every group unsharded
  older["version"] = 5
  for g in older["groups"]:
    del g["shard_params"]
  assert not any(g.shard_params for g in GroupPlan.from_json(older).groups)
  with pytest.raises(InvalidValueError, match="shard_params runs data-only for now"):
    Group((0, 1), 2, (1, 1), model=2, model_dims=(("kernel", 1),), shard_params=True)


class _Block(nn.Module):
  width: int
  scanned: bool = False

  @nn.compact
  def __call__(self, x, _=None):
    x = x + nn.gelu(nn.Dense(self.width)(nn.LayerNorm()(x)))
    return (x, None) if self.scanned else x


class _Layers(nn.Module):
  """Blocks as a layer scan (stacked parameters, one scan each way) or unrolled, as Flax users write both."""
  width: int = 16
  depth: int = 4
  scanned: bool = False

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.width)(x)
    if self.scanned:
      blocks = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.depth)
      x, _ = blocks(self.width, scanned=True)(x, None)
    else:
      for _ in range(self.depth):
        x = _Block(self.width)(x)
    return nn.Dense(4)(x)


def _layers_step_with(value_and_grad):
  """A Linen ``TrainState`` step whose gradients ``value_and_grad`` takes."""
  def step(state, batch):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, batch["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    loss, grads = value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}
  return step


_layers_step = _layers_step_with(jax.value_and_grad)
# through hs.value_and_grad: the plan's remat policy checkpoints the loss
_layers_step_rematted = _layers_step_with(hs.value_and_grad)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scanned,remat", [(False, "none"), (True, "none"), (False, "dots"), (True, "dots")],
                         ids=["unrolled", "layer-scan", "unrolled-dots", "layer-scan-dots"])
def test_layers_gathered_one_reader_at_a_time_match_one_device(scanned, remat):
  require_devices(8)
  _, state = _layer_state(_Layers(scanned=scanned))
  # a layer scan's stacked parameters split after the layers' axis: (4, 16, 16) along 1, (4, 16) along 1; under a
  # remat policy the loss is one checkpointed call, inside which each reader gathers its copy
  fn = _layers_step if remat == "none" else _layers_step_rematted
  plan = group_plan([Group((0, 1, 2, 3), 2, (2, 2, 1, 1), remat, shard_params=True),
                     ((4, 5, 6, 7), 1, (1, 1, 2, 2), remat)], 18)
  _trained(plan, state, fn)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("remat", ["none", "dots"])
def test_explain_gives_the_bytes_held_and_gathered_per_device(remat):
  require_devices(8)
  params, state = _layer_state(_Layers(depth=6))
  # under a remat policy the loss is one checkpointed call: its readers inside it each gather their own copy
  plan = group_plan([Group((0, 1, 2, 3), 2, (1, 1, 1, 1), remat, shard_params=True),
                     ((4, 5, 6, 7), 2, (1, 1, 1, 1), remat)], 16)
  step = run_groups(_layers_step if remat == "none" else _layers_step_rematted, plan)
  step(step.shard_state(state()), _batches(16)[0])
  sizes = step._latest.shards[0].sizes
  leaves = jax.tree.leaves(params)
  whole = sum(x.nbytes for x in leaves)
  padding = sum(x.nbytes // min(x.shape) for x in leaves)  # at most one slice along the split axis per leaf
  assert sizes.whole == whole and whole / 4 <= sizes.held <= whole / 4 + padding
  # two readers' copies at most: the largest two leaves, never the model (six blocks and two projections)
  largest = sorted(x.nbytes for x in leaves)[-2:]
  assert sizes.reader <= largest[-1] and sizes.gathered <= sum(largest) < whole / 3
  text = step.explain()
  assert f"{sizes.held / 1e6:.3f} MB of the parameters held in its loop (of {whole / 1e6:.3f} MB whole)" in text
  assert f"--xla_gpu_all_gather_combine_threshold_bytes={sizes.reader}" in text


@pytest.mark.timeout(240)
def test_under_zero_3_a_sharded_group_receives_only_its_parts(monkeypatch):
  require_devices(8)
  # ZeRO-3 in even shares: every parameter lives on one device between steps; the sharded group's devices take
  # their parts of it, the unsharded group's devices take it whole, and the exchange program takes none
  plan = group_plan([_sharded((0, 1, 2, 3), 2, (2, 2, 1, 1)), ((4, 5, 6, 7), 1, (2, 2, 1, 1))], 18,
                    zero_stage=3, state_shares=(1 / 8,) * 8)
  placed = []
  real_on = transfers.on
  monkeypatch.setattr(transfers, "on", lambda mesh, x: placed.append(
      ({d.id for d in mesh.devices.flat}, tuple(np.shape(x)))) or real_on(mesh, x))
  params, state = _layer_state(_Layers())
  batches = _batches(plan.global_batch) + _batches(plan.global_batch, seed=1)
  # the first call finds the parameters replicated (as shard_state placed them); later ones held
  step, _ = _trained(plan, state, _layers_step, batches, before=lambda i: placed.clear() if i == 1 else None)
  shapes = {tuple(x.shape) for x in jax.tree.leaves(params) if x.size > 1}
  assert len(step._latest.parted) == len(jax.tree.leaves(params))
  whole_on_group_0 = [(on, shape) for on, shape in placed if on & {0, 1, 2, 3} and shape in shapes]
  assert not whole_on_group_0, whole_on_group_0
  assert any(on == {4, 5, 6, 7} and shape in shapes for on, shape in placed)  # the unsharded group's whole copies
  assert step.memory_analysis()["exchange"].argument_size_in_bytes < min(x.nbytes for x in jax.tree.leaves(params))


def _grad_norm_step(state, batch):
  """A step that logs its gradients' global norm, as many training loops do: the exchange program reads every
  gradient sum."""
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["x"], train=False)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss, "grad_norm": optax.tree.norm(grads)}


# even shares (copies), and one device holding most (the other sums take two hops)
OWNER_SHARES = {"even": (1 / 8,) * 8, "skewed": (0.65,) + (0.05,) * 7}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shares", list(OWNER_SHARES), ids=list(OWNER_SHARES))
@pytest.mark.parametrize("zero", [1, 3], ids=["zero-1", "zero-3"])
def test_under_state_shares_a_sharded_group_hands_its_owners_parts(zero, shares):
  """Each owner reduces the sums its units read itself: a sharded group's program returns its parts of them (a
  quarter of the gradients per device, not whole-shaped rows), and each owner joins them; exact against one
  device."""
  require_devices(8)
  hidden, n = 256, 4
  state = lambda: _state(hidden)
  plan = group_plan([_sharded((0, 1, 2, 3), 2, (2, 2, 1, 1)), ((4, 5, 6, 7), 1, (2, 2, 1, 1))], 18,
                    zero_stage=zero, state_shares=OWNER_SHARES[shares])
  step, _ = _trained(plan, state)
  assert step._latest.part_sums and not set(step._latest.part_sums) & set(step._latest.relay)
  assert f"its parts of {len(step._latest.part_sums)} sums, which each owner joins" in step.explain()
  params = jax.tree.leaves(state().params)
  whole = sum(x.nbytes for x in params)
  padding = sum(x.size // min(x.shape) * x.dtype.itemsize for x in params)
  loss = 4  # the loss's float32 sum, whole on every device
  outputs = step.memory_analysis()
  assert outputs["group 0"].output_size_in_bytes <= whole / n + padding + loss, (outputs["group 0"], whole)
  assert outputs["group 1"].output_size_in_bytes >= whole  # the unsharded group's rows: whole
  assert whole / n + padding + loss < whole / 2  # the bound tells parts from whole-shaped rows


@pytest.mark.timeout(240)
def test_a_sum_the_exchange_reads_stays_whole_rows_and_exact():
  """A gradient norm among the metrics: the exchange program reads every gradient sum, so the sharded group hands
  it whole-shaped rows (its part in place), and the step stays exact."""
  require_devices(8)
  plan = group_plan([_sharded((0, 1, 2, 3), 2, (2, 2, 1, 1)), ((4, 5, 6, 7), 1, (2, 2, 1, 1))], 18,
                    zero_stage=1, state_shares=(1 / 8,) * 8)
  step, _ = _trained(plan, _state, _grad_norm_step)
  assert not step._latest.part_sums


@pytest.mark.timeout(240)
@pytest.mark.parametrize("zero,remat", [(0, "none"), (3, "none"), (0, {"V100-32GB": "none", "P100-16GB": "layers"})],
                         ids=["replicated", "zero-3-shares", "replicated-own-remat"])
def test_a_priced_sharded_group_plan_runs_as_priced(zero, remat):
  """The pricing's sharded group (each kind its microbatch, the sharded kind's devices in lockstep), made a plan by
  ``to_group_plan`` and run: exact against one device, with the priced counts and the group that shards; with the
  state replicated the groups exchange parts, as priced, whatever remat policy each kind runs."""
  require_devices(8)
  pool = hs.Cluster.emulate(jax.devices()[:8], kinds=["V100-32GB"] * 4 + ["P100-16GB"] * 4)
  batches = _batches(24)
  profile = profile_step(dropout_step, _state(), {k: v[:2] for k, v in batches[0].items()})
  layout = device_groups(pool, "group programs by kind", tuple(range(8)), 1)
  priced = price_groups(Costing(pool, profile, 2), layout, {"V100-32GB": 2, "P100-16GB": 1}, remat, 24, zero=zero,
                        sharded=frozenset({"P100-16GB"}))
  plan = to_group_plan(pool, priced)
  by_kind = {g.devices[0] < 4: g for g in plan.groups}
  assert by_kind[False].shard_params and not by_kind[True].shard_params
  assert bool(plan.state_shares) == (zero == 3)
  if isinstance(remat, dict):
    assert (by_kind[True].remat, by_kind[False].remat) == ("none", "layers")
  step, _ = _trained(plan, _state)
  assert "shards its parameters over its 4 devices" in step.explain()
  assert step.execution.parts_exchange == priced.group.execution.parts_exchange == (zero == 0)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("remat,zero", [("none", None), ("dots", 3)], ids=["none", "dots-zero-3"])
def test_the_zoo_language_model_in_a_sharded_group_matches_one_device(remat, zero):
  """The zoo's GPT-2 (a tied embedding read by a gather and by the logits' matmul, attention, LayerNorms) through
  ``hs.value_and_grad``, its parameters sharded over four devices beside an unsharded group."""
  require_devices(8)
  w = models.get("gpt2-tiny")
  plan = group_plan([Group((0, 1, 2, 3), 2, (2, 2, 1, 1), remat, shard_params=True), ((4, 5, 6, 7), 1, (2, 1, 1, 1), remat)],
                    17, zero_stage=zero, state_shares=(1 / 8,) * 8 if zero else ())
  state, ref = group_trained(w.make_train_step(hs.value_and_grad), plan, w.init_state,
                             token_batches(w, plan.global_batch))
  ref.check(state)


@pytest.mark.timeout(240)
def test_batchnorm_over_the_global_batch_in_a_sharded_group_matches_one_device():
  """Two loops (BatchNorm's statistics over every group's examples first, then the gradients): the sharded group
  gathers its parameters in both, in lockstep."""
  require_devices(8)
  plan = group_plan([Group((0, 1, 2, 3), 2, (2, 2, 1, 1), shard_params=True), ((4, 5, 6, 7), 1, (2, 1, 1, 2))], 18)
  state, ref = group_trained(normed_step, plan, _normed_state, _batches(18))
  ref.check(state)
  step = run_groups(normed_step, plan)
  step(_normed_state(), _batches(18)[0])
  # all but BatchNorm's scale, which the work between the loops reads (its product with 1/sqrt(var + eps))
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(_normed_state())[0]]
  split = {paths[i] for i in step._latest.shards[0].at}
  assert split == {p for p in paths if "params" in p and "scale" not in p}, split
  # groups of one size, but the earlier loop's sums feed the later one: whole-shaped rows, and explain() says so
  assert step.execution.parts_exchange and not step._latest.part_sums
  assert "the groups hand over whole-shaped rows: the step runs several microbatch loops" in step.explain()


class _Normalised(nn.Module):
  """Inputs scaled to unit length first: a zero example (a lockstep padding slot) gives NaN there."""

  @nn.compact
  def __call__(self, x):
    x = x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    return nn.Dense(4)(nn.gelu(nn.Dense(8)(x)))


class _ClassToken(nn.Module):
  """A learned (1, 8) token broadcast to the batch beside each example's own (a ViT's class token)."""

  @nn.compact
  def __call__(self, x):
    own = nn.Dense(8)(x)[:, None, :]
    token = self.param("token", nn.initializers.normal(1.0), (1, 8))
    tokens = jnp.concatenate([jnp.broadcast_to(token, (x.shape[0], 1, 8)), own], axis=1)
    return nn.Dense(4)(nn.gelu(tokens).mean(axis=1))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("module", [_Normalised, _ClassToken], ids=["nan-in-padding", "class-token"])
def test_user_shaped_models_in_a_sharded_group_match_one_device(module):
  """A NaN a padding slot makes stays on its device (the gathers' ordering ties take it as 0), and a parameter the
  loop rebuilds at the microbatch's size (broadcast to the batch) is gathered for that rebuild."""
  require_devices(8)
  params, state = _layer_state(module(), jnp.ones((1, 6)))
  # device 3 runs one microbatch and a masked padding slot (lockstep)
  plan = group_plan([_sharded((0, 1, 2, 3), 2, (2, 2, 2, 1)), ((4, 5, 6, 7), 1, (1, 1, 1, 1))], 18)
  step, _ = _trained(plan, state, _layers_step, opt_state=False)
  assert len(step._latest.shards[0].at) == len(jax.tree.leaves(params))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layers", [None, "unrolled", "layer-scan"])
def test_beside_a_sharded_group_an_unsharded_one_hands_over_parts(layers):
  """Groups of one size, one sharding its parameters and one not, the state replicated: the unsharded group
  reduce-scatters its sums after its loop onto the sharded group's parts (a layer scan's stacked sums along the
  axis the sharded group splits them), so no device hands the exchange a whole-sized row of a gradient; exact
  against one device."""
  require_devices(8)
  n = 4
  if layers is None:
    params, state, fn = _state(256).params, lambda: _state(256), dropout_step
  else:
    params, state = _layer_state(_Layers(scanned=layers == "layer-scan", width=64))
    fn = _layers_step
  plan = group_plan([_sharded((0, 1, 2, 3), 2, (2, 2, 1, 1)), ((4, 5, 6, 7), 1, (1, 1, 2, 2))], 18)
  step, _ = _trained(plan, state, fn)
  _check_parts_handed_over(step, params, n)


def _check_parts_handed_over(step, params, n):
  """Every group's program hands over per device its parts of the sums (of ``n``), not whole-shaped rows."""
  assert step.execution.parts_exchange and step._latest.part_sums
  assert "the unsharded groups reduce-scatter their sums onto the sharded groups' parts" in step.explain()
  leaves = jax.tree.leaves(params)
  whole = sum(x.nbytes for x in leaves)
  padding = sum(x.size // min(x.shape) * x.dtype.itemsize for x in leaves)
  loss = 4 * 8  # the loss's and the metrics' float32 sums, whole on every device
  outputs = step.memory_analysis()
  for name in ("group 0", "group 1"):  # per device: its parts, not whole-shaped rows
    assert outputs[name].output_size_in_bytes <= whole / n + padding + loss, (name, outputs[name], whole)
  assert whole / n + padding + loss < whole / 2  # the bound tells parts from whole-shaped rows


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scanned,remats,fn", [
    (False, ("layers", "none"), _layers_step),  # the user's own jax.value_and_grad, its layers rematted
    (True, ("none", "dots"), _layers_step_rematted),  # hs.value_and_grad: the loss checkpointed
], ids=["unrolled-layers-beside-none", "layer-scan-none-beside-dots"])
def test_groups_of_their_own_remat_policies_hand_over_parts(scanned, remats, fn):
  """A sharded group beside an unsharded one of its size, each under its own remat policy: each trace's sums are
  matched to the exchange program's, and the unsharded group still reduce-scatters them onto the sharded
  group's parts; exact against one device."""
  require_devices(8)
  params, state = _layer_state(_Layers(scanned=scanned, width=64))
  plan = group_plan([Group((0, 1, 2, 3), 2, (2, 2, 1, 1), remats[0], shard_params=True),
                     Group((4, 5, 6, 7), 1, (1, 1, 2, 2), remats[1])], 18)
  step, _ = _trained(plan, state, fn)
  assert {g.remat for g in plan.groups} == set(remats)
  _check_parts_handed_over(step, params, 4)


def test_a_value_laid_out_where_it_is_wanted_is_passed_as_it_is():
  """The state between steps is replicated on the plan's devices, and a hybrid plan of one group (plain FSDP)
  holds its leaves split as its group takes them and hands its rows over as the exchange takes them: each call
  passes them on as they are, with no new array made per leaf (a one-group gpt2-tiny step spent about half its
  host time making them); a value on other devices is still made where it is wanted, equal to the value."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  require_devices(4)
  devices = np.asarray(jax.devices()[:4])
  x = jax.device_put(jnp.arange(12.0).reshape(3, 4), NamedSharding(Mesh(devices, ("data",)), P()))
  assert transfers.on(Mesh(devices, ("data",)), x) is x
  half = transfers.on(Mesh(devices[:2], ("data",)), x)
  assert half.sharding.device_set == set(devices[:2]) and half.is_fully_replicated
  np.testing.assert_array_equal(np.asarray(half), np.asarray(x))
  # a held leaf split over one group of every device, and that group's rows: the same layout, as they are
  held = jax.device_put(jnp.arange(16.0).reshape(4, 4), NamedSharding(Mesh(devices[None], ("group", "part")),
                                                                      P(None, "part")))
  assert transfers.group_part(held, Mesh(devices, ("group 0",)), 1) is held
  rows = jax.device_put(jnp.arange(8.0).reshape(4, 2), NamedSharding(Mesh(devices, ("group 0",)), P("group 0")))
  assert transfers.global_rows([rows], Mesh(devices, ("data",))) is rows
  halves = [jax.device_put(np.arange(4.0).reshape(2, 2) + 4 * k, NamedSharding(Mesh(devices[2 * k:2 * k + 2], ("g",)),
                                                                               P("g"))) for k in (0, 1)]
  joined = transfers.global_rows(halves, Mesh(devices, ("data",)))  # two groups' rows: one array made of them
  np.testing.assert_array_equal(np.asarray(joined), np.arange(8.0).reshape(4, 2))


_COLLECTIVE = re.compile(r"= \S+ (all-gather|reduce-scatter)(?:-start)?\(")


def _zoo_case(name):
  workload = models.get(name)
  return workload.make_train_step(), workload.init_state(0), lambda n: workload.synthetic_batch(0, batch=n)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["layernorm-mlp", "gpt2-tiny"])
def test_the_profile_counts_the_collectives_a_sharded_group_issues_per_microbatch(case):
  """What CPU pricing counts (XLA:CPU combines no collectives: ``sharding.combines``): one all-gather per reader
  of each parameter leaf (``StepProfile.param_reads``: a layer norm's reshaped scale read forward and backward
  counts twice) and one reduce-scatter per leaf, as the compiled program of a group sharding its parameters
  issues them for its one microbatch."""
  require_devices(4)
  step_fn, state, batch = ((dropout_step, _state(), lambda n: _batches(n)[0]) if case == "layernorm-mlp"
                           else _zoo_case(case))
  step = run_groups(step_fn, group_plan([_sharded((0, 1, 2, 3), 1, (1, 1, 1, 1))], 4))
  step(step.shard_state(state), batch(4))
  program, args = step._last["group 0"]
  issued = collections.Counter(_COLLECTIVE.findall(program.lower(*args).compile().as_text()))
  profile = profile_step(step_fn, state, batch(1))
  assert issued["all-gather"] == sum(f + b for f, b, _ in profile.param_reads), (issued, profile.param_reads)
  assert issued["reduce-scatter"] == sum(size > 1 for size in profile.param_leaf_sizes), issued
  assert all(iterations == 1 for *_, iterations in profile.param_reads)  # no loop reads them
