"""Front end: a JAX function and example arguments to a :class:`Graph`.

``trace(fn, *args)`` traces ``fn`` under ``jax.jit`` with abstract arguments
(concrete arrays are replaced by ``ShapeDtypeStruct``s first, so nothing is
allocated or computed), then walks the jaxpr once:

* call-like equations (the primitives of ``_jax_adapter.CALL_RULES``:
  ``jit``, ``closed_call``, ``custom_jvp_call``, ``custom_vjp_call``,
  ``remat``, ...) are inlined;
* ``scan`` bodies are inlined once, their nodes' ``count`` multiplied by the
  scan length; a ``while`` written as ``for i in range(lo, hi)`` with literal
  bounds is treated the same way; any other ``while`` is costed as one
  iteration and recorded in ``Graph.loops`` with ``data_dependent=True``;
* ``cond`` contributes its most expensive branch (by FLOPs);
* every other equation becomes a node costed by :mod:`hetspmd.passes.costing.flops`;
  primitives without a rule get the default rule and are listed in
  ``Graph.unknown_primitives``;
* any other primitive that carries a jaxpr in its params (found by scanning
  the params, :func:`~hetspmd.passes._jax_adapter.nested_jaxprs`) and has no
  cost rule of its own (as ``scatter-add`` has for its combiner) raises
  :class:`~hetspmd.errors.UnsupportedPrimitiveError`: its body cannot be
  costed as one node;
* host callbacks and debug prints raise :class:`UnpartitionableError` naming
  the primitive and its Flax module path.
"""

from __future__ import annotations

import dataclasses

import inspect
from typing import Any, Callable, Mapping, Sequence

import jax

from hetspmd._pytree import key_name, path_components, path_str
from hetspmd.errors import TraceError, UnpartitionableError
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.costing import flops as flops_rules
from hetspmd.passes.ir import (Edge, Graph, GraphInput, GraphOutput, Loop, Node, ScanCall, Source, TensorType, ValueRef,
                               totals)
from hetspmd.passes.frontend.layers import group_layers
from hetspmd.passes.frontend.roles import Leaf, assign_roles

# Primitives whose effects cannot be split across devices.
UNPARTITIONABLE = frozenset({"io_callback", "debug_callback", "debug_print", "outside_call", "host_callback"})

_LITERAL = ValueRef(Source.LITERAL, 0)


def trace(fn: Callable[..., Any], *args: Any, roles: Mapping[int | str, Any] | None = None, **kwargs: Any) -> Graph:
  """Traces ``fn(*args, **kwargs)`` to the passes IR without running it.

  Args:
    fn: the step to analyse, e.g. ``train_step(state, batch)``.
    *args, **kwargs: example arguments; arrays or ``jax.ShapeDtypeStruct``
      pytrees (abstract arguments allocate nothing).
    roles: optional map from an argument index or an input path prefix
      (``"state/opt_state"``) to a role name (``param``, ``opt_state``,
      ``batch``, ``rng``, ``other``). Unmapped inputs get inferred roles.

  Returns:
    A frozen :class:`hetspmd.passes.Graph`.
  """
  if not callable(fn):
    raise TraceError(f"trace() needs a callable step function, got {type(fn).__name__}: {fn!r}")
  abstract_args, abstract_kwargs = jx.to_abstract(args), jx.to_abstract(kwargs)
  try:
    closed, out_info = jx.trace_to_jaxpr(fn, abstract_args, abstract_kwargs)
  except (UnpartitionableError, TraceError):
    raise
  except (TypeError, ValueError) as e:
    raise TraceError(f"could not trace {_name(fn)} with the given arguments: {e}") from e
  leaves = _input_leaves(fn, abstract_args, abstract_kwargs)
  invars = jx.invars(closed)
  if len(invars) != len(leaves):
    raise TraceError(f"{_name(fn)}: {len(leaves)} input leaves but the jaxpr takes {len(invars)}")
  input_roles = assign_roles(leaves, len(args), roles)
  inputs = tuple(
      GraphInput(i, leaf.path_str, tensor_type(var), role)
      for i, (leaf, var, role) in enumerate(zip(leaves, invars, input_roles)))

  builder = _Builder()
  out_refs = builder.run(closed, [ValueRef(Source.INPUT, i) for i in range(len(inputs))], prefix="", count=1, loops=())
  out_paths = [_path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(out_info)[0]]
  outputs = tuple(
      GraphOutput(i, out_paths[i] if i < len(out_paths) else f"out{i}", tensor_type(var), ref)
      for i, (var, ref) in enumerate(zip(jx.outvars(closed), out_refs)))
  return dataclasses.replace(builder.graph(inputs, outputs), jaxpr=closed)


