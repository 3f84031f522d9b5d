"""Adapter over JAX's jaxpr internals: the only module that reads them.

Everything else in ``hetspmd.passes`` sees jaxprs through the small vocabulary
defined here (equations, values, shapes, nested bodies, name stacks), so a JAX
upgrade that moves an internal touches this file alone.

Checked against jax 0.10.2: ``jax.jit(f).trace(...).jaxpr`` gives a
``ClosedJaxpr``; nested bodies are found by scanning equation params for
jaxprs (:func:`nested_jaxprs`, as equinox's ``_finalise_jaxpr`` does), and
the call primitives whose body computes their results are listed in
``CALL_RULES`` with the key of that body; ``scan`` carries ``length``/``num_consts``/
``num_carry``; ``while`` carries ``cond_jaxpr``/``body_jaxpr`` and their const
counts; ``cond`` carries ``branches`` and takes the branch index first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import re
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.extend import core as jcore
from jax.extend import source_info_util

from hetspmd.errors import TraceError, UnsupportedPrimitiveError

ClosedJaxpr = jcore.ClosedJaxpr
Jaxpr = jcore.Jaxpr
Equation = jcore.JaxprEqn

# Call-like primitives: the param under which each keeps the body that computes its results, and whether
# evaluating that body in place computes the same values (not so for ``shard_map``, whose body runs per shard:
# it is walked for its cost but never inlined). A primitive listed here whose key has moved is still read
# through :func:`nested_jaxprs` when it carries exactly one body.
@dataclasses.dataclass(frozen=True, slots=True)
class CallRule:
  body_key: str
  inlinable: bool = True


CALL_RULES: dict[str, CallRule] = {
    "pjit": CallRule("jaxpr"),
    "jit": CallRule("jaxpr"),
    "closed_call": CallRule("call_jaxpr"),
    "core_call": CallRule("call_jaxpr"),
    "custom_jvp_call": CallRule("call_jaxpr"),
    "custom_vjp_call": CallRule("call_jaxpr"),
    "custom_vjp_call_jaxpr": CallRule("fun_jaxpr"),
    "remat2": CallRule("jaxpr"),
    "checkpoint": CallRule("jaxpr"),
    "custom_lin": CallRule("jaxpr"),
    "shard_map": CallRule("jaxpr", inlinable=False),
}

# Calls that checkpoint their body (``jax.checkpoint`` / ``remat``): the batch-axis pass keeps them whole.
CHECKPOINTS = frozenset({"remat2", "checkpoint"})

# Transformation wrappers that JAX writes around name-stack components.
_TRANSFORM_WRAPPER = re.compile(r"\b(?:jvp|transpose|vmap|pmap|remat|checkpoint)\(")
_HIDDEN_COMPONENTS = frozenset({"rematted_computation", "checkpoint", "remat", ""})


def trace_to_jaxpr(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[ClosedJaxpr, Any]:
  """Traces ``fn(*args, **kwargs)`` under ``jax.jit`` without running it.

  Returns the closed jaxpr and the output pytree of ``ShapeDtypeStruct``s.
  """
  traced = jax.jit(fn).trace(*args, **kwargs)
  return traced.jaxpr, traced.out_info


def jit_static_arguments(fn: Any) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
  """``(static_argnums, static_argnames)`` of a ``jax.jit``-ed ``fn``, or of an ``nnx.jit``-ed one (the
  ``jax.jit`` of its function, ``jitted_fn``, which takes the same arguments); ``None`` for a function that is
  not jitted. JAX resolves each against the signature, so both name the same arguments (jax 0.10.2: the
  ``PjitFunction``'s ``_jit_info``, a ``PjitInfo``)."""
  info = getattr(getattr(fn, "jitted_fn", fn), "_jit_info", None)
  if info is None or not hasattr(info, "static_argnums"):
    return None
  return tuple(info.static_argnums), tuple(info.static_argnames)


# A shape or a Python branch that met a traced value (jax 0.10.2 wordings): a shape of tracers is a plain
# TypeError, a jitted function's static argument given a tracer a ValueError.
_CONCRETENESS = re.compile(r"concrete value|Non-hashable static arguments are not supported.*Tracer", re.DOTALL)


def is_concreteness_error(error: BaseException) -> bool:
  """Whether ``error``, or an error it was raised from, says the trace needed a concrete Python value (a shape,
  a branch, a jitted function's static argument) where it had a traced one."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError)):
      return True
    if isinstance(error, (TypeError, ValueError)) and _CONCRETENESS.search(str(error)):
      return True
    error = error.__cause__ or error.__context__
  return False


# JAX's two wordings of a collective over an axis name that nothing binds (core.AxisEnv and lax.parallel).
_UNBOUND_AXIS = re.compile(r"unbound axis name: (?P<name>[^\s.]+)")


def unbound_axis_name(error: BaseException) -> str | None:
  """The axis name of JAX's ``NameError`` for a collective (``lax.pmean(x, 'batch')``) traced where no
  transformation binds the axis; ``None`` for any other error."""
  if not isinstance(error, NameError):
    return None
  found = _UNBOUND_AXIS.search(str(error))
  return found.group("name") if found else None


def to_abstract(tree: Any) -> Any:
  """Replaces every array leaf by a ``ShapeDtypeStruct`` (no device memory)."""

  def leaf(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
      return x
    if hasattr(x, "shape") and hasattr(x, "dtype"):
      return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
    return x

  return jax.tree.map(leaf, tree)


# --- values ---------------------------------------------------------------


def is_literal(value: Any) -> bool:
  return isinstance(value, jcore.Literal)


def is_dropped(value: Any) -> bool:
  return isinstance(value, jcore.DropVar)


def aval_of(value: Any) -> Any:
  """The abstract value of a variable or literal (hashable; use as a cache key)."""
  return value.aval


def describe_aval(aval: Any) -> tuple[tuple[int, ...], str, int]:
  """(shape, dtype name, item size) of an abstract value."""
  shape = tuple(int(d) for d in getattr(aval, "shape", ()))
  dtype = getattr(aval, "dtype", None)
  if dtype is None:  # tokens and other non-array values
    return shape, type(aval).__name__, 0
  return shape, str(dtype), int(getattr(dtype, "itemsize", 0))


# --- equations ------------------------------------------------------------


def primitive_name(eqn: Equation) -> str:
  return eqn.primitive.name






def module_path(eqn: Equation, prefix: str = "") -> str:
  """The Flax module path of ``eqn``, with transformation wrappers removed.

  JAX writes ``transpose(jvp(h_3))/attn`` for the backward pass of a
  ``h_3/attn`` scope; both map to ``h_3/attn``. ``prefix`` is the path of
  the enclosing equation when ``eqn`` sits in a nested body.
  """
  return join_paths(prefix, normalise_name_stack(str(eqn.source_info.name_stack)))


def phase(eqn: Equation) -> str:
  """``"backward"`` for an equation of a transposed (gradient) pass, ``"forward"`` for one of a
  differentiated function's forward pass, ``""`` when the name stack says neither."""
  text = str(eqn.source_info.name_stack)
  if "transpose(" in text:
    return "backward"
  return "forward" if "jvp(" in text else ""


def normalise_name_stack(text: str) -> str:
  text = _TRANSFORM_WRAPPER.sub("", text).replace(")", "")
  # jnp.einsum names its call after the subscripts ("bqhd,bkhd->bhqk").
  parts = [p for p in text.split("/") if p not in _HIDDEN_COMPONENTS and "->" not in p]
  # remat writes the saved forward scope again after the transposed one.
  half = len(parts) // 2
  if half and len(parts) % 2 == 0 and parts[:half] == parts[half:]:
    parts = parts[:half]
  return "/".join(parts)


def join_paths(prefix: str, path: str) -> str:
  if not prefix:
    return path
  if not path:
    return prefix
  return f"{prefix}/{path}"


def user_location(eqn: Equation) -> str:
  """``file:line (function)`` of the user code that created ``eqn``."""
  return source_info_util.summarize(eqn.source_info)


# --- nested bodies ----------------------------------------------------------


def _is_jaxpr(value: Any) -> bool:
  return isinstance(value, (Jaxpr, ClosedJaxpr))


def nested_jaxprs(eqn: Equation) -> tuple[tuple[str, ClosedJaxpr], ...]:
  """Every jaxpr ``eqn`` carries in its params, as ``(param key, closed jaxpr)`` pairs in key order.

  A param counts when it is a ``Jaxpr`` or ``ClosedJaxpr``, or a tuple or list of them (``cond``'s
  branches); thunks and callables that make jaxprs later (``custom_vjp``'s backward rule) are not bodies.
  """
  found = []
  for key, value in sorted(eqn.params.items()):
    if _is_jaxpr(value):
      found.append((key, as_closed(value)))
    elif isinstance(value, (tuple, list)) and value and all(_is_jaxpr(v) for v in value):
      found.extend((key, as_closed(v)) for v in value)
  return tuple(found)


def has_nested_jaxpr(eqn: Equation) -> bool:
  """Whether ``eqn`` carries a body (any jaxpr in its params)."""
  return bool(nested_jaxprs(eqn))


def call_body(eqn: Equation) -> ClosedJaxpr | None:
  """The body that computes a call-like equation's results (jit, remat, custom_jvp, ...), or None.

  The primitive must be in ``CALL_RULES``; its body is the param the rule names, or, where JAX keeps it
  under another key, the one jaxpr the params carry. None for any other equation.
  """
  rule = CALL_RULES.get(primitive_name(eqn))
  if rule is None:
    return None
  if _is_jaxpr(eqn.params.get(rule.body_key)):
    return as_closed(eqn.params[rule.body_key])
  bodies = nested_jaxprs(eqn)
  return bodies[0][1] if len(bodies) == 1 else None


def inlinable_body(eqn: Equation, keep: frozenset = frozenset()) -> ClosedJaxpr | None:
  """The body to evaluate in place of ``eqn``: :func:`call_body` for a call that computes the same values
  inlined, unless its primitive is named in ``keep``; None otherwise."""
  rule = CALL_RULES.get(primitive_name(eqn))
  if rule is None or not rule.inlinable or primitive_name(eqn) in keep:
    return None
  return call_body(eqn)


def is_checkpoint(eqn: Equation) -> bool:
  """Whether ``eqn`` is a ``jax.checkpoint`` (remat) call."""
  return primitive_name(eqn) in CHECKPOINTS


def unsupported_body(eqn: Equation, path: str | None = None) -> UnsupportedPrimitiveError:
  """The error for an equation whose primitive carries a body hetspmd does not know how to read.

  ``path``: the Flax module path of ``eqn`` (default: from its name stack).
  """
  name = primitive_name(eqn)
  path = module_path(eqn) if path is None else path
  keys = ", ".join(dict.fromkeys(k for k, _ in nested_jaxprs(eqn)))
  return UnsupportedPrimitiveError(
      f"{name} in module {path or '(top level)'} at {user_location(eqn)} carries a nested jaxpr ({keys}) but is "
      "not a primitive hetspmd knows (a call, scan, while or cond), so its body's cost and its effect on the "
      f"batch axis are unknown; write this part with standard JAX operations, or register {name!r} in "
      "hetspmd.passes._jax_adapter.CALL_RULES if its body computes its results")


def as_closed(jaxpr: Any) -> ClosedJaxpr:
  if isinstance(jaxpr, ClosedJaxpr):
    return jaxpr
  return ClosedJaxpr(jaxpr, ())


@dataclasses.dataclass(frozen=True, slots=True)
class ScanParts:
  body: ClosedJaxpr
  length: int
  num_consts: int
  num_carry: int
  reverse: bool = False


def scan_parts(eqn: Equation) -> ScanParts:
  p = eqn.params
  return ScanParts(as_closed(p["jaxpr"]), int(p["length"]), int(p["num_consts"]), int(p["num_carry"]),
                   bool(p["reverse"]))


@dataclasses.dataclass(frozen=True, slots=True)
class WhileParts:
  cond: ClosedJaxpr
  body: ClosedJaxpr
  cond_nconsts: int
  body_nconsts: int


def while_parts(eqn: Equation) -> WhileParts:
  p = eqn.params
  return WhileParts(as_closed(p["cond_jaxpr"]), as_closed(p["body_jaxpr"]), int(p["cond_nconsts"]), int(p["body_nconsts"]))


def cond_branches(eqn: Equation) -> tuple[ClosedJaxpr, ...]:
  return tuple(as_closed(b) for b in eqn.params["branches"])


def literal_int(value: Any) -> int | None:
  """The integer held by a scalar literal, or None."""
  if not is_literal(value):
    return None
  v = np.asarray(value.val)
  if v.shape != () or not np.issubdtype(v.dtype, np.integer):
    return None
  return int(v)


def static_while_trip_count(eqn: Equation, init_values: Sequence[Any]) -> int | None:
  """Trip count of a ``while`` written as ``for i in range(lo, hi)``, or None.

  Recognises a loop whose condition is the single equation
  ``lt(carry[i], hi)``, whose body returns ``carry[i] + 1`` in position
  ``i``, and where ``lo`` and ``hi`` are integer literals (``hi`` either in
  the condition or as a carried value the body passes through unchanged).
  Anything else is data dependent.
  """
  parts = while_parts(eqn)
  cond, body = parts.cond.jaxpr, parts.body.jaxpr
  if len(cond.eqns) != 1 or primitive_name(cond.eqns[0]) != "lt":
    return None
  cond_carry = list(cond.invars[parts.cond_nconsts:])
  body_carry = list(body.invars[parts.body_nconsts:])
  counter, bound = cond.eqns[0].invars
  if is_literal(counter) or counter not in cond_carry:
    return None
  position = cond_carry.index(counter)
  if not _increments_by_one(body, body_carry[position], body.outvars[position]):
    return None
  lo = literal_int(init_values[position])
  if is_literal(bound):
    hi = literal_int(bound)
  elif bound in cond_carry:
    k = cond_carry.index(bound)
    hi = literal_int(init_values[k]) if body.outvars[k] is body_carry[k] else None
  else:
    return None
  if lo is None or hi is None:
    return None
  return max(0, hi - lo)


def increments_by_one(closed: ClosedJaxpr, before: Any, after: Any) -> bool:
  """Whether ``closed`` computes its variable ``after`` as ``before + 1`` (a loop counter's step)."""
  return _increments_by_one(closed.jaxpr, before, after)


def _increments_by_one(body: Jaxpr, before: Any, after: Any) -> bool:
  for eqn in body.eqns:
    if after in eqn.outvars:
      if primitive_name(eqn) != "add":
        return False
      a, b = eqn.invars
      return (a is before and literal_int(b) == 1) or (b is before and literal_int(a) == 1)
  return False


# --- a closed jaxpr's parts ---------------------------------------------------


def equations(closed: ClosedJaxpr) -> list[Equation]:
  """The equations of ``closed``, in program order."""
  return list(closed.jaxpr.eqns)


def invars(closed: ClosedJaxpr) -> list[Any]:
  """The input variables of ``closed``."""
  return list(closed.jaxpr.invars)


def constvars(closed: ClosedJaxpr) -> list[Any]:
  """The variables ``closed`` binds to its constants."""
  return list(closed.jaxpr.constvars)


def consts(closed: ClosedJaxpr) -> list[Any]:
  """The constant values of ``closed``, one per :func:`constvars` entry."""
  return list(closed.consts)


def outvars(closed: ClosedJaxpr) -> list[Any]:
  """The output variables (or literals) of ``closed``."""
  return list(closed.jaxpr.outvars)


def input_avals(closed: ClosedJaxpr) -> list[jax.ShapeDtypeStruct]:
  """A ``ShapeDtypeStruct`` per input of ``closed`` (to trace a function of the same inputs)."""
  return [jax.ShapeDtypeStruct(aval_shape(v), aval_dtype(v)) for v in closed.jaxpr.invars]


def make_closed_jaxpr(fn: Callable[..., Any], *avals: Any, return_shape: bool = False) -> Any:
  """The closed jaxpr of ``fn`` traced at the abstract arguments ``avals`` (nothing runs); with
  ``return_shape``, also its outputs as ``ShapeDtypeStruct``s."""
  return jax.make_jaxpr(fn, return_shape=return_shape)(*avals)


def loop_body_holds(lowered: Any, ops: Sequence[str]) -> bool:
  """Whether the compiled program of ``lowered`` (a ``jax.stages.Lowered``) has any of the HLO ops ``ops`` inside
  a ``while`` loop's body (XLA names them ``.../while/body/...``); read from the compiled HLO text."""
  text = lowered.compile().as_text()
  return any(op in line and "while/body" in line for line in text.splitlines() for op in ops)


def literal_value(value: Any) -> Any:
  """The constant a literal holds."""
  return value.val




def _plain(value: Any) -> Any:
  """``value`` as nested tuples of ints/floats/strs, or raises TraceError (a TypeError)."""
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, np.dtype) or type(value).__name__.endswith("DType"):
    return str(np.dtype(value))
  if isinstance(value, (tuple, list)):
    return tuple(_plain(v) for v in value)
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, enum.Enum):  # lax.Precision, lax.DotAlgorithmPreset
    return value.name
  raise TraceError(type(value).__name__)


