"""One call of a parallelized step, bound: the train state, the batch, everything else, and the Flax adapter.

A call's arguments are seen as ``pure(state, batch, rest)``: the state is a
functional step's state argument or the NNX state of its graph objects
(``nnx.split``, merged back and ``nnx.update``-d after the call, as
``nnx.jit`` does); the batch is the arguments whose arrays lead with the
global batch (or ``batch_argnums``); the rest is passed through. A
``nnx.cached_partial`` step is unbound into its function and objects.

Static arguments (:class:`StaticArgs`: the step's own ``jax.jit`` /
``nnx.jit`` ``static_argnums`` and ``static_argnames``, those given to
``parallelize``, and an unjitted step's Python ``int`` or ``bool`` found to
set a shape or a branch) arrive wrapped in :class:`Static`: not an array,
so bound into the programs as a constant and part of their key, and
unwrapped to the step's own value as it is called.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from hetspmd._dtypes import traced_dtype
from hetspmd._pytree import new_state_leaves
from hetspmd.errors import HetSpmdError, InvalidValueError
from hetspmd.passes import _jax_adapter as jx
from hetspmd.plan.state_layout import parameter_paths
from hetspmd.runtime.placement import GroupedBatch, ShardedBatch


def is_graph_node(x: Any) -> bool:
  from flax import nnx

  return nnx.graph.is_graph_node(x)


class Static:
  """A static argument's value, as ``jax.jit`` takes one: hashable, equal to another of the same type and value
  (so a new value builds programs of its own), never traced. ``where`` names the argument in messages."""

  __slots__ = ("value", "where")

  def __init__(self, value: Any, where: str):
    if not _is_hashable(value):
      raise HetSpmdError(f"the static argument {where} is a {type(value).__name__}, which is not hashable: static "
                         "arguments are bound into the programs as jax.jit binds them, keyed by value. Pass a "
                         "hashable value (a tuple for a list, a frozen dataclass for a dict), or leave the argument "
                         "out of static_argnums/static_argnames so that it is traced")
    self.value, self.where = value, where

  def __eq__(self, other: Any) -> bool:
    return (isinstance(other, Static) and type(other.value) is type(self.value)
            and bool(other.value == self.value))

  def __hash__(self) -> int:
    return hash(self.value)

  def __repr__(self) -> str:
    return f"Static({self.value!r})"


def unwrapped(x: Any) -> Any:
  """A call's argument as the step takes it: a :class:`Static`'s value, anything else as it is."""
  return x.value if isinstance(x, Static) else x


@dataclasses.dataclass(frozen=True)
class StaticArgs:
  """Which of a step's arguments are static, with ``jax.jit``'s meaning: positions ``argnums`` (counted among
  every argument the step's function takes, ``nnx.cached_partial``'s objects first) and keyword ``argnames``,
  each resolved against the signature where it has one. ``jitted``: the step is ``jax.jit``- or
  ``nnx.jit``-ed, so its own static arguments are all it takes as Python values; ``inferred``: an unjitted
  step's Python ``int``/``bool`` arguments (position or name) bound static because their trace needed them
  concrete."""

  argnums: frozenset = frozenset()
  argnames: frozenset = frozenset()
  jitted: bool = False
  inferred: tuple = ()
  names: tuple = ()  # the step's positional parameters' names, where its signature says them

  @classmethod
  def of(cls, fn: Callable[..., Any], argnums: Any, argnames: Any, bound: int) -> "StaticArgs":
    """The step's own static arguments (read from its ``jax.jit`` / ``nnx.jit``) and the ``argnums`` (counted
    after the ``bound`` objects of an ``nnx.cached_partial``) and ``argnames`` given for it."""
    own = jx.jit_static_arguments(fn)
    nums = {i + bound if i >= 0 else i for i in _ints(argnums, "static_argnums")} | set(own[0] if own else ())
    names = set(_strs(argnames)) | set(own[1] if own else ())
    params = _positional_names(fn)
    nums |= {params.index(n) for n in names if n in params}
    names |= {params[i] for i in nums if 0 <= i < len(params)}
    return cls(frozenset(nums), frozenset(names), own is not None, (), tuple(params))

  def inferring(self, key: int | str) -> "StaticArgs":
    return dataclasses.replace(self, inferred=self.inferred + (key,))

  def is_static(self, key: int | str, n_args: int) -> bool:
    if isinstance(key, str):
      return key in self.argnames or key in self.inferred
    return key in self.inferred or any(i == key or i < 0 and i + n_args == key for i in self.argnums)

  def mark(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each static argument's value wrapped in :class:`Static`."""
    if not (self.argnums or self.argnames or self.inferred):
      return args, kwargs
    args = tuple(Static(a, self.describe(i)) if self.is_static(i, len(args)) else a for i, a in enumerate(args))
    kwargs = {k: Static(v, self.describe(k)) if self.is_static(k, len(args)) else v for k, v in kwargs.items()}
    return args, kwargs

  def scalars(self, args: tuple, kwargs: dict) -> list:
    """The positions and names of the call's top-level Python ``int`` and ``bool`` arguments not static yet."""
    found = [i for i, a in enumerate(args) if type(a) in (int, bool) and not self.is_static(i, len(args))]
    return found + [k for k, v in kwargs.items() if type(v) in (int, bool) and not self.is_static(k, len(args))]

  def describe(self, key: int | str) -> str:
    if isinstance(key, str):
      return f"{key!r}"
    return f"{key} ({self.names[key]!r})" if key < len(self.names) else f"{key}"


