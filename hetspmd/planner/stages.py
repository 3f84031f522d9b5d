"""Pipeline-stage plans for a step whose model scans its layers: priced with the search's cost pieces, and ranked.

A step's profile (:func:`hetspmd.passes.profile.profile_step`) holds the scan over layers as nodes inside two
loops of the same trip count ``L``: the forward body and its transpose. A stage plan
(:func:`hetspmd.planner.building.plan_for` with ``stages``, run by :mod:`hetspmd.lowering.staged`) is priced as that program
runs:

* per microbatch of ``m`` examples on each stage's slowest device kind: a layer's forward and backward
  (the loops' node seconds over ``L``), the work before the stack (modules ahead of it in forward order:
  the embedding) on the first stage, its gradient there too, and everything else per microbatch (the
  head, the loss, their gradients, work outside any module) on the last stage;
* ``M + S - 1`` lockstep forward ticks (``M`` the most microbatches a data position runs), each as long as
  its slowest stage, then as many backward ticks;
  each tick also sends one microbatch's activations (the bytes the stack's forward reads from before
  it, per example) between neighbouring stages: over the cluster's inter-host link, all of a host's
  devices of a stage sharing it;
* after the ticks: each stage's block of the stacked gradients all-reduced over its own devices, the
  other gradients over every device, and the optimizer update on each device's share of the state;
* memory: the state (the stack's share of a stage, the rest whole), float32 gradients, and every
  microbatch's kept layer outputs for the stage's layers (GPipe keeps them until the backward ticks),
  against the smallest device: one program holds the same buffers everywhere.

Stages are whole consecutive groups of hosts (equal device counts); the layer split minimises the
slowest tick by dynamic programming. These are predictions: the schedule itself is measured in
``benchmarks/pipeline_hetero.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from hetspmd.hardware.cluster import Cluster
from hetspmd.errors import HetSpmdError, NoLayerStackError
from hetspmd.passes.frontend import stack as layer_stack
from hetspmd.passes.ir import Source
from hetspmd.plan.counts import even_counts
from hetspmd.planner.data_axis import GRAD_BYTES, REDUCE_BYTES, WORKSPACE, allreduce_seconds


@dataclasses.dataclass(frozen=True)
class Stack:
  """Where a profile's layer stack is: node masks (per-microbatch nodes only) and bytes per example."""

  layers: int
  forward: np.ndarray   # the stack's forward body, all layers
  backward: np.ndarray  # its transpose
  first: np.ndarray     # work before the stack and its gradient (first stage)
  last: np.ndarray      # everything else per microbatch (last stage)
  carry: float          # bytes per example handed from one stage to the next (and as many back)
  kept: float           # bytes per example one layer keeps from its forward for its backward (an upper estimate)
  stack_params: float   # parameter elements of the stack
  scans: layer_stack.LayerStack | None = None  # the stack's two scans, as the lowering finds them


@dataclasses.dataclass(frozen=True)
class StagePlan:
  stages: tuple[int, ...]       # layers per stage
  hosts: tuple[tuple[int, ...], ...]  # cluster host indices of each stage
  microbatch: int
  microbatches: int             # the most any data position runs: the ticks are lockstep
  step_seconds: float
  tick_seconds: float           # one forward and one backward tick, transfers included
  transfer_seconds: float       # of one tick's sends, each way
  reduce_seconds: float
  memory_bytes: float           # per device
  grad_reduce_dtype: str = "float32"  # gradients cross the data axis (and the stages' shared leaves all devices) in it
  counts: tuple[int, ...] = ()  # microbatches per data position, as plan_for(stages=...) spreads them

  def to_json(self) -> dict:
    return {"stages": list(self.stages), "hosts": [list(h) for h in self.hosts], "microbatch": self.microbatch,
            "microbatches": self.microbatches, "counts": list(self.counts), "step_seconds": self.step_seconds,
            "tick_seconds": self.tick_seconds, "transfer_seconds": self.transfer_seconds,
            "reduce_seconds": self.reduce_seconds, "memory_bytes": self.memory_bytes,
            "grad_reduce_dtype": self.grad_reduce_dtype}