def simple_params(eqn: Equation) -> tuple[tuple[str, Any], ...]:
  """The params of ``eqn`` that are plain data (no jaxprs, functions, meshes)."""
  out = []
  for key, value in sorted(eqn.params.items()):
    try:
      out.append((key, _plain(value)))
    except (TypeError, ValueError):
      continue
  return tuple(out)


# How a float32 matmul's precision setting is priced: "reduced" (one pass with reduced-precision inputs:
# TF32 on NVIDIA GPUs, bfloat16 on TPUs) or "full" (float32, or several passes)
_FULL_PRECISION = {"float32", "highest"}


def f32_matmul_precision(setting: Any) -> str | None:
  """``"full"``, ``"reduced"``, or ``None`` (not set) for a dot's ``precision`` or a config value.

  ``setting``: a ``dot_general``'s ``precision`` param as traced (``None``,
  a pair of ``lax.Precision`` names, or a ``lax.DotAlgorithmPreset``
  name), or a ``jax_default_matmul_precision`` value. ``HIGHEST``,
  ``float32``, float32/float64 algorithms and multi-pass algorithms
  (``..._X3``, ``_X6``, ``_X9``) are full; ``DEFAULT``, ``HIGH`` (TF32 on
  GPUs), ``bfloat16``, ``tensorfloat32`` and one-pass algorithms are reduced.
  """
  if setting is None:
    return None
  names = [str(getattr(v, "name", v)) for v in (setting if isinstance(setting, (tuple, list)) else (setting,))]
  for name in names:
    upper = name.upper()
    if (name.lower() in _FULL_PRECISION or upper.startswith(("F32_F32", "F64")) or upper.endswith(("_X3", "_X6", "_X9"))
        or upper == "HIGHEST"):
      return "full"
  return "reduced"


