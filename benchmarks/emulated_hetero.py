"""A real heterogeneous pair on one machine: weighted plan vs uniform vs ideal.

    python benchmarks/emulated_hetero.py [--batch 8192] [--microbatch 256] [--steps 7] [--slowdown-seconds 240]
                                         [--sharded-only | --adaptive [--prior equal|swapped] [--every 1] [--json]]

Two processes with one CPU device each, pinned to separate cores with
``taskset`` and joined by ``jax.distributed`` (gloo on 127.0.0.1). A busy
loop pinned to the second core (it stops by itself after
``--slowdown-seconds``) makes that device slower. Each process measures its
own device with the profiler (matmul FLOP/s, copy and read bandwidth), and
one all-reduce of the gradients' bytes between the two times the link; the
weighted plan splits microbatches by the cost model's time on those specs.
Printed side by side, from one run:

* DP-EV: the uniform split;
* hetspmd (weighted): the planner's counts at this microbatch (the cost
  model's step time on the profiled specs, balanced), and for comparison the
  split proportional to each device's measured gradient throughput;
* hetspmd (group plan): the best group plan the search prices on the same
  specs and the measured link (one program per process's device, each its
  own microbatch of ``--microbatch`` or half of it, a tail or not), run by
  ``hetspmd.parallelize(plan=group_plan)``, its batch placed ahead
  (``shard_batch``) as the single programs' is;
* step ideal: both devices' throughputs added, each measured training alone
  (the same hetspmd step, whole global batch, on that device only): what the
  two devices would do with no communication and no imbalance;
* ideal: both devices' throughputs on bare microbatch gradients added (no
  gradient accumulation, no optimizer update either): a stricter bound.

Then the pair again with two CPU devices per process, one group per process
(``--sharded-only`` runs only this): the group plan, and the same plan with
each group sharding its parameters over its two devices (FSDP in the group:
gathers and reduce-scatters every microbatch, in lockstep; every group
sharding, the plan is hybrid), the steps of the two interleaved; each against
the step ideal of this layout.

``--adaptive``: the pair planned on a wrong prior (``equal``: as fast as each other; ``swapped``: each the
other's measured speed), run static and with ``hetspmd.Rebalance`` for ``--steps`` steps, then core 1 freed for
as many more (drift); each step's fraction of the step ideal (slowed, then freed), and the counts the
controller moved to. Goals: the rebalanced run at >= 90% of the step ideal within 5 steps, and again within 5
steps of the drift. Each form is also run static at the best splits (slowed, then freed): its
fractions there are the form's ceiling on this machine, which its rebalanced run cannot pass. ``--json``
ends with one line: ``static_fraction``, ``rebalanced_fraction``, ``steps_to_balance``, ``drift_fraction``,
``steps_after_drift``, ``freed_best_fraction``, the counts and the measurements (``group_plan`` also has
``best_static_fraction``).

Goal: hetspmd (weighted) at >= 90% of the step ideal; the sharded group plan
within 5 points of the unsharded one. Needs Linux with
``taskset`` and 2+ cores. The default batch keeps the per-step costs that
no split can remove (the gradient all-reduce over gloo, about 20 ms for this
MLP's 6 MB of gradients; the optimizer update) small against the
microbatches; at ``--batch 2048 --microbatch 64`` they take a fifth of the
step.
"""

from __future__ import annotations

import argparse
import statistics
import textwrap

# Both workers' start: ``{devices}`` CPU devices per process, gloo, the benchmark's MLP, and alone_rate(devices): the
# whole step's throughput (examples/s) on those devices only (one program), the median of several steps.
PRELUDE = textwrap.dedent("""
    import os, sys, json, time, statistics, dataclasses
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count={devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    rank, port, batch, steps, microbatch = map(int, sys.argv[1:6])
    jax.distributed.initialize(f"127.0.0.1:{{port}}", num_processes=2, process_id=rank, initialization_timeout=120)
    import numpy as np
    import hetspmd as hs
    from hetspmd import models
    from hetspmd.models.mlp import MLPConfig
    from jax.experimental import multihost_utils

    workload = dataclasses.replace(models.get("mlp"), name="mlp-bench", config=MLPConfig((512, 1024, 1024, 10)))

    def alone_rate(devices):
      cluster = hs.Cluster.emulate(devices, kinds=["cpu"] * len(devices))
      alone = hs.parallelize(workload.make_train_step(hs.value_and_grad), cluster=cluster,
                             plan=hs.plan_for(cluster, workload.init_state(0), global_batch=batch,
                                              microbatch=microbatch), global_batch=batch)
      st, sb = alone.shard_state(workload.init_state(0)), alone.shard_batch(workload.synthetic_batch(rank, batch=batch))
      st, m = alone(st, sb); jax.block_until_ready(m)
      times = []
      for _ in range(max(3, steps // 2)):
        t = time.perf_counter(); st, m = alone(st, sb); jax.block_until_ready(m); times.append(time.perf_counter() - t)
      return batch / statistics.median(times)
""")

