"""Per-example outputs (logits among the metrics, a BatchNorm'd batch, an NNX model's predictions) under group
plans: each group's program returns its devices' examples of them, and the uniform program puts them, with the
tail's, into the global batch's order. Exact against one device, on every path a group plan takes."""

import textwrap

import jax
import optax
import pytest

from hetspmd.plan.groups import group_plan
from hetspmd.runtime.grouped import run_groups

from conftest import require_devices
from exactness import Float64, assert_exact
from test_group_model_axis import _groups as model_axis_groups
from test_group_programs import (PLANS, SHARES_80_16, Normed, _batches, _normed_state, _state, _trained, dropout_step,
                                 nnx_objects)


def with_logits(state, batch):
  """As Flax's examples evaluate: the step's metrics and, beside them, the logits of the batch before the update."""
  new_state, metrics = dropout_step(state, batch)
  return new_state, {**metrics, "logits": state.apply_fn({"params": state.params}, batch["x"], train=False)}


def normed_with_outputs(state, batch):
  """BatchNorm over the global batch (two loops), the normalised network's outputs returned per example."""
  def loss_fn(params):
    out, updates = Normed().apply({"params": params, "batch_stats": state["stats"]}, batch["x"],
                                  mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean(), (updates, out)
  (loss, (updates, out)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
  return ({"params": jax.tree.map(lambda p, g: p - 0.1 * g, state["params"], grads),
           "stats": updates["batch_stats"]}, {"loss": loss, "outputs": out})


def _examples(groups, tail=(0, 0)) -> int:
  """The global batch of ``groups`` (a model axis's positions counted once) and a tail on 8 devices."""
  return sum(g[1] * sum(g[2][::(g[4] if len(g) > 4 else 1)]) for g in groups) + 8 * tail[0] * tail[1]


REMATS = [((0, 1, 2, 3), 2, (2, 2, 1, 1), "none"), ((4, 5, 6, 7), 1, (2, 1, 1, 1), "full")]
# (groups, tail, state shares, ZeRO stage): each path the programs take, from the groups' rows to the update
CASES = {
    "two-groups": (PLANS[0], (0, 0), (), 0),
    "three-groups-tail-2x2": (PLANS[1], (2, 2), (), 0),
    "shares-owner-reduction": (PLANS[0], (0, 0), SHARES_80_16, 1),
    "zero3-tail": (PLANS[1], (1, 1), SHARES_80_16, 3),
    "model-axis-2-tail": (model_axis_groups(2), (1, 1), (), 0),
    "model-axis-3-shares": (model_axis_groups(3), (0, 0), SHARES_80_16, 1),
    "remat-by-group-tail": (REMATS, (1, 1), (), 0),
    "remat-by-group-zero3": (REMATS, (0, 0), SHARES_80_16, 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_among_the_metrics_come_back_in_global_order(case):
  require_devices(8)
  groups, tail, shares, zero = CASES[case]
  plan = group_plan(groups, _examples(groups, tail), tail=tail, state_shares=shares, zero_stage=zero or None)
  state, ref = _trained(with_logits, plan, _state, _batches(plan.global_batch), placed=bool(shares))
  ref.check(state.params, lambda s: s.params)
  ref.check(state.opt_state, lambda s: s.opt_state)


def test_a_devices_examples_are_its_slots_in_order():
  """Each example's slot: its device's loop rows (a model axis's position on its first device), then the tail."""
  plan = group_plan([((0, 1), 3, (2, 1)), ((2, 3, 4, 5), 1, (1, 1, 2, 2), "none", 2, {"kernel": 0})], 18,
                    tail=(1, 1))
  assert plan.example_width == 6
  first, second, position_0, position_1 = range(0, 6), range(6, 9), range(12, 13), range(24, 26)
  assert plan.example_slots() == (*first, *second, *position_0, *position_1, *range(36, 42))
  assert sorted(plan.example_slots()) == sorted(set(plan.example_slots()))


def test_batchnorm_outputs_over_two_loops():
  """Exact BatchNorm: the statistics' loop, then the loop that normalises, whose outputs come back per example."""
  require_devices(8)
  plan = group_plan(PLANS[1], 36)
  state, ref = _trained(normed_with_outputs, plan, _normed_state, _batches(36))
  ref.check(state)


def test_an_nnx_step_returns_its_predictions():
  """NNX in place, as Flax's NNX examples write a step that also hands back what the model predicted."""
  from flax import nnx

  require_devices(8)

  def step(model, optimizer, batch):
    def loss_fn(model):
      logits = model(batch["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), logits
    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return {"loss": loss, "logits": logits}

  plan = group_plan(PLANS[0], 38, state_shares=SHARES_80_16)
  graphdef, wide_state = nnx.split(nnx_objects())

  def pure(state, batch):
    objects = nnx.merge(graphdef, state)
    out = step(*objects, batch)
    return nnx.split(objects)[1], out

  wide, single, single_step = Float64(pure), nnx_objects(), nnx.jit(step)
  objects, runner = nnx_objects(), run_groups(step, plan)
  for i, batch in enumerate(_batches(38)):
    out = runner(*objects, batch)
    wide_state, wide_out = wide(wide_state, batch)
    assert out["logits"].shape == (38, 4)
    assert_exact(out, single_step(*single, batch), wide_out, what=f"outputs of step {i}")
  params = [nnx.state(o[0], nnx.Param) for o in (objects, single, nnx.merge(graphdef, wide_state))]
  assert_exact(*params, what="params")


def test_two_processes_return_the_global_batchs_logits():
  """2 processes x 4 CPU devices (gloo), one group per process and a uniform tail: every process holds the
  whole batch's logits, in its order."""
  from multiprocess import group_child, run_processes

  results = run_processes(group_child("test_group_per_example") + textwrap.dedent(f"""
      from hetspmd.plan.groups import group_plan
      from hetspmd.runtime.grouped import run_groups

      batches = t._batches(42)
      ref = reference(t.with_logits, t._state(), batches)
      for shares, zero in (((), 0), ({SHARES_80_16!r}, 1)):
        plan = group_plan([(ids[0], 4, (2, 2, 1, 1)), (ids[1], 1, (3, 3, 2, 2))], 42, tail=(1, 1),
                          state_shares=shares, zero_stage=zero)
        step = run_groups(t.with_logits, plan)
        state = step.shard_state(t._state())
        for i, batch in enumerate(batches):
          state, metrics = step(state, fed(step, batch))
          ref.check_metrics(jax.tree.map(local, metrics), i)
      print(json.dumps({{"logits": list(local(metrics["logits"]).shape)}}))
  """), num_processes=2, devices_per_process=4, timeout=240)
  assert [r["logits"] for r in results] == [[42, 4], [42, 4]]