def reduced_precision_f32_matmuls() -> bool:
  """Whether float32 matmuls that set no precision of their own get reduced-precision inputs.

  JAX's default does (TF32 on NVIDIA GPUs, one bfloat16 pass on TPUs);
  ``jax.default_matmul_precision("float32")`` (or ``"highest"``) asks for
  full float32.
  """
  return f32_matmul_precision(jax.config.jax_default_matmul_precision) != "full"


# --- evaluating equations -----------------------------------------------------

# :func:`inline_calls` evaluates the body of every call ``CALL_RULES`` marks inlinable in place (no autodiff
# follows a traced train step, so a custom_jvp / custom_vjp rule is never needed again, only its primal body).


def bind(eqn: Equation, invals: Sequence[Any], params: dict[str, Any] | None = None) -> list[Any]:
  """Binds ``eqn``'s primitive to ``invals`` (with ``params`` instead of its own), keeping its source info."""
  params = eqn.params if params is None else params
  bind_params = eqn.primitive.get_bind_params(params)
  name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
  with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
    out = eqn.primitive.bind(*invals, **bind_params)
  return list(out) if eqn.primitive.multiple_results else [out]


def read(env: dict[Any, Any], value: Any) -> Any:
  """The value of a variable in ``env``, or the constant of a literal."""
  return literal_value(value) if is_literal(value) else env[value]


