"""Machine-independent "matches one device" checks.

A parallel step never reproduces the single-device float32 step bit for bit:
it sums the same terms in another order (per microbatch, then over devices).
A fixed tolerance on ``|parallel - single32|`` is therefore a guess at one
machine's rounding. Instead both float32 results are compared with a float64
run of the *same* step, and the parallel step may be at most a small factor
worse than the single-device step::

    max|got - ref64| <= K * max|single32 - ref64| + FLOOR_ULPS * eps32 * scale     (per leaf)

The float64 run is the same math: the step's jaxpr, traced exactly as the
float32 step runs (same random bits, same explicit casts, same control flow),
is evaluated with every float32 value, literal, cast target and accumulation
type widened to float64 (bfloat16/float16 stay as they are; random bits
converted into float32 stay float32 values, then widen).

K = 16: reordering a sum of n terms has a worst-case error bound of the same
form as the order the single-device step happens to use (``log2(n) * eps *
sum|x_i|`` for XLA's tree reduction); the parallel step's reduction is up to
about twice as deep (a tree inside each microbatch, then its count of
microbatch partials added in turn, then the devices' partials, then a
rescale), and a leaf's realised single-device error is one draw, which can sit
well below its bound by chance (a bias summed over every token, whose Adam
step turns its gradient's relative error into the parameter's: c_proj.bias
under ZeRO-3 was 10.3x its single-device error with XLA's unoptimised CPU
code, 5.5x with the optimised). 16 keeps a margin over that; a real error is
still outside it (tests/test_exactness.py: a leaf scaled by 1 + 1e-4 is 2.6x
to 50x over, one example dropped from a 64-example batch 1,400x to 6,800x).

The floor: ``FLOOR_ULPS * eps32 * scale`` with ``scale`` the leaf's largest
magnitude in the float64 result (at least ``eps32``-relative ``unit`` for
leaves that are exactly zero). Every float32 value is a rounding of its exact
value, and a trained leaf went through ``steps`` read-modify-write roundings,
so a few units in the last place of the leaf's scale are inevitable in any
order even where the single-device step happens to land exactly (a sum of
integers, a leaf whose exact gradient is zero, such as an attention key bias).

The bound assumes the step's outputs move smoothly with its sums at the
rounding scale, and a half-precision step (``Reference(half=True)``) can
break that with Adam's default ``eps``. Summing across examples in another
order moves a float32 partial sum across a bfloat16 rounding boundary here
and there, so the half-precision values downstream are fresh draws of their
roundings; a bias's gradient summed over every token can cancel to rounding
noise, and ``m / (sqrt(v) + eps)`` with ``eps=1e-8`` is the sign of any
gradient far above ``eps``, noise included: that element moves by about
the learning rate one way in one order and the other way in another, and
one draw does not bound another. Measured on the zoo's GPT-2 tiny in
bfloat16 (batch 25, 3 Adam steps at learning rate 1e-3), the same
single-device step on a permuted batch was 20x to 33x its as-written error
on some seeds, all of it one bias element. With ``eps=1e-4`` the worst of
32 permutations (8 seeds) was 1.05x the bound; with ``eps=1e-3``, where the
update is linear in a gradient at that noise, 0.48x, while a dropped
example still failed on 2 to 7 of its 28 parameter leaves
(tests/test_exactness.py). Tests of half-precision steps therefore run
Adam with ``eps`` above the gradients' rounding noise.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

K = 16.0
EPS32 = float(np.finfo(np.float32).eps)
FLOOR_ULPS = 8.0

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)

# primitives whose body runs once, inline: evaluate the body itself in float64
_CALLS = {"pjit", "jit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call", "custom_vjp_call",
          "custom_vjp_call_jaxpr", "remat2"}
_CALL_JAXPR = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _extended(dtype) -> bool:
  return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


# the dtypes the float64 run widens: float32, and with ``half=True`` float16 and bfloat16 too (set while a
# Float64 traces and runs)
_WIDENED = [frozenset({_F32})]
_HALF = frozenset({np.dtype(np.float16), np.dtype(jnp.bfloat16)})


def _is_f32(dtype) -> bool:
  return dtype is not None and not _extended(dtype) and np.dtype(dtype) in _WIDENED[-1]


class _widening:
  def __init__(self, half: bool):
    self.dtypes = frozenset({_F32}) | (_HALF if half else frozenset())

  def __enter__(self):
    _WIDENED.append(self.dtypes)

  def __exit__(self, *exc):
    _WIDENED.pop()


def _wide(dtype):
  return _F64 if _is_f32(dtype) else dtype


def _up(x):
  return jnp.asarray(x, _F64) if _is_f32(getattr(x, "dtype", None)) else x


def _eval(jaxpr: jcore.Jaxpr, consts, *args):
  env = {}

  def read(v):
    if isinstance(v, jcore.Literal):  # Python scalars would take 64-bit types here: keep the traced dtype
      return _up(v.val if _extended(v.aval.dtype) else jnp.asarray(v.val, v.aval.dtype))
    return env[v]

  for v, c in zip(jaxpr.constvars, consts):
    env[v] = _up(c)
  for v, a in zip(jaxpr.invars, args):
    env[v] = _up(a)
  for eqn in jaxpr.eqns:
    outs = _apply(eqn, [read(v) for v in eqn.invars])
    if not eqn.primitive.multiple_results:
      outs = [outs]
    for v, o in zip(eqn.outvars, outs):
      if not isinstance(v, jcore.DropVar):
        env[v] = o
  return [read(v) for v in jaxpr.outvars]


def _closed64(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
  avals = [jax.ShapeDtypeStruct(a.shape, _wide(a.dtype)) for a in closed.in_avals]
  return jax.make_jaxpr(lambda *a: _eval(closed.jaxpr, closed.consts, *a))(*avals)


def _wide_param(p):
  if isinstance(p, np.dtype):
    return _wide(p)
  if isinstance(p, jcore.ClosedJaxpr):
    return _closed64(p)
  if isinstance(p, jcore.Jaxpr):  # a reducer (scatter-add's update_jaxpr): scalars, no constants
    return _closed64(jcore.ClosedJaxpr(p, ())).jaxpr
  if isinstance(p, tuple) and p and all(isinstance(b, jcore.ClosedJaxpr) for b in p):
    return tuple(_closed64(b) for b in p)
  return p


def _apply(eqn, invals):
  name, params = eqn.primitive.name, dict(eqn.params)
  if name in _CALLS:
    key = next(k for k in _CALL_JAXPR if k in params)
    body = params[key]
    if isinstance(body, jcore.ClosedJaxpr):
      outs = _eval(body.jaxpr, body.consts, *invals)
    else:
      outs = _eval(body, (), *invals)
    return outs if eqn.primitive.multiple_results else outs[0]
  if name in ("bitcast_convert_type", "reduce_precision"):
    if name == "reduce_precision" and _is_f32(eqn.invars[0].aval.dtype) and (
        params["exponent_bits"], params["mantissa_bits"]) == (8, 23):
      return invals[0]  # float32's own precision: a no-op in float32, so one in float64 too
    # bit-level: run on the float32 operand as traced, widen the result
    invals = [jnp.asarray(x, v.aval.dtype) if hasattr(v, "aval") and hasattr(x, "dtype") else x
              for x, v in zip(invals, eqn.invars)]
    out = eqn.primitive.bind(*invals, **params)
    return [_up(o) for o in out] if eqn.primitive.multiple_results else _up(out)
  # loops, branches and reducers: the same primitive over bodies widened to float64
  params = {k: _wide_param(p) for k, p in params.items()}
  return eqn.primitive.bind(*invals, **params)


def _narrow(x):
  """The float32 abstract value a float64 (or float32) leaf stands for."""
  if hasattr(x, "dtype") and _extended(x.dtype):  # PRNG keys
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  # Python scalars: the dtype JAX gives them in 32-bit mode (0 -> int32, 2.0 -> float32), as the step is traced
  dtype = np.dtype(jnp.asarray(x).dtype) if not hasattr(x, "dtype") else np.dtype(x.dtype)
  if dtype == np.int64 and not hasattr(x, "dtype"):
    dtype = np.dtype(np.int32)
  return jax.ShapeDtypeStruct(np.shape(x), _F32 if dtype in (_F32, _F64) else dtype)


class Float64:
  """``fn`` run as the same math in float64.

  Call it with float32 or float64 arguments of the shapes ``fn`` takes in
  float32 (keyword arguments too); it returns numpy float64 arrays where ``fn``
  returns float32. One trace and one compilation per argument signature.
  ``half=True`` widens float16 and bfloat16 work too: the float64 run is then
  the exact math of a mixed-precision step, and the single-device step's
  distance from it includes its half-precision roundings.
  """

  def __init__(self, fn: Callable[..., Any], *, half: bool = False):
    self.fn = fn
    self.half = half
    self._compiled = {}

  def __call__(self, *args, **kwargs):
    flat, tree = jax.tree.flatten((args, kwargs))
    avals = [_narrow(x) for x in flat]
    key = (tree, tuple((a.shape, a.dtype) for a in avals))
    if key not in self._compiled:
      def flat_fn(*f):
        a, k = jax.tree.unflatten(tree, f)
        return self.fn(*a, **k)

      closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*avals)
      with jax.enable_x64(True):
        run = jax.jit(lambda *f: _eval(closed.jaxpr, closed.consts, *f))
      self._compiled[key] = (run, jax.tree.structure(out_shape))
    run, out_tree = self._compiled[key]
    with jax.enable_x64(True), _widening(self.half):
      # each argument in the dtype it was traced with (a Python int step stays int32), floats widened
      out = run(*[_up(x if _extended(a.dtype) else jnp.asarray(x, a.dtype)) for x, a in zip(flat, avals)])
      out = [o if _extended(o.dtype) else np.asarray(o) for o in out]
    return jax.tree.unflatten(out_tree, out)


class Reference:
  """A step run on one device twice, side by side: as written (float32, under ``jax.jit``) and as the same math
  in float64. ``step(*args, **kwargs)`` advances both from the states they hold and returns both metrics."""

  def __init__(self, step_fn: Callable[..., Any], state: Any, *, jit=None, half: bool = False):
    self.single_step = jit if jit is not None else jax.jit(step_fn)
    self.float64_step = Float64(step_fn, half=half)
    self.single, self.ref64 = state, state
    self.single_metrics, self.ref64_metrics = [], []

  def step(self, *args, **kwargs):
    self.single, m32 = self.single_step(self.single, *args, **kwargs)
    self.ref64, m64 = self.float64_step(self.ref64, *args, **kwargs)
    self.single_metrics.append(m32)
    self.ref64_metrics.append(m64)
    return m32, m64

  def run(self, batches, *args, **kwargs):
    for batch in batches:
      self.step(batch, *args, **kwargs)
    return self

  def check(self, got, select=lambda state: state, what="state"):
    """``got`` (the parallel run's final state, or ``select`` of it) against both final states."""
    assert_exact(got, select(self.single), select(self.ref64), what=what)

  def check_metrics(self, got, i: int, what="metrics"):
    """``got``, the parallel run's metrics of step ``i`` (a dict may hold only some of the keys)."""
    single, ref64 = self.single_metrics[i], self.ref64_metrics[i]
    if isinstance(got, dict):
      single, ref64 = ({k: m[k] for k in got} for m in (single, ref64))
    assert_exact(got, single, ref64, what=f"{what} of step {i}")


class NnxReference:
  """An NNX step that updates its objects in place (``step(model, optimizer, metrics, batch)``), run on one
  device as written (``nnx.jit``, on ``objects``) and as the same math in float64 (on a copy of their state).
  ``ref64`` holds the float64 objects."""

  def __init__(self, step_fn: Callable[..., Any], objects: tuple):
    from flax import nnx

    self.single = objects
    self._graphdef, self._state64 = nnx.split(objects)
    self._jit = nnx.jit(step_fn)

    def pure(state, *args):
      objs = nnx.merge(self._graphdef, state)
      step_fn(*objs, *args)
      return nnx.split(objs)[1]

    self._float64 = Float64(pure)

  def run(self, batches):
    for batch in batches:
      self._jit(*self.single, batch)
      self._state64 = self._float64(self._state64, batch)
    return self

  @property
  def ref64(self):
    from flax import nnx

    return nnx.merge(self._graphdef, self._state64)


# --- the comparison ---------------------------------------------------------------------------------------------


def _leaves(tree):
  return jax.tree_util.tree_flatten_with_path(tree)[0]


def _array(x):
  x = jax.device_get(x)
  if hasattr(x, "dtype") and _extended(x.dtype):  # PRNG keys: their bits
    return np.asarray(jax.random.key_data(x))
  return np.asarray(x.value if hasattr(x, "value") and not hasattr(x, "dtype") else x)


def excess(got, single, ref, *, k: float = K, floor_ulps: float = FLOOR_ULPS, eps: float | None = None):
  """Per leaf path: ``(max|got - ref| - (k * max|single - ref| + floor), max|got - ref|, max|single - ref|,
  floor)``; a positive first entry fails the check. Leaves that are not floating point (integers, booleans,
  PRNG keys) must equal the single-device step's exactly (first entry ``inf`` where they do not). ``eps``: the
  floor's unit roundoff (default the leaf dtype's, at least float32's); a step computing in float16 rounds each
  value to float16's, in whatever order it sums."""
  out = {}
  g_leaves, s_leaves, r_leaves = _leaves(got), jax.tree.leaves(single), jax.tree.leaves(ref)
  assert len(g_leaves) == len(s_leaves) == len(r_leaves), (len(g_leaves), len(s_leaves), len(r_leaves))
  for (path, g), s, r in zip(g_leaves, s_leaves, r_leaves):
    name = jax.tree_util.keystr(path)
    g, s, r = _array(g), _array(s), _array(r)
    assert g.shape == s.shape == r.shape, (name, g.shape, s.shape, r.shape)
    if not jnp.issubdtype(g.dtype, jnp.inexact):
      out[name] = (0.0 if np.array_equal(g, s) else np.inf, 0.0, 0.0, 0.0)
      continue
    unit = eps if eps is not None else max(EPS32, float(jnp.finfo(g.dtype).eps))
    g, s, r = (np.asarray(x, np.float64) for x in (g, s, r))
    if not g.size:
      out[name] = (0.0, 0.0, 0.0, 0.0)
      continue
    floor = floor_ulps * unit * float(np.max(np.abs(r)))
    err_got, err_single = float(np.max(np.abs(g - r))), float(np.max(np.abs(s - r)))
    if not (np.isfinite(err_got) and np.isfinite(err_single)):  # a NaN or an overflow fails, whatever the rest
      out[name] = (np.inf, err_got, err_single, floor)
      continue
    out[name] = (err_got - (k * err_single + floor), err_got, err_single, floor)
  return out


def assert_exact(got, single, ref, *, k: float = K, floor_ulps: float = FLOOR_ULPS, what: str = "",
                 eps: float | None = None):
  """``got`` (the parallel step's result) is within ``k`` times the single-device float32 result's distance
  from the float64 result ``ref``, plus a floor of ``floor_ulps`` float32 ulps (or units of ``eps``) of the
  leaf's scale."""
  bad = {p: v for p, v in excess(got, single, ref, k=k, floor_ulps=floor_ulps, eps=eps).items() if v[0] > 0}
  assert not bad, f"{what}: leaves further from float64 than {k} x single-device + {floor_ulps} ulps " + "; ".join(
      f"{p}: |got-ref64|={v[1]:.3g} |single-ref64|={v[2]:.3g} floor={v[3]:.3g}" for p, v in list(bad.items())[:8])
