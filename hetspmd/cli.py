"""The ``hetspmd`` command line.

    hetspmd trace --model gpt2-small [--batch B] [--seq S] [--json]
    hetspmd profile [--json] [--out cluster.toml]
    hetspmd calibrate --model gpt2-small --out calibration.json [--devices N] [--kinds A,B] [--global-batch 64]
                      [--remat none,layers]
    hetspmd search [--model gpt2-small | --step FILE_OR_MODULE:FUNCTION] [--cluster amp-t4-v100]
                   [--global-batch 64] [--calibration calibration.json] [--out plan.json]
                   [--group-plan-out groups.json] [--json]
    hetspmd explain plan.json [--png plan.png] [--json]

Errors that hetspmd raises on purpose print one line to stderr and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.util
import inspect
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
from hetspmd.hardware.calibration import Calibration
from hetspmd.hardware.cluster import Cluster
from hetspmd.hardware.devices import LINK_PRESETS
from hetspmd.hardware.profiler import profile as profile_devices
from hetspmd.passes import Role
from hetspmd.passes import trace as trace_graph
from hetspmd.plan.groups import GroupPlan, is_group_plan_file
from hetspmd.plan.options import REMAT_POLICIES
from hetspmd.plan.value import Plan
from hetspmd.planner.grouping import to_group_plan
from hetspmd.runtime.searching import single_plan
from hetspmd.runtime.step import parallelize
from hetspmd.step_search import search as search_step

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

  _add_profile(sub)

  _add_calibrate(sub)

  search = sub.add_parser(
      "search", help="rank device-weighted plans for a zoo model or your own step on a cluster",
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
  search.add_argument("--model", help="zoo model name (default: gpt2-small)")
  search.add_argument("--step", metavar="FILE_OR_MODULE:FUNCTION",
                      help="search your own step instead of a zoo model: FUNCTION() takes no arguments and returns "
                      "(step, args, kwargs), the step as you call it and its arguments (arrays or "
                      "jax.ShapeDtypeStruct, NNX objects from nnx.eval_shape), e.g. examples/nnx_lm.py:gemma3_1b")
  search.add_argument("--cluster", default="amp-t4-v100",
                      help="preset name, cluster TOML file, or spec (default: amp-t4-v100)")
  search.add_argument("--global-batch", type=_positive_int,
                      help="examples per step (default: 64 for --model; for --step, the batch argument's size)")
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
  search.add_argument("--calibration", metavar="FILE",
                      help="price the kinds it times on the step's measured times (hetspmd calibrate, or "
                      "ParallelStep.calibrate(...).save); one measured on another step is refused")
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


def _add_profile(sub: Any) -> None:
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


def _add_calibrate(sub: Any) -> None:
  calibrate = sub.add_parser(
      "calibrate", help="time a zoo model's train step on each device kind here and write a calibration",
      description="Run the model's train step on this machine's devices, each kind's devices at once, at two "
      "microbatch counts of the sizes the search would try: per kind, seconds per microbatch and per step. Where "
      "the step fits no one device, one layer of its layer scan is timed instead (the -scan zoo models). "
      "hetspmd search --calibration prices those kinds on the measured times; communication stays modelled.")
  calibrate.add_argument("--model", help="zoo model name (default: gpt2-small)")
  calibrate.add_argument("--out", required=True, help="write the calibration to this JSON file")
  calibrate.add_argument("--devices", type=_positive_int, help="time only the first N devices")
  calibrate.add_argument("--kinds", help="comma-separated kind per device (emulated kinds, as Cluster.emulate "
                         "gives them; one name for all), default: each device's own kind")
  calibrate.add_argument("--global-batch", type=_positive_int, default=64,
                         help="examples per step the search will plan for (default: 64)")
  calibrate.add_argument("--seq", type=_positive_int, help="sequence length (default: the model's own)")
  calibrate.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                         help="the model's compute dtype, as hetspmd search --dtype (default: float32)")
  calibrate.add_argument("--remat", default="none",
                         help="comma-separated remat policies to time each kind under (of "
                         f"{', '.join(REMAT_POLICIES)}; the search prices a policy timed from its own times, "
                         "one not timed from a model of what it recomputes; default: none)")
  calibrate.add_argument("--json", action="store_true", help="print the calibration as JSON")
  calibrate.set_defaults(run=_run_calibrate)


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


def _first_devices(n: int | None) -> list:
  """JAX's first ``n`` devices (all of them without ``--devices``), or a usage error naming how many there are."""
  if n and n > len(jax.devices()):
    raise HetSpmdError(f"--devices {n}: JAX sees {len(jax.devices())} device(s) ({jax.devices()[0].platform}); "
                       f"give at most {len(jax.devices())}")
  return jax.devices()[:n] if n else jax.devices()