def _eval_inlining(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any], keep: frozenset = frozenset()
                   ) -> list[Any]:
  env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    invals = [read(env, v) for v in eqn.invars]
    body = inlinable_body(eqn, keep)
    if body is not None:  # custom_vjp_call passes its consts as ordinary leading operands of call_jaxpr
      with source_info_util.extend_name_stack(_call_name(eqn)):
        out = _eval_inlining(body.jaxpr, body.consts, invals, keep)
    else:
      out = bind(eqn, invals)
    env.update(zip(eqn.outvars, out))
  return [read(env, v) for v in jaxpr.outvars]


def _call_name(eqn: Equation) -> str:
  name = eqn.params.get("name")
  return name if isinstance(name, str) and primitive_name(eqn) in ("pjit", "jit") and name[:1] != "_" else ""


def inline_calls(closed: ClosedJaxpr, keep: frozenset = frozenset()) -> ClosedJaxpr:
  """``closed`` with every jit / custom_jvp / custom_vjp / checkpoint call replaced by its body, recursively.

  The result computes the same values as one flat list of equations
  (``scan``, ``while`` and ``cond`` bodies are left as they are, and so are
  the call primitives named in ``keep``); name stacks keep the Flax module
  paths.
  """
  avals = [v.aval for v in closed.jaxpr.invars]
  fn = lambda *args: _eval_inlining(closed.jaxpr, closed.consts, args, keep)
  return jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])


