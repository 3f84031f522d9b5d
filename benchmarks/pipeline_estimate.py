"""What uneven pipeline stages would predict on the slow-network reference clusters, next to today's best plan.

    python benchmarks/pipeline_estimate.py [--case hap-v100-p100:bert-base:2048:128 ...]

hetspmd cannot run pipeline plans yet. This script prices them with the search's own pieces, to say
whether building them would pay, and where:

* units: the step's top-level modules in forward order (``embed``, ``h_0`` ... ``h_23``, ``ln_f``,
  ``lm_head``, ``loss``), each with its forward and backward nodes of the traced graph; nodes with no
  module run on the last stage;
* a unit's seconds per microbatch on a device kind: the profile's roofline per node
  (``StepProfile.node_seconds``), the same numbers the search uses;
* a boundary between units: the bytes of the values the forward pass hands across it (the residual
  stream, masks), and as many back for their cotangents, per example (fitted over the two traces);
* stages: whole hosts, consecutive, in the cluster's order or reversed, every stage with the same device
  count; inside a stage, data parallelism split evenly (its slowest device bounds it);
* a schedule of 1F1B ticks: ``(M + S - 1)`` ticks of the slowest stage's forward and backward of one
  microbatch plus its boundary transfers (every replica of a stage sends its microbatch's activations
  through its host's link), then each stage's gradient reduction over its own devices (float32 or
  bfloat16, whichever is faster) and its share of the optimizer update; priced twice: nothing
  overlapped, and (a bound) every transfer and reduction hidden behind compute;
* the layer split: the one that minimises the slowest stage, by dynamic programming over the units;
* memory: per stage its parameters, float32 gradients and optimizer state, and the residuals of
  ``min(M, S)`` microbatches in flight (1F1B's first stage), against the smallest device of the
  cluster: one SPMD program allocates the same buffers on every device (the padded layer stack of
  DESIGN.md's mechanism 6), so no stage can hold more than the smallest device; a split that does not
  fit is skipped.

Prints, per case, the best plan the search finds today, the best pipeline estimate, its stages,
layer counts and microbatching, and the ratio. These are predictions of a cost model that has not
priced a pipeline against a measurement; they bound what building the mechanism could give.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import numpy as np

CASES = [  # (cluster, model, global batch, sequence or None)
    ("hap-v100-p100", "bert-base", 2048, 128),
    ("hap-v100-p100", "vit-b16", 2048, None),
    ("hap-v100-p100", "vgg19", 2048, None),
    ("hap-v100-p100", "bert-moe-base", 2048, 128),
    ("amp-t4-v100", "gpt2-medium", 32, 1024),
    ("amp-t4-v100", "gpt2-medium", 128, 1024),
]


@dataclasses.dataclass(frozen=True)
class Units:
  """The step's top-level modules in forward order, with their nodes, boundaries and parameter bytes."""

  names: tuple[str, ...]
  nodes: tuple[np.ndarray, ...]        # per unit: bool mask over the profile's nodes (per-microbatch ones)
  boundary: tuple[float, ...]          # bytes per example crossing after unit i (forward; as many back)
  residual: tuple[float, ...]          # bytes per example unit i keeps from its forward for its backward
  params: tuple[float, ...]            # parameter elements read by unit i's forward
  forward: tuple[np.ndarray, ...] = ()  # per unit: the forward part of ``nodes`` (recomputed by the built schedule)


