"""The ``hetspmd`` command line.

    hetspmd trace --model gpt2-small [--batch B] [--seq S] [--json]
    hetspmd profile [--json] [--out cluster.toml]
    hetspmd search [--model gpt2-small] [--cluster amp-t4-v100] [--global-batch 64] [--out plan.json]
                   [--group-plan-out groups.json] [--json]
    hetspmd explain plan.json [--png plan.png] [--json]

Errors that hetspmd raises on purpose print one line to stderr and exit 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import jax

from hetspmd import models
from hetspmd import report as plan_report
from hetspmd._format import si
from hetspmd.errors import HetSpmdError
from hetspmd.hardware.cluster import Cluster
from hetspmd.hardware.devices import LINK_PRESETS
from hetspmd.hardware.profiler import profile as profile_devices
from hetspmd.passes import Role
from hetspmd.passes import trace as trace_graph
from hetspmd.passes.profile import profile_step
from hetspmd.plan.groups import GroupPlan, is_group_plan_file
from hetspmd.plan.options import GRAD_REDUCE_DTYPES, STEP_REMAT_POLICIES
from hetspmd.plan.value import Plan
from hetspmd.planner.building import plan_from
from hetspmd.planner.grouping import to_group_plan
from hetspmd.errors import PlanDoesNotFitError
from hetspmd.planner.ranking import (BASELINES, GROUP_PLAN_CONDITIONS, GROUP_PLAN_MARGIN, chosen_group_plan,
                                     group_plan_alone, ideal_throughput)
from hetspmd.planner.ranking import search as search_plans
from hetspmd.planner.stages import describe, search_stages

_si = functools.partial(si, small=".0f")  # counts and rates below a thousand as integers


def _positive_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
  return value


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="hetspmd", description="Automatic, device-weighted SPMD sharding for JAX on mixed accelerator pools.")
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

  trace = sub.add_parser(
      "trace", help="trace a model's training step and report its parameters, FLOPs and layers",
      description="Trace a zoo model's single-device train step (forward, backward, optimizer) abstractly, "
      "without allocating weights, and report parameters, FLOPs per step, the per-layer breakdown "
      "and the primitives that dominate.")
  trace.add_argument("--model", default="gpt2-small", help="zoo model name (default: gpt2-small); "
                     "--list shows every name")
  trace.add_argument("--list", action="store_true", help="list the zoo models and exit")
  trace.add_argument("--batch", type=_positive_int, help="global batch size (default: the model's own)")
  trace.add_argument("--seq", type=_positive_int, help="sequence length, for sequence models (default: the model's own)")
  trace.add_argument("--top", type=_positive_int, default=8, help="how many primitives to list (default: 8)")
  trace.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
  trace.set_defaults(run=_run_trace)

  profile = sub.add_parser(
      "profile", help="measure this machine's devices and links and write a cluster file",
      description="Measure every visible JAX device (matmul FLOP/s in float32 and bfloat16, alone and with "
      "all devices busy; memory copy bandwidth alone and busy, read bandwidth busy) and the collectives between them (all-reduce, all-gather, "
      "reduce-scatter over message sizes, fitted to alpha + beta * bytes). With jax.distributed initialised "
      "every process measures its own devices.",
      epilog="Cluster spec grammar used by --cluster elsewhere: " + _GRAMMAR)
  profile.add_argument("--out", help="write the measured cluster to this TOML file")
  profile.add_argument("--json", action="store_true", help="print the full profile as JSON")
  profile.add_argument("--devices", type=_positive_int, help="measure only the first N devices")
  profile.set_defaults(run=_run_profile)

  search = sub.add_parser(
      "search", help="rank device-weighted plans for a zoo model on a cluster",
      description="Trace the model's train step, cost it on every device kind of the cluster, and rank "
      "plans over (data, model) layouts: per-operation tensor-parallel splits along model (an ILP), microbatch "
      "counts per data position weighted by device speed (balanced to the slowest position), microbatch size, "
      "ZeRO stage, remat, and which device kinds take part; against the baselines dp_even, dp_proportional, "
      "fastest_only and best_homogeneous (each a candidate too, so the best plan is never below one), fsdp (one "
      "group of every device, an even batch, parameters and optimizer state sharded over all of them, gathered per "
      "layer: a group plan, offered among the group plans), and "
      "homogeneous_equivalent: the best plan of the same pool with every device its mean; the heterogeneity tax is "
      "1 - (best / ideal) / (homogeneous_equivalent / its own ideal), how much further the best plan falls short of "
      "the pool's ideal than the equivalent falls short of its own. Also the best group plan (one program per "
      "device kind, each its own microbatch, a kind's parameters sharded over its devices where that lets it join or "
      "recompute less; where every kind shards, each group holds its state split: hybrid; or the fsdp plan where it is faster). For a model that scans its layers (the zoo's -scan models), pipeline "
      "stage plans too, in a table of their own (stages of whole hosts, layers split by speed).",
      epilog="Cluster spec grammar: " + _GRAMMAR)
  search.add_argument("--model", default="gpt2-small", help="zoo model name (default: gpt2-small)")
  search.add_argument("--cluster", default="amp-t4-v100",
                      help="preset name, cluster TOML file, or spec (default: amp-t4-v100)")
  search.add_argument("--global-batch", type=_positive_int, default=64, help="examples per step (default: 64)")
  search.add_argument("--seq", type=_positive_int, help="sequence length (default: the model's own)")
  search.add_argument("--top", type=_positive_int, default=5, help="plans to show (default: 5)")
  search.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                      help="the model's compute dtype, float32 master weights either way (default: float32)")
  search.add_argument("--grad-reduce-dtype", choices=("float32", "bfloat16", "search"),
                      default="float32",
                      help="dtype gradients cross the data axis in; 'search' lets the search pick float32 or "
                      "bfloat16 per plan; accumulation stays float32 (default: float32, exact)")
  search.add_argument("--no-overlap", action="store_true",
                      help="do not overlap gradient reductions with the last microbatch's backward pass")
  search.add_argument("--out", help="write the best plan to this JSON file")
  search.add_argument("--group-plan-out", metavar="FILE",
                      help="write the best group plan to this JSON file (devices by cluster position; run it with "
                      "hetspmd.parallelize(step, plan=FILE, global_batch=...))")
  search.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
  search.set_defaults(run=_run_search)

  explain = sub.add_parser("explain", help="show a plan file: devices, microbatch shares, predictions")
  explain.add_argument("plan", help="a plan JSON file written by hetspmd search --out, or a group plan written "
                       "by --group-plan-out or GroupPlan.save")
  explain.add_argument("--png", metavar="FILE", help="also draw the bars to FILE (needs matplotlib)")
  explain.add_argument("--json", action="store_true", help="print the per-position figures as JSON")
  explain.set_defaults(run=_run_explain)
  return parser


_GRAMMAR = ("SPEC := GROUP('+'GROUP)*(';'OPTION)*, GROUP := [HOSTSx][DEVICESx]KIND[@LINK], "
            "OPTION := inter=LINK | intra=LINK | inter_latency=TIME | intra_latency=TIME | processes=N; "
            "e.g. '2x8xV100-32GB+6x8xP100-16GB;inter=10.4Gbps'. LINK is a preset "
            f"({', '.join(LINK_PRESETS)}) or a bandwidth such as 25Gbps.")


def main(argv: Sequence[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return args.run(args)
  except HetSpmdError as e:
    print(f"hetspmd {args.command}: error: {e}", file=sys.stderr)
    return 2


# --- trace -------------------------------------------------------------------


def _run_trace(args: argparse.Namespace) -> int:
  if args.list:
    return _print_model_list(models, args.json)
  workload = models.get(args.model)
  batch = workload.example_batch(args.batch, args.seq)
  if not args.json:
    print(f"tracing {workload.name} train step (abstract, batch {_batch_desc(batch)}) ...", file=sys.stderr)
  start = time.perf_counter()
  graph = trace_graph(workload.make_train_step(), workload.abstract_state(), batch)
  seconds = time.perf_counter() - start
  report = trace_report(workload, graph, batch, seconds, args.top)
  if args.json:
    print(json.dumps(report, indent=2))
  else:
    print(format_trace_report(report))
  return 0


def _run_profile(args: argparse.Namespace) -> int:

  _check_writable(args.out, "--out")
  if args.devices and args.devices > len(jax.devices()):
    raise HetSpmdError(f"--devices {args.devices}: JAX sees {len(jax.devices())} device(s) "
                       f"({jax.devices()[0].platform}); give at most {len(jax.devices())}")
  devices = jax.devices()[: args.devices] if args.devices else jax.devices()
  result = profile_devices(devices, progress=not args.json)
  cluster = Cluster.from_profile(result)
  writes = [(args.out, "the measured cluster", lambda: cluster.save(args.out))] if args.out else []
  if args.json:
    print(json.dumps({**result.to_json(), "cluster": cluster.describe()}, indent=2))
    return _write_all(args, writes)
  print(f"measured {len(result.devices)} {result.backend} device(s) in {result.seconds:.1f} s")
  print(f"{'device':>6} {'kind':<10} {'fp32 alone':>15} {'fp32 busy':>15} {'bf16 busy':>15} {'copy alone':>11} {'copy busy':>11} {'read busy':>11} {'cache write':>11} {'cache':>9} {'memory':>9}")
  for d in result.devices:
    print(f"{d.id:>6} {d.kind:<10} {_si(d.peak('float32', busy=False), 'FLOP/s'):>15} "
          f"{_si(d.peak('float32'), 'FLOP/s'):>15} {_si(d.peak('bfloat16'), 'FLOP/s'):>15} "
          f"{_si(d.copy_bandwidth, 'B/s'):>11} {_si(d.bandwidth, 'B/s'):>11} {_si(d.busy_read_bandwidth, 'B/s'):>11} "
          f"{_si(d.busy_cache_write_bandwidth, 'B/s'):>11} {_si(d.cache_bytes, 'B'):>9} {_si(d.memory_bytes, 'B'):>9}")
  for fit in result.collectives:
    print(f"{fit.op:<15} over {fit.group_size} ({fit.axis}): alpha {fit.alpha * 1e6:.1f} us, "
          f"{_si(1 / fit.beta if fit.beta else float('inf'), 'B/s')} asymptotic")
  return _write_all(args, writes)


def _check_writable(path: str | None, option: str) -> None:
  """Refuses, before any work, an output path that cannot be written: a folder, or in a folder that does not
  exist or that this user may not write to (a write that still fails is reported after the results)."""
  if not path:
    return
  target = Path(path)
  folder = target.parent
  if target.is_dir():
    raise HetSpmdError(f"{option} {path!r} is a folder: give a file path, such as {str(target / 'out.json')!r}")
  if not folder.is_dir():
    raise HetSpmdError(f"{option} {path!r}: the folder {str(folder)!r} does not exist")
  if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
    raise HetSpmdError(f"{option} {path!r} cannot be written (no permission)")


def _write_all(args: argparse.Namespace, writes: list) -> int:
  """Writes each ``(path, what, write)`` after the results are printed; a write that fails is reported on
  stderr (the results stay above it) and the exit status is 2."""
  status = 0
  for path, what, write in writes:
    try:
      write()
    except (OSError, HetSpmdError) as e:
      why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
      print(f"hetspmd {args.command}: error: {what} was not written to {path}: {why} (the results are printed "
            "above)", file=sys.stderr)
      status = 2
    else:
      if not getattr(args, "json", False):
        print(f"wrote {what} to {path}")
  return status


def _run_search(args: argparse.Namespace) -> int:
  _check_writable(args.out, "--out")
  _check_writable(args.group_plan_out, "--group-plan-out")
  cluster = Cluster.resolve(args.cluster)
  workload = models.get(args.model).with_dtype(args.dtype)
  batch = workload.example_batch(2, args.seq)
  state = workload.abstract_state()
  start = time.perf_counter()

  def progress(message: str) -> None:
    if not args.json:
      print(f"[{time.perf_counter() - start:5.1f}s] {message}", file=sys.stderr)


  dtypes = GRAD_REDUCE_DTYPES if args.grad_reduce_dtype == "search" else (args.grad_reduce_dtype,)
  progress("tracing the step at two batch sizes")
  profile = profile_step(workload.make_train_step(), state, batch)
  try:
    # the zoo's step differentiates with jax.value_and_grad: only the policies parallelize applies to any step
    result = search_plans(cluster, profile, args.global_batch, args.top, progress, grad_reduce_dtypes=dtypes,
                          remat_policies=STEP_REMAT_POLICIES,
                          overlap=not args.no_overlap, homogeneous=True, groups=True)
  except PlanDoesNotFitError as e:
    return _group_plan_only(args, cluster, workload, profile, e, dtypes, progress=progress)
  stage_plans = search_stages(cluster, profile, args.global_batch, top=3, grad_reduce_dtypes=dtypes,
                              progress=progress)
  report = _search_report(args, cluster, workload, batch, result, stage_plans)
  if args.json:
    print(json.dumps(report, indent=2))
  else:
    _print_search(args, cluster, workload, result, stage_plans, report)
  writes = []
  if args.out:
    writes.append((args.out, "the best plan",
                   lambda: plan_from(result.plans[0], cluster, state, result.ideal_throughput).save(args.out)))
  if args.group_plan_out:
    writes.append((args.group_plan_out, "the best group plan",
                   lambda: _write_group_plan(args, cluster, result.group_plan, result.ideal_throughput)))
  return _write_all(args, writes)


def _print_search(args: argparse.Namespace, cluster: Cluster, workload, result, stage_plans, report: dict) -> None:
  """The search's tables: the ranked plans, the baselines, the homogeneous equivalent, group and stage plans."""
  ideal, best = result.ideal_throughput, result.plans[0]
  kinds = ", ".join(f"{sum(1 for d in cluster.devices if d.spec.name == k)} {k}" for k in cluster.kinds)
  print(f"{workload.name} on {cluster} ({cluster.num_devices} devices: {kinds}), global batch {args.global_batch}"
        + (f", seq {report['seq']}" if report["seq"] else "") + (f", {args.dtype} compute" if args.dtype != "float32"
                                                                   else ""))
  print(f"searched {result.candidates} candidates in {result.search_seconds:.2f} s (after tracing); "
        f"ideal throughput {ideal:.1f} samples/s")
  print()
  print(f"{'#':>2} {'plan':<28} {'mb':>4} {'ZeRO':>4} {'remat':>8} {'step s':>8} {'samples/s':>10} {'eff':>6} "
        f"{'comm s':>7} {'hidden':>7} {'reduce':>6} {'mem/dev':>9}  counts")
  for i, p in enumerate(result.plans, 1):
    print(_plan_row(str(i), p, ideal))
  print()
  print(f"{'':>2} {'baseline':<28}")
  for name in BASELINES:
    if name in result.baselines:
      b = result.baselines[name]
      print(_plan_row("", b, ideal, label=f"{name}", suffix=f"  best is {best.throughput / b.throughput:.2f}x"))
  equivalent = result.homogeneous_equivalent
  if equivalent is not None:
    print(_plan_row("", equivalent, ideal, label="homogeneous_equivalent",
                    suffix=f"  heterogeneity tax {result.heterogeneity_tax:.1%} (the same pool, every device its "
                           f"mean, reaches {equivalent.throughput / result.homogeneous_ideal:.1%} of its own ideal; "
                           f"best is {result.throughput_vs_homogeneous:.2f}x its throughput)"))
  if result.group_plan is not None:
    print()
    print(f"{'':>2} group programs (one per device kind, each its own microbatch, or the fsdp plan's one group; "
          "parallelize(plan=...) runs them)")
    print(_group_plan_row(result.group_plan, best, ideal))
  if stage_plans:
    print()
    print(f"{'':>2} pipeline stages (the step scans its layers; run with plan_for(..., stages=layers))")
    for p in stage_plans:
      print(f"{'':>2} {describe(p, cluster):<60} {p.step_seconds:8.3f} s {args.global_batch / p.step_seconds:10.1f} "
            f"samples/s {p.memory_bytes / 1e9:6.2f} GB/dev  {best.step_seconds / p.step_seconds:.2f}x the best plan")
  if args.out or args.group_plan_out:
    print()