def retraced(closed: ClosedJaxpr, replaced: dict[int, Callable[[Equation, dict[Any, Any]], list[Any]]]
             ) -> ClosedJaxpr:
  """``closed`` traced again with the equations ``replaced`` names (by ``id``) computed by their function of
  ``(equation, env)`` instead of their primitive: a rewrite of some equations, the rest as they are."""

  def run(*args):
    env = dict(zip(constvars(closed), consts(closed)))
    env.update(zip(invars(closed), args))
    for eqn in equations(closed):
      out = replaced[id(eqn)](eqn, env) if id(eqn) in replaced else bind(eqn, [read(env, v) for v in eqn.invars])
      env.update(zip(eqn.outvars, out))
    return [read(env, v) for v in outvars(closed)]

  return make_closed_jaxpr(run, *input_avals(closed))


def read_vars(closed: ClosedJaxpr) -> frozenset:
  """The variables of ``closed`` that some equation or its outputs read (an output of an equation outside it is
  unused, whether or not it is a ``DropVar``)."""
  read = {v for e in closed.jaxpr.eqns for v in e.invars if not is_literal(v)}
  read.update(v for v in closed.jaxpr.outvars if not is_literal(v))
  return frozenset(read)


def eval_equations(eqns: Sequence[Equation], env: dict[Any, Any],
                   rebind: Callable[[Equation, list[Any]], list[Any]] = None) -> None:
  """Evaluates ``eqns`` in order over ``env`` (a dict from variables to values), in place."""
  for eqn in eqns:
    invals = [read(env, v) for v in eqn.invars]
    out = bind(eqn, invals) if rebind is None else rebind(eqn, invals)
    env.update(zip(eqn.outvars, out))