def find_stack(profile) -> Stack | None:
  """The profile's layer scan (:func:`hetspmd.passes.frontend.stack.find_layer_stack`, as the lowering finds
  it), or None when it has none (layers unrolled, or no forward scan over stacked layers and its transpose)."""
  small, large = profile.traces
  micro = ~profile.per_step
  try:
    found = layer_stack.find_layer_stack(layer_stack.sites_in_traces(small, large))
  except NoLayerStackError:
    return None
  f_ids = [i for i, node in enumerate(large.nodes) if micro[i] and node.loops == (found.forward,)]
  b_ids = [i for i, node in enumerate(large.nodes) if micro[i] and node.loops == (found.backward,)]
  if not f_ids or not b_ids:
    return None
  layers = found.length
  n = len(large.nodes)
  f_mask, b_mask = np.zeros(n, bool), np.zeros(n, bool)
  f_mask[f_ids], b_mask[b_ids] = True, True
  top = lambda node: node.module_path.split("/")[0] if node.module_path else ""
  stack_module = top(large.nodes[f_ids[0]])
  order = []
  for node in large.nodes:
    if node.phase == "forward" and top(node) and top(node) not in order:
      order.append(top(node))
  before = set(order[:order.index(stack_module)]) if stack_module in order else set()
  first = np.array([micro[i] and not f_mask[i] and not b_mask[i] and top(node) in before
                    for i, node in enumerate(large.nodes)])
  last = micro & ~f_mask & ~b_mask & ~first

  def crossing(graph):
    into, kept = {}, {}
    for i, node in enumerate(graph.nodes):
      for ref in node.operands:
        if ref.source is not Source.NODE:
          continue
        j = ref.index
        if f_mask[i] and first[j]:
          into[(j, ref.output)] = graph.nodes[j].outputs[ref.output].nbytes
        if b_mask[i] and f_mask[j]:
          kept[(j, ref.output)] = graph.nodes[j].outputs[ref.output].nbytes
    return sum(into.values()), sum(kept.values())

  (c0, k0), (c1, k1) = crossing(small), crossing(large)
  b0, b1 = profile.trace_batches
  stack_params = sum(size for size, shape in zip(profile.param_leaf_sizes, profile.param_leaf_shapes)
                     if shape and shape[0] == layers)
  # what a layer keeps: the values its backward reads from its forward, or its share of the microbatch's peak
  # live bytes (the measure the search's own memory check uses), whichever is larger
  kept = max((k1 - k0) / (b1 - b0) / layers, profile.activation.per_example / layers, 0.0)
  return Stack(int(layers), f_mask, b_mask, first, last, max(0.0, (c1 - c0) / (b1 - b0)), kept, float(stack_params),
               found)


def _stage_costs(cluster: Cluster, profile, stack: Stack, hosts: Sequence[Sequence[int]], microbatch: int) -> list:
  """Per stage, on its slowest device kind, seconds of one microbatch's: a layer's forward, a layer's backward,
  the first stage's work before the stack, its gradient, and the last stage's work."""
  costs = []
  for g in hosts:
    specs = {cluster.hosts[h].device.name: cluster.hosts[h].device for h in g}
    seconds = [profile.node_seconds(spec, microbatch) for spec in specs.values()]
    part = lambda mask: max(float(np.sum(t[mask])) for t in seconds)
    costs.append((part(stack.forward) / stack.layers, part(stack.backward) / stack.layers,
                  part(stack.first & profile.forward), part(stack.first & ~profile.forward), part(stack.last)))
  return costs