def _search_report(args: argparse.Namespace, cluster: Cluster, workload, batch, result, stage_plans) -> dict:
  """The search's ``--json`` report: plans, baselines, the homogeneous equivalent, the group plan, stage plans."""
  ideal, best = result.ideal_throughput, result.plans[0]
  return {
      "model": workload.name, "cluster": str(cluster), "devices": cluster.num_devices,
      "global_batch": args.global_batch, "dtype": args.dtype, "seq": batch[next(iter(batch))].shape[1] if workload.default_seq else None,
      "plans": [p.to_json(ideal) for p in result.plans],
      "baselines": {name: {**result.baselines[name].to_json(ideal), "speedup_of_best": best.throughput /
                           result.baselines[name].throughput} for name in BASELINES if name in result.baselines},
      "homogeneous_equivalent": (None if result.homogeneous_equivalent is None else
                                 result.homogeneous_equivalent.to_json(ideal)),
      "heterogeneity_tax": result.heterogeneity_tax, "throughput_vs_homogeneous": result.throughput_vs_homogeneous,
      "homogeneous_ideal_throughput": result.homogeneous_ideal,
      "group_plan": (None if result.group_plan is None else
                     {**result.group_plan.to_json(ideal), "speedup_over_best": result.group_plan.throughput /
                      best.throughput, "parallelize": {
                          "margin": GROUP_PLAN_MARGIN, "priced_past_margin": chosen_group_plan(result) is not None,
                          "conditions": GROUP_PLAN_CONDITIONS}}),
      "ideal_throughput": ideal, "search_seconds": result.search_seconds, "candidates": result.candidates,
      "stage_plans": [{**p.to_json(), "speedup_over_best": best.step_seconds / p.step_seconds} for p in stage_plans],
  }


