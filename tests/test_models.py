"""The model zoo: registry, published sizes, batches, and real training on CPU."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import hetspmd
from hetspmd import models

PUBLISHED = [name for name in models.names() if models.get(name).published_params]


def test_registry_lists_the_foundation_models():
  for name in ("mlp", "mlp-tiny", "gpt2-tiny", "gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"):
    assert name in models.names()
  assert set(models.test_names()) >= {"mlp-tiny", "gpt2-tiny"}


def test_unknown_model_lists_known_ones():
  with pytest.raises(hetspmd.UnknownNameError, match="unknown model 'gpt5'.*gpt2-small"):
    models.get("gpt5")


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_count_within_one_percent_of_published(name):
  workload = models.get(name)
  assert workload.param_count() == pytest.approx(workload.published_params, rel=0.01)


@pytest.mark.parametrize("batch,seq,match", [
    (0, 16, "batch must be a positive integer"),
    (2, 0, "sequence length must be a positive integer"),
    (2, 4096, "exceeds the model's context of 128"),
])
def test_bad_batch_sizes_are_refused(batch, seq, match):
  with pytest.raises(hetspmd.InvalidValueError, match=match):
    models.get("gpt2-tiny").example_batch(batch, seq)


def test_sequence_length_on_a_model_without_one_is_refused():
  with pytest.raises(hetspmd.InvalidValueError, match="no sequence axis"):
    models.get("mlp-tiny").example_batch(4, 16)


def _bad_configs():
  from hetspmd.models.bert import BertConfig, MoEConfig
  from hetspmd.models.cnn import ResNetConfig, VGGConfig
  from hetspmd.models.gpt2 import GPT2Config
  from hetspmd.models.mlp import MLPConfig
  from hetspmd.models.vit import ViTConfig

  return [
      (lambda: MoEConfig(num_experts=1), "num_experts must be at least 2, got 1"),
      (lambda: MoEConfig(num_experts=4, top_k=3), r"top_k must be 1 \(Switch\) or 2 \(GShard\), got 3"),
      (lambda: MoEConfig(num_experts=4, every=0), "every must be a positive integer, got 0"),
      (lambda: BertConfig(2, 3, 64), "d_model must be divisible by n_head=3, got d_model=64"),
      (lambda: BertConfig(2, 2, 64, vocab_size=50), r"mask_token_id must lie in \[0, vocab_size=50\), got mask_token_id=103"),
      (lambda: GPT2Config(n_layer=2, n_head=3, d_model=64), "d_model must be divisible by n_head=3, got d_model=64"),
      (lambda: MLPConfig((8,)), r"at least two positive widths .*got \(8,\)"),
      (lambda: ViTConfig(30, 16, 2, 64, 4, 128), "image_size must be divisible by patch_size=16, got image_size=30"),
      (lambda: VGGConfig(((8,), ())), "no empty one"),
      (lambda: ResNetConfig((1, 1), widths=(8,)), r"one positive block count per width, got blocks=\(1, 1\)"),
      (lambda: ResNetConfig((1, 1), widths=(8, 16), image_size=12), "image_size must be divisible by 8.*got image_size=12"),
  ]


@pytest.mark.parametrize("build,match", _bad_configs())
def test_bad_model_configs_say_what_was_given(build, match):
  with pytest.raises(hetspmd.InvalidValueError, match=match) as info:
    build()
  assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("name", models.test_names())
def test_tiny_models_train_on_cpu(name):
  workload = models.get(name)
  step = jax.jit(workload.make_train_step())
  state = workload.init_state(seed=0)
  batch = workload.synthetic_batch(seed=0)
  losses = []
  for _ in range(20):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  assert np.isfinite(losses).all()
  assert losses[-1] < 0.9 * losses[0]
  assert int(state["step"]) == 20


def test_abstract_trace_of_gpt2_xl_allocates_no_weights(tmp_path):
  """1.5B float32 parameters and adam state are 18 GiB; the trace stays under 2 GiB."""
  # The peak is read from VmHWM, this process's own high-water mark: ru_maxrss carries
  # the parent's across fork and exec, so under pytest it measures the test runner.
  if not os.path.exists("/proc/self/status"):
    pytest.skip("reads the peak resident size from /proc/self/status (Linux)")
  script = textwrap.dedent("""
      import re, hetspmd
      from hetspmd import models
      w = models.get("gpt2-xl")
      g = hetspmd.trace(w.make_train_step(), w.abstract_state(), w.example_batch(1, 1024))
      with open("/proc/self/status") as f:
        peak_kib = int(re.search(r"VmHWM:\\s*(\\d+) kB", f.read()).group(1))
      print(g.elements_with_role("param"), peak_kib)
  """)
  out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=240)
  assert out.returncode == 0, out.stderr
  params, max_rss_kib = map(int, out.stdout.split())
  assert params == models.get("gpt2-xl").published_params
  assert max_rss_kib * 1024 < 2 * 2**30


def test_abstract_rngs_draw_the_same_keys_as_nnx_rngs():
  from flax import nnx

  from hetspmd.models.gpt2 import GPT2
  from hetspmd.models.workload import abstract_rngs

  cfg = models.get("gpt2-tiny").config
  fast = nnx.state(GPT2(cfg, abstract_rngs(3)), nnx.Param)
  plain = nnx.state(GPT2(cfg, nnx.Rngs(3)), nnx.Param)
  for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(plain), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
