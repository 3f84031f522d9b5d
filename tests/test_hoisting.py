"""Example-free outputs of scans inside the microbatch loop, read outside it, are made before the loop.

Hand-written ``lax.scan`` steps with per-layer counters beside the
per-example work, run under an uneven plan on 8 emulated devices against
``jax.jit`` on one device: a counter one scan hands to another, and a
counter of a scan that also sums over the batch, read by per-example work.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hetspmd as hs

from exactness import Reference
from test_unmodified_steps import _cluster

BATCH, WIDTH, LAYERS = 16, 4, 3
COUNTS = (3, 2, 1, 1, 1, 0, 0, 0)  # microbatch 2


def chained_counters(state, x):
  """Scan A advances a counter and hands back its layers scaled; scan B goes on from A's counter."""
  def first(carry, w):
    k, h = carry
    return (k + 1, jnp.tanh(h @ w)), w * 2.0

  def second(carry, w):
    k, h = carry
    return (k + 1, jnp.tanh(h @ w)), None

  (k, h), doubled = jax.lax.scan(first, (state["count"], x), state["w"])
  (k, h), _ = jax.lax.scan(second, (k, h), state["w"])
  return {"w": doubled * 0.5 - 1e-2 * jnp.sign(h.sum()), "count": k}, h.sum()


def counter_beside_a_sum(state, x):
  """The scan sums over the batch in its outputs (a cut) and carries a counter that per-example work reads."""
  def body(carry, w):
    k, h = carry
    h = jnp.tanh(h @ w)
    return (k + 1, h), h.sum(0)

  (k, h), sums = jax.lax.scan(body, (state["count"], x), state["w"])
  scale = k.astype(jnp.float32) * 2.0
  return {"w": state["w"], "count": k}, (h * scale).sum() + sums.sum()


@pytest.mark.parametrize("step_fn", [chained_counters, counter_beside_a_sum], ids=lambda f: f.__name__)
def test_scan_counters_outside_the_loop(step_fn):
  state = {"w": jnp.asarray(np.random.RandomState(0).randn(LAYERS, WIDTH, WIDTH).astype(np.float32) * 0.3),
           "count": jnp.int32(5)}
  x = np.random.RandomState(1).randn(BATCH, WIDTH).astype(np.float32)
  ref = Reference(step_fn, state).run([x])
  expected_state = ref.single
  cluster = _cluster()
  plan = hs.plan_for(cluster, state, global_batch=BATCH, microbatch=2, counts=COUNTS)
  step = hs.parallelize(step_fn, cluster=cluster, plan=plan, global_batch=BATCH)
  new_state, loss = step(step.shard_state(state), x)
  ref.check_metrics(loss, 0, what="loss")
  assert int(new_state["count"]) == int(expected_state["count"])
  ref.check(new_state)


@pytest.mark.timeout(300)
def test_scan_counters_in_two_processes():
  """2 processes x 4 CPU devices over gloo, each feeding its own examples: the hoisted copies run on the
  processes' shards of the state like the rest of the work before the loop."""
  import textwrap

  from multiprocess import run_processes

  mine = sum(COUNTS[:4]) * 2
  results = run_processes(textwrap.dedent(f"""
      import json, types
      import numpy as np, jax, jax.numpy as jnp
      import hetspmd as hs
      sys.modules["conftest"] = types.SimpleNamespace(require_devices=lambda n: None)  # keep 4 devices here
      sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
      import test_hoisting as t
      w = np.random.RandomState(0).randn(t.LAYERS, t.WIDTH, t.WIDTH).astype(np.float32) * 0.3
      x = np.random.RandomState(1).randn(t.BATCH, t.WIDTH).astype(np.float32)
      local = jax.local_devices()[0]
      ref_state, ref_loss = jax.jit(t.chained_counters)(
          jax.device_put({{"w": w, "count": np.int32(5)}}, local), jax.device_put(x, local))
      cluster = hs.Cluster.emulate(jax.devices(), kinds=["V100-32GB"] * 4 + ["P100-16GB"] * 4)
      state = {{"w": jnp.asarray(w), "count": jnp.int32(5)}}
      plan = hs.plan_for(cluster, state, global_batch=t.BATCH, microbatch=2, counts=t.COUNTS)
      step = hs.parallelize(t.chained_counters, cluster=cluster, plan=plan, global_batch=t.BATCH)
      part = slice(0, {mine}) if jax.process_index() == 0 else slice({mine}, t.BATCH)
      new, loss = step(step.shard_state(state), x[part])
      from exactness import Float64, excess
      ref64_loss = Float64(t.chained_counters)({{"w": w, "count": np.int32(5)}}, x)[1]
      over = excess(loss, ref_loss, ref64_loss)
      print(json.dumps({{"count": int(new["count"]), "ref_count": int(ref_state["count"]),
                         "over": {{k: v[0] for k, v in over.items() if v[0] > 0}}}}))
  """), num_processes=2, devices_per_process=4, timeout=240)
  assert len(results) == 2
  for r in results:
    assert r["count"] == r["ref_count"] == 5 + 2 * LAYERS
    assert r["over"] == {}  # the loss as close to float64 as exactness asks