def _group_plan_only(args: argparse.Namespace, cluster: Cluster, workload, profile, error: Exception,
                     dtypes: tuple[str, ...], *, progress=None) -> int:
  """Where no single program fits: the best group plan, which holds each device's own microbatch and share of the
  state, or the error when none fits either."""
  grouped = group_plan_alone(cluster, profile, args.global_batch, grad_reduce_dtypes=dtypes, progress=progress,
                             remat_policies=STEP_REMAT_POLICIES)
  if grouped is None:
    raise error
  ideal = ideal_throughput(cluster, profile, args.global_batch)
  writes = ([(args.group_plan_out, "the best group plan", lambda: _write_group_plan(args, cluster, grouped, ideal))]
            if args.group_plan_out else [])
  written = 0 if not args.out else 1  # the single program asked for: none fits
  if args.json:
    print(json.dumps({"model": workload.name, "cluster": str(cluster), "devices": cluster.num_devices,
                      "global_batch": args.global_batch, "dtype": args.dtype, "seq": args.seq, "plans": [],
                      "baselines": {}, "homogeneous_equivalent": None, "heterogeneity_tax": None,
                      "throughput_vs_homogeneous": None, "homogeneous_ideal_throughput": None,
                      "no_single_program": str(error), "group_plan": grouped.to_json(ideal),
                      "ideal_throughput": ideal, "search_seconds": None, "candidates": 0, "stage_plans": []},
                     indent=2))
    return _write_all(args, writes) or written
  print(f"{workload.name} on {cluster}, global batch {args.global_batch}"
        + (f", {args.dtype} compute" if args.dtype != "float32" else "") + f"; ideal throughput {ideal:.1f} samples/s")
  print(f"\nno single program fits ({error})\n")
  print(f"{'':>2} group programs (one per device kind, each its own microbatch; parallelize(plan=...) runs them)")
  print(_group_plan_row(grouped, None, ideal))
  if args.out:
    print(f"nothing written to {args.out}: no single program fits (--group-plan-out FILE writes the group plan)",
          file=sys.stderr)
  return _write_all(args, writes) or written