class _Builder:
  """Accumulates nodes while walking a jaxpr; used once per trace."""

  def __init__(self):
    self.nodes: list[Node] = []
    self.loops: list[Loop] = []
    self.scans: list[ScanCall] = []
    self.unknown: set[str] = set()
    self.num_consts = 0
    self.phase = ""  # of the enclosing call: its body's equations may not say it themselves

  def graph(self, inputs: tuple[GraphInput, ...], outputs: tuple[GraphOutput, ...]) -> Graph:
    nodes = tuple(self.nodes)
    flops, trans, nbytes = totals(nodes)
    return Graph(
        nodes=nodes,
        edges=_edges(nodes),
        inputs=inputs,
        outputs=outputs,
        layers=group_layers(nodes),
        loops=tuple(self.loops),
        unknown_primitives=tuple(sorted(self.unknown)),
        total_flops=flops,
        total_transcendentals=trans,
        total_bytes=nbytes,
        scans=tuple(self.scans),
    )

  def run(self, closed: jx.ClosedJaxpr, operands: Sequence[ValueRef], *, prefix: str, count: int,
          loops: tuple[int, ...]) -> list[ValueRef]:
    env: dict[Any, ValueRef] = {}
    for var in jx.constvars(closed):
      env[var] = ValueRef(Source.CONST, self.num_consts)
      self.num_consts += 1
    for var, ref in zip(jx.invars(closed), operands):
      env[var] = ref
    for eqn in jx.equations(closed):
      ins = [_LITERAL if jx.is_literal(v) else env[v] for v in eqn.invars]
      outs = self.equation(eqn, ins, prefix, count, loops)
      for var, ref in zip(eqn.outvars, outs):
        if not jx.is_dropped(var):
          env[var] = ref
    return [_LITERAL if jx.is_literal(v) else env[v] for v in jx.outvars(closed)]

  def equation(self, eqn, ins: list[ValueRef], prefix: str, count: int, loops: tuple[int, ...]) -> list[ValueRef]:
    name = jx.primitive_name(eqn)
    path = jx.module_path(eqn, prefix)
    if name in UNPARTITIONABLE:
      raise UnpartitionableError(
          f"{name} in module {path or '(top level)'} at {jx.user_location(eqn)}: host callbacks and debug "
          "prints cannot be partitioned across devices; remove it from the step or move it outside")
    enclosing = self.phase
    self.phase = jx.phase(eqn) or enclosing
    try:
      body = jx.call_body(eqn)
      if body is not None:
        return self.run(body, ins, prefix=path, count=count, loops=loops)
      structured = _STRUCTURED.get(name)
      if structured is not None:
        return structured(self, eqn, ins, path, count, loops)
      if jx.has_nested_jaxpr(eqn) and name not in flops_rules.COST_RULES:  # a body no rule costs: never a leaf
        raise jx.unsupported_body(eqn, path)
      return self.leaf(eqn, ins, path, count, loops)
    finally:
      self.phase = enclosing

  def leaf(self, eqn, ins: list[ValueRef], path: str, count: int, loops: tuple[int, ...]) -> list[ValueRef]:
    name = jx.primitive_name(eqn)
    in_types = tuple(tensor_type(v) for v in eqn.invars)
    out_types = tuple(tensor_type(v) for v in eqn.outvars)
    params = jx.simple_params(eqn)
    cost, known = flops_rules.cost_of(name, in_types, out_types, dict(params))
    if not known:
      self.unknown.add(name)
    node = Node(
        id=len(self.nodes), primitive=name, inputs=in_types, outputs=out_types, operands=tuple(ins),
        params=params, flops=cost.flops, transcendentals=cost.transcendentals, bytes_read=cost.bytes_read,
        bytes_written=cost.bytes_written, module_path=path, location=jx.user_location(eqn), count=count,
        loops=loops, phase=self.phase)
    self.nodes.append(node)
    return [ValueRef(Source.NODE, node.id, k) for k in range(len(out_types))]

  def new_loop(self, eqn, trip_count: int, data_dependent: bool, path: str, loops: tuple[int, ...]) -> tuple[int, ...]:
    loop = Loop(len(self.loops), jx.primitive_name(eqn), trip_count, data_dependent, path, jx.user_location(eqn),
                loops[-1] if loops else None)
    self.loops.append(loop)
    return loops + (loop.id,)