def pruned(eqn: Equation, outputs: Sequence[int]) -> Equation | None:
  """``eqn`` computing only its outputs at positions ``outputs``, its dead work removed (JAX's own DCE rules:
  a scan keeps only the carries and bodies those outputs need); ``None`` if nothing of it is left."""
  from jax._src.interpreters import partial_eval as pe

  rule = pe.dce_rules.get(eqn.primitive, pe._default_dce_rule)
  _, kept = rule([j in set(outputs) for j in range(len(eqn.outvars))], eqn)
  return kept


def aval_shape(value: Any) -> tuple[int, ...]:
  return tuple(int(d) for d in getattr(value.aval, "shape", ()))


def aval_dtype(value: Any) -> Any:
  return getattr(value.aval, "dtype", None)


def is_effectful(eqn: Equation) -> bool:
  return bool(eqn.effects)


def checkpoint_call(eqn: Equation, fn: Callable[..., list[Any]], args: Sequence[Any]) -> list[Any]:
  """``fn(*args)`` as the checkpointed (``remat``) call ``eqn`` was, with its params.

  ``eqn`` is a checkpoint of a differentiated step: binding it with ``differentiated=True`` keeps its
  recomputation behind XLA's optimization barrier (``jax.checkpoint`` outside autodiff would not).
  """
  return _bind_checkpoint(eqn.primitive, fn, args, eqn, dict(eqn.params))