def _write_group_plan(args: argparse.Namespace, cluster: Cluster, priced, ideal: float) -> None:
  if priced is None:
    raise HetSpmdError(f"no group plan fits {args.model} on {cluster} at global batch {args.global_batch} (one "
                       "device kind, or replicated and shared state both too large): nothing written to "
                       f"{args.group_plan_out}")
  to_group_plan(cluster, priced, ideal).save(args.group_plan_out)


def _group_plan_row(g, best, ideal: float) -> str:
  """The best group plan's row: each kind's microbatch, remat, model axis and state share, the tail, against the
  best plan."""
  n = len(g.kinds)
  part = g.group
  models = [tp.m for tp in part.group_models] or [1] * n
  sizes = ", ".join(f"{k}: mb {m}, remat {r}" + (f", model axis {axis}" if axis > 1 else "") + (
      f", {share:.1%} of the {'parameters and ' if g.zero_stage == 3 else ''}optimizer state per device"
      if share else "")
                    for k, m, r, axis, share in dict.fromkeys(zip(g.kinds, part.microbatches, part.remats or (g.remat,) * n,
                                                                  models, part.state_shares or (None,) * n)))
  if part.tail[1]:
    sizes += f"; a tail of {part.tail[1]} x {part.tail[0]} per device overlapping the reduction"
  sharded = [k for k, s in dict.fromkeys(zip(g.kinds, part.shard_params)) if s]
  if sharded:
    sizes += ("; plain FSDP: one group of every device, its parameters and optimizer state split over them"
              if part.execution.hybrid and part.execution.groups[0][1] == len(g.device_positions) else
              "; hybrid: every group its parameters and optimizer state split over its devices" if part.execution.hybrid
              else "; parameters sharded (FSDP) on " + ", ".join(sharded))
  if best is None:  # no single program fits
    return _plan_row("", g, ideal, label="best group plan", suffix=f"  ({sizes})")
  ratio = g.throughput / best.throughput
  chosen = (f"parallelize(plan='search') runs group plans priced {GROUP_PLAN_MARGIN:.2f}x or more "
            f"{GROUP_PLAN_CONDITIONS}")
  return _plan_row("", g, ideal, label="best group plan", suffix=f"  ({sizes}; {ratio:.2f}x the best plan: "
                   f"{chosen})")