def _scan(builder: _Builder, eqn, ins, path, count, loops):
  parts = jx.scan_parts(eqn)
  inner = builder.new_loop(eqn, parts.length, False, path, loops)
  outs = builder.run(parts.body, ins, prefix=path, count=count * parts.length, loops=inner)
  if not loops:  # where the layer-stack finder looks
    builder.scans.append(ScanCall(inner[-1], parts.reverse, parts.length, parts.num_consts, parts.num_carry,
                                  builder.phase, tuple(ins), tuple(tensor_type(v) for v in eqn.invars), tuple(outs)))
  return outs


def _while(builder: _Builder, eqn, ins, path, count, loops):
  parts = jx.while_parts(eqn)
  trips = jx.static_while_trip_count(eqn, eqn.invars[parts.cond_nconsts + parts.body_nconsts:])
  data_dependent = trips is None
  trips = 1 if trips is None else trips
  inner = builder.new_loop(eqn, trips, data_dependent, path, loops)
  cond_consts = ins[:parts.cond_nconsts]
  body_consts = ins[parts.cond_nconsts:parts.cond_nconsts + parts.body_nconsts]
  carry = ins[parts.cond_nconsts + parts.body_nconsts:]
  builder.run(parts.cond, cond_consts + carry, prefix=path, count=count * trips, loops=inner)
  return builder.run(parts.body, body_consts + carry, prefix=path, count=count * trips, loops=inner)


def _cond(builder: _Builder, eqn, ins, path, count, loops):
  branches = jx.cond_branches(eqn)
  costs = [_branch_flops(b, ins[1:]) for b in branches]
  heaviest = branches[costs.index(max(costs))]
  return builder.run(heaviest, ins[1:], prefix=path, count=count, loops=loops)


def _branch_flops(branch: jx.ClosedJaxpr, operands: Sequence[ValueRef]) -> float:
  probe = _Builder()
  probe.run(branch, operands, prefix="", count=1, loops=())
  return totals(probe.nodes)[0]


_STRUCTURED = {"scan": _scan, "while": _while, "cond": _cond}


def _edges(nodes: Sequence[Node]) -> tuple[Edge, ...]:
  return tuple(
      Edge(ref.index, node.id, node.inputs[k].nbytes)
      for node in nodes
      for k, ref in enumerate(node.operands)
      if ref.source is Source.NODE)


_TYPE_CACHE: dict[Any, TensorType] = {}


def tensor_type(var: Any) -> TensorType:
  """The IR type of a jaxpr variable (cached per abstract value)."""
  aval = jx.aval_of(var)
  try:
    return _TYPE_CACHE[aval]
  except KeyError:
    pass
  except TypeError:  # an unhashable abstract value
    return TensorType(*jx.describe_aval(aval))
  if len(_TYPE_CACHE) > 65536:
    _TYPE_CACHE.clear()
  typ = _TYPE_CACHE[aval] = TensorType(*jx.describe_aval(aval))
  return typ


def _name(fn: Callable[..., Any]) -> str:
  return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _path_str(path: Sequence[Any]) -> str:
  return path_str(path) or "out"


def _arg_names(fn: Callable[..., Any], num_args: int) -> list[str]:
  try:
    params = list(inspect.signature(fn).parameters.values())
  except (TypeError, ValueError):
    params = []
  names = []
  for i in range(num_args):
    p = params[i] if i < len(params) else None
    if p is not None and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
      names.append(p.name)
    else:
      names.append(f"arg{i}")
  return names


def _input_leaves(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Leaf]:
  arg_names = _arg_names(fn, len(args))
  variable_types = _variable_types((args, kwargs))
  leaves = []
  for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
    top, position = path[0].idx, key_name(path[1])
    argnum = int(position) if top == 0 else None
    head = arg_names[argnum] if argnum is not None else position
    dtype = str(getattr(leaf, "dtype", type(leaf).__name__))
    leaves.append(Leaf((head,) + path_components(path[2:]), argnum, dtype,
                       variable_types.get(jax.tree_util.keystr(path[:-1]))))
  return leaves


def _variable_types(tree: Any) -> dict[str, str]:
  """keystr of each NNX variable in ``tree`` → its class name."""
  try:
    from flax import nnx
  except ImportError:  # flax is a dependency, but keep tracing plain JAX working
    return {}
  is_var = lambda x: isinstance(x, nnx.Variable)
  found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_var)[0]
  return {jax.tree_util.keystr(p): _variable_kind(type(v), nnx) for p, v in found if is_var(v)}


def _variable_kind(cls: type, nnx: Any) -> str:
  """``Param`` or ``OptState`` for subclasses of those, else the class name."""
  for base in (nnx.Param, nnx.OptState):
    if issubclass(cls, base):
      return base.__name__
  return cls.__name__