WORKER = PRELUDE.format(devices=1) + textwrap.dedent("""
    from hetspmd.hardware import profiler
    from hetspmd.passes.profile import profile_step
    from hetspmd.plan.counts import balanced_counts
    from hetspmd.planner.building import plan_from
    from hetspmd.planner.grouping import search_groups, to_group_plan
    from hetspmd.planner.pricing import evaluate

    device = jax.local_devices()[0]

    # This device's speed, measured under whatever load it has.
    spec = profiler.measure_device_spec(device, f"cpu{rank}")  # matmul FLOP/s, copy and read bandwidth
    # Its own throughput (examples/s) on the step's gradient work, for the ideal bound.
    from flax import nnx
    graphdef = workload.graphdef()
    grad_fn = jax.jit(jax.value_and_grad(lambda p, b: workload.loss(nnx.merge(graphdef, p), b)[0]))
    state, micro = workload.init_state(0), workload.synthetic_batch(rank, batch=microbatch)
    # Averaged over many calls: a single short call can fit in one scheduler time slice.
    jax.block_until_ready(grad_fn(state["params"], micro))
    start, calls = time.perf_counter(), 0
    while calls < 20 or time.perf_counter() - start < 1.0:
      jax.block_until_ready(grad_fn(state["params"], micro)); calls += 1
    rate = microbatch * calls / (time.perf_counter() - start)
    # And its throughput training alone: the whole step (microbatch loop, optimizer) on this device only.
    alone = alone_rate([device])
    # The link between the processes (gloo over TCP on 127.0.0.1): one all-reduce of the gradients' bytes, timed.
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()), ("x",))
    n_floats = sum(int(np.size(x)) for x in jax.tree.leaves(state["params"]))
    rows = jax.make_array_from_single_device_arrays((2, n_floats), NamedSharding(mesh, P("x")),
                                                    [jax.device_put(np.ones((1, n_floats), np.float32), device)])
    all_reduce = jax.jit(lambda r: r.sum(0), out_shardings=NamedSharding(mesh, P()))
    jax.block_until_ready(all_reduce(rows))
    reduce_times = []
    for _ in range(10):
      t = time.perf_counter(); jax.block_until_ready(all_reduce(rows)); reduce_times.append(time.perf_counter() - t)
    reduce_s = statistics.median(reduce_times)
    speeds = multihost_utils.process_allgather(np.array([spec.fp32_flops, rate, alone, spec.memory_bandwidth,
                                                         spec.read_bandwidth or 0.0, reduce_s]))

    custom = {f"cpu{i}": hs.DeviceSpec(f"cpu{i}", float(speeds[i][0]), float(speeds[i][0]), 2**30, float(speeds[i][3]),
                                       measured=True, read_bandwidth=float(speeds[i][4]) or None) for i in range(2)}
    # a 2-device all-reduce moves each device's bytes once each way: the link's rate is the bytes over the time
    gloo = hs.Link("gloo", 4 * n_floats / max(float(s[5]) for s in speeds), 0.0)
    cluster = hs.Cluster.emulate(jax.devices(), kinds=["cpu0", "cpu1"], custom=custom, inter=gloo)
    global_batch = batch
    total_microbatches = global_batch // microbatch
    plans = {
        "DP-EV (uniform)": hs.plan_for(cluster, state, global_batch=global_batch, microbatch=microbatch,
                                       counts=(total_microbatches // 2, total_microbatches - total_microbatches // 2)),
        "hetspmd (weighted)": plan_from(evaluate(
            cluster, profile_step(workload.make_train_step(), workload.abstract_state(), workload.example_batch(2)),
            (0, 1), microbatch, 0, "none", global_batch=global_batch,
            counts_rule=lambda kinds, costs: balanced_counts(kinds, costs, total_microbatches), name="weighted"),
            cluster, state),
        "hetspmd (by step rate)": hs.plan_for(cluster, state, global_batch=global_batch, microbatch=microbatch,
                                              counts=hs.plan.proportional_counts([float(s[1]) for s in speeds],
                                                                                 total_microbatches)),
    }
    profile = profile_step(workload.make_train_step(), workload.abstract_state(), workload.example_batch(2))
    grouped = to_group_plan(cluster, search_groups(cluster, profile, global_batch, [microbatch // 2, microbatch]))
    host_batch = workload.synthetic_batch(7, batch=global_batch)
    result = {"speeds_flops": [float(s[0]) for s in speeds], "rates": [float(s[1]) for s in speeds],
              "bandwidths": [float(s[3]) for s in speeds], "read_bandwidths": [float(s[4]) for s in speeds],
              "alone_rates": [float(s[2]) for s in speeds], "reduce_s": max(float(s[5]) for s in speeds),
              "reduce_bytes": 4 * n_floats}
    for name, plan in plans.items():
      step = hs.parallelize(workload.make_train_step(hs.value_and_grad), cluster=cluster, plan=plan, global_batch=global_batch)
      st = step.shard_state(workload.init_state(0))
      sb = step.shard_batch({k: v[step.process_examples()] for k, v in host_batch.items()})
      st, m = step(st, sb); jax.block_until_ready(m)
      times = []
      for _ in range(steps):
        t = time.perf_counter(); st, m = step(st, sb); jax.block_until_ready(m); times.append(time.perf_counter() - t)
      result[name] = {"counts": list(plan.microbatch_counts), "median_s": statistics.median(times)}
    step = hs.parallelize(workload.make_train_step(hs.value_and_grad), plan=grouped, global_batch=global_batch)
    st = step.shard_state(workload.init_state(0))
    sb = step.shard_batch({k: v[step.process_examples()] for k, v in host_batch.items()})
    st, m = step(st, sb); jax.block_until_ready(m)
    times = []
    for _ in range(steps):
      t = time.perf_counter(); st, m = step(st, sb); jax.block_until_ready(m); times.append(time.perf_counter() - t)
    result["hetspmd (group plan)"] = {"counts": [f"{g.microbatch}x{list(g.counts)}" for g in grouped.groups]
                                      + ([f"tail {grouped.tail_count}x{grouped.tail_microbatch}"]
                                         if grouped.tail_count else []), "median_s": statistics.median(times)}
    print(json.dumps(result))
""")


