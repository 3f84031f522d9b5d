"""GPT-3 sizes traced abstractly, and the Linen LM's logical axis names."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

import hetspmd
from conftest import require_devices
from exactness import Float64, assert_exact
from hetspmd import models
from hetspmd.models import linen_lm

# --- GPT-3 ---------------------------------------------------------------------


def test_abstract_trace_of_gpt3_13b_allocates_no_weights(tmp_path):
  """13B float32 parameters and adam state are 144 GiB; the trace stays under 3 GiB."""
  # The peak is read from VmHWM, this process's own high-water mark: ru_maxrss carries
  # the parent's across fork and exec, so under pytest it measures the test runner.
  if not os.path.exists("/proc/self/status"):
    pytest.skip("reads the peak resident size from /proc/self/status (Linux)")
  script = textwrap.dedent("""
      import re, hetspmd
      from hetspmd import models
      w = models.get("gpt3-13b")
      g = hetspmd.trace(w.make_train_step(), w.abstract_state(), w.example_batch(1, 2048))
      with open("/proc/self/status") as f:
        peak_kib = int(re.search(r"VmHWM:\\s*(\\d+) kB", f.read()).group(1))
      print(g.elements_with_role("param"), w.param_count(), peak_kib)
  """)
  out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  traced, counted, max_rss_kib = map(int, out.stdout.split())
  assert traced == counted == 12_853_386_240
  assert max_rss_kib * 1024 < 3 * 2**30


def test_gpt3_sizes_are_table_2_1():
  expected = {"gpt3-1.3b": (24, 2048, 16), "gpt3-2.7b": (32, 2560, 32), "gpt3-6.7b": (32, 4096, 32),
              "gpt3-13b": (40, 5120, 40)}
  for name, (n_layer, d_model, n_head) in expected.items():
    cfg = models.get(name).config
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_ctx, cfg.vocab_size) == (n_layer, d_model, n_head, 2048, 50257)


# --- Linen ---------------------------------------------------------------------

TINY = "linen-lm-tiny"
_is_spec = lambda x: isinstance(x, P)


def test_every_linen_parameter_has_a_logical_spec_of_its_rank():
  w = models.get(TINY)
  params = w.abstract_state()["params"]
  specs = w.logical_specs()
  assert jax.tree.structure(specs, is_leaf=_is_spec) == jax.tree.structure(params)
  known = {name for name, _ in linen_lm.LOGICAL_AXIS_RULES}
  for spec, leaf in zip(jax.tree.leaves(specs, is_leaf=_is_spec), jax.tree.leaves(params)):
    assert len(spec) == leaf.ndim, (spec, leaf.shape)
    assert set(spec) <= known, spec


def test_linen_mesh_specs_follow_the_rules():
  w = models.get(TINY)
  mesh = w.mesh_specs()
  assert jax.tree.structure(mesh, is_leaf=_is_spec) == jax.tree.structure(w.abstract_state()["params"])
  block = mesh["h_0"]
  assert block["mlp"]["c_fc"]["kernel"] == P(None, "model")
  assert block["mlp"]["c_fc"]["bias"] == P("model")
  assert block["mlp"]["c_proj"]["kernel"] == P("model", None)
  assert block["attn"]["query"]["kernel"] == P(None, "model", None)
  assert block["attn"]["out"]["kernel"] == P("model", None, None)
  assert block["ln_1"]["scale"] == P(None)
  assert mesh["wte"]["embedding"] == P("model", None)
  assert mesh["wpe"]["embedding"] == P(None, None)
  replicated = w.mesh_specs(rules=())
  assert all(all(axis is None for axis in spec) for spec in jax.tree.leaves(replicated, is_leaf=_is_spec))


def test_linen_state_mesh_specs_give_moments_their_parameter_spec():
  w = models.get(TINY)
  specs = w.state_mesh_specs()
  assert jax.tree.structure(specs, is_leaf=_is_spec) == jax.tree.structure(w.abstract_state())
  adam = specs["opt_state"][0]
  assert adam.mu == adam.nu == specs["params"] == w.mesh_specs()
  assert adam.count == P() and specs["step"] == P()


def test_linen_workload_traces_with_parameter_roles():
  w = models.get(TINY)
  graph = hetspmd.trace(w.make_train_step(), w.abstract_state(), w.example_batch())
  assert graph.elements_with_role("param") == w.param_count()
  param_paths = {i.path for i in graph.inputs if i.role.value == "param"}
  assert "state/params/h_0/mlp/c_fc/kernel" in param_paths
  assert all(p.startswith("state/params/") for p in param_paths)


def test_linen_graphdef_is_refused_with_a_pointer_to_the_module():
  w = models.get(TINY)
  with pytest.raises(hetspmd.InvalidValueError, match="Linen workload.*module"):
    w.graphdef()
  assert isinstance(w.module(), linen_lm.LinenLM)


def _mesh_2x4():
  require_devices(8)
  auto = (jax.sharding.AxisType.Auto,) * 2  # GSPMD propagation, as Linen + logical rules assume
  return jax.make_mesh((2, 4), ("data", "model"), axis_types=auto, devices=jax.devices()[:8])


def test_logical_constraints_are_no_ops_without_rules_and_a_mesh():
  w = models.get(TINY)
  step, state, batch = w.make_train_step(), w.abstract_state(), w.example_batch()
  assert "sharding_constraint" not in str(jax.make_jaxpr(step)(state, batch))
  with nn.logical_axis_rules(linen_lm.LOGICAL_AXIS_RULES):  # rules but no mesh
    assert "sharding_constraint" not in str(jax.make_jaxpr(step)(state, batch))
  with jax.set_mesh(_mesh_2x4()), nn.logical_axis_rules(linen_lm.LOGICAL_AXIS_RULES):
    assert "sharding_constraint" in str(jax.make_jaxpr(step)(state, batch))


def test_linen_step_sharded_by_its_logical_specs_matches_plain_jit():
  mesh = _mesh_2x4()
  w = models.get(TINY)
  state, batch = w.init_state(seed=0), w.synthetic_batch(seed=0, batch=4)
  plain = jax.jit(w.make_train_step())
  shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), w.state_mesh_specs(), is_leaf=_is_spec)
  batch_sharding = NamedSharding(mesh, P("data", None))
  sharded = jax.jit(w.make_train_step(), in_shardings=(shardings, batch_sharding), out_shardings=(shardings, None))

  plain_state, sharded_state, plain_losses, sharded_losses = state, jax.device_put(state, shardings), [], []
  with jax.set_mesh(mesh), nn.logical_axis_rules(linen_lm.LOGICAL_AXIS_RULES):
    sharded_batch = jax.device_put(batch, batch_sharding)
    for _ in range(3):
      sharded_state, metrics = sharded(sharded_state, sharded_batch)
      sharded_losses.append(float(metrics["loss"]))
  ref64_state, ref64_losses, float64_step = state, [], Float64(w.make_train_step())
  for _ in range(3):
    plain_state, metrics = plain(plain_state, batch)
    plain_losses.append(float(metrics["loss"]))
    ref64_state, metrics = float64_step(ref64_state, batch)
    ref64_losses.append(metrics["loss"])

  assert_exact(sharded_losses, plain_losses, ref64_losses, what="losses")
  assert sharded_losses[-1] < sharded_losses[0]
  kernel = sharded_state["params"]["h_0"]["mlp"]["c_fc"]["kernel"]
  assert kernel.sharding.spec == P(None, "model")
  assert len({s.data.shape for s in kernel.addressable_shards}) == 1
  assert kernel.addressable_shards[0].data.shape == (64, 256 // 4)
  # Adam moves a weight by up to lr = 1e-3 a step whatever its gradient's size, so
  # near-zero gradients (the key bias's is zero in exact arithmetic: softmax ignores
  # a shift shared by every key) turn summation-order rounding into visible steps:
  # Adam divides a gradient by its own magnitude, so a leaf's rounding is amplified
  # without bound where the gradient cancels, and no factor of the single-device
  # error holds for it. What Adam does bound is the step: at most lr per element
  # per step, so a wrong gradient shows at lr scale. Each parameter is held to a
  # tenth of three steps' reach of the float64 run; the losses above are held to
  # the float64 run's distance.
  reach = 3 * 1e-3
  for a, b in zip(jax.tree.leaves(jax.device_get(sharded_state["params"])), jax.tree.leaves(ref64_state["params"])):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=0, atol=reach / 10)
  assert int(sharded_state["step"]) == 3
