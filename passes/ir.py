"""The passes IR: a frozen, flat dataflow graph of one traced step.

A :class:`Graph` is what every later pass reads. Nodes are jaxpr equations
after inlining calls (``jit``, ``remat``, ``custom_jvp``/``custom_vjp``);
loops stay one block: a node inside a ``scan`` of length 12 appears once
with ``count == 12``. Nothing here refers to JAX objects, so a graph can be
compared, hashed, pickled and built by hand in tests.

Costs on a node are for **one** execution (``flops``, ``transcendentals``,
``bytes_read``, ``bytes_written``); ``step_*`` properties multiply by
``count``. FLOPs follow XLA's convention: a multiply-add is two FLOPs,
transcendental functions are counted apart from FLOPs.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Iterable

from hetspmd.errors import InvalidValueError, UnknownNameError


class Role(str, enum.Enum):
  """What a step input is, for sharding and memory accounting."""

  PARAM = "param"
  OPT_STATE = "opt_state"
  BATCH = "batch"
  RNG = "rng"
  OTHER = "other"


class Source(enum.Enum):
  """Where a node operand comes from."""

  INPUT = "input"      # a step input; index into Graph.inputs
  NODE = "node"        # an output of another node
  CONST = "const"      # a constant captured by the traced function
  LITERAL = "literal"  # a scalar literal in the jaxpr


@dataclasses.dataclass(frozen=True, slots=True)
class TensorType:
  shape: tuple[int, ...]
  dtype: str
  itemsize: int

  def __post_init__(self):
    if any(d < 0 for d in self.shape):
      raise InvalidValueError(f"TensorType shape must be non-negative, got {self.shape}")

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.itemsize

  def __str__(self) -> str:
    return f"{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclasses.dataclass(frozen=True, slots=True)
class ValueRef:
  source: Source
  index: int
  output: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Node:
  id: int
  primitive: str
  inputs: tuple[TensorType, ...]
  outputs: tuple[TensorType, ...]
  operands: tuple[ValueRef, ...]
  params: tuple[tuple[str, Any], ...]
  flops: float
  transcendentals: float
  bytes_read: int
  bytes_written: int
  module_path: str
  location: str
  count: int = 1
  loops: tuple[int, ...] = ()
  phase: str = ""  # "forward" / "backward" of a differentiated function, "" otherwise

  def replace(self, **changes: Any) -> "Node":
    return dataclasses.replace(self, **changes)

  def param(self, key: str, default: Any = None) -> Any:
    for k, v in self.params:
      if k == key:
        return v
    return default

  @property
  def step_flops(self) -> float:
    return self.flops * self.count

  @property
  def step_transcendentals(self) -> float:
    return self.transcendentals * self.count

  @property
  def step_bytes(self) -> int:
    return (self.bytes_read + self.bytes_written) * self.count

  def signature(self) -> tuple[Any, ...]:
    """Structure of the node, independent of its id, position and scope."""
    return (self.primitive, self.inputs, self.outputs, self.params)


@dataclasses.dataclass(frozen=True, slots=True)
class Edge:
  """Data flowing from one node's output into another node."""

  src: int
  dst: int
  nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class GraphInput:
  index: int
  path: str
  type: TensorType
  role: Role


@dataclasses.dataclass(frozen=True, slots=True)
class GraphOutput:
  index: int
  path: str
  type: TensorType
  source: ValueRef


@dataclasses.dataclass(frozen=True, slots=True)
class Loop:
  """A ``scan`` or ``while`` kept as one repeated block.

  ``trip_count`` is the number of iterations per execution of the loop;
  ``data_dependent`` loops have an unknown trip count and are costed as one
  iteration.
  """

  id: int
  primitive: str
  trip_count: int
  data_dependent: bool
  module_path: str
  location: str
  parent: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ScanCall:
  """A ``scan`` outside every loop, as :mod:`hetspmd.passes.frontend.stack` reads it to find the layer stack.

  ``loop``: the :class:`Loop` its body's nodes run in; ``phase``: ``"forward"``, ``"backward"`` or ``""``
  (as :attr:`Node.phase`); ``operands`` and ``results``: the graph values it reads and makes, in the
  scan's order (consts, carries, scanned inputs; carries, stacked outputs), with their ``operand_types``.
  """

  loop: int
  reverse: bool
  length: int
  num_consts: int
  num_carry: int
  phase: str
  operands: tuple[ValueRef, ...]
  operand_types: tuple[TensorType, ...]
  results: tuple[ValueRef, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Layer:
  """Nodes that share a Flax module path.

  ``repeat_of`` names an earlier layer with the same structure (same
  primitives, shapes and params in the same order), so a search may solve
  one and reuse the answer.
  """

  name: str
  node_ids: tuple[int, ...]
  flops: float
  transcendentals: float
  bytes: int
  repeat_of: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Graph:
  nodes: tuple[Node, ...]
  edges: tuple[Edge, ...]
  inputs: tuple[GraphInput, ...]
  outputs: tuple[GraphOutput, ...]
  layers: tuple[Layer, ...]
  loops: tuple[Loop, ...] = ()
  unknown_primitives: tuple[str, ...] = ()
  total_flops: float = 0.0
  total_transcendentals: float = 0.0
  total_bytes: int = 0
  scans: tuple[ScanCall, ...] = ()  # the scans outside every loop, in program order
  jaxpr: Any = dataclasses.field(default=None, compare=False, repr=False)  # the closed jaxpr it was read from

  def __post_init__(self):
    for position, node in enumerate(self.nodes):
      if node.id != position:
        raise InvalidValueError(f"Graph node ids must equal their positions; node at {position} has id {node.id}")
    n = len(self.nodes)
    for edge in self.edges:
      if not (0 <= edge.src < n and 0 <= edge.dst < n):
        raise InvalidValueError(f"Edge {edge} refers to a node outside 0..{n - 1}")

  def replace(self, **changes: Any) -> "Graph":
    return dataclasses.replace(self, **changes)

  def inputs_with_role(self, role: Role | str) -> tuple[GraphInput, ...]:
    role = Role(role)
    return tuple(i for i in self.inputs if i.role is role)

  def bytes_with_role(self, role: Role | str) -> int:
    return sum(i.type.nbytes for i in self.inputs_with_role(role))

  def elements_with_role(self, role: Role | str) -> int:
    return sum(i.type.size for i in self.inputs_with_role(role))

  def layer(self, name: str) -> Layer:
    for layer in self.layers:
      if layer.name == name:
        return layer
    raise UnknownNameError(f"No layer named {name!r}; layers are {[l.name for l in self.layers]}")

  @property
  def data_dependent_loops(self) -> tuple[Loop, ...]:
    return tuple(l for l in self.loops if l.data_dependent)

  def flops_by_primitive(self) -> dict[str, float]:
    totals: dict[str, float] = {}
    for node in self.nodes:
      totals[node.primitive] = totals.get(node.primitive, 0.0) + node.step_flops
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def totals(nodes: Iterable[Node]) -> tuple[float, float, int]:
  """Step FLOPs, transcendentals and bytes summed over ``nodes``."""
  flops = trans = 0.0
  nbytes = 0
  for node in nodes:
    flops += node.step_flops
    trans += node.step_transcendentals
    nbytes += node.step_bytes
  return flops, trans, nbytes