def _ints(value: Any, what: str) -> tuple[int, ...]:
  value = () if value is None else (value,) if isinstance(value, int) else tuple(value)
  if not all(isinstance(i, int) for i in value):
    raise InvalidValueError(f"{what} must be an int or a sequence of ints, got {value!r}")
  return value


def _strs(value: Any) -> tuple[str, ...]:
  value = () if value is None else (value,) if isinstance(value, str) else tuple(value)
  if not all(isinstance(n, str) for n in value):
    raise InvalidValueError(f"static_argnames must be a str or a sequence of strs, got {value!r}")
  return value


def _positional_names(fn: Callable[..., Any]) -> list[str]:
  """The names of ``fn``'s parameters that may be passed by position, in order (none where it has no
  signature)."""
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    return []
  kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
  return [p.name for p in params if p.kind in kinds]


def is_dynamic(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, bool, int, float, complex))


def leading_sizes(tree: Any) -> list[int | None]:
  return [np.shape(x)[0] if np.ndim(x) >= 1 else None for x in jax.tree.leaves(tree) if is_dynamic(x)]


@dataclasses.dataclass(frozen=True)
class Arguments:
  """A call's positional arguments, sorted: the NNX objects (``graph_args``, split into ``graphdef`` and their
  ``state``), or a functional step's state argument (``state_argnum``); the batch arguments; the rest."""

  graph_args: tuple[int, ...]
  batch_argnums: tuple[int, ...]
  state_argnum: int | None
  graphdef: Any
  state: Any
  batch: tuple
  rest: tuple

  @classmethod
  def of(cls, step: Any, args: tuple) -> "Arguments":
    from flax import nnx

    graph_args = tuple(i for i, a in enumerate(args) if is_graph_node(a))
    batch_argnums = step.batch_argnums if step.batch_argnums is not None else find_batch(step, args, graph_args)
    for i in batch_argnums:
      if i >= len(args) or i in graph_args:
        raise InvalidValueError(f"batch_argnums={batch_argnums} names argument {i}, but the step got "
                                f"{len(args)} positional argument(s)" + (" and that one is an NNX object"
                                                                         if i in graph_args else ""))
    graphdef, state, state_argnum = None, None, None
    if graph_args:
      graphdef, state = nnx.split(tuple(args[i] for i in graph_args))
    else:
      candidates = [i for i in range(len(args)) if i not in batch_argnums and leading_sizes(args[i])]
      if not candidates:
        raise HetSpmdError("the train step got no state: pass the train state (a pytree of arrays such as a "
                           "flax TrainState, or NNX objects) as an argument beside the batch")
      state_argnum = candidates[0]
      state = args[state_argnum]
    rest = tuple(a for i, a in enumerate(args) if i not in batch_argnums and i not in graph_args and i != state_argnum)
    return cls(graph_args, tuple(batch_argnums), state_argnum, graphdef, state,
               tuple(args[i] for i in batch_argnums), rest)

  def function(self, fn: Callable[..., Any], n_args: int) -> Callable[..., Any]:
    """``fn`` as ``f(state, batch, rest, kwargs)``: see :func:`positional_function`."""
    return positional_function(fn, n_args, graph_args=self.graph_args, graphdef=self.graphdef,
                               batch_argnums=self.batch_argnums, state_argnum=self.state_argnum)