def _plan_row(rank: str, p, ideal: float, label: str | None = None, suffix: str = "") -> str:
  counts = _counts_summary(p.kinds, p.counts)
  if p.overlap_microbatches > 1:
    counts += f"; last {p.overlap_microbatches} as one pass"
  return (f"{rank:>2} {(label or p.name)[:28]:<28} {p.microbatch:>4} {p.zero_stage:>4} {p.remat:>8} "
          f"{p.step_seconds:8.3f} {p.throughput:10.1f} {p.throughput / ideal:6.1%} {p.comm_seconds:7.3f} "
          f"{p.hidden_seconds:7.3f} {_DTYPE_SHORT[p.grad_reduce_dtype]:>6} {_si(max(p.memory_bytes), 'B'):>9}  "
          f"{counts}{suffix}")


_DTYPE_SHORT = {"float32": "f32", "bfloat16": "bf16"}


def _counts_summary(kinds, counts) -> str:
  groups: dict[tuple[str, int], int] = {}
  for k, c in zip(kinds, counts):
    groups[(k, c)] = groups.get((k, c), 0) + 1
  return ", ".join(f"{n}x{k}:{c}" for (k, c), n in groups.items())


def _run_explain(args: argparse.Namespace) -> int:
  _check_writable(args.png, "--png")
  if is_group_plan_file(args.plan):
    return _explain_group_plan(args)
  plan = Plan.load(args.plan)
  if args.json:
    print(json.dumps({"plan": plan.to_json(), "positions": plan_report.positions(plan)}, indent=2))
  else:
    print(plan_report.explain_text(plan))
  if args.png:
    path = plan_report.explain_png(plan, args.png)
    print(f"wrote {path}", file=sys.stderr)
  return 0


