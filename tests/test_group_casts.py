"""ZeRO-3 group plans of a model that computes in bfloat16 from float32 parameters: each device sends the
bfloat16 casts of the parameters it holds, the group programs read those (half the bytes of the float32
parameters to send and to hold during the loop), and the device that holds a parameter updates its float32
value. A parameter some other work reads in float32 is sent whole. Exact against one device running the same
mixed-precision step (its float64 reference widens the half-precision work too)."""

import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

from hetspmd import models
from hetspmd._pytree import leaves_with_paths
from hetspmd.plan.groups import group_plan
from hetspmd.runtime.grouped import run_groups

from conftest import require_devices
from exactness import Reference
from test_exactness import smooth
from test_group_programs import SHARES_80_16, _batches

GROUPS = [((0, 1, 2, 3), 2, (2, 2, 1, 1)), ((4, 5, 6, 7), 1, (2, 1, 1, 1))]


class HalfNet(nn.Module):
  """Dense layers computing in bfloat16 (float32 parameters), and a float32 ``temperature`` per class the loop reads as it
  is."""

  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(16, dtype=jnp.bfloat16)(x))
    logits = nn.Dense(4, dtype=jnp.bfloat16)(nn.LayerNorm(dtype=jnp.bfloat16)(x)).astype(jnp.float32)
    return logits * self.param("temperature", nn.initializers.ones, (4,))


def _half_state(tx=None):
  model = HalfNet()
  params = model.init(jax.random.key(0), jnp.zeros((1, 6)))["params"]
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx or optax.adam(1e-2, eps=1e-3))


def half_step(state, batch):
  """A Linen step in mixed precision; its metrics also read the first kernel in float32 (a weight norm)."""
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  norm = jnp.sum(state.params["Dense_0"]["kernel"] ** 2)
  return state.apply_gradients(grads=grads), {"loss": loss, "kernel_norm": norm}


def _run(step_fn, make, batches, plan, half=True):
  ref = Reference(step_fn, make(), half=half).run(batches)
  runner = run_groups(step_fn, plan, donate_state=True)
  state = runner.shard_state(make())
  for i, batch in enumerate(batches):
    state, metrics = runner(state, batch)
    ref.check_metrics(metrics, i)
  ref.check(state)
  return runner, state


@pytest.mark.parametrize("tail,remat", [((0, 0), "none"), ((1, 1), "none"), ((0, 0), "dots")],
                         ids=["no-tail", "tail-1x1", "remat-dots"])
def test_a_bfloat16_gpt_sends_its_parameters_as_casts(tail, remat):
  """The zoo's GPT-2 in bfloat16: every parameter is read through a cast (under a remat policy, inside the
  checkpoint that ``hetspmd.value_and_grad`` makes), so every one is sent as its cast; the group programs take
  half the parameter bytes of the float32 model's."""
  import hetspmd as hs

  require_devices(8)
  groups = [g + (remat,) for g in GROUPS]
  plan = group_plan(groups, 17 + 8 * tail[0] * tail[1], state_shares=SHARES_80_16, zero_stage=3, tail=tail)
  rs = np.random.RandomState(2)
  arguments = {}
  for dtype in ("float32", "bfloat16"):
    w = smooth(models.get("gpt2-tiny").with_dtype(dtype))
    batches = [jax.tree.map(lambda s: rs.randint(0, 50, s.shape).astype(s.dtype), w.example_batch(plan.global_batch))
               for _ in range(3)]
    step_fn = w.make_train_step(hs.value_and_grad if remat != "none" else jax.value_and_grad)
    runner, _ = _run(step_fn, w.init_state, batches, plan, half=dtype != "float32")
    (built,) = runner._built.values()
    assert len(built.casts) == (len(built.params) if dtype == "bfloat16" else 0)
    arguments[dtype] = runner.memory_analysis()["group 1"].argument_size_in_bytes
  params = sum(x.size for x in jax.tree.leaves(models.get("gpt2-tiny").init_state()["params"]))
  assert arguments["float32"] - arguments["bfloat16"] == 2 * params  # the parameters, at 4 then 2 bytes


@pytest.mark.parametrize("tx", ["adam", "adamw"])
def test_a_parameter_read_in_float32_is_sent_whole(tx):
  """The temperature and the LayerNorm the loop reads in float32, and the kernel a metric reads in float32, are
  sent as they are; the bfloat16 Dense layers' other parameters as their casts, AdamW's decay term (which reads
  them whole, for their update only) too. Exact."""
  require_devices(8)
  plan = group_plan(GROUPS, 17, state_shares=SHARES_80_16, zero_stage=3)
  make = lambda: _half_state(optax.adamw(1e-2, eps=1e-3, weight_decay=0.1) if tx == "adamw" else None)
  runner, state = _run(half_step, make, _batches(17), plan)
  (built,) = runner._built.values()
  paths = [path for path, _ in leaves_with_paths(state)]
  cast = {paths[i] for i in built.casts}
  params = {paths[i] for i in built.params}
  assert cast == {"params/Dense_0/bias", "params/Dense_1/kernel", "params/Dense_1/bias"}
  # the loop reads the temperature and the LayerNorm (its statistics in float32) as they are
  assert params - cast == {"params/temperature", "params/Dense_0/kernel", "params/LayerNorm_0/scale",
                           "params/LayerNorm_0/bias"}
  assert all(built.casts[i] == jnp.bfloat16 for i in built.casts)