def positional_function(fn: Callable[..., Any], n_args: int, *, graph_args: tuple[int, ...], graphdef: Any,
                        batch_argnums: tuple[int, ...], state_argnum: int | None) -> Callable[..., Any]:
  """``fn`` as ``f(state, batch, rest, kwargs)``: ``batch`` the batch arguments (a tuple), ``rest`` the other
  positional arguments in order; every argument an input, none closed over. With NNX objects, ``state`` is
  theirs and ``f`` returns ``(their new state, fn's outputs)``, as ``nnx.jit`` traces them."""
  from flax import nnx

  def f(state, batch, rest, kwargs):
    args: list = [None] * n_args
    for i, b in zip(batch_argnums, batch):
      args[i] = b
    others = iter(rest)
    objects = nnx.merge(graphdef, state) if graph_args else None
    for i in range(n_args):
      if i in batch_argnums:
        continue
      if i in graph_args:
        args[i] = objects[graph_args.index(i)]
      elif i == state_argnum:
        args[i] = state
      else:
        args[i] = next(others)
    out = fn(*map(unwrapped, args), **{k: unwrapped(v) for k, v in kwargs.items()})
    if graph_args:
      return nnx.state(objects), out
    return out

  return f


@dataclasses.dataclass
class Call:
  """One call's arguments, seen as ``pure(state, batch, rest)``: the train state (a functional step's state
  argument, or the NNX state of its graph objects), the batch arguments, and everything else."""

  step: Any
  args: tuple
  kwargs: dict
  graph_args: tuple[int, ...]
  batch_argnums: tuple[int, ...]
  state_argnum: int | None
  graphdef: Any
  state: Any
  batch: ShardedBatch
  rest: tuple
  treedef: Any = None
  static: tuple = ()
  key: Any = None

  @classmethod
  def bind(cls, step: Any, args: tuple, kwargs: dict, shard: Callable[[tuple], ShardedBatch]) -> "Call":
    """``args``/``kwargs`` of a call of ``step`` (the front, its plan resolved); ``shard``: the batch arguments
    (a tuple) placed as the plan places them."""
    parts = Arguments.of(step, args)
    state = parts.state
    graph_args, batch_argnums, graphdef, state_argnum = (parts.graph_args, parts.batch_argnums, parts.graphdef,
                                                         parts.state_argnum)
    rest, batch_args = parts.rest, parts.batch
    if len(batch_args) == 1 and isinstance(batch_args[0], ShardedBatch):  # placed already: one batch argument
      sharded = ShardedBatch((batch_args[0].data,), batch_args[0].counts)
    else:
      sharded = shard(batch_args)
    call = cls(step, args, kwargs, graph_args, tuple(batch_argnums), state_argnum, graphdef, state, sharded,
               rest)
    leaves, call.treedef = jax.tree.flatten((state, sharded.data, rest, kwargs))
    call.static = tuple((i, x) for i, x in enumerate(leaves) if not is_dynamic(x))
    call._dynamic = [x for x in leaves if is_dynamic(x)]
    call._n_state = sum(1 for x in leaves[:len(jax.tree.leaves(state))] if is_dynamic(x))
    call.key = (call.treedef, tuple(aval_key(x) for x in call._dynamic), hashable(call.static), graphdef)
    return call

  @property
  def dynamic(self) -> tuple[list, list]:
    return self._dynamic[:self._n_state], self._dynamic[self._n_state:]

  @property
  def batch_inputs(self) -> tuple[int, ...]:
    n_batch = len(jax.tree.leaves(self.batch.data))
    return tuple(range(self._n_state, self._n_state + n_batch))

  @property
  def float_state_inputs(self) -> tuple[int, ...]:
    return tuple(i for i, x in enumerate(self._dynamic[:self._n_state])
                 if jnp.issubdtype(traced_dtype(x), jnp.floating))

  @property
  def param_paths(self) -> dict[int, str]:
    """``{input position: path}`` of the parameters among the step's dynamic state leaves."""
    return parameter_paths(self.state, is_dynamic)

  def inputs(self, dynamic: tuple[list, list]) -> list:
    return list(dynamic[0]) + list(dynamic[1])

  def _pure(self):
    """``flat dynamic leaves -> outputs``: the user's step as a function of arrays."""
    treedef, static = self.treedef, dict(self.static)
    f = positional_function(self.step.fn, len(self.args), graph_args=self.graph_args, graphdef=self.graphdef,
                            batch_argnums=self.batch_argnums, state_argnum=self.state_argnum)

    def pure(*dynamic):
      it = iter(dynamic)
      leaves = [static[i] if i in static else next(it) for i in range(treedef.num_leaves)]
      return f(*jax.tree.unflatten(treedef, leaves))

    return self.step.traced(pure)

  def trace(self, global_batch: int):
    """The step's closed jaxpr at the global batch, and its output tree."""
    abstract = []
    batch_ids = set(self.batch_inputs)
    for i, x in enumerate(self._dynamic):
      shape, dtype = np.shape(x), traced_dtype(x)
      if i in batch_ids:  # buffers [positions * max_count, microbatch, ...] stand for [global batch, ...]
        shape = (global_batch,) + tuple(shape[2:])
      abstract.append(jax.ShapeDtypeStruct(shape, dtype, weak_type=isinstance(x, (int, float, bool, complex))))
    closed, shapes = jx.make_closed_jaxpr(self._pure(), *abstract, return_shape=True)
    return closed, jax.tree.structure(shapes)

  def returns_state(self, out_tree: Any, closed: Any) -> bool:
    """Whether the step hands back a new state, whose buffers may then be the old state's: NNX objects, or a
    first output shaped like the state that is not its gradient (made by the backward pass). A step returning
    only gradients (``grads, loss = apply_model(state, ...)``, then an update of its own) must leave the state
    it was given alive."""
    if self.graph_args:
      return True
    first = new_state_leaves(self.state, out_tree)
    if not first:
      return False
    producer = {v: e for e in jx.equations(closed) for v in e.outvars}
    made = [producer.get(jx.outvars(closed)[i]) for i in first]
    return not all(e is not None and jx.phase(e) == "backward" for e in made)

  def skeleton(self) -> "Call":
    """This call without its values: the structure a built program reads (:meth:`inputs`, :meth:`constrain`),
    the state as shapes, so that a program kept for later calls holds none of this call's arrays alive."""
    out = copy.copy(self)
    out.args, out.kwargs, out.rest, out.batch, out._dynamic = (), {}, (), None, []
    out.state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), traced_dtype(x)) if is_dynamic(x) else x,
                             self.state)
    return out

  def constrain(self, outputs: Any, state_shardings: Any) -> Any:
    """The new state leaves of ``outputs`` held to the plan's shardings."""
    new = self.new_state(outputs)
    if new is None:
      return outputs
    return (jax.lax.with_sharding_constraint(new, state_shardings),) + tuple(outputs[1:])

  def new_state(self, outputs: Any) -> Any:
    """The new state among the program's ``outputs``, where the step hands one back (NNX objects' state, or a
    first output shaped like the state), else None."""
    if self.graph_args:
      return outputs[0]
    if isinstance(outputs, tuple) and outputs and jax.tree.structure(outputs[0]) == jax.tree.structure(self.state):
      return outputs[0]
    return None

  def finish(self, outputs: Any) -> Any:
    from flax import nnx

    if self.graph_args:
      new_state, out = outputs
      nnx.update(tuple(self.args[i] for i in self.graph_args), new_state)
      return out
    return outputs