# The same pair with two CPU devices per process, one group per process: the group plan as it runs, then with each
# group sharding its parameters over its two devices (FSDP in the group; every group sharding, the plan is hybrid:
# each holds its state split), the counts the same.
WORKER_SHARDED = PRELUDE.format(devices=2) + textwrap.dedent("""
    from hetspmd.plan.groups import Group, group_plan

    local = jax.local_devices()
    # This process's throughput training alone: the whole step on its two devices (one program), for the step ideal.
    rate = alone_rate(local)
    # An all-gather of the parameters' bytes between this process's two devices (what a sharded group does twice
    # a microbatch): under gloo, JAX's CPU client runs collectives inside one process through gloo too.
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(local), ("d",))
    n_floats = sum(int(np.size(x)) for x in jax.tree.leaves(workload.init_state(0)["params"]))
    half = (n_floats + 1) // 2
    parts = jax.device_put(np.zeros((2 * half,), np.float32), NamedSharding(mesh, P("d")))
    gather = jax.jit(jax.shard_map(lambda x: jax.lax.all_gather(x, "d", tiled=True), mesh=mesh, in_specs=P("d"),
                                   out_specs=P(), check_vma=False))
    jax.block_until_ready(gather(parts))
    gathers = []
    for _ in range(10):
      t = time.perf_counter(); jax.block_until_ready(gather(parts)); gathers.append(time.perf_counter() - t)
    measured = multihost_utils.process_allgather(np.array([rate, statistics.median(gathers)]))
    rates = [float(r) for r in measured[:, 0]]
    # one group per process, its microbatches split by the measured rates (each device half of its process's)
    ids = [[d.id for d in jax.devices() if d.process_index == p] for p in (0, 1)]
    counts = hs.plan.proportional_counts([rates[0] / 2] * 2 + [rates[1] / 2] * 2, batch // microbatch)
    host_batch = workload.synthetic_batch(7, batch=batch)
    runs = {}
    for name, sharded in (("group plan", False), ("group plan, hybrid", True)):
      plan = group_plan([Group(tuple(ids[0]), microbatch, tuple(counts[:2]), shard_params=sharded),
                         Group(tuple(ids[1]), microbatch, tuple(counts[2:]), shard_params=sharded)], batch)
      step = hs.parallelize(workload.make_train_step(hs.value_and_grad), plan=plan, global_batch=batch)
      st = step.shard_state(workload.init_state(0))
      sb = step.shard_batch({k: v[step.process_examples()] for k, v in host_batch.items()})
      for _ in range(2):
        st, m = step(st, sb); jax.block_until_ready(m)
      runs[name] = [step, st, sb, []]
    for _ in range(steps):  # interleaved: both plans see the same load over the run
      for run in runs.values():
        t = time.perf_counter(); run[1], m = run[0](run[1], run[2]); jax.block_until_ready(m)
        run[3].append(time.perf_counter() - t)
    print(json.dumps({"alone_rates": rates, "counts": list(counts), "gather_s": float(measured[:, 1].max()),
                      "gather_bytes": 8 * half,
                      **{name: statistics.median(run[3]) for name, run in runs.items()}}))
""")