def _run_profile(args: argparse.Namespace) -> int:

  _check_writable(args.out, "--out")
  devices = _first_devices(args.devices)
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


def _calibration_file(path: str | None) -> Any:
  if path is None:
    return None
  if not Path(path).is_file():
    raise HetSpmdError(f"--calibration {path!r}: no such file (write one with hetspmd calibrate --out)")
  return Calibration.load(path)


def _run_calibrate(args: argparse.Namespace) -> int:
  _check_writable(args.out, "--out")
  devices = _first_devices(args.devices)
  if args.kinds:
    kinds = [k.strip() for k in args.kinds.split(",")]
    if len(kinds) not in (1, len(devices)):
      raise HetSpmdError(f"--kinds names {len(kinds)} kind(s) for {len(devices)} device(s): give one per device, "
                         "or one for all")
    cluster = Cluster.emulate(devices, kinds=kinds * len(devices) if len(kinds) == 1 else kinds)
  else:
    cluster = Cluster.from_devices(devices)
  workload = models.get(args.model or "gpt2-small").with_dtype(args.dtype)
  batch = workload.synthetic_batch(0, batch=min(args.global_batch, 8), seq=args.seq)
  step = parallelize(workload.make_train_step(), cluster=cluster, plan="search", global_batch=args.global_batch)
  if not args.json:
    print(f"timing {workload.name} on {cluster.num_devices} device(s): {', '.join(cluster.kinds)}", file=sys.stderr)
  with jax.default_device(jax.devices("cpu")[0]):  # in host memory: the state may fit no device
    state = workload.init_state(0)
  calibration = step.calibrate(state, batch, remats=[r.strip() for r in args.remat.split(",")])
  if args.json:
    print(json.dumps(calibration.to_json(), indent=2))
  else:
    print("\n".join(calibration.describe()))
  return _write_all(args, [(args.out, "the calibration", lambda: calibration.save(args.out))])


def _run_search(args: argparse.Namespace) -> int:
  _check_writable(args.out, "--out")
  _check_writable(args.group_plan_out, "--group-plan-out")
  cluster = Cluster.resolve(args.cluster)
  start = time.perf_counter()

  def progress(message: str) -> None:
    if not args.json:
      print(f"[{time.perf_counter() - start:5.1f}s] {message}", file=sys.stderr)

  if args.step:
    if args.model is not None or args.seq or args.dtype != "float32":
      raise HetSpmdError("--step searches your own step as it is: drop --model, --seq and --dtype (set them in "
                         "the function that builds the step)")
    step, step_args, step_kwargs = load_step(args.step)
    name, dtype, seq = args.step, None, None
  else:
    workload = models.get(args.model or "gpt2-small").with_dtype(args.dtype)
    args.global_batch = args.global_batch or DEFAULT_GLOBAL_BATCH
    batch = workload.example_batch(args.global_batch, args.seq)
    step, step_args, step_kwargs = workload.make_train_step(), (workload.abstract_state(), batch), {}
    name, dtype = workload.name, args.dtype
    seq = batch[next(iter(batch))].shape[1] if workload.default_seq else None
  found = search_step(step, *step_args, cluster=cluster, global_batch=args.global_batch, top=args.top,
                      progress=progress, overlap=not args.no_overlap, grad_reduce_dtype=args.grad_reduce_dtype,
                      name=name, calibration=_calibration_file(args.calibration), **step_kwargs)
  found = dataclasses.replace(found, subject=dataclasses.replace(found.subject, dtype=dtype, seq=seq))
  print(json.dumps(found.to_json(), indent=2) if args.json else found)
  if not args.json and (args.out or args.group_plan_out):
    print()
  writes = []
  if args.out:
    writes.append((args.out, "the best plan", lambda: _write_plan(found, args.out)))
  if args.group_plan_out:
    writes.append((args.group_plan_out, "the best group plan", lambda: _write_group_plan(found, args.group_plan_out)))
  return _write_all(args, writes)