def _explain_group_plan(args: argparse.Namespace) -> int:
  """A group plan file (hetspmd search --group-plan-out, GroupPlan.save): per group and per device."""
  if args.png:
    raise HetSpmdError(f"--png draws plans written by hetspmd search --out; {args.plan!r} is a group plan: "
                       "drop --png to see it as text")
  plan = GroupPlan.load(args.plan)
  if args.json:
    print(json.dumps({"group_plan": plan.to_json(), "hybrid": plan.hybrid, "devices": plan_report.group_devices(plan)},
                     indent=2))
  else:
    print(plan_report.explain_group_text(plan))
  return 0


def _batch_desc(batch: dict[str, Any]) -> str:
  return ", ".join(f"{k}{list(v.shape)}" for k, v in batch.items())


def trace_report(workload, graph, batch, seconds: float, top: int) -> dict[str, Any]:
  """The machine-readable summary printed by ``hetspmd trace --json``."""

  return {
      "model": workload.name,
      "params": graph.elements_with_role(Role.PARAM),
      "batch": {k: list(v.shape) for k, v in batch.items()},
      "flops_per_step": graph.total_flops,
      "transcendentals_per_step": graph.total_transcendentals,
      "bytes_per_step": graph.total_bytes,
      "state_bytes": {role.value: graph.bytes_with_role(role) for role in Role},
      "nodes": len(graph.nodes),
      "layers": [{"name": l.name, "flops": l.flops, "nodes": len(l.node_ids), "repeat_of": l.repeat_of}
                 for l in graph.layers],
      "top_primitives": [{"primitive": p, "flops": f} for p, f in list(graph.flops_by_primitive().items())[:top]],
      "loops": [{"primitive": l.primitive, "trip_count": l.trip_count, "data_dependent": l.data_dependent,
                 "module": l.module_path} for l in graph.loops],
      "unknown_primitives": list(graph.unknown_primitives),
      "trace_seconds": round(seconds, 3),
  }


