"""The jaxpr front end: FLOP counts against XLA, loops, inlining, errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

import hetspmd
import hetspmd.errors
from hetspmd import models
from hetspmd.passes import Graph, Source
from hetspmd.passes.costing.flops import integer_pow_multiplies

from conftest import xla_flops

RTOL = 0.03


@pytest.mark.parametrize("name", models.test_names())
def test_zoo_train_step_flops_match_xla(name):
  """Forward + backward + optax adam of every test-size zoo model, within 3%."""
  workload = models.get(name)
  step, state, batch = workload.make_train_step(), workload.abstract_state(), workload.example_batch()
  graph = hetspmd.trace(step, state, batch)
  reference = workload
  if getattr(workload.config, "scan_layers", False):  # XLA's count takes a while loop's body once: count unrolled
    reference = dataclasses.replace(workload, config=dataclasses.replace(workload.config, scan_layers=False))
  expected = xla_flops(reference.make_train_step(), reference.abstract_state(), reference.example_batch())
  assert graph.total_flops == pytest.approx(expected, rel=RTOL)
  assert graph.unknown_primitives == ()


# Small functions, one feature each: (name, fn, args). XLA's count must match.
_X = jax.ShapeDtypeStruct((64, 128), jnp.float32)
_W = jax.ShapeDtypeStruct((128, 96), jnp.float32)
PRIMITIVE_CASES = [
    ("matmul", lambda x, w: x @ w, (_X, _W)),
    ("tanh_mlp", lambda x, w: jnp.sum(jnp.tanh(x @ w) * 3.0), (_X, _W)),
    ("softmax", lambda x: jax.nn.softmax(x, axis=-1), (_X,)),
    ("gelu", lambda x: jax.nn.gelu(x), (_X,)),
    ("gelu_exact", lambda x: jax.nn.gelu(x, approximate=False), (_X,)),  # through erfc
    ("max_pool_and_grad", lambda x: jax.value_and_grad(lambda x: jnp.sum(jax.lax.reduce_window(
        x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME") ** 2))(x),
     (jax.ShapeDtypeStruct((2, 16, 16, 8), jnp.float32),)),
    ("avg_pool", lambda x: jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4,
     (jax.ShapeDtypeStruct((2, 16, 16, 8), jnp.float32),)),
    ("sigmoid", lambda x: jax.nn.sigmoid(x) * x, (_X,)),
    ("pow3", lambda x: x**3 + x**-1, (_X,)),
    ("reductions", lambda x: jnp.sum(x, 0) + jnp.max(x, 0), (_X,)),
    ("grad", lambda x, w: jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w), (_X, _W)),
    ("conv", lambda x, k: jax.lax.conv(x, k, (1, 1), "VALID"),
     (jax.ShapeDtypeStruct((2, 3, 32, 32), jnp.float32), jax.ShapeDtypeStruct((8, 3, 3, 3), jnp.float32))),
    ("bf16_matmul", lambda x, w: (x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32), (_X, _W)),
]


@pytest.mark.parametrize("name,fn,args", PRIMITIVE_CASES, ids=[c[0] for c in PRIMITIVE_CASES])
def test_primitive_flops_match_xla(name, fn, args):
  assert hetspmd.trace(fn, *args).total_flops == pytest.approx(xla_flops(fn, *args), rel=RTOL)


def test_dot_general_counts_two_flops_per_multiply_add():
  graph = hetspmd.trace(lambda a, b: a @ b, jnp.ones((3, 5)), jnp.ones((5, 7)))
  (node,) = graph.nodes
  assert node.primitive == "dot_general"
  assert node.flops == 2 * 3 * 5 * 7
  assert node.bytes_read == (15 + 35) * 4 and node.bytes_written == 21 * 4


@pytest.mark.parametrize("exponent,ops", [(0, 0), (1, 0), (2, 1), (3, 2), (4, 2), (7, 4), (8, 3), (-1, 1), (-2, 2)])
def test_integer_pow_multiplies(exponent, ops):
  assert integer_pow_multiplies(exponent) == ops


# --- loops ------------------------------------------------------------------


def _layer(x, w):
  return jnp.tanh(x @ w)


@pytest.mark.parametrize("length", [1, 4, 12])
def test_scan_counts_every_iteration_once_in_the_graph(length):
  x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
  ws = jax.ShapeDtypeStruct((length, 256, 256), jnp.float32)

  def scanned(x, ws):
    return jax.lax.scan(lambda c, w: (_layer(c, w), None), x, ws)[0]

  def unrolled(x, ws):
    for i in range(length):
      x = _layer(x, ws[i])
    return x

  graph = hetspmd.trace(scanned, x, ws)
  dots = [n for n in graph.nodes if n.primitive == "dot_general"]
  assert len(dots) == 1 and dots[0].count == length
  assert graph.loops[0].trip_count == length and not graph.loops[0].data_dependent
  # XLA counts a while body once, so compare with the unrolled program.
  assert graph.total_flops == pytest.approx(xla_flops(unrolled, x, ws), rel=RTOL)


def test_grad_of_scan_counts_forward_and_backward_loops():
  x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
  ws = jax.ShapeDtypeStruct((5, 64, 64), jnp.float32)
  scanned = lambda ws, x: jnp.sum(jax.lax.scan(lambda c, w: (_layer(c, w), None), x, ws)[0])

  def unrolled(ws, x):
    for i in range(5):
      x = _layer(x, ws[i])
    return jnp.sum(x)

  graph = hetspmd.trace(jax.grad(scanned, argnums=(0, 1)), ws, x)
  assert {l.trip_count for l in graph.loops} == {5}
  assert graph.total_flops == pytest.approx(xla_flops(jax.grad(unrolled, argnums=(0, 1)), ws, x), rel=RTOL)


def test_static_fori_loop_is_counted_by_trip_count():
  f = lambda x: jax.lax.fori_loop(0, 6, lambda i, c: c @ jnp.eye(8), x)
  graph = hetspmd.trace(f, jnp.ones((4, 8)))
  dot = next(n for n in graph.nodes if n.primitive == "dot_general")
  assert dot.count == 6 and dot.step_flops == 6 * 2 * 4 * 8 * 8


def test_while_with_literal_bounds_is_static():
  def f(x):
    return jax.lax.while_loop(lambda c: c[0] < 10, lambda c: (c[0] + 1, c[1] @ jnp.eye(4)), (0, x))[1]

  graph = hetspmd.trace(f, jnp.ones((2, 4)))
  assert graph.loops[0].trip_count == 10 and not graph.loops[0].data_dependent
  assert graph.data_dependent_loops == ()


def test_data_dependent_while_is_flagged_and_costed_once():
  def f(x, n):
    return jax.lax.fori_loop(0, n, lambda i, c: c @ jnp.eye(4), x)

  graph = hetspmd.trace(f, jnp.ones((2, 4)), jnp.int32(3))
  (loop,) = graph.data_dependent_loops
  assert loop.primitive == "while" and loop.trip_count == 1
  dot = next(n for n in graph.nodes if n.primitive == "dot_general")
  assert dot.count == 1 and dot.loops == (loop.id,)


def test_while_whose_body_does_not_count_up_is_data_dependent():
  def f(x):
    return jax.lax.while_loop(lambda c: c[0] < 10, lambda c: (c[0] + 2, c[1] * 2.0), (0, x))[1]

  assert hetspmd.trace(f, jnp.ones(3)).loops[0].data_dependent


def test_cond_counts_the_most_expensive_branch():
  def f(p, x):
    return jax.lax.cond(p, lambda x: (x @ x) @ x, lambda x: x + 1.0, x)

  graph = hetspmd.trace(f, True, jnp.ones((16, 16)))
  dots = [n for n in graph.nodes if n.primitive == "dot_general"]
  assert sum(n.step_flops for n in dots) == 2 * (2 * 16**3)
  assert not any(n.primitive == "add" for n in graph.nodes)
  swapped = hetspmd.trace(lambda p, x: jax.lax.cond(p, lambda x: x + 1.0, lambda x: (x @ x) @ x, x), True,
                          jnp.ones((16, 16)))
  assert swapped.total_flops == graph.total_flops


# --- inlining -----------------------------------------------------------------


@jax.custom_vjp
def _clip_grad(x):
  return x


_clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1, 1),))


@jax.custom_jvp
def _softplus(x):
  return jnp.log1p(jnp.exp(x))


_softplus.defjvp(lambda primals, tangents: (_softplus(primals[0]), tangents[0] * jax.nn.sigmoid(primals[0])))

# (name, fn, number of dot_general nodes once inlined)
CALL_CASES = [
    ("jit", lambda x: jax.jit(lambda y: y @ y)(x), 1),
    ("remat", lambda x: jax.checkpoint(lambda y: jnp.sin(y @ y))(x), 1),
    ("custom_jvp", lambda x: _softplus(x @ x), 1),
    ("custom_vjp", lambda x: _clip_grad(x @ x), 1),
    # forward, recomputed forward, two transposes
    ("grad_remat", lambda x: jax.grad(lambda y: jnp.sum(jax.checkpoint(lambda z: jnp.sin(z @ z))(y)))(x), 4),
    ("grad_custom_vjp", lambda x: jax.grad(lambda y: jnp.sum(_clip_grad(y @ y)))(x), 3),
]


@pytest.mark.parametrize("name,fn,dots", CALL_CASES, ids=[c[0] for c in CALL_CASES])
def test_calls_are_inlined(name, fn, dots):
  graph = hetspmd.trace(fn, jnp.ones((8, 8)))
  call_like = {"pjit", "jit", "closed_call", "custom_jvp_call", "custom_vjp_call", "remat2", "checkpoint"}
  assert not call_like & {n.primitive for n in graph.nodes}
  dot_nodes = [n for n in graph.nodes if n.primitive == "dot_general"]
  assert len(dot_nodes) == dots
  assert all(n.flops == 2 * 8**3 for n in dot_nodes)


# --- graph structure ----------------------------------------------------------


def test_graph_is_frozen_and_edges_follow_dataflow():
  graph = hetspmd.trace(lambda x, w: jnp.tanh(x @ w), jnp.ones((2, 3)), jnp.ones((3, 4)))
  assert isinstance(graph, Graph)
  with pytest.raises(dataclasses.FrozenInstanceError):
    graph.total_flops = 0
  dot, tanh = graph.nodes
  assert [r.source for r in dot.operands] == [Source.INPUT, Source.INPUT]
  assert tanh.operands[0].source is Source.NODE and tanh.operands[0].index == dot.id
  assert [(e.src, e.dst, e.nbytes) for e in graph.edges] == [(0, 1, 2 * 4 * 4)]
  assert graph.outputs[0].source.index == tanh.id


def test_graph_rejects_inconsistent_ids():
  graph = hetspmd.trace(lambda x: x * 2.0, jnp.ones(3))
  with pytest.raises(ValueError, match="ids must equal"):
    graph.replace(nodes=(graph.nodes[0].replace(id=5),))


def test_module_paths_strip_transform_wrappers():
  def loss(w, x):
    with jax.named_scope("block_0"):
      with jax.named_scope("attn"):
        y = jnp.tanh(x @ w)
    return jnp.sum(y)

  graph = hetspmd.trace(jax.grad(loss), jnp.ones((4, 4)), jnp.ones((2, 4)))
  paths = {n.module_path for n in graph.nodes if n.primitive == "dot_general"}
  assert paths == {"block_0/attn"}
  assert len([n for n in graph.nodes if n.primitive == "dot_general"]) == 2  # forward and backward


def test_gpt2_layers_repeat_and_carry_module_paths():
  workload = models.get("gpt2-tiny")
  graph = hetspmd.trace(workload.make_train_step(), workload.abstract_state(), workload.example_batch())
  names = [l.name for l in graph.layers]
  for expected in ("embed", "h_0/attn", "h_0/mlp", "h_1/attn", "h_1/mlp", "ln_f", "lm_head", "loss"):
    assert expected in names
  assert graph.layer("h_1/attn").repeat_of == "h_0/attn"
  assert graph.layer("h_1/mlp").repeat_of == "h_0/mlp"
  assert graph.layer("h_0/attn").repeat_of is None
  assert graph.layer("h_0/attn").repeat_of != graph.layer("h_0/mlp").name
  assert sum(l.flops for l in graph.layers) == pytest.approx(graph.total_flops)
  assert sorted(i for l in graph.layers for i in l.node_ids) == list(range(len(graph.nodes)))


def test_concrete_and_abstract_arguments_give_the_same_graph():
  x = np.ones((4, 8), np.float32)
  fn = lambda x: jnp.exp(x).sum()
  assert hetspmd.trace(fn, x) == hetspmd.trace(fn, jax.ShapeDtypeStruct(x.shape, x.dtype))


# --- unknown primitives and bad input -------------------------------------------


def _make_unknown_primitive():
  from jax.extend.core import Primitive
  from jax.interpreters import mlir

  prim = Primitive("hetspmd_test_mystery")
  prim.def_abstract_eval(lambda x: x)
  prim.def_impl(lambda x: x)
  mlir.register_lowering(prim, lambda ctx, x: [x])
  return prim


_MYSTERY = _make_unknown_primitive()


def test_unknown_primitive_gets_default_rule_and_is_listed():
  graph = hetspmd.trace(lambda x: _MYSTERY.bind(x @ x), jnp.ones((4, 4)))
  assert graph.unknown_primitives == ("hetspmd_test_mystery",)
  node = next(n for n in graph.nodes if n.primitive == "hetspmd_test_mystery")
  assert node.flops == 16 and node.bytes_read == 64 and node.bytes_written == 64


def test_non_callable_is_refused():
  with pytest.raises(hetspmd.TraceError, match="callable"):
    hetspmd.trace(42, jnp.ones(3))


def test_mismatched_arguments_are_refused():
  with pytest.raises(hetspmd.TraceError, match="could not trace"):
    hetspmd.trace(lambda a, b: a @ b, jnp.ones((3, 4)), jnp.ones((5, 6)))


@pytest.mark.parametrize("effect", ["io_callback", "debug_print", "debug_callback"])
def test_side_effects_are_refused_with_module_path(effect):
  def fn(x):
    with jax.named_scope("encoder"):
      if effect == "io_callback":
        x = io_callback(lambda v: v, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
      elif effect == "debug_print":
        jax.debug.print("x={}", x)
      else:
        jax.debug.callback(lambda v: None, x)
      return x * 2.0

  with pytest.raises(hetspmd.UnpartitionableError, match=rf"{effect}.*encoder"):
    hetspmd.trace(fn, jnp.ones(3))


# --- primitives that carry a body -------------------------------------------------


def _make_body_primitive():
  """A primitive hetspmd does not know that carries its body as a ``ClosedJaxpr`` param (as pallas_call,
  run_state or a library's own call primitive do)."""
  from jax.extend.core import Primitive, jaxpr_as_fun
  from jax.interpreters import mlir

  prim = Primitive("hetspmd_test_body_call")
  prim.multiple_results = True
  prim.def_abstract_eval(lambda *avals, body: [v.aval for v in body.jaxpr.outvars])
  prim.def_impl(lambda *args, body: jaxpr_as_fun(body)(*args))
  mlir.register_lowering(prim, mlir.lower_fun(lambda *args, body: jaxpr_as_fun(body)(*args), multiple_results=True))
  return prim


_BODY_CALL = _make_body_primitive()


def _with_body_call(x):
  with jax.named_scope("mixer"):
    body = jax.make_jaxpr(lambda y: jnp.cumsum(y, axis=0))(x)  # mixes rows: not elementwise
    return _BODY_CALL.bind(x, body=body)[0]


def test_nested_jaxprs_are_found_by_scanning_params():
  from hetspmd.passes import _jax_adapter as jx

  closed = jax.make_jaxpr(lambda x: jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x) + _with_body_call(x))(jnp.ones(3))
  found = {jx.primitive_name(e): [k for k, _ in jx.nested_jaxprs(e)] for e in jx.equations(closed)}
  assert found["cond"] == ["branches", "branches"]
  assert found["hetspmd_test_body_call"] == ["body"]
  assert not any(keys for name, keys in found.items() if name not in ("cond", "hetspmd_test_body_call"))