def distinct_leaves(tree: Any) -> Any:
  """``tree`` with each leaf that is the same array as an earlier leaf copied: a buffer can be donated once (a
  state whose moving average starts as the parameters themselves holds them twice)."""
  leaves, treedef = jax.tree.flatten(tree)
  seen: set[int] = set()
  out = []
  for x in leaves:
    if isinstance(x, jax.Array) and id(x) in seen:
      x = jnp.copy(x)
    seen.add(id(x))
    out.append(x)
  return jax.tree.unflatten(treedef, out)


def aval_key(x: Any) -> Any:
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return (type(x).__name__,)
  return (tuple(np.shape(x)), str(dtype), getattr(x, "weak_type", False))


class _Same:
  """An unhashable value as part of a cache key: equal only to itself, and held, so that its id cannot pass to
  another value while the key lives."""

  def __init__(self, value: Any):
    self.value = value

  def __eq__(self, other: Any) -> bool:
    return isinstance(other, _Same) and other.value is self.value

  def __hash__(self) -> int:
    return id(self.value)


def hashable(static: tuple) -> Any:
  """``static`` (``(position, value)`` pairs) as a cache key; an unhashable value counts as itself."""
  try:
    hash(static)
    return static
  except TypeError:
    return tuple((i, x if _is_hashable(x) else _Same(x)) for i, x in static)