def units_of(profile) -> Units:
  from hetspmd.passes.ir import Role, Source

  small, large = profile.traces
  b0, b1 = profile.trace_batches
  order: list[str] = []
  unit_of = []
  for node in large.nodes:
    top = node.module_path.split("/")[0] if node.module_path else ""
    if top and node.phase == "forward" and top not in order:
      order.append(top)
    unit_of.append(top)
  index = {name: i for i, name in enumerate(order)}
  last = len(order) - 1
  per_node = np.array([index.get(u, last) for u in unit_of])  # moduleless work runs on the last stage
  micro = ~profile.per_step
  nodes = tuple(micro & (per_node == i) for i in range(len(order)))
  is_forward = np.array([node.phase == "forward" for node in large.nodes])
  forward = tuple(mask & is_forward for mask in nodes)

  def crossing(graph):
    """Bytes handed forward across each boundary (each value once, to its last forward reader), and kept
    from forward to backward, per unit."""
    units = np.array([index.get(n.module_path.split("/")[0] if n.module_path else "", last) for n in graph.nodes])
    reach: dict = {}   # forward value -> the last unit whose forward reads it
    kept: dict = {}    # forward value read by the backward pass -> its unit
    for node in graph.nodes:
      if profile.per_step[node.id]:
        continue
      for ref in node.operands:
        if ref.source is not Source.NODE or graph.nodes[ref.index].phase != "forward":
          continue
        key = (ref.index, ref.output)
        if node.phase == "forward":
          reach[key] = max(reach.get(key, 0), units[node.id])
        elif node.phase == "backward":
          kept[key] = units[ref.index]
    across = np.zeros(len(order))
    for (i, k), to in reach.items():
      across[units[i]:to] += graph.nodes[i].outputs[k].nbytes
    held = np.zeros(len(order))
    for (i, k), unit in kept.items():
      held[unit] += graph.nodes[i].outputs[k].nbytes
    return across, held

  (a0, k0), (a1, k1) = crossing(small), crossing(large)
  boundary = tuple(np.maximum(0.0, (a1 - a0) / (b1 - b0)))
  residual = tuple(np.maximum(0.0, (k1 - k0) / (b1 - b0)))
  params = np.zeros(len(order))
  inputs = {i for i, x in enumerate(large.inputs) if x.role is Role.PARAM}
  counted = set()
  for node in large.nodes:
    if node.phase != "forward":
      continue
    for ref in node.operands:
      if ref.source is Source.INPUT and ref.index in inputs and ref.index not in counted:
        counted.add(ref.index)
        params[per_node[node.id]] += math.prod(large.inputs[ref.index].type.shape)
  return Units(tuple(order), nodes, boundary, residual, tuple(params), forward)


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
  step_seconds: float
  stages: tuple[str, ...]
  units: tuple[int, ...]
  microbatch: int
  microbatches: int
  grad_reduce_dtype: str
  recompute: bool = False


def split_units(cost: np.ndarray, limit: np.ndarray | None = None) -> tuple[float, tuple[int, ...]] | None:
  """Consecutive units per stage minimising the slowest stage; ``cost[s, i, j]``: stage s running units i..j-1."""
  stages, n = cost.shape[0], cost.shape[1] - 1
  best = np.full((stages + 1, n + 1), np.inf)
  choice = np.zeros((stages + 1, n + 1), int)
  best[0, 0] = 0.0
  for s in range(1, stages + 1):
    for j in range(s, n + 1):
      for i in range(s - 1, j):
        value = max(best[s - 1, i], cost[s - 1, i, j])
        if value < best[s, j]:
          best[s, j], choice[s, j] = value, i
  if not np.isfinite(best[stages, n]):
    return None
  counts, j = [], n
  for s in range(stages, 0, -1):
    i = choice[s, j]
    counts.append(j - i)
    j = i
  return float(best[stages, n]), tuple(int(c) for c in reversed(counts))


