"""A real heterogeneous pair on one machine: weighted plan vs uniform vs ideal.

    python benchmarks/emulated_hetero.py [--batch 1024] [--steps 7] [--slowdown-seconds 240]

Two processes with one CPU device each, pinned to separate cores with
``taskset`` and joined by ``jax.distributed`` (gloo on 127.0.0.1). A busy
loop pinned to the second core (it stops by itself after
``--slowdown-seconds``) makes that device slower. Each process measures its
own device with the profiler's matmul probe; the weighted plan splits
microbatches by those speeds. Printed side by side, from one run:

* DP-EV: the uniform split;
* hetspmd: the split weighted by the profiler's matmul speeds, and the split
  weighted by each device's measured gradient throughput;
* ideal: both devices' measured throughputs added (each device alone
  computing microbatch gradients; no communication, no imbalance, no
  optimizer update).

Goal: hetspmd at >= 90% of ideal. Needs Linux with ``taskset`` and 2+ cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap

WORKER = textwrap.dedent("""
    import os, sys, json, time, statistics, dataclasses
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    rank, port, batch, steps, microbatch = map(int, sys.argv[1:6])
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank, initialization_timeout=120)
    import numpy as np
    import hetspmd as hs
    from hetspmd import models, profiler
    from hetspmd.models.mlp import MLPConfig
    from jax.experimental import multihost_utils

    workload = dataclasses.replace(models.get("mlp"), name="mlp-bench", config=MLPConfig((512, 1024, 1024, 10)))
    device = jax.local_devices()[0]

    # This device's speed, measured under whatever load it has.
    flops = profiler.matmul_flops(device, 512, "float32")
    # Its own throughput (examples/s) on the step's gradient work, for the ideal bound.
    from flax import nnx
    graphdef = workload.graphdef()
    grad_fn = jax.jit(jax.value_and_grad(lambda p, b: workload.loss(nnx.merge(graphdef, p), b)[0]))
    state, micro = workload.init_state(0), workload.synthetic_batch(rank, batch=microbatch)
    jax.block_until_ready(grad_fn(state["params"], micro))
    times = []
    for _ in range(20):
      t = time.perf_counter(); jax.block_until_ready(grad_fn(state["params"], micro)); times.append(time.perf_counter() - t)
    rate = microbatch / statistics.median(times)
    speeds = multihost_utils.process_allgather(np.array([flops, rate]))

    custom = {f"cpu{i}": hs.DeviceSpec(f"cpu{i}", float(speeds[i][0]), float(speeds[i][0]), 2**30, 1e10, measured=True)
              for i in range(2)}
    cluster = hs.Cluster.emulate(jax.devices(), kinds=["cpu0", "cpu1"], custom=custom)
    global_batch = batch
    total_microbatches = global_batch // microbatch
    plans = {
        "DP-EV (uniform)": hs.plan_for(cluster, state, global_batch=global_batch, microbatch=microbatch,
                                       counts=(total_microbatches // 2, total_microbatches - total_microbatches // 2)),
        "hetspmd (weighted)": hs.plan_for(cluster, state, global_batch=global_batch, microbatch=microbatch),
        "hetspmd (by step rate)": hs.plan_for(cluster, state, global_batch=global_batch, microbatch=microbatch,
                                              counts=hs.plan.proportional_counts([float(s[1]) for s in speeds],
                                                                                 total_microbatches)),
    }
    host_batch = workload.synthetic_batch(7, batch=global_batch)
    mine = lambda plan: slice(0, plan.examples_per_position()[0]) if rank == 0 else slice(plan.examples_per_position()[0], None)
    result = {"speeds_flops": [float(s[0]) for s in speeds], "rates": [float(s[1]) for s in speeds]}
    for name, plan in plans.items():
      step = hs.parallelize(workload.make_train_step(hs.value_and_grad), cluster=cluster, plan=plan, global_batch=global_batch)
      st = step.shard_state(workload.init_state(0))
      sb = step.shard_batch({k: v[mine(plan)] for k, v in host_batch.items()})
      st, m = step(st, sb); jax.block_until_ready(m)
      times = []
      for _ in range(steps):
        t = time.perf_counter(); st, m = step(st, sb); jax.block_until_ready(m); times.append(time.perf_counter() - t)
      result[name] = {"counts": list(plan.microbatch_counts), "median_s": statistics.median(times)}
    print(json.dumps(result))
""")


def _port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=2048)
  parser.add_argument("--microbatch", type=int, default=64)
  parser.add_argument("--steps", type=int, default=7)
  parser.add_argument("--slowdown-seconds", type=int, default=240)
  args = parser.parse_args()
  if shutil.which("taskset") is None or (os.cpu_count() or 1) < 2:
    sys.exit("needs taskset and at least 2 cores")

  busy = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c",
                           f"import time\nend = time.time() + {args.slowdown_seconds}\nwhile time.time() < end: pass"])
  port = _port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  workers = [subprocess.Popen(["taskset", "-c", str(rank), sys.executable, "-c", WORKER, str(rank), str(port),
                               str(args.batch), str(args.steps), str(args.microbatch)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
  try:
    outputs = [w.communicate(timeout=args.slowdown_seconds) for w in workers]
  finally:
    for p in workers + [busy]:
      if p.poll() is None:
        p.kill()
  for w, (out, err) in zip(workers, outputs):
    if w.returncode != 0:
      sys.exit(f"worker failed:\n{err[-3000:]}")
  result = json.loads([l for l in outputs[0][0].splitlines() if l.startswith("{")][-1])

  rates = result["rates"]
  ideal = args.batch / sum(rates)
  print(f"2 processes x 1 CPU device (cores 0 and 1; core 1 shared with a busy loop), global batch {args.batch}, "
        f"microbatch {args.microbatch}")
  print(f"measured matmul speed: device 0 {result['speeds_flops'][0] / 1e9:.1f} GFLOP/s, "
        f"device 1 {result['speeds_flops'][1] / 1e9:.1f} GFLOP/s (ratio {result['speeds_flops'][1] / result['speeds_flops'][0]:.2f})")
  print(f"measured gradient throughput alone: {rates[0]:.0f} and {rates[1]:.0f} examples/s")
  print(f"{'plan':22} {'counts':>10} {'median step s':>14} {'of ideal':>9} {'speedup vs DP-EV':>17}")
  uniform = result["DP-EV (uniform)"]["median_s"]
  for name in ("DP-EV (uniform)", "hetspmd (weighted)", "hetspmd (by step rate)"):
    r = result[name]
    print(f"{name:22} {str(r['counts']):>10} {r['median_s']:14.3f} {ideal / r['median_s']:9.1%} "
          f"{uniform / r['median_s']:17.2f}")
  print(f"{'ideal (sum of rates)':22} {'':>10} {ideal:14.3f} {1:9.0%}")


if __name__ == "__main__":
  main()