def test_two_processes_send_casts():
  """2 processes x 4 CPU devices (gloo), one group per process: each process's devices send the casts of the
  parameters they hold through the uniform program, and the step is exact."""
  from multiprocess import group_child, run_processes

  results = run_processes(group_child("test_group_casts") + textwrap.dedent(f"""
      from hetspmd.plan.groups import group_plan
      from hetspmd.runtime.grouped import run_groups

      batches = t._batches(42)
      ref = Reference(t.half_step, t._half_state(), half=True,
                      jit=jax.jit(t.half_step, device=jax.local_devices()[0])).run(batches)
      plan = group_plan([(ids[0], 4, (2, 2, 1, 1)), (ids[1], 1, (3, 3, 2, 2))], 42, tail=(1, 1),
                        state_shares={SHARES_80_16!r}, zero_stage=3)
      step = run_groups(t.half_step, plan, donate_state=True)
      state = step.shard_state(t._half_state())
      for i, batch in enumerate(batches):
        state, metrics = step(state, fed(step, batch))
        ref.check_metrics(jax.tree.map(local, metrics), i)
      mine = jax.tree.map(local, state.params)
      ref.check(jax.tree.map(lambda m, r: r if m is None else m, mine, ref.single.params,
                             is_leaf=lambda x: x is None), lambda s: s.params)
      (built,) = step._built.values()
      print(json.dumps({{"casts": len(built.casts)}}))
  """), num_processes=2, devices_per_process=4, timeout=240)
  assert [r["casts"] for r in results] == [3, 3]


def test_the_search_fits_a_bfloat16_model_no_single_program_fits():
  """GPT-3 2.7B computing in bfloat16 on Cephalo's workstation (2 L4, an RTX A6000, a P40; one process): no
  single program fits (every device holds whole float32 parameters), but a group plan holding the parameters
  and optimizer state in shares (ZeRO-3), its programs taking the parameters' bfloat16 casts and handing over
  bfloat16 rows, does; priced within each device's memory."""
  import hetspmd as hs
  from hetspmd.errors import PlanDoesNotFitError
  from hetspmd.passes.profile import profile_step
  from hetspmd.planner.ranking import group_plan_alone, search

  w = models.get("gpt3-2.7b").with_dtype("bfloat16")
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2, 512))
  assert profile.cast_param_bytes == profile.castable_param_bytes // 2 > 0
  cluster = hs.Cluster.preset("cephalo-workstation")
  with pytest.raises(PlanDoesNotFitError):
    search(cluster, profile, 64, grad_reduce_dtypes=("float32", "bfloat16"))
  found = group_plan_alone(cluster, profile, 64, grad_reduce_dtypes=("float32", "bfloat16"))
  assert found is not None and found.zero_stage == 3 and found.grad_reduce_dtype == "bfloat16"
  assert all(m <= cluster.devices[d].spec.memory_bytes for d, m in zip(found.device_positions, found.memory_bytes))
  # float32 rows beside the accumulator fit an L4 only where its group shards its parameters (gathering a layer's
  # bfloat16 casts at a time, not holding them all)
  f32 = group_plan_alone(cluster, profile, 64)
  assert f32 is None or any(f32.group.shard_params), f32


def test_a_priced_zero3_plan_runs_exactly():
  """The pricing's ZeRO-3 group plan of the zoo's bfloat16 GPT-2 on an emulated pool, written by
  ``to_group_plan`` (ZeRO-3, bfloat16 rows) and run: exact against one device."""
  import hetspmd as hs
  from hetspmd.passes.profile import profile_step
  from hetspmd.planner.grouping import price_groups, to_group_plan
  from hetspmd.planner.pricing import Costing, device_groups

  require_devices(8)
  w = models.get("gpt2-tiny").with_dtype("bfloat16")
  cluster = hs.Cluster.emulate(jax.devices()[:8], kinds=["V100-32GB"] * 4 + ["P100-16GB"] * 4)
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))
  layout = device_groups(cluster, "every kind", tuple(range(8)), 1)
  priced = price_groups(Costing(cluster, profile, 2, 1.0), layout, {"V100-32GB": 2, "P100-16GB": 1}, "none", 24,
                        zero=3, dtype="bfloat16")
  plan = to_group_plan(cluster, priced)
  assert plan.zero_stage == 3 and plan.grad_reduce_dtype == "bfloat16" and "parameters and optimizer state" in priced.name
  rs = np.random.RandomState(4)
  batches = [jax.tree.map(lambda s: rs.randint(0, 50, s.shape).astype(s.dtype), w.example_batch(24))
             for _ in range(3)]
  runner, _ = _run(w.make_train_step(), w.init_state, batches, plan)
  (built,) = runner._built.values()
  assert len(built.casts) == len(built.params)