def price(cluster: Cluster, profile, stack: Stack, hosts: Sequence[Sequence[int]], stages: Sequence[int],
          microbatch: int, *, global_batch: int, costs: list | None = None, grad_reduce_dtype: str = "float32"
          ) -> StagePlan | None:
  """One stage plan's predicted step; None when it does not fit memory or the batch does not split into
  microbatches of ``microbatch``, at least one per data position. A batch the positions do not divide is
  spread as :func:`hetspmd.plan.counts.even_counts` spreads it, and runs as many ticks as the most any takes.
  ``costs``: :func:`_stage_costs` of these hosts at this microbatch, when already known; ``grad_reduce_dtype``:
  the dtype gradients cross in (:func:`hetspmd.lowering.staged` casts them for the wire, accumulation stays float32)."""
  S = len(stages)
  width = sum(cluster.hosts[h].count for h in hosts[0])
  if (any(sum(cluster.hosts[h].count for h in g) != width for g in hosts) or global_batch % microbatch
      or global_batch < width * microbatch):
    return None
  counts = even_counts(width, global_batch // microbatch)
  M = counts[0]
  first_of = np.cumsum([0] + [h.count for h in cluster.hosts])
  costs = _stage_costs(cluster, profile, stack, hosts, microbatch) if costs is None else costs
  tick_f = max(n * c[0] + (c[2] if s == 0 else 0.0) + (c[4] if s == S - 1 else 0.0)
               for s, (n, c) in enumerate(zip(stages, costs)))
  tick_b = max(n * c[1] + (c[3] if s == 0 else 0.0) for s, (n, c) in enumerate(zip(stages, costs)))
  link = cluster.inter if len(cluster.hosts) > 1 else cluster.hosts[0].intra
  share = max(cluster.hosts[h].count for g in hosts for h in g)  # a host's devices send over its one link
  transfer = share * microbatch * stack.carry / link.bandwidth + link.latency if S > 1 else 0.0
  ticks = M + S - 1
  others = profile.param_count - stack.stack_params
  block = stack.stack_params / S
  reduce = max(allreduce_seconds(cluster, [p for h in g for p in range(first_of[h], first_of[h + 1])],
                                 block * REDUCE_BYTES[grad_reduce_dtype]) for g in hosts)
  reduce += allreduce_seconds(cluster, list(range(cluster.num_devices)), others * REDUCE_BYTES[grad_reduce_dtype])
  update = max(float(np.sum(profile.node_seconds(cluster.hosts[h].device, 1)[profile.per_step]))
               for g in hosts for h in g) * (others + block) / max(profile.param_count, 1)
  step = ticks * (tick_f + tick_b + 2 * transfer) + reduce + update
  per_param = (profile.param_bytes + profile.opt_state_bytes) / max(profile.param_count, 1)
  most = max(stages)
  memory = ((others + block) * per_param + (others + stack.stack_params * most / stack.layers) * GRAD_BYTES
            + M * most * microbatch * stack.kept + microbatch * stack.carry * M)
  if memory * WORKSPACE > min(h.device.memory_bytes for h in cluster.hosts):
    return None
  return StagePlan(tuple(stages), tuple(tuple(g) for g in hosts), microbatch, M, step, tick_f + tick_b + 2 * transfer,
                   transfer, reduce, memory, grad_reduce_dtype, counts)


def split_layers(per_layer: Sequence[float], fixed: Sequence[float], layers: int) -> tuple[int, ...]:
  """Consecutive layer counts (at least one each) minimising ``max_s fixed[s] + n_s * per_layer[s]``."""
  S = len(per_layer)
  if layers < S:
    raise HetSpmdError(f"{layers} layers cannot fill {S} stages")
  counts = [1] * S
  for _ in range(layers - S):
    s = min(range(S), key=lambda k: (fixed[k] + (counts[k] + 1) * per_layer[k], k))
    counts[s] += 1
  return tuple(counts)


def search_stages(cluster: Cluster, profile, global_batch: int, top: int = 5,
                  microbatches: Sequence[int] = (1, 2, 4, 8, 16, 32),
                  grad_reduce_dtypes: Sequence[str] = ("float32",), *,
                  progress: Callable[[str], None] | None = None) -> list[StagePlan]:
  """The fastest stage plans that fit, best first; [] when the step has no layer scan or one host only.
  ``grad_reduce_dtypes``: the dtypes gradients may cross in (each plan takes the fastest); ``progress``: called
  with a line of text after each stage count."""
  stack = find_stack(profile)
  hosts = list(range(len(cluster.hosts)))
  if stack is None or len(hosts) < 2:
    return []
  found = []
  for S in range(2, min(len(hosts), stack.layers) + 1):
    if len(hosts) % S:
      continue
    groups = [hosts[k * len(hosts) // S:(k + 1) * len(hosts) // S] for k in range(S)]
    for m in microbatches:
      costs = _stage_costs(cluster, profile, stack, groups, m)
      per_layer = [c[0] + c[1] for c in costs]
      fixed = [(c[2] + c[3] if s == 0 else 0.0) + (c[4] if s == S - 1 else 0.0) for s, c in enumerate(costs)]
      stages = split_layers(per_layer, fixed, stack.layers)
      priced = [price(cluster, profile, stack, groups, stages, m, global_batch=global_batch, costs=costs,
                      grad_reduce_dtype=dtype)
                for dtype in grad_reduce_dtypes]
      priced = [p for p in priced if p is not None]
      if priced:
        found.append(min(priced, key=lambda p: p.step_seconds))
    if progress:
      progress(f"stage plans: {S} stages ({S - 1}/{min(len(hosts), stack.layers) - 1} stage counts), "
               f"{len(found)} plans fit")
  found.sort(key=lambda p: p.step_seconds)
  return found[:top]


def describe(plan: StagePlan, cluster: Cluster) -> str:
  kinds = ["+".join(f"{cluster.hosts[h].count}x{cluster.hosts[h].device.name}" for h in g) for g in plan.hosts]
  return (f"{len(plan.stages)} stages [{', '.join(kinds)}], layers {list(plan.stages)}, "
          f"{plan.microbatches}{' (some positions one fewer)' if len(set(plan.counts)) > 1 else ''} x microbatch "
          f"{plan.microbatch}"
          + (f", {plan.grad_reduce_dtype} reduction" if plan.grad_reduce_dtype != "float32" else ""))