# A wrong prior, then measured balance: the slowed pair planned as if equal (or swapped), run with and without
# rebalancing; then core 1 is freed mid-run (drift). Rank 0 switches the busy loop through HETSPMD_BUSY_SWITCH.
WORKER_ADAPTIVE = PRELUDE.format(devices=1) + textwrap.dedent("""
    import pathlib
    switch = pathlib.Path(os.environ["HETSPMD_BUSY_SWITCH"])
    prior, every, drift_steps = sys.argv[6], int(sys.argv[7]), int(sys.argv[8])
    def slow(on):  # rank 0 flips the busy loop; both wait at a collective so each sees the same load after
      if rank == 0:
        switch.touch() if on else switch.unlink(missing_ok=True)
      time.sleep(0.2); multihost_utils.sync_global_devices("switch")
    device = jax.local_devices()[0]
    slow(True)
    slowed = [float(r) for r in np.ravel(multihost_utils.process_allgather(np.array([alone_rate([device])])))]
    slow(False)
    freed = [float(r) for r in np.ravel(multihost_utils.process_allgather(np.array([alone_rate([device])])))]
    cluster = hs.Cluster.emulate(jax.devices(), kinds=["V100-32GB", "P100-16GB"])  # two kinds: one per process
    total = batch // microbatch
    weights = {"equal": [1.0, 1.0], "swapped": slowed[::-1]}[prior]
    counts = hs.plan.proportional_counts(weights, total)
    host_batch = workload.synthetic_batch(7, batch=batch)
    result = {"slowed_alone_rates": slowed, "freed_alone_rates": freed, "prior_counts": list(counts)}
    # the best static split: counts in proportion to each device's measured rate training alone, slowed
    best = hs.plan.proportional_counts(slowed, total)
    result["best_counts"] = list(best)
    freed_best = hs.plan.proportional_counts(freed, total)
    result["freed_best_counts"] = list(freed_best)
    from hetspmd.plan.groups import Group, group_plan
    ids = [d.id for d in jax.devices()]
    both, slowed_only, freed_only = (("slowed", steps), ("freed", drift_steps)), (("slowed", steps),), (("freed", drift_steps),)
    # (mode, group plan?, counts, rebalanced?, phases); each form at the best splits measures its ceiling
    modes = (("static", False, counts, False, slowed_only), ("best static", False, best, False, slowed_only),
             ("freed best", False, freed_best, False, freed_only),
             ("rebalanced", False, counts, True, both), ("group plan, rebalanced", True, counts, True, both),
             ("group plan, best static", True, best, False, slowed_only),
             ("group plan, freed best", True, freed_best, False, freed_only))
    for mode, grouped, mode_counts, rebalanced, phases in modes:
      rebalance = hs.Rebalance(every=every, confirm=2, lag=1) if rebalanced else None
      if grouped:  # one group per process: each group's program timed as it runs
        plan = group_plan([Group((i,), microbatch, (c,)) for i, c in zip(ids, mode_counts)], batch)
      else:
        plan = hs.plan_for(cluster, workload.init_state(0), global_batch=batch, microbatch=microbatch,
                           counts=mode_counts)
      step = hs.parallelize(workload.make_train_step(hs.value_and_grad), cluster=cluster, plan=plan,
                            global_batch=batch, rebalance=rebalance)
      st = step.shard_state(workload.init_state(0))
      st, m = step(st, {k: v[step.process_examples()] for k, v in host_batch.items()}); jax.block_until_ready(m)
      times, counts_seen = [], []
      for phase, n in phases:
        slow(phase == "slowed")
        for _ in range(n):
          b = {k: v[step.process_examples()] for k, v in host_batch.items()}
          t = time.perf_counter(); st, m = step(st, b); jax.block_until_ready(m); times.append(time.perf_counter() - t)
          counts_seen.append([c for g in step.plan.groups for c in g.counts] if step.grouped
                             else list(step.plan.microbatch_counts))
      result[mode] = {"times": times, "counts": counts_seen, "compiles": step.rebalancer.compiles if rebalance else 1,
                      "history": step.history}
    slow(False)
    print(json.dumps(result))
""")