def _is_hashable(x: Any) -> bool:
  try:
    hash(x)
    return True
  except TypeError:
    return False


def find_batch(step: Any, args: tuple, graph_args: tuple[int, ...]) -> tuple[int, ...]:
  """The positional arguments whose every array leaf leads with the batch (or are a ShardedBatch)."""
  return batch_arguments(args, graph_args, step.global_batch, step.batch_sizes())


def batch_arguments(args: tuple, graph_args: tuple[int, ...], global_batch: int,
                    expected: set[int] | None = None) -> tuple[int, ...]:
  """The positional arguments (not NNX objects) whose every array leaf leads with one of ``expected`` examples
  (``{global_batch}`` unless given), or that are a batch placed ahead (a ShardedBatch or GroupedBatch)."""
  expected = expected or {global_batch}
  found = []
  for i, a in enumerate(args):
    if i in graph_args:
      continue
    if isinstance(a, (ShardedBatch, GroupedBatch)):
      return (i,)
    leading = leading_sizes(a)
    if leading and all(n in expected for n in leading):
      found.append(i)
  if not found:
    described = ", ".join(f"argument {i}: leading dims {sorted(set(map(str, leading_sizes(a))))[:4]}"
                          for i, a in enumerate(args) if i not in graph_args)
    sizes = " or ".join(map(str, sorted(expected)))
    where = ("the global batch" if expected == {global_batch} else
             "this process's examples, batch[step.process_examples()]")
    across = ("; across processes each passes only its own examples, known once the plan is: call "
              "step.shard_state(state) first (plan='search' traces example_batch=), then feed "
              "batch[step.process_examples()]" if jax.process_count() > 1 and expected == {global_batch} else "")
    raise HetSpmdError(f"no argument of the step is a batch of {sizes} examples (every array with a "
                       f"leading axis of {sizes}); got {described or 'no array arguments'}. Pass "
                       f"{where}, or name it with parallelize(..., batch_argnums=(i,)){across}")
  return tuple(found)


def unbound(fn: Callable[..., Any]) -> tuple[Callable[..., Any], tuple]:
  """``(f, objects)`` of ``nnx.cached_partial(f, *objects)``; ``(fn, ())`` for any other callable.

  The partial's objects are clones that hold the caller's ``Variable``s, so
  the step's updates to them reach the caller's model and optimizer.
  """
  code = getattr(fn, "__code__", None)
  if code is None or code.co_name != "cache_args_wrapper" or "flax" not in (getattr(fn, "__globals__", {})
                                                                          .get("__name__") or ""):
    return fn, ()
  free = inspect.getclosurevars(fn).nonlocals
  if "f" not in free or "cached_args" not in free:
    raise HetSpmdError("this flax version's nnx.cached_partial keeps its function and objects where hetspmd does "
                       "not look; parallelize the step itself and call it with the model and optimizer")
  return free["f"], tuple(free["cached_args"])


def static_bound(fn: Callable[..., Any], rest: tuple) -> tuple[Callable[..., Any], tuple, Any]:
  """``fn(state, batch, *rest)`` with the leaves of ``rest`` that are not arrays or numbers (a string, a config,
  a function) bound as constants, as the single program takes them: ``(fn(state, batch, arrays), (arrays,),
  a key for the bound values and where they were)``; ``fn`` and ``rest`` as they are when there are none."""
  leaves, tree = jax.tree.flatten(rest)
  fixed = {i: x for i, x in enumerate(leaves) if not is_dynamic(x)}
  if not fixed:
    return fn, rest, ()

  def bound(state, batch, arrays):
    given = iter(arrays)
    return fn(state, batch, *jax.tree.unflatten(tree, [fixed[i] if i in fixed else next(given)
                                                       for i in range(len(leaves))]))

  return bound, ([x for x in leaves if is_dynamic(x)],), (tree, hashable(tuple(fixed.items())))