def format_trace_report(report: dict[str, Any]) -> str:
  total = report["flops_per_step"] or 1.0
  lines = [
      f"model            {report['model']}",
      f"parameters       {report['params']:,} ({_si(report['params'])})",
      "batch            " + ", ".join(f"{k}{v}" for k, v in report["batch"].items()),
      f"FLOPs per step   {_si(report['flops_per_step'], 'FLOP')} (+ {_si(report['transcendentals_per_step'])} transcendentals)",
      f"graph            {report['nodes']:,} nodes, {len(report['layers'])} layers, traced in {report['trace_seconds']:.2f} s",
  ]
  if report["unknown_primitives"]:
    lines.append(f"default-costed   {', '.join(report['unknown_primitives'])}")
  dynamic = [l for l in report["loops"] if l["data_dependent"]]
  if dynamic:
    lines.append(f"warning          {len(dynamic)} data-dependent while loop(s) costed as one iteration")
  lines += ["", f"{'layer':<28} {'FLOPs':>14} {'share':>7}  repeat of"]
  for layer in report["layers"]:
    lines.append(f"{layer['name'][:28]:<28} {_si(layer['flops'], 'FLOP'):>14} {layer['flops'] / total:>6.1%}  "
                 f"{layer['repeat_of'] or ''}")
  lines += ["", f"{'primitive':<28} {'FLOPs':>14} {'share':>7}"]
  for row in report["top_primitives"]:
    lines.append(f"{row['primitive']:<28} {_si(row['flops'], 'FLOP'):>14} {row['flops'] / total:>6.1%}")
  return "\n".join(lines)


def _print_model_list(models, as_json: bool) -> int:
  rows = []
  for name in models.names():
    w = models.get(name)
    rows.append({"name": name, "family": w.family, "params": w.param_count(), "source": w.source})
  if as_json:
    print(json.dumps(rows, indent=2))
  else:
    width = max(len(r["name"]) for r in rows)
    print(f"{'model':<{width}} {'params':>10}  source")
    for r in rows:
      print(f"{r['name']:<{width}} {_si(r['params']):>10}  {r['source']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