def adaptive_rows(args) -> None:
  """A wrong prior, static against rebalanced, then drift (the busy loop stops mid-run)."""
  import json
  import tempfile
  from pathlib import Path

  from _steps import run_slowed_pair

  switch = str(Path(tempfile.mkdtemp()) / "busy")
  result = run_slowed_pair(WORKER_ADAPTIVE, (args.batch, args.steps, args.microbatch, args.prior, args.every,
                                             args.steps), args.slowdown_seconds, switch=switch)
  ideal = args.batch / sum(result["slowed_alone_rates"])
  freed_ideal = args.batch / sum(result["freed_alone_rates"])
  static = result["static"]
  n = args.steps
  total = args.batch // args.microbatch
  best = statistics.median(result["best static"]["times"])

  def reached(times, goal_ideal):
    """Steps until one at >= 90% of the ideal from which the rest of the phase holds a median >= 90% (a noisy
    step later does not undo it; None: never)."""
    fractions = [goal_ideal / t for t in times]
    for i in range(len(times)):
      if fractions[i] >= 0.9 and statistics.median(fractions[i:]) >= 0.9:
        return i + 1
    return None

  def summary(run):
    times = run["times"]
    return {"rebalanced_fraction": ideal / statistics.mean(times[n - tail:n]),
            "steps_to_balance": reached(times[:n], ideal),
            "steps_to_best_static": next((i + 1 for i in range(n) if all(t <= 1.05 * best for t in times[i:n])),
                                         None),
            "drift_fraction": freed_ideal / statistics.mean(times[-tail:]),
            "steps_after_drift": reached(times[n:], freed_ideal),
            "counts": run["counts"], "compiles": run["compiles"],
            "measured": [{"call": h["call"], "moved_to": h["moved_to"],
                          "microbatch_seconds": {k: v["microbatch_seconds"] for k, v in h["measured"].items()}}
                         for h in run["history"]]}

  tail = max(1, n // 2)
  single, grouped = summary(result["rebalanced"]), summary(result["group plan, rebalanced"])
  # each form's own ceiling: the form run at the best splits, static
  single["freed_best_fraction"] = freed_ideal / statistics.median(result["freed best"]["times"])
  grouped["best_static_fraction"] = ideal / statistics.median(result["group plan, best static"]["times"])
  grouped["freed_best_fraction"] = freed_ideal / statistics.median(result["group plan, freed best"]["times"])
  out = {"prior": args.prior, "prior_counts": result["prior_counts"],
         "static_fraction": ideal / statistics.median(static["times"]),
         "best_static_fraction": ideal / best, "best_counts": result["best_counts"], **single, "group_plan": grouped}
  print(f"2 processes x 1 CPU device, core 1 shared with a busy loop; global batch {args.batch}, microbatch "
        f"{args.microbatch}; prior {args.prior!r}: counts {result['prior_counts']}; hetspmd.Rebalance(every="
        f"{args.every}, confirm=2, lag=1): two measurements in a row must find the split off balance, and new counts "
        "run one call after the decision. The single program's loops are timed inside the step (host callbacks), "
        "the group plan's programs (one group per process) as they run")
  print(f"whole step alone, slowed: {result['slowed_alone_rates'][0]:.0f} and {result['slowed_alone_rates'][1]:.0f}"
        f" examples/s; freed: {result['freed_alone_rates'][0]:.0f} and {result['freed_alone_rates'][1]:.0f}")
  print(f"{'step':>5} {'static':>14} {'single program, rebalanced':>35} {'group plan, rebalanced':>35}")
  runs = (result["rebalanced"], result["group plan, rebalanced"])
  for i in range(2 * n):
    goal = ideal if i < n else freed_ideal
    if i == n:
      print(f"core 1 freed (drift); step ideal now {freed_ideal:.3f} s")
    first = f"{static['times'][i]:7.3f} {ideal / static['times'][i]:6.1%}" if i < n else ""
    cells = [f"{r['times'][i]:7.3f} {goal / r['times'][i]:6.1%} {str(r['counts'][i]):>20}" for r in runs]
    print(f"{i + 1:5d} {first:>14} {cells[0]:>35} {cells[1]:>35}")
  print(f"static split on the {args.prior} prior: {out['static_fraction']:.1%} of the step ideal (median); best static "
        f"split {result['best_counts']} (each device's measured rate alone): {out['best_static_fraction']:.1%}, the "
        f"most a split of {total} microbatches reaches here")
  for name, r in (("single program", single), ("group plan", grouped)):
    print(f"{name}, rebalanced: {r['rebalanced_fraction']:.1%} (mean of the last {tail} slowed steps), at >= 90% from "
          f"step {r['steps_to_balance']} (median of the rest; goal: within 5: "
          f"{'met' if r['steps_to_balance'] and r['steps_to_balance'] <= 5 else 'NOT met'}), within 5% of the best "
          f"static split from step {r['steps_to_best_static']}; after the drift {r['drift_fraction']:.1%} of the new "
          f"step ideal, at >= 90% from step {r['steps_after_drift']} after it (goal: within 5: "
          f"{'met' if r['steps_after_drift'] and r['steps_after_drift'] <= 5 else 'NOT met'}); "
          f"{r['compiles']} program(s) built")
    slowed_ceiling = out["best_static_fraction"] if name == "single program" else r["best_static_fraction"]
    print(f"  the form's ceiling: run static at the best split {result['best_counts']} it reaches "
          f"{slowed_ceiling:.1%} of the step ideal (median), and at {result['freed_best_counts']} after "
          f"the drift {r['freed_best_fraction']:.1%} of the new one: a goal above these is above the form, not the "
          "rebalancing")
    for h in [h for i, h in enumerate(r["measured"]) if i == 0 or h["moved_to"]]:  # the first and the moves
      print(f"  measured at call {h['call']}: " + ", ".join(f"{k} {v * 1e3:.1f} ms a microbatch"
                                                        for k, v in h["microbatch_seconds"].items())
            + (f" -> counts {h['moved_to']}" if h["moved_to"] else ""))
  if args.json:
    print(json.dumps(out))


def sharded_rows(args) -> None:
  """The group plan against the same plan with each group sharding its parameters (two devices per process)."""
  from _steps import run_slowed_pair

  result = run_slowed_pair(WORKER_SHARDED, (args.batch, args.steps, args.microbatch), args.slowdown_seconds)
  step_ideal = args.batch / sum(result["alone_rates"])
  print(f"\n2 processes x 2 CPU devices (one group per process, pinned as above, core 1 shared with the busy loop), "
        f"global batch {args.batch}, microbatch {args.microbatch}; whole step alone: "
        f"{result['alone_rates'][0]:.0f} and {result['alone_rates'][1]:.0f} examples/s")
  print(f"{'plan':30} {'counts':>16} {'median step s':>14} {'of step ideal':>14}")
  fractions = {}
  for name in ("group plan", "group plan, hybrid"):
    fractions[name] = step_ideal / result[name]
    print(f"{'hetspmd (' + name + ')':30} {str(result['counts']):>16} {result[name]:14.3f} {fractions[name]:14.1%}")
  print(f"an all-gather of the {result['gather_bytes'] / 1e6:.1f} MB of parameters between a process's two devices: "
        f"{result['gather_s'] * 1e3:.1f} ms (under gloo, JAX's CPU client runs the collectives inside a process "
        f"through gloo too; a sharded group runs two such gathers and a reduce-scatter every microbatch)")
  gap = (fractions["group plan"] - fractions["group plan, hybrid"]) * 100
  print(f"the hybrid group plan (each group sharding its parameters) is {gap:.1f} points below the unsharded one "
        f"(goal: within 5; the steps interleaved, "
        f"medians of {args.steps}; on CPU the group's gathers and reduce-scatters run in line): "
        f"{'met' if gap <= 5 else 'NOT met'}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8192)
  parser.add_argument("--microbatch", type=int, default=256)
  parser.add_argument("--steps", type=int, default=7)
  parser.add_argument("--slowdown-seconds", type=int, default=240)
  parser.add_argument("--sharded-only", action="store_true", help="run only the sharded-group comparison")
  parser.add_argument("--adaptive", action="store_true",
                      help="plan on a wrong prior, run it static and rebalanced, then free core 1 mid-run")
  parser.add_argument("--prior", choices=("equal", "swapped"), default="equal",
                      help="with --adaptive: the speeds the plan is made on")
  parser.add_argument("--every", type=int, default=1, help="with --adaptive: calls between measurements")
  parser.add_argument("--json", action="store_true", help="with --adaptive: end with one JSON line")
  args = parser.parse_args()
  if args.adaptive:
    return adaptive_rows(args)
  if args.sharded_only:
    return sharded_rows(args)
  from _steps import run_slowed_pair

  result = run_slowed_pair(WORKER, (args.batch, args.steps, args.microbatch), args.slowdown_seconds)

  rates, alone_rates = result["rates"], result["alone_rates"]
  ideal = args.batch / sum(rates)
  alone_ideal = args.batch / sum(alone_rates)
  print(f"2 processes x 1 CPU device (cores 0 and 1; core 1 shared with a busy loop), global batch {args.batch}, "
        f"microbatch {args.microbatch}")
  print(f"measured matmul speed: device 0 {result['speeds_flops'][0] / 1e9:.1f} GFLOP/s, "
        f"device 1 {result['speeds_flops'][1] / 1e9:.1f} GFLOP/s (ratio {result['speeds_flops'][1] / result['speeds_flops'][0]:.2f}); "
        f"copy bandwidth {result['bandwidths'][0] / 1e9:.1f} and {result['bandwidths'][1] / 1e9:.1f} GB/s, "
        f"read {result['read_bandwidths'][0] / 1e9:.1f} and {result['read_bandwidths'][1] / 1e9:.1f} GB/s (0: not above copy)")
  print(f"measured gradient throughput alone: {rates[0]:.0f} and {rates[1]:.0f} examples/s; "
        f"whole step alone: {alone_rates[0]:.0f} and {alone_rates[1]:.0f} examples/s; "
        f"all-reduce of the {result['reduce_bytes'] / 1e6:.1f} MB of gradients over gloo: "
        f"{result['reduce_s'] * 1e3:.1f} ms (the cluster's link between the processes)")
  print(f"{'plan':22} {'counts':>10} {'median step s':>14} {'of ideal':>9} {'of step ideal':>14} {'speedup vs DP-EV':>17}")
  uniform = result["DP-EV (uniform)"]["median_s"]
  for name in ("DP-EV (uniform)", "hetspmd (weighted)", "hetspmd (by step rate)", "hetspmd (group plan)"):
    r = result[name]
    print(f"{name:22} {str(r['counts']):>10} {r['median_s']:14.3f} {ideal / r['median_s']:9.1%} "
          f"{alone_ideal / r['median_s']:14.1%} {uniform / r['median_s']:17.2f}")
  print(f"{'ideal (sum of rates)':22} {'':>10} {ideal:14.3f} {1:9.0%}")
  print(f"{'step ideal':22} {'':>10} {alone_ideal:14.3f} {'':>9} {1:14.0%}")
  weighted = result["hetspmd (weighted)"]["median_s"]
  print(f"hetspmd (weighted) at {alone_ideal / weighted:.1%} of the step ideal (goal >= 90%: "
        f"{'met' if alone_ideal / weighted >= 0.9 else 'NOT met'}), {ideal / weighted:.1%} of the gradient-only ideal")
  grouped = result["hetspmd (group plan)"]["median_s"]
  print(f"hetspmd (group plan) at {alone_ideal / grouped:.1%} of the step ideal (goal >= 90%: "
        f"{'met' if alone_ideal / grouped >= 0.9 else 'NOT met'})")
  sharded_rows(args)

if __name__ == "__main__":
  main()
