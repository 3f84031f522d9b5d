"""hetspmd's runtime overhead: one uniform plan vs hand-written jax.jit.

    python benchmarks/overhead.py [--model gpt2-tiny] [--batch 64] [--layout 8,1] [--steps 41]

Both run the same train step with the same state shardings and the batch
split evenly over the data axis (one microbatch per position for hetspmd).
Steps alternate between the two (in ABBA order) so machine noise hits both alike; prints the
median step time of each and their ratio (goal: hetspmd / jit <= 1.03).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

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

  workload = models.get(args.model)
  layout = tuple(int(x) for x in args.layout.split(","))
  cluster = hs.Cluster.emulate(jax.devices(), kinds=["cpu"] * len(jax.devices()))
  state0 = workload.init_state(0)
  plan = hs.plan_for(cluster, state0, global_batch=args.batch, layout=layout,
                     microbatch=args.batch // layout[0], counts=(1,) * layout[0])
  step = hs.parallelize(workload.make_train_step(hs.value_and_grad), cluster=cluster, plan=plan,
                        global_batch=args.batch)
  mesh = plan.mesh()
  shardings = plan.state_shardings(mesh, state0)
  batch_sharding = NamedSharding(mesh, P("data"))
  plain = jax.jit(workload.make_train_step(), in_shardings=(shardings, batch_sharding),
                  out_shardings=(shardings, None), donate_argnums=0)

  host_batch = workload.synthetic_batch(0, batch=args.batch)
  hs_batch = step.shard_batch(host_batch)
  jit_batch = jax.device_put(host_batch, batch_sharding)
  hs_state = step.shard_state(state0)
  jit_state = jax.device_put(workload.init_state(0), shardings)
  for _ in range(2):  # compile and warm up
    hs_state, _ = step(hs_state, hs_batch)
    jit_state, _ = plain(jit_state, jit_batch)
  jax.block_until_ready((hs_state, jit_state))

  states = {"hs": hs_state, "jit": jit_state}
  runs = {"hs": (step, hs_batch), "jit": (plain, jit_batch)}
  times = {"hs": [], "jit": []}
  for i in range(args.steps):
    for name in ("hs", "jit") if i % 2 == 0 else ("jit", "hs"):  # ABBA: neither always runs first
      fn, batch = runs[name]
      start = time.perf_counter()
      states[name], _ = fn(states[name], batch)
      jax.block_until_ready(states[name])
      times[name].append(time.perf_counter() - start)
  hs_state, jit_state = states["hs"], states["jit"]
  hs_times, jit_times = times["hs"], times["jit"]

  hs_median, jit_median = statistics.median(hs_times), statistics.median(jit_times)
  print(f"model {args.model}, global batch {args.batch}, mesh {dict(zip(plan.axis_names, plan.mesh_shape))}, "
        f"{args.steps} steps each, {os.cpu_count()} CPUs")
  print(f"{'':24} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
  print(f"{'hetspmd.parallelize':24} {hs_median * 1e3:10.2f} {min(hs_times) * 1e3:8.2f} {max(hs_times) * 1e3:8.2f}")
  print(f"{'jax.jit (same shardings)':24} {jit_median * 1e3:10.2f} {min(jit_times) * 1e3:8.2f} {max(jit_times) * 1e3:8.2f}")
  ratio = hs_median / jit_median
  print(f"ratio hetspmd / jit: {ratio:.3f} (goal <= 1.03: {'met' if ratio <= 1.03 else 'NOT met'})")
  cost = lambda f, *a: (lambda c: c[0] if isinstance(c, list) else c)(f.lower(*a).compile().cost_analysis())["flops"]
  print(f"XLA FLOPs per step: hetspmd {cost(step, hs_state, host_batch):.4g}, jit {cost(plain, jit_state, jit_batch):.4g}")


if __name__ == "__main__":
  main()
