"""Cost model: per-device compute time and live memory of a traced step.

Compute is a roofline per node: ``max(FLOPs / (peak × efficiency),
(bytes read / read bandwidth + bytes written / write bandwidth) /
efficiency)``, bytes counted after XLA-style loop fusion
(:mod:`hetspmd.passes.costing.fusion`; the two bandwidths are
:class:`~hetspmd.hardware.devices.DeviceSpec`'s, equal unless profiled). A
microbatch after the first writes its values of at most the spec's
``cache_bytes`` at its ``cache_write_bandwidth``: they land in cache, in
memory the step has already touched; the first microbatch writes every value
at the memory rate (on CPUs, a program's fresh pages fault in on first
write). Each node uses the peak for its dtype
(bf16/fp16 peaks for low-precision contractions) and the spec's
``efficiency`` (:mod:`hetspmd.hardware.efficiency`): a matmul whose peak is
above the float32 one runs on matrix units, at ``efficiency.matrix``, others
at ``efficiency.vector``, memory traffic at ``efficiency.memory``. Measured
specs (``hetspmd profile``) already hold achieved rates: efficiency 1.

Memory is the peak of live intermediate values over the graph in program
order (a value lives from its producer to its last consumer; step outputs
to the end), not counting the step's inputs, which the caller accounts for
by role (parameters, optimizer state, batch).

A step is traced at two batch sizes and every node's FLOPs and bytes are
fitted linearly in the batch (:class:`StepProfile`), so the search can cost
any microbatch size without tracing again. The profile keeps both traces,
so that :mod:`hetspmd.passes.sharding.strategies` can cost tensor-parallel choices
per node with the same fits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

import numpy as np

from hetspmd.errors import InvalidValueError
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes import remat
from hetspmd.passes.costing.fusion import FUSIBLE, REDUCTIONS, fused_traffic, largest_written
from hetspmd.passes.ir import Graph, Role, Source

ACCUMULATOR_BYTES = 4  # gradients are accumulated over microbatches in float32
MATMUL_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})
_LOW_PRECISION = ("bfloat16", "float16")


class Device(Protocol):
  """What the cost model reads of a device kind (:class:`hetspmd.hardware.devices.DeviceSpec` is one).

  Peaks in FLOP/s, rates in bytes/s; ``measured``: the numbers are achieved rates (efficiency 1);
  ``cache_bytes``: the largest value a kernel writes into cache (None: no cache rate);
  ``efficiency``: the fractions of those peaks and rates reached (all 1 when ``measured``).
  """

  @property
  def fp32_flops(self) -> float: ...

  @property
  def bf16_flops(self) -> float: ...

  @property
  def float16_flops(self) -> float: ...

  @property
  def measured(self) -> bool: ...

  @property
  def cache_bytes(self) -> int | None: ...

  @property
  def read_rate(self) -> float: ...

  @property
  def write_rate(self) -> float: ...

  @property
  def cached_write_rate(self) -> float: ...

  def f32_matmul_flops(self, reduced_precision: bool = True) -> float: ...

  @property
  def efficiency(self) -> Any:
    """Fractions of peak reached: ``.matrix``, ``.vector``, ``.memory`` (:class:`hetspmd.hardware.efficiency.Efficiency`)."""


def peak_live_bytes(graph: Graph, nodes: Sequence[int] | None = None, hand_on: bool = True) -> int:
  """Peak bytes of intermediate values live at once, in program order.

  ``nodes``: only those nodes (ascending ids) run, as one microbatch's
  forward and backward pass inside the step's loop. A value made before
  them and read by them is live from their start to its last use among
  them; a value they make that is used after them (a gradient, read by the
  update) stays live to the end of their run, or, with ``hand_on=False``,
  takes no room in it (it goes straight into the step's accumulator).
  """
  run = list(range(len(graph.nodes))) if nodes is None else list(nodes)
  if not run:
    return 0
  inside, end = set(run), run[-1]
  nbytes = value_bytes(graph)
  last: dict[tuple[int, int], int] = {}       # value -> the node after which it is dead
  entering: dict[tuple[int, int], int] = {}   # made before the run, read in it -> bytes
  after: set[tuple[int, int]] = set()         # read after the run (or a step output)
  for node in graph.nodes:
    for ref in node.operands:
      if ref.source is not Source.NODE:
        continue
      key = (ref.index, ref.output)
      if node.id in inside:
        if ref.index not in inside:
          entering.setdefault(key, nbytes(key))
        last[key] = max(last.get(key, -1), node.id)
      elif node.id > end:
        after.add(key)
  after.update((out.source.index, out.source.output) for out in graph.outputs if out.source.source is Source.NODE)
  for key in after:  # handed on: live to the end of the run, or (hand_on=False) only while the run reads it
    if key in entering or key[0] in inside and hand_on:
      last[key] = end
  frees: dict[int, int] = {}
  for key, dead in last.items():
    frees[dead] = frees.get(dead, 0) + nbytes(key)
  live = peak = sum(entering.values())
  for i in run:
    node = graph.nodes[i]
    live += sum(nbytes((node.id, k)) for k in range(len(node.outputs)) if (node.id, k) in last)
    peak = max(peak, live)
    live -= frees.get(node.id, 0)
  return peak


def value_bytes(graph: Graph):
  """``key -> bytes`` of a graph value ``(node, output)``: a scan's stacked output is its body's value once per
  iteration (the body's node outputs are one iteration's)."""
  stacked: dict[tuple[int, int], int] = {}
  for scan in graph.scans:
    for ref in scan.results[scan.num_carry:]:
      if ref.source is Source.NODE:
        stacked[(ref.index, ref.output)] = scan.length
  return lambda key: graph.nodes[key[0]].outputs[key[1]].nbytes * stacked.get(key, 1)


def _microbatch_nodes(graph: Graph) -> list[int] | None:
  nodes = [n.id for n in graph.nodes if n.phase in ("forward", "backward")]
  return nodes or None


def microbatch_peak_bytes(graph: Graph) -> int:
  """Peak live bytes of one microbatch: its forward and backward pass.

  Its gradients take no room of their own: the step's loop adds each into
  the float32 accumulator as it is made (counted apart by the search, like
  the state), and XLA writes it there. (On 8 CPU devices the MLP's compiled
  step holds the accumulator and 17 MB besides during its loop, not a
  second 40 MB of gradients.) The update runs once, after the loop; its new
  state takes the donated buffers of the old. A step with no differentiated
  part is one microbatch.
  """
  return peak_live_bytes(graph, _microbatch_nodes(graph), hand_on=False)


def layer_segments(small: Graph, large: Graph) -> tuple[remat.Segment, ...]:
  """What remat ``"layers"`` recomputes of the step traced as ``small`` and ``large`` (two batch sizes, one
  structure): :func:`hetspmd.passes.remat.segments` over the graph's nodes, a value per-example when
  its bytes follow the batch. (Nodes inside a loop body are read saved, as the rewrite keeps a scan whole.)"""
  sites = [remat.Site(n.module_path, n.phase,
                      tuple((r.index, r.output) if r.source is Source.NODE else ("in", r.index)
                            for r in n.operands if r.source in (Source.NODE, Source.INPUT)),
                      tuple((n.id, k) for k in range(len(n.outputs))),
                      recomputable=not n.loops and n.primitive not in remat.COLLECTIVES) for n in small.nodes]
  sites.append(remat.Site("", "", tuple((o.source.index, o.source.output) for o in small.outputs
                                        if o.source.source is Source.NODE), ()))

  def per_example(key):
    return key[0] != "in" and small.nodes[key[0]].outputs[key[1]].nbytes != large.nodes[key[0]].outputs[key[1]].nbytes

  params = {("in", item.index): item.path for item in small.inputs_with_role(Role.PARAM)}
  return remat.segments(sites, per_example, params)


def recomputed_peak_bytes(graph: Graph, found: Sequence[remat.Segment]) -> int:
  """:func:`microbatch_peak_bytes` with each segment of ``found`` recomputed: a residual dies after its last
  forward reader; just before its layer's first backward reader the recomputation makes every member's values
  (for that moment) and keeps the residuals until their last backward reader."""
  run = _microbatch_nodes(graph)
  if not run or not found:
    return microbatch_peak_bytes(graph)
  inside, end = set(run), run[-1]
  remade = {key: s for s in found for key in s.residuals}
  nbytes = value_bytes(graph)
  last: dict = {}
  entering: dict = {}
  late: dict = {}  # residual -> its last backward reader
  for node in graph.nodes:
    if node.id not in inside:
      continue
    for ref in node.operands:
      if ref.source is not Source.NODE:
        continue
      key = (ref.index, ref.output)
      if ref.index not in inside:
        entering.setdefault(key, nbytes(key))
      if key in remade and node.phase == "backward":
        late[key] = max(late.get(key, -1), node.id)
      else:
        last[key] = max(last.get(key, -1), node.id)
  for key in remade:
    last.setdefault(key, key[0])
  for key in entering:
    last[key] = end
  births: dict[int, int] = {}
  frees: dict[int, int] = {}
  for key, dead in last.items():
    frees[dead] = frees.get(dead, 0) + nbytes(key)
  for s in found:
    working = _recompute_peak(graph, s)
    kept = sum(nbytes(k) for k in s.residuals if k in late)
    births[s.at] = births.get(s.at, 0) + working
    frees[s.at] = frees.get(s.at, 0) + working - kept
    for key, dead in late.items():
      if remade[key] is s:
        frees[dead] = frees.get(dead, 0) + nbytes(key)
  live = peak = sum(entering.values())
  for i in run:
    node = graph.nodes[i]
    live += births.get(i, 0) + sum(nbytes((node.id, k)) for k in range(len(node.outputs)) if (node.id, k) in last)
    peak = max(peak, live)
    live -= frees.get(node.id, 0)
  return peak


def _recompute_peak(graph: Graph, segment: remat.Segment) -> int:
  """Peak live bytes of ``segment``'s recomputation run alone: each member's outputs live until their last reader
  among the members, the residuals to its end."""
  members = set(segment.members)
  last: dict = {}
  for i in segment.members:
    for ref in graph.nodes[i].operands:
      if ref.source is Source.NODE and ref.index in members:
        last[(ref.index, ref.output)] = i
  keep = set(segment.residuals)
  live = peak = 0
  frees: dict[int, int] = {}
  for i in segment.members:
    for k, t in enumerate(graph.nodes[i].outputs):
      key = (i, k)
      live += t.nbytes
      if key not in keep:
        dead = last.get(key, i)
        frees[dead] = frees.get(dead, 0) + t.nbytes
    peak = max(peak, live)
    live -= frees.get(i, 0)
  return peak


@dataclasses.dataclass(frozen=True, slots=True)
class LinearCost:
  """``fixed + per_example × batch`` for one device kind."""

  fixed: float
  per_example: float

  def at(self, batch: float) -> float:
    return self.fixed + self.per_example * batch


def fit_linear(small: float, large: float, small_batch: int, large_batch: int) -> LinearCost:
  per_example = max(0.0, (large - small) / (large_batch - small_batch))
  return LinearCost(max(0.0, small - per_example * small_batch), per_example)


@dataclasses.dataclass(frozen=True)
class StepProfile:
  """What the search needs from a model: per-node costs linear in the batch.

  The step is traced at two batch sizes; node ``i`` of both traces is the
  same operation (checked), so its FLOPs and bytes are fitted as
  ``a + b × batch`` per node. Nodes whose cost does not change with the
  batch (the optimizer update) run once per step; every other node runs
  once per microbatch, including its batch-independent part (re-reading
  the weights each microbatch).
  """

  param_bytes: int
  opt_state_bytes: int
  param_count: int
  activation: LinearCost       # peak live bytes of one microbatch's forward and backward (microbatch_peak_bytes)
  flops: LinearCost            # FLOPs per step at a given batch
  per_step: np.ndarray         # bool per node
  flops_fit: np.ndarray        # [nodes, 2]: a, b
  reads_fit: np.ndarray        # [nodes, 2]: bytes read, after fusion
  writes_fit: np.ndarray       # [nodes, 2]: bytes written
  matmul: np.ndarray           # bool per node
  low_precision: np.ndarray    # bool per node
  counts: np.ndarray           # executions per step
  forward: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, bool))   # bool per node
  saveable: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, bool))  # forward matmuls without batch dims
  batched_dots: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, bool))  # forward matmuls with them
  elementwise: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, bool))  # fuse into their consumers
  saved: LinearCost = LinearCost(0.0, 0.0)  # output bytes of the saveable matmuls per microbatch
  saved_batched: LinearCost = LinearCost(0.0, 0.0)  # output bytes of the batched ones (attention's)
  # remat "layers" (hetspmd.passes.remat): the forward nodes it runs again, and the microbatch's peak
  layer_recomputed: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, bool))
  layer_activation: LinearCost | None = None  # None: no layer to recompute (the policy changes nothing)
  # per node: a float32 matmul's own precision: 1 reduced, 2 full, 0 not set (JAX's default when costed)
  f32_precision: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int8))
  # per node: both operands float16 (priced at the float16 peak, which before Ampere is not the bfloat16 one)
  float16: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, bool))
  param_leaf_sizes: tuple[int, ...] = ()  # elements of each parameter leaf (one gradient leaf each)
  param_leaf_shapes: tuple[tuple[int, ...], ...] = ()  # their shapes (which ZeRO can split over n positions)
  param_leaf_paths: tuple[str, ...] = ()  # their paths inside the step's first argument (``params/...``)
  param_reads: tuple[tuple[int, int, int], ...] = ()  # their gathers (forward, backward, iterations): _param_reads
  # the parameters the step reads only through casts to a narrower dtype, besides its update (a model computing
  # in bfloat16): their bytes, and the bytes of those casts (what ZeRO-3 group plans send and hold in the loop)
  castable_param_bytes: int = 0
  cast_param_bytes: int = 0
  write_sizes_fit: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 2)))  # largest value written
  traces: tuple[Graph, ...] = dataclasses.field(default=(), compare=False, repr=False)  # small, large
  trace_batches: tuple[int, ...] = ()
  # model-axis size -> hetspmd.passes.sharding.strategies.StrategySpace, prepared by hetspmd.passes.profile.profile_step
  strategy_spaces: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
  # (data positions, model size, tensor-parallel choice) -> hetspmd.planner.data_axis.ZeroSplit, filled by the search
  zero_splits: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  def node_seconds(self, spec: Device, batch: float, first: bool = False) -> np.ndarray:
    """Seconds of every node (all its executions in one step) at ``batch``.

    Per-microbatch nodes are costed as in a microbatch after the first
    (values of at most ``spec.cache_bytes`` written at the cache rate);
    ``first=True`` costs them as the step's first microbatch, whose every
    write goes to memory. Per-step nodes (the optimizer update) always
    write to memory.
    """
    flops = self.flops_fit[:, 0] + self.flops_fit[:, 1] * batch
    reads = self.reads_fit[:, 0] + self.reads_fit[:, 1] * batch
    writes = self.writes_fit[:, 0] + self.writes_fit[:, 1] * batch
    f32 = spec.f32_matmul_flops(jx.reduced_precision_f32_matmuls())
    if self.f32_precision.size:
      f32 = np.select([self.f32_precision == 1, self.f32_precision == 2], [spec.f32_matmul_flops(True), spec.fp32_flops], f32)
    half = np.where(self.float16, spec.float16_flops, spec.bf16_flops) if self.float16.size else spec.bf16_flops
    rate = np.where(self.low_precision, half, f32)
    efficiency = spec.efficiency
    peak = rate * np.where(rate > spec.fp32_flops, efficiency.matrix, efficiency.vector)
    compute = np.where(self.matmul, flops / peak, 0.0)
    write_rate = spec.write_rate
    if not first and spec.cache_bytes is not None and len(self.write_sizes_fit):
      largest = self.write_sizes_fit[:, 0] + self.write_sizes_fit[:, 1] * batch
      write_rate = np.where(~self.per_step & (largest <= spec.cache_bytes), spec.cached_write_rate, spec.write_rate)
    memory = (reads / spec.read_rate + writes / write_rate) / efficiency.memory
    return np.maximum(compute, memory) * self.counts

  def _seconds(self, spec: Device, batch: float, mask: np.ndarray) -> float:
    return float(np.sum(self.node_seconds(spec, batch) * mask))

  def microbatch_seconds(self, spec: Device, microbatch: int) -> float:
    """Forward and backward of one microbatch (after the step's first) on one device of kind ``spec``."""
    return self._seconds(spec, microbatch, ~self.per_step)

  def first_microbatch_extra_seconds(self, spec: Device, microbatch: int) -> float:
    """What the step's first microbatch costs over a later one: its values are written to fresh memory. A node
    inside a loop of the step (a layer scan's body, run ``count`` times) pays it once: the loop's iterations
    write into the buffers its first one touched. An elementwise node XLA fuses into its consumer
    (:attr:`elementwise`) writes no buffer of its own, so it pays none."""
    micro = ~self.per_step & ~self.elementwise if self.elementwise.size else ~self.per_step
    extra = (self.node_seconds(spec, microbatch, first=True) - self.node_seconds(spec, microbatch)) * micro
    return max(0.0, float(np.sum(extra / np.maximum(self.counts, 1))))

  def kept(self, policy: str) -> np.ndarray:
    """Per node: whether a remat policy saves its forward output for the backward pass.

    ``dots`` saves the matmuls without batch dimensions (the weight matmuls:
    ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``);
    ``all_dots`` every matmul, attention's batched ones too
    (``jax.checkpoint_policies.dots_saveable``); ``full`` nothing.
    """
    if policy == "dots":
      return self.saveable
    if policy == "all_dots":
      return self.saveable | self.batched_dots if self.batched_dots.size else self.saveable
    return np.zeros(len(self.per_step), bool)

  def saved_bytes(self, policy: str, microbatch: float) -> float:
    """Bytes of the forward outputs ``policy`` saves per microbatch (see :meth:`kept`)."""
    if policy == "dots":
      return self.saved.at(microbatch)
    if policy == "all_dots":
      return self.saved.at(microbatch) + self.saved_batched.at(microbatch)
    return 0.0

  def recomputed(self, policy: str) -> np.ndarray:
    """Per node: whether a remat policy runs it again in the backward pass of a microbatch.

    ``full`` recomputes the whole forward pass; ``dots`` and ``all_dots``
    recompute what they do not save (:meth:`kept`): ``dots`` attention's
    batched matmuls, reductions and gathers, ``all_dots`` only the
    reductions and gathers.
    Recomputed elementwise and shape operations are not counted: XLA fuses
    them into the backward kernels that consume them, which then read the
    operation's inputs instead of its saved output, at no extra pass over
    memory. (On 8 CPU devices, GPT-tiny at microbatch 4: counting them
    predicted 1.28x / 1.44x per microbatch for dots / full; measured 1.08x /
    1.19x; without them 1.09x / 1.25x.)
    """
    if policy == "none" or not self.forward.size:
      return np.zeros(len(self.per_step), bool)
    recomputed = self.forward & ~self.per_step & ~self.kept(policy)
    if policy == "layers":
      recomputed &= self.layer_recomputed if self.layer_recomputed.size else False
    return recomputed & ~self.elementwise if self.elementwise.size else recomputed

  def recompute_seconds(self, spec: Device, batch: float, policy: str) -> float:
    """Seconds of the forward work ``policy`` runs again for one microbatch."""
    return self._seconds(spec, batch, self.recomputed(policy))

  def accumulate_seconds(self, spec: Device) -> float:
    """Adding one microbatch's gradients into the float32 accumulator.

    XLA fuses the add into the gradient's producer (a GEMM that adds into
    its output), so the extra traffic is one read of the accumulator.
    """
    return ACCUMULATOR_BYTES * self.param_count / (spec.read_rate * spec.efficiency.memory)

  def zeroing_seconds(self, spec: Device) -> float:
    """Writing the float32 accumulator's zeros, once per step of a program that loops over its microbatches:
    a fresh buffer each step (a program of one microbatch everywhere folds its zeros away)."""
    return ACCUMULATOR_BYTES * self.param_count / spec.write_rate

  def step_fixed_seconds(self, spec: Device) -> float:
    """Per-step work that does not scale with the batch (the optimizer update)."""
    return self._seconds(spec, 0, self.per_step)


_PRECISION_CODE = {None: 0, "reduced": 1, "full": 2}


def _cast_params(graph: Graph) -> tuple[int, int]:
  """The bytes of the parameters the differentiated function in ``graph`` reads only through casts to one
  narrower floating dtype (the update and other work outside it aside), and the bytes of those casts. (The
  runtime decides per parameter on the analysed program, :func:`hetspmd.lowering.groups.narrow_reads`; a metric
  reading a parameter outside the differentiated function is not seen here.)"""
  readers: dict[int, list[int]] = {}
  for k, node in enumerate(graph.nodes):
    for ref in node.operands:
      if ref.source is Source.INPUT:
        readers.setdefault(ref.index, []).append(k)
  castable = casts = 0
  for item in graph.inputs_with_role(Role.PARAM):
    found = [graph.nodes[k] for k in readers.get(item.index, ()) if graph.nodes[k].phase]
    narrow = {(n.outputs[0].dtype, n.outputs[0].itemsize) for n in found if n.primitive == "convert_element_type"
              and n.outputs[0].dtype in _LOW_PRECISION}
    if found and len(narrow) == 1 and all(n.primitive == "convert_element_type" for n in found):
      ((_, size),) = narrow
      if size < item.type.itemsize:
        castable += item.type.nbytes
        casts += item.type.size * size
  return castable, casts


def _param_reads(graph: Graph) -> tuple[tuple[int, int, int], ...]:
  """Per parameter leaf, ``(forward, backward, iterations)``: the all-gathers a group that shards its parameters
  issues for it per microbatch (:class:`hetspmd.lowering.param_shards.ParamShards`), forward and backward apart,
  and the iterations of the loop that reads it (1 outside loops). Each equation of the differentiated function
  that reads the leaf gathers it whole. Example-free work on the parameters alone (a cast, a reshape) is not a
  reader: its own readers stand for it. A loop (a layer scan) gathers one slice of it per iteration, shared by
  every reader in its body: ``iterations`` gathers of ``1/iterations`` of it per loop and pass."""
  params = {item.index for item in graph.inputs_with_role(Role.PARAM)}
  readers: dict[tuple[Source, int], list[int]] = {}
  derived: set[int] = set()
  for k, node in enumerate(graph.nodes):
    refs = [ref for ref in node.operands if ref.source in (Source.INPUT, Source.NODE)]
    for ref in refs:
      readers.setdefault((ref.source, ref.index), []).append(k)
    if refs and all(ref.index in (params if ref.source is Source.INPUT else derived) for ref in refs):
      derived.add(node.id)

  def reads(key: tuple[Source, int], looped: dict) -> tuple[int, int]:
    forward = backward = 0
    for k in readers.get(key, ()):
      node = graph.nodes[k]
      if not node.phase or node.loops in looped:
        continue
      if node.id in derived:
        f, b = reads((Source.NODE, node.id), looped)
      else:
        if node.loops:  # the loop's one gather per iteration serves every reader in it
          looped[node.loops] = node.count
        f, b = (node.count, 0) if node.phase == "forward" else (0, node.count)
      forward, backward = forward + f, backward + b
    return forward, backward

  out = []
  for item in graph.inputs_with_role(Role.PARAM):
    looped: dict = {}
    forward, backward = reads((Source.INPUT, item.index), looped)
    out.append((forward, backward, max(looped.values(), default=1)))
  return tuple(out)


def step_profile(small: Graph, large: Graph, small_batch: int, large_batch: int) -> StepProfile:
  """Fits a :class:`StepProfile` from the step traced at two batch sizes."""
  if [n.primitive for n in small.nodes] != [n.primitive for n in large.nodes]:
    raise InvalidValueError("the two traces differ in structure; trace the step at two batch sizes of one program")

  def fit(values_small, values_large):
    a, b = np.asarray(values_small, float), np.asarray(values_large, float)
    slope = (b - a) / (large_batch - small_batch)
    return np.stack([a - slope * small_batch, slope], axis=1)

  flops_fit = fit([n.flops for n in small.nodes], [n.flops for n in large.nodes])
  forward = np.array([n.phase == "forward" for n in small.nodes], bool)
  saveable = forward & np.array([n.primitive == "dot_general" and not n.param("dimension_numbers")[1][0]
                                 for n in small.nodes], bool)
  batched_dots = forward & np.array([n.primitive == "dot_general" for n in small.nodes], bool) & ~saveable

  def saved(mask):
    return [sum(g.nodes[i].outputs[0].nbytes * g.nodes[i].count for i in np.flatnonzero(mask)) for g in (small, large)]

  saved_weight, saved_batched = saved(saveable), saved(batched_dots)
  (reads_small, writes_small), (reads_large, writes_large) = fused_traffic(small), fused_traffic(large)
  reads_fit, writes_fit = fit(reads_small, reads_large), fit(writes_small, writes_large)
  write_sizes_fit = fit(largest_written(small), largest_written(large))
  per_step = (np.abs(flops_fit[:, 1]) < 1e-12) & (np.abs(reads_fit[:, 1]) < 1e-12) & (np.abs(writes_fit[:, 1]) < 1e-12)
  castable, casts = _cast_params(small)
  layers = layer_segments(small, large)
  layer_recomputed = np.zeros(len(small.nodes), bool)
  layer_recomputed[[i for s in layers for i in s.members]] = True
  return StepProfile(
      layer_recomputed=layer_recomputed,
      layer_activation=fit_linear(recomputed_peak_bytes(small, layers), recomputed_peak_bytes(
          large, layer_segments(large, small)), small_batch, large_batch) if layers else None,
      param_bytes=small.bytes_with_role(Role.PARAM),
      opt_state_bytes=small.bytes_with_role(Role.OPT_STATE),
      param_count=small.elements_with_role(Role.PARAM),
      param_leaf_sizes=tuple(i.type.size for i in small.inputs_with_role(Role.PARAM)),
      param_leaf_shapes=tuple(tuple(i.type.shape) for i in small.inputs_with_role(Role.PARAM)),
      param_leaf_paths=tuple(i.path.split("/", 1)[-1] for i in small.inputs_with_role(Role.PARAM)),
      param_reads=_param_reads(small),
      write_sizes_fit=write_sizes_fit,
      activation=fit_linear(microbatch_peak_bytes(small), microbatch_peak_bytes(large), small_batch, large_batch),
      flops=fit_linear(small.total_flops, large.total_flops, small_batch, large_batch),
      per_step=per_step,
      castable_param_bytes=castable,
      cast_param_bytes=casts,
      flops_fit=flops_fit,
      reads_fit=reads_fit,
      writes_fit=writes_fit,
      matmul=np.array([n.primitive in MATMUL_PRIMITIVES for n in small.nodes]),
      low_precision=np.array([all(t.dtype in _LOW_PRECISION for t in n.inputs[:2]) for n in small.nodes]),
      float16=np.array([all(t.dtype == "float16" for t in n.inputs[:2]) for n in small.nodes], bool),
      f32_precision=np.array([_PRECISION_CODE[jx.f32_matmul_precision(n.param("precision"))] for n in small.nodes],
                             np.int8),
      counts=np.array([n.count for n in small.nodes], float),
      forward=forward,
      saveable=saveable,
      elementwise=np.array([n.primitive in FUSIBLE and n.primitive not in REDUCTIONS for n in small.nodes], bool),
      batched_dots=batched_dots,
      saved=fit_linear(saved_weight[0], saved_weight[1], small_batch, large_batch),
      saved_batched=fit_linear(saved_batched[0], saved_batched[1], small_batch, large_batch),
      traces=(small, large),
      trace_batches=(small_batch, large_batch),
  )
