"""hetspmd's runtime overhead: one uniform plan vs hand-written jax.jit, and an unmodified step vs a marked one.

    python benchmarks/overhead.py [--model gpt2-tiny] [--batch 64] [--layout 8,1] [--steps 41]

Three programs run the zoo's train step with the same state shardings and the batch split evenly over
the data axis (one microbatch per position for hetspmd):

* ``hetspmd (hs.value_and_grad)``: the step with its gradient marked by ``hetspmd.value_and_grad``;
* ``hetspmd (unmodified)``: the same step with ``jax.value_and_grad``, as a Flax user writes it;
* ``jax.jit``: the unmodified step under ``jax.jit`` with the plan's shardings.

On a data-only layout, two group plans run the same microbatches: ``group plan, one group`` (one group of
every device) and ``one group sharding params`` (the same group holding its parameters split, FSDP). Their
ratios to ``jax.jit`` (timed again in their own rotation, so the goals' rotation stays the three programs') are
printed without a goal: each runs a group program and an exchange program, and the host lays the state's leaves
out between them.

Steps rotate between them (each order in turn) so machine noise hits all alike; prints the median step
time of each and the ratios (goals: marked / jit <= 1.03, unmodified / marked <= 1.02).
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="gpt2-tiny")
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--layout", default="8,1", help="data,model mesh shape")
  parser.add_argument("--steps", type=int, default=41)
  args = parser.parse_args()

  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  import hetspmd as hs
  from hetspmd import models
  from hetspmd.plan.groups import Group, group_plan

  workload = models.get(args.model)
  layout = tuple(int(x) for x in args.layout.split(","))
  cluster = hs.Cluster.emulate(jax.devices(), kinds=["cpu"] * len(jax.devices()))
  state0 = workload.init_state(0)
  plan = hs.plan_for(cluster, state0, global_batch=args.batch, layout=layout,
                     microbatch=args.batch // layout[0], counts=(1,) * layout[0])
  step = hs.parallelize(workload.make_train_step(hs.value_and_grad), cluster=cluster, plan=plan,
                        global_batch=args.batch)
  unmodified = hs.parallelize(workload.make_train_step(), cluster=cluster, plan=plan, global_batch=args.batch)
  mesh = plan.mesh()
  shardings = plan.state_shardings(mesh, state0)
  batch_sharding = NamedSharding(mesh, P("data"))
  plain = jax.jit(workload.make_train_step(), in_shardings=(shardings, batch_sharding),
                  out_shardings=(shardings, None), donate_argnums=0)

  host_batch = workload.synthetic_batch(0, batch=args.batch)
  hs_batch = step.shard_batch(host_batch)
  jit_batch = jax.device_put(host_batch, batch_sharding)
  runs = {"hs": (step, hs_batch), "unmodified": (unmodified, unmodified.shard_batch(host_batch)),
          "jit": (plain, jit_batch)}
  states = {"hs": step.shard_state(state0), "unmodified": unmodified.shard_state(workload.init_state(0)),
            "jit": jax.device_put(workload.init_state(0), shardings)}
  if layout[1] == 1:  # the same microbatches as group programs: one group of every device, unsharded and sharded
    for name, sharded in (("group", False), ("fsdp group", True)):
      grouped = hs.parallelize(workload.make_train_step(), plan=group_plan(
          [Group(tuple(range(layout[0])), args.batch // layout[0], (1,) * layout[0], shard_params=sharded)],
          args.batch), global_batch=args.batch)
      runs[name] = (grouped, grouped.shard_batch(host_batch))
      states[name] = grouped.shard_state(workload.init_state(0))
  from _steps import rotated_step_seconds

  grouped = {name: runs.pop(name) for name in ("group", "fsdp group") if name in runs}
  names = list(runs)
  times = rotated_step_seconds(runs, states, args.steps)
  if grouped:  # a rotation of their own beside jax.jit again: the goals' rotation stays the three programs'
    beside = {"jit again": states["jit"], **{k: states[k] for k in grouped}}
    again = rotated_step_seconds({"jit again": runs["jit"], **grouped}, beside, args.steps)
    states["jit"] = beside["jit again"]  # the jit step donates its state
    times.update(again)
    names += list(again)
  medians = {name: statistics.median(t) for name, t in times.items()}
  print(f"model {args.model}, global batch {args.batch}, mesh {dict(zip(plan.axis_names, plan.mesh_shape))}, "
        f"{args.steps} steps each, {os.cpu_count()} CPUs")
  labels = {"hs": "hetspmd (hs.value_and_grad)", "unmodified": "hetspmd (unmodified)", "jit": "jax.jit (same shardings)",
            "jit again": "jax.jit (beside the groups)", "group": "group plan, one group",
            "fsdp group": "one group sharding params"}
  print(f"{'':28} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
  for name in names:
    print(f"{labels[name]:28} {medians[name] * 1e3:10.2f} {min(times[name]) * 1e3:8.2f} {max(times[name]) * 1e3:8.2f}")
  ratio = medians["hs"] / medians["jit"]
  print(f"ratio hetspmd / jit: {ratio:.3f} (goal <= 1.03: {'met' if ratio <= 1.03 else 'NOT met'})")
  same = medians["unmodified"] / medians["hs"]
  print(f"ratio unmodified / hs.value_and_grad: {same:.3f} (goal <= 1.02: {'met' if same <= 1.02 else 'NOT met'})")
  for name in ("group", "fsdp group"):
    if name in medians:  # its programs, their exchange and the host's work between them, against one program
      print(f"ratio {labels[name]} / jit: {medians[name] / medians['jit again']:.3f}")
  hs_state = states["hs"]
  jit_state = states["jit"]
  cost = lambda f, *a: (lambda c: c[0] if isinstance(c, list) else c)(f.lower(*a).compile().cost_analysis())["flops"]
  print(f"XLA FLOPs per step: hetspmd {cost(step, hs_state, host_batch):.4g}, jit {cost(plain, jit_state, jit_batch):.4g}")


if __name__ == "__main__":
  main()