DEFAULT_GLOBAL_BATCH = 64  # --model's, where --global-batch is not given (--step reads the step's batch)


def load_step(spec: str) -> tuple[Any, tuple, dict]:
  """``FILE_OR_MODULE:FUNCTION`` imported and called: ``(step, args, kwargs)``, the step as the user calls it and
  its arguments. Each way it can fail names the file or module and the function, and says what was expected."""
  where, sep, function = spec.rpartition(":")
  if not sep or not where or not function.isidentifier():
    raise HetSpmdError(f"--step {spec!r}: expected FILE.py:FUNCTION or MODULE:FUNCTION, such as "
                       "examples/nnx_lm.py:gemma3_1b or mypackage.train:search_inputs")
  try:
    if where.endswith(".py") or os.sep in where:
      if not Path(where).is_file():
        raise HetSpmdError(f"--step {spec!r}: no file {where!r}")
      name = Path(where).stem if Path(where).stem not in sys.modules else f"_hetspmd_step_{Path(where).stem}"
      loaded = importlib.util.spec_from_file_location(name, where)
      module = importlib.util.module_from_spec(loaded)
      sys.modules[name] = module  # as an import registers it (dataclasses look their module up there)
      folder = str(Path(where).resolve().parent)
      sys.path.insert(0, folder)  # the file's own imports, as python FILE finds them
      try:
        loaded.loader.exec_module(module)
      except BaseException:
        del sys.modules[name]
        raise
      finally:
        if folder in sys.path:
          sys.path.remove(folder)
    else:
      module = importlib.import_module(where)
  except HetSpmdError:
    raise
  except Exception as e:  # noqa: BLE001 (the user's module: any error it raises on import is reported)
    raise HetSpmdError(f"--step {spec!r}: importing {where!r} failed: {type(e).__name__}: {e}") from e
  make = getattr(module, function, None)
  if not callable(make):
    raise HetSpmdError(f"--step {spec!r}: {where!r} has no function {function!r}"
                       + ("" if make is None else f" (it is a {type(make).__name__})"))
  expected = ("it must take no arguments and return (step, args, kwargs): the train step as you call it, a tuple "
              "of its positional arguments (arrays or jax.ShapeDtypeStruct, NNX objects from nnx.eval_shape) and "
              "a dict of its keyword arguments")
  try:
    inspect.signature(make).bind()
  except TypeError as e:
    raise HetSpmdError(f"--step {spec!r}: {function}() cannot be called without arguments ({e}); {expected}") from e
  except ValueError:  # no signature to read: call it and see
    pass
  made = make()
  if not (isinstance(made, tuple) and len(made) == 3 and callable(made[0]) and isinstance(made[1], (tuple, list))
          and isinstance(made[2], dict)):
    got = f"a tuple of {len(made)}" if isinstance(made, tuple) else f"a {type(made).__name__}"
    raise HetSpmdError(f"--step {spec!r}: {function}() returned {got}; {expected}")
  return made[0], tuple(made[1]), made[2]


def _write_plan(found, path: str) -> None:
  """The best single program to ``path``."""
  if not found.plans:
    raise HetSpmdError(f"no single program fits ({found.priced.error}); --group-plan-out FILE writes the group "
                       "plan that fits")
  single_plan(found.plans[0], found.cluster, found.state, found.ideal_throughput).save(path)


def _write_group_plan(found, path: str) -> None:
  """The best group plan to ``path``."""
  if found.group_plan is None:
    raise HetSpmdError(f"no group plan fits {found.subject.name} on {found.cluster} at global batch "
                       f"{found.subject.global_batch} (one device kind, or replicated and shared state both too "
                       "large)")
  to_group_plan(found.cluster, found.group_plan, found.ideal_throughput).save(path)


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
