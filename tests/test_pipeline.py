"""Uneven pipeline stages (hetspmd.lowering.pipeline) against one device.

A stack of pre-LayerNorm transformer blocks written in Linen (causal
self-attention and an MLP, parameters stacked the way ``nn.scan`` stacks
them), with a language-model head, is run as 2 and 4 stages of uneven
layer counts, with and without a data axis inside each stage and with
fewer or more microbatches than stages. The loss and the gradients of
the stack, the head and the stack's inputs must match ``jax.grad`` of
the same sum computed by ``lax.scan`` on one device.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from conftest import require_devices
from exactness import Float64, assert_exact
from hetspmd.lowering import pipeline
from hetspmd.errors import InvalidValueError

WIDTH, HEADS, SEQ, VOCAB = 16, 2, 6, 11


class Block(nn.Module):
  @nn.compact
  def __call__(self, h):
    y = nn.LayerNorm()(h)
    y = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=WIDTH, deterministic=True)(y, mask=nn.make_causal_mask(h[..., 0]))
    h = h + y
    y = nn.Dense(2 * WIDTH)(nn.LayerNorm()(h))
    return h + nn.Dense(WIDTH)(nn.gelu(y))


class Head(nn.Module):
  @nn.compact
  def __call__(self, h, targets):
    logits = nn.Dense(VOCAB)(nn.LayerNorm()(h))
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.take_along_axis(logp, targets[..., None], -1).sum()


@functools.partial(jax.jit, static_argnums=(0, 1, 2))  # one compiled program, not an op-by-op init per shape
def _setup(layers: int, microbatches: int, examples: int):
  keys = jax.random.split(jax.random.key(0), layers + 3)
  h = jnp.zeros((1, SEQ, WIDTH))
  stack = jax.vmap(lambda k: Block().init(k, h)["params"])(keys[:layers])
  head = Head().init(keys[-3], h, jnp.zeros((1, SEQ), jnp.int32))["params"]
  xs = jax.random.normal(keys[-2], (microbatches, examples, SEQ, WIDTH))
  targets = jax.random.randint(keys[-1], (microbatches, examples, SEQ), 0, VOCAB)
  return stack, head, xs, targets


def _block(p, h):
  return Block().apply({"params": p}, h)


def _head(p, h, t):
  return Head().apply({"params": p}, h, t)


def _total(stack, head, xs, targets):
  def one(x, t):
    h, _ = jax.lax.scan(lambda h, p: (_block(p, h), None), x, stack)
    return _head(head, h, t)
  return sum(one(xs[m], targets[m]) for m in range(xs.shape[0]))


_GRAD = jax.value_and_grad(_total, argnums=(0, 1, 2))
_GRAD_JIT = jax.jit(_GRAD)
_GRAD64 = Float64(_GRAD)  # one trace and compilation per shape, kept for the module


def _reference(stack, head, xs, targets):
  return _GRAD_JIT(stack, head, xs, targets)


def _reference64(stack, head, xs, targets):
  """``_reference`` as the same math in float64."""
  return _GRAD64(stack, head, xs, targets)


@functools.cache
def _case(layers: int, microbatches: int, examples: int):
  """``_setup``'s inputs with their ``_reference`` and ``_reference64``, built once per shape: cases that differ
  only in the stages (or recomputation) share them."""
  inputs = _setup(layers, microbatches, examples)
  return inputs, _reference(*inputs), _reference64(*inputs)


CASES = [  # (stages' layers, data axis size, microbatches, examples per microbatch, recompute)
    ((3, 1), 4, 3, 4, True),
    ((3, 1), 4, 3, 4, False),
    ((1, 3), 2, 1, 2, True),
    ((2, 1, 3, 2), 2, 5, 2, True),
    ((2, 1, 3, 2), 2, 5, 2, False),
    ((2, 2, 1, 1), 1, 2, 3, True),
    ((4,), 8, 2, 8, False),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layers,data,microbatches,examples,recompute", CASES,
                         ids=[f"{'-'.join(map(str, c[0]))}-data{c[1]}-m{c[2]}{'-recompute' if c[4] else ''}"
                              for c in CASES])
def test_uneven_stages_match_one_device(layers, data, microbatches, examples, recompute):
  require_devices(len(layers) * data)
  stages = pipeline.Stages(layers=layers, microbatches=microbatches, recompute=recompute)
  devices = np.array(jax.devices()[:len(layers) * data]).reshape(len(layers), data)
  mesh = Mesh(devices, ("stage", "data"))
  (stack, head, xs, targets), (loss, (dstack, dhead, dxs)), ref64 = _case(sum(layers), microbatches, examples)
  run = jax.jit(pipeline.pipelined_grad(_block, _head, stages, mesh))
  got_loss, got_dstack, got_dhead, got_dxs = run(pipeline.pack(stack, stages), head, xs, targets)

  got = (got_loss, (pipeline.unpack(got_dstack, stages), got_dhead, got_dxs))
  assert_exact(got, (loss, (dstack, dhead, dxs)), ref64, what="loss and gradients")
  padding = np.setdiff1d(np.arange(len(layers) * stages.max_layers), stages.rows())
  for leaf in jax.tree.leaves(got_dstack):
    assert not np.any(np.asarray(leaf)[padding]), "a padding row of the stack got a gradient"


def test_stack_is_padded_per_stage():
  stages = pipeline.Stages(layers=(3, 1, 2), microbatches=1)
  stack = {"w": jnp.arange(6.0)[:, None] + 1}
  padded = pipeline.pack(stack, stages)
  np.testing.assert_array_equal(padded["w"][:, 0], [1, 2, 3, 4, 0, 0, 5, 6, 0])
  np.testing.assert_array_equal(pipeline.unpack(padded, stages)["w"], stack["w"])
  assert stages.ticks == 3


def test_bad_stages_are_refused():
  with pytest.raises(InvalidValueError, match="at least one layer"):
    pipeline.Stages(layers=(2, 0), microbatches=2)
  with pytest.raises(InvalidValueError, match="holds? 4"):
    pipeline.pack({"w": jnp.zeros((5, 2))}, pipeline.Stages(layers=(2, 2), microbatches=1))
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("stage", "data"))
  with pytest.raises(InvalidValueError, match="mesh axis 'stage' of size 2"):
    pipeline.pipelined_grad(_block, _head, pipeline.Stages(layers=(1, 1), microbatches=1), mesh)


@pytest.mark.timeout(300)
def test_stages_on_two_processes():
  """Each process is one stage of two devices (data inside); the ppermutes between ticks cross gloo."""
  import textwrap

  from multiprocess import run_processes

  results = run_processes(textwrap.dedent(f"""
      import json, types
      import numpy as np, jax
      from jax.experimental import multihost_utils
      from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      sys.modules["conftest"] = types.SimpleNamespace(require_devices=lambda n: None)
      sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
      import test_pipeline as t
      from hetspmd.lowering import pipeline
      stages = pipeline.Stages(layers=(3, 1), microbatches=3)
      stack, head, xs, targets = jax.device_get(t._setup(4, 3, 4))
      local = jax.local_devices()[0]
      loss, (dstack, dhead, dxs) = t._reference(*jax.device_put((stack, head, xs, targets), local))
      from exactness import excess
      ref64 = t._reference64(stack, head, xs, targets)
      mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("stage", "data"))
      assert {{d.process_index for d in mesh.devices[jax.process_index()]}} == {{jax.process_index()}}
      def put(tree, spec):
        return jax.tree.map(lambda a: jax.make_array_from_callback(
            a.shape, NamedSharding(mesh, spec), lambda i: np.asarray(a)[i]), tree)
      packed = jax.device_get(pipeline.pack(stack, stages))
      run = jax.jit(pipeline.pipelined_grad(t._block, t._head, stages, mesh))
      got = run(put(packed, P("stage")), put(head, P()), put(xs, P(None, "data")), put(targets, P(None, "data")))
      got = multihost_utils.process_allgather(got, tiled=True)
      over = excess((got[0], (pipeline.unpack(got[1], stages), got[2], got[3])), (loss, (dstack, dhead, dxs)), ref64)
      print(json.dumps({{"over": {{k: v[0] for k, v in over.items() if v[0] > 0}}}}))
  """), num_processes=2, devices_per_process=2, timeout=240)
  assert len(results) == 2
  for r in results:  # loss and gradients as close to float64 as exactness asks
    assert r["over"] == {}, r


@pytest.mark.timeout(300)
def test_kept_residuals_skip_the_recomputed_forward():
  """Without recomputation the backward ticks hold no forward matmuls: fewer dots in the compiled program."""
  require_devices(4)
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("stage", "data"))
  stack, head, xs, targets = _setup(4, 3, 4)
  dots = {}
  for recompute in (True, False):
    stages = pipeline.Stages(layers=(3, 1), microbatches=3, recompute=recompute)
    run = jax.jit(pipeline.pipelined_grad(_block, _head, stages, mesh))
    text = run.lower(pipeline.pack(stack, stages), head, xs, targets).compile().as_text()
    dots[recompute] = text.count(" dot(")
  assert dots[False] < dots[True], dots


def test_schedule_is_priced_by_its_slowest_stage_per_tick():
  stages = pipeline.Stages(layers=(3, 1), microbatches=4)
  # stage 0: 3 layers of 1 s forward, 2 s backward (+1 s recomputed); stage 1: 1 layer of 2 + 4 (+2), head 1 s
  seconds = pipeline.schedule_seconds(stages, forward=(1.0, 2.0), backward=(2.0, 4.0), head=1.0, transfer=0.5)
  assert seconds == pytest.approx(5 * (max(3.0, 2.0 + 1.0) + max(9.0, 6.0) + 1.0))
  kept = pipeline.Stages(layers=(3, 1), microbatches=4, recompute=False)
  assert pipeline.schedule_seconds(kept, (1.0, 2.0), (2.0, 4.0), head=1.0) == pytest.approx(5 * (3.0 + 6.0))
  with pytest.raises(InvalidValueError, match="one forward and one backward time per stage"):
    pipeline.schedule_seconds(stages, (1.0,), (1.0, 1.0))