def recomputed_call(fn: Callable[..., list[Any]], args: Sequence[Any], like: Equation) -> list[Any]:
  """``fn(*args)`` as a differentiated ``jax.checkpoint`` call (``remat2``, ``differentiated=True``) under
  ``like``'s name stack: XLA sees its inputs through an optimization barrier, so it cannot merge the
  recomputation back into the forward pass that first made the same values (as ``jax.checkpoint`` lowers)."""
  from jax._src import ad_checkpoint

  return _bind_checkpoint(ad_checkpoint.remat_p, fn, args, like,
                          dict(prevent_cse=True, differentiated=True, policy=None))


def _bind_checkpoint(primitive: Any, fn: Callable[..., list[Any]], args: Sequence[Any], like: Equation,
                     params: dict[str, Any]) -> list[Any]:
  """Binds the checkpoint ``primitive`` with ``params`` over ``fn`` traced on ``args``, under ``like``'s name stack."""
  from jax._src.interpreters import partial_eval as pe

  avals = [jax.ShapeDtypeStruct(np.shape(a), jax.typeof(a).dtype) for a in args]
  closed = jax.make_jaxpr(lambda *xs: list(fn(*xs)))(*avals)
  params["jaxpr"] = pe.convert_constvars_jaxpr(closed.jaxpr)
  with source_info_util.user_context(like.source_info.traceback, name_stack=source_info_util.current_name_stack()
                                     + like.source_info.name_stack):
    return list(primitive.bind(*closed.consts, *args, **params))


def eval_closed(closed: ClosedJaxpr, args: Sequence[Any]) -> list[Any]:
  """The outputs of ``closed`` on ``args``, each equation bound with its source info (nothing inlined)."""
  env: dict[Any, Any] = dict(zip(closed.jaxpr.constvars, closed.consts))
  env.update(zip(closed.jaxpr.invars, args))
  eval_equations(closed.jaxpr.eqns, env)
  return [read(env, v) for v in closed.jaxpr.outvars]