def test_unknown_primitive_with_a_body_is_refused_with_module_path():
  with pytest.raises(hetspmd.errors.UnsupportedPrimitiveError, match=r"hetspmd_test_body_call.*mixer.*\(body\)"):
    hetspmd.trace(_with_body_call, jnp.ones((4, 3)))


def test_unknown_primitive_with_a_body_is_not_elementwise_for_the_batch_axis():
  from hetspmd.passes.batch_axis import analysis

  closed = jax.make_jaxpr(lambda x: jnp.sum(_with_body_call(x)))(jnp.ones((4, 3)))
  with pytest.raises(hetspmd.errors.UnsupportedPrimitiveError, match="hetspmd_test_body_call"):
    analysis.analyse(closed, batch_inputs=[0], global_batch=4)
  assert issubclass(hetspmd.errors.UnsupportedPrimitiveError, hetspmd.TraceError)


def test_call_primitive_missing_from_the_rule_table_is_refused(monkeypatch):
  from hetspmd.passes import _jax_adapter as jx

  monkeypatch.delitem(jx.CALL_RULES, "jit")
  with pytest.raises(hetspmd.errors.UnsupportedPrimitiveError, match=r"jit in module .*\(jaxpr\)"):
    hetspmd.trace(lambda x: jax.jit(lambda y: y @ y)(x), jnp.ones((8, 8)))


def test_call_body_under_a_renamed_param_is_found_by_the_scan(monkeypatch):
  from hetspmd.passes import _jax_adapter as jx

  fn = lambda x: jnp.sin(jax.jit(lambda y: y @ y)(x))
  expected = hetspmd.trace(fn, jnp.ones((8, 8)))
  monkeypatch.setitem(jx.CALL_RULES, "jit", jx.CallRule("a_key_jax_no_longer_uses"))
  assert hetspmd.trace(fn, jnp.ones((8, 8))) == expected
