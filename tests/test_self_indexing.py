"""passes.self_indexing: ``x[i, jnp.arange(n)]`` becomes a batched gather (and its transpose a batched scatter)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.batch_axis import self_indexing

TIME, BATCH, WIDTH = 7, 5, 3


def _last(x, lengths):
  """Each sequence's last step, time-major, as Flax's nn.RNN picks its last carry."""
  return x[lengths - 1, jnp.arange(x.shape[1])]


def _loss(x, lengths):
  return jnp.sum(jnp.sin(_last(x, lengths)) * jnp.arange(WIDTH))


def _indexing(closed, name):
  return [e.params["dimension_numbers"] for e in closed.jaxpr.eqns if jx.primitive_name(e) == name]


def _args(seed=0):
  rs = np.random.RandomState(seed)
  return rs.randn(TIME, BATCH, WIDTH).astype(np.float32), rs.randint(1, TIME + 1, BATCH).astype(np.int32)


@pytest.mark.parametrize("fn,primitives", [(_last, ("gather",)), (jax.grad(_loss), ("gather", "scatter-add"))],
                         ids=["gather", "its transpose"])
def test_self_indexing_becomes_batched_and_computes_the_same(fn, primitives):
  x, lengths = _args()
  closed = jx.inline_calls(jax.make_jaxpr(fn)(x, lengths))
  rewritten = self_indexing.rewrite(closed)
  for name in primitives:
    before, after = _indexing(closed, name), _indexing(rewritten, name)
    assert before and not any(n.operand_batching_dims for n in before)
    assert after and all(n.operand_batching_dims == (1,) for n in after)  # the batch dimension of x
  expected = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, x, lengths)
  actual = jax.core.eval_jaxpr(rewritten.jaxpr, rewritten.consts, x, lengths)
  for e, a in zip(expected, actual):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


@pytest.mark.parametrize("index", [lambda n: n - 1 - jnp.arange(n), lambda n: jnp.zeros(n, jnp.int32)],
                         ids=["reversed", "constant"])
def test_other_indices_are_left_alone(index):
  x, lengths = _args()
  closed = jx.inline_calls(jax.make_jaxpr(lambda x, l: x[l - 1, index(x.shape[1])])(x, lengths))
  assert self_indexing.rewrite(closed) is closed


def test_a_position_cast_to_a_narrower_integer_is_not_trusted():
  """An iota of 300 cast to int8 wraps past 127: not each example's own position."""
  n = 300
  x = np.arange(4 * n, dtype=np.float32).reshape(4, n)

  def wrapped(x, i):
    idx = jnp.concatenate([i[:, None], jax.lax.iota(jnp.int32, n).astype(jnp.int8)[:, None]], axis=1)
    numbers = jax.lax.GatherDimensionNumbers(offset_dims=(), collapsed_slice_dims=(0, 1), start_index_map=(0, 1))
    return jax.lax.gather(x, idx, numbers, (1, 1), mode="clip")

  closed = jax.make_jaxpr(wrapped)(x, np.zeros(n, np.int8))
  assert self_indexing.rewrite(closed) is closed