def scan_as(eqn: Equation, body: Callable[[Any, Any], Any], init: Any, xs: Any, *, length: int, reverse: bool
            ) -> tuple[Any, Any]:
  """``jax.lax.scan(body, init, xs)`` under the scan equation ``eqn``'s name stack (its phase stays its own)."""
  with source_info_util.user_context(eqn.source_info.traceback, name_stack=source_info_util.current_name_stack()
                                     + eqn.source_info.name_stack):
    return jax.lax.scan(body, init, xs, length=length, reverse=reverse)


def draw_is_sliceable(eqn: Equation) -> bool:
  """Whether :func:`random_bits_slice` can draw a slice of the ``random_bits`` equation ``eqn``."""
  import math

  impl = getattr(aval_dtype(eqn.invars[0]), "_impl", None)  # a typed key's PRNG implementation
  return (bool(jax.config.jax_threefry_partitionable) and eqn.params["bit_width"] in (8, 16, 32)
          and math.prod(eqn.params["shape"]) < 2**32 and aval_shape(eqn.invars[0]) == ()
          and getattr(impl, "name", None) == "threefry2x32")


def random_bits_slice(key: Any, bit_width: int, shape: Sequence[int], dim: int, start: Any, size: int) -> Any:
  """``random_bits(key, bit_width, shape)[..., start:start + size, ...]`` (along ``dim``), drawn directly.

  With JAX's partitionable threefry (``jax_threefry_partitionable``, the default) every element's bits
  are ``threefry2x32(key, its flat index)``, so the slice needs only its own indices. Returns ``None``
  where that does not hold: another PRNG, a batch of keys, 64-bit draws, or 2**32 elements or more.
  """
  import math

  from jax import lax
  from jax.extend.random import threefry2x32_p

  if (not jax.config.jax_threefry_partitionable or np.shape(key) != () or bit_width not in (8, 16, 32)
      or math.prod(shape) >= 2**32 or str(jax.random.key_impl(key)) != "threefry2x32"):
    return None
  strides = [math.prod(shape[j + 1:]) for j in range(len(shape))]
  sliced = tuple(size if j == dim else n for j, n in enumerate(shape))
  flat = lax.convert_element_type(start, np.uint32) * np.uint32(strides[dim])
  for j, stride in enumerate(strides):
    flat = flat + lax.broadcasted_iota(np.uint32, sliced, j) * np.uint32(stride)
  data = jax.random.key_data(key)
  bits1, bits2 = threefry2x32_p.bind(data[0], data[1], lax.full(sliced, 0, np.uint32), flat)
  bits = bits1 ^ bits2
  return bits if bit_width == 32 else lax.convert_element_type(bits, np.dtype(f"uint{bit_width}"))


def _trace_key_state() -> Any:
  """A value of JAX's own trace context (part of every ``jax.jit`` cache key) that hetspmd sets, or None where
  this JAX has no such states."""
  try:
    from jax._src import config as jax_config

    return jax_config.config_ext.Config("hetspmd_trace_key", "", include_in_jit_key=True,
                                        include_in_trace_context=True)
  except (ImportError, AttributeError, TypeError):
    return None


_TRACE_KEY = _trace_key_state()


@contextlib.contextmanager
def trace_key(value: str):
  """Within: ``value`` is part of JAX's trace context, so a ``jax.jit``-ed function the step calls (a user's
  jitted ``train_step``) is traced afresh for each ``value`` instead of reusing a trace made under another (a
  remat policy that ``hetspmd.value_and_grad`` reads when it is traced)."""
  if _TRACE_KEY is None:
    yield
    return
  previous = _TRACE_KEY.swap_local(value)
  try:
    yield
  finally:
    _TRACE_KEY.set_local(previous)