def estimate(cluster, profile, units: Units, batch: int, overlapped: bool = False,
             schedule: str = "1f1b") -> PipelinePlan | None:
  """The fastest pipeline plan that fits; ``overlapped``: boundary transfers and gradient reductions hide behind
  compute (a bound no schedule beats). ``schedule``: ``"1f1b"`` (each stage's forward and backward of a
  microbatch per tick, ``min(M, S)`` microbatches in flight), or ``"gpipe"``, what
  :func:`hetspmd.lowering.pipeline.pipelined_grad` runs: lockstep forward ticks then backward ticks, each as long
  as its slowest stage, either every residual of all ``M`` microbatches kept, or only each unit's input
  kept and its forward recomputed in the backward (whichever is faster and fits)."""
  from hetspmd.planner.data_axis import WORKSPACE

  hosts = list(range(len(cluster.hosts)))
  first_of = np.cumsum([0] + [h.count for h in cluster.hosts])
  n = len(units.names)
  per_param = profile.param_bytes / max(profile.param_count, 1)
  state_per_param = per_param + 4 + profile.opt_state_bytes / max(profile.param_count, 1)
  optimizer = {}
  memory = min(h.device.memory_bytes for h in cluster.hosts) / WORKSPACE  # one program: the same buffers everywhere
  best = None
  for order in (hosts, hosts[::-1]):
    for stages in range(2, len(hosts) + 1):
      if len(hosts) % stages:
        continue
      groups = [order[k * len(hosts) // stages:(k + 1) * len(hosts) // stages] for k in range(stages)]
      width = {sum(cluster.hosts[h].count for h in g) for g in groups}
      if len(width) != 1:
        continue
      d = width.pop()
      for microbatch in (1, 2, 4, 8, 16, 32, 64):
        if batch % (d * microbatch):
          continue
        m = batch // (d * microbatch)
        seconds = np.zeros((stages, n))
        forward = np.zeros((stages, n))
        for s, g in enumerate(groups):
          specs = {cluster.hosts[h].device.name: cluster.hosts[h].device for h in g}
          per_kind = [profile.node_seconds(spec, microbatch) for spec in specs.values()]
          seconds[s] = [max(float(np.sum(t[mask])) for t in per_kind) for mask in units.nodes]
          forward[s] = [max(float(np.sum(t[mask])) for t in per_kind) for mask in units.forward]
          if s not in optimizer:
            optimizer[s] = max(float(np.sum(profile.node_seconds(spec, 1)[profile.per_step])) for spec in specs.values())
        params = np.concatenate([[0.0], np.cumsum(units.params)])
        kept = np.concatenate([[0.0], np.cumsum(units.residual)])
        inputs = np.concatenate([[0.0], np.cumsum((0.0,) + tuple(units.boundary[:-1]))])  # each unit's input
        for recompute in ((False,) if schedule == "1f1b" else (False, True)):
          work = seconds + forward if recompute else seconds
          prefix = np.concatenate([np.zeros((stages, 1)), np.cumsum(work, axis=1)], axis=1)
          prefix_f = np.concatenate([np.zeros((stages, 1)), np.cumsum(forward, axis=1)], axis=1)
          cost = np.full((stages, n + 1, n + 1), np.inf)
          sent = np.zeros((stages, n + 1, n + 1))
          for s, g in enumerate(groups):
            link = cluster.inter if len(hosts) > 1 else cluster.hosts[g[0]].intra
            share = d // len(g)  # replicas on one host share its link
            for i in range(n):
              for j in range(i + 1, n + 1):
                if schedule == "1f1b":  # one SPMD program: every stage holds the first stage's buffers
                  buffers = min(m, stages) * microbatch * (kept[j] - kept[i])
                elif recompute:
                  buffers = m * microbatch * (inputs[j] - inputs[i]) + microbatch * max(units.residual[i:j])
                else:
                  buffers = m * microbatch * (kept[j] - kept[i])
                if (params[j] - params[i]) * state_per_param + buffers > memory:
                  continue
                sends = (units.boundary[j - 1] if j < n else 0.0) + (units.boundary[i - 1] if i > 0 else 0.0)
                sent[s, i, j] = share * microbatch * sends / link.bandwidth
                compute = prefix[s, j] - prefix[s, i]
                cost[s, i, j] = max(compute, sent[s, i, j]) if overlapped else compute + sent[s, i, j]
          split = split_units(cost)
          if split is None:
            continue
          tick, counts = split
          bounds = np.concatenate([[0], np.cumsum(counts)])
          if schedule == "gpipe":  # lockstep: the forward ticks and the backward ticks each wait for their slowest stage
            span = [(bounds[s], bounds[s + 1]) for s in range(stages)]
            tick_f = max(prefix_f[s, j] - prefix_f[s, i] for s, (i, j) in enumerate(span))
            tick_b = max(prefix[s, j] - prefix[s, i] - (prefix_f[s, j] - prefix_f[s, i]) for s, (i, j) in enumerate(span))
            moved = max(sent[s, i, j] for s, (i, j) in enumerate(span))
            tick = max(tick_f + tick_b, moved) if overlapped else tick_f + tick_b + moved
          best = _best_of(best, cluster, groups, counts, bounds, params, optimizer, first_of, m, stages, tick,
                          microbatch, overlapped, recompute)
  return best


def _best_of(best, cluster, groups, counts, bounds, params, optimizer, first_of, m, stages, tick, microbatch,
             overlapped, recompute):
  """``best`` or this split at its fastest gradient-reduction dtype, whichever is faster."""
  from hetspmd.planner.data_axis import REDUCE_BYTES, allreduce_seconds

  for dtype, wire in REDUCE_BYTES.items():
    reduce = max(allreduce_seconds(cluster, [p for h in g for p in range(first_of[h], first_of[h + 1])],
                                   (params[bounds[s + 1]] - params[bounds[s]]) * wire)
                 for s, g in enumerate(groups))
    update = max(optimizer[s] * (params[bounds[s + 1]] - params[bounds[s]]) / params[-1] for s in range(stages))
    step = (m + stages - 1) * tick + (0.0 if overlapped else reduce) + update
    if best is None or step < best.step_seconds:
      names = tuple("+".join(f"{cluster.hosts[h].count}x{cluster.hosts[h].device.name}" for h in g) for g in groups)
      best = PipelinePlan(step, names, counts, microbatch, m, dtype, recompute)
  return best


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--case", action="append", default=[],
                      help="cluster:model:batch:sequence (sequence 'none' for vision models); repeatable")
  args = parser.parse_args()
  cases = [(c, mdl, int(b), None if s == "none" else int(s)) for c, mdl, b, s in (x.split(":") for x in args.case)] \
      or CASES

  from hetspmd import Cluster, models
  from hetspmd.passes.profile import profile_step
  from hetspmd.planner.ranking import search

  print(f"{'cluster':<15} {'model':<13} {'batch':>5} {'best plan s':>11} {'1F1B s':>8} {'ratio':>6} "
        f"{'hidden s':>8} {'ratio':>6} {'built s':>8} {'ratio':>6}  built schedule's plan (lockstep GPipe)")
  for preset, name, batch, seq in cases:
    w = models.get(name)
    profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2, seq))
    cluster = Cluster.preset(preset)
    today = search(cluster, profile, batch, overlap=True, grad_reduce_dtypes=("float32", "bfloat16")).plans[0]
    units = units_of(profile)
    plans = [estimate(cluster, profile, units, batch), estimate(cluster, profile, units, batch, overlapped=True),
             estimate(cluster, profile, units, batch, schedule="gpipe")]
    row = f"{preset:<15} {name:<13} {batch:>5} {today.step_seconds:11.3f}"
    for plan, width in zip(plans, (8, 8, 8)):
      row += f" {'no fit':>{width}} {'':>6}" if plan is None else \
          f" {plan.step_seconds:{width}.3f} {today.step_seconds / plan.step_seconds:6.2f}"
    built = plans[2]
    if built is not None:
      row += (f"  {len(built.stages)} stages [{', '.join(built.stages)}], units {list(built.units)}, "
              f"{built.microbatches} x microbatch {built.microbatch}, {built.grad_reduce_dtype} reduction, "
              f"{'forward recomputed' if built.recompute else 'residuals kept'}")
    print(row, flush=True)
  print("ratio = today's best step / the pipeline estimate (> 1: a pipeline would be faster); 1F1B: nothing "
        "overlapped; hidden: 1F1B with every boundary transfer and gradient reduction hidden behind compute (a "
        "bound); built: the schedule hetspmd.lowering.pipeline runs, nothing overlapped")


if __name__ == "__main__":
  main()
