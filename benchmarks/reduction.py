"""Gradient reduction options side by side: overlapped with the last microbatch, and in bfloat16.

    python benchmarks/reduction.py [--model gpt2-tiny] [--batch 48] [--microbatch 4] [--steps 31]

Runs the zoo's unmodified train step on 8 emulated CPU devices under one uneven plan (about 2:1 between
the first and last four positions' microbatch counts) four ways: float32 reduction after the loop (the plan as before),
overlapped, in bfloat16, and both; and, where every position runs at least two microbatches (``--batch 96``),
overlapped with each position's last microbatches fused into one pass (``overlap_microbatches``). Steps rotate between them so machine noise hits all alike. Prints
per variant the median step time, its ratio to the first, the bytes its collectives over ``data`` move
per step (operands of the all-reduces and reduce-scatters the program asks XLA for), and the largest
parameter difference from the float32 variant after the run.

On CPU, XLA runs collectives inside the step's thunk sequence, so overlap cannot hide anything here;
the ratio shows what the peeled microbatch costs (nothing, if it is within noise). Hiding needs an
accelerator with asynchronous collectives (on GPUs the runtime turns on XLA's latency-hiding scheduler).
XLA's CPU compiler also widens bfloat16 all-reduces to float32 (its collectives have no bfloat16 sum),
so on CPU the bfloat16 variants pay two casts and move float32; NCCL reduces bfloat16 as such.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

VARIANTS = {  # name: plan options
    "float32": {},
    "overlapped": {"overlap_reduction": True},
    "bfloat16": {"grad_reduce_dtype": "bfloat16"},
    "overlapped bfloat16": {"overlap_reduction": True, "grad_reduce_dtype": "bfloat16"},
}
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4}


def collective_bytes(stablehlo: str) -> int:
  """Bytes of the operands of every all-reduce and reduce-scatter in a lowered StableHLO module."""
  total = 0
  for operands in re.findall(r'"stablehlo\.(?:all_reduce|reduce_scatter)".*?\}\) : \(([^)]*)\)', stablehlo, re.DOTALL):
    for dims, dtype in re.findall(r"tensor<((?:\d+x)*)(f32|bf16|f16|i32)>", operands):
      size = 1
      for d in filter(None, dims.split("x")):
        size *= int(d)
      total += size * _BYTES[dtype]
  return total


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="gpt2-tiny")
  parser.add_argument("--batch", type=int, default=48)
  parser.add_argument("--microbatch", type=int, default=4)
  parser.add_argument("--steps", type=int, default=31)
  args = parser.parse_args()

  import jax
  import numpy as np

  import hetspmd as hs
  from hetspmd import models

  workload = models.get(args.model)
  devices = jax.devices()[:8]
  cluster = hs.Cluster.emulate(devices, kinds=["V100-32GB"] * 4 + ["P100-16GB"] * 4)
  total = args.batch // args.microbatch
  counts = [2 * total // 12] * 4 + [total // 12] * 4
  counts[0] += total - sum(counts)
  host_batch = workload.synthetic_batch(0, batch=args.batch)
  runs, states = {}, {}
  variants = dict(VARIANTS)
  if min(counts) >= 2:
    variants[f"overlapped, last {min(counts)} fused"] = {"overlap_reduction": True, "overlap_microbatches": min(counts)}
  for name, options in variants.items():
    plan = hs.plan_for(cluster, workload.init_state(0), global_batch=args.batch, microbatch=args.microbatch,
                       counts=counts, **options)
    step = hs.parallelize(workload.make_train_step(), cluster=cluster, plan=plan, global_batch=args.batch)
    states[name] = step.shard_state(workload.init_state(0))
    runs[name] = (step, step.shard_batch(host_batch))
  wire = {name: collective_bytes(step.lower(states[name], batch).as_text())
          for name, (step, batch) in runs.items()}
  from _steps import rotated_step_seconds

  names = list(runs)
  times = rotated_step_seconds(runs, states, args.steps)
  medians = {name: statistics.median(t) for name, t in times.items()}
  reference = jax.tree.leaves(states["float32"]["params"])
  print(f"model {args.model}, global batch {args.batch}, microbatch {args.microbatch}, counts {counts}, "
        f"{args.steps} steps each, {os.cpu_count()} CPUs")
  print(f"{'':26} {'median ms':>10} {'vs float32':>10} {'wire bytes':>11} {'vs float32':>10} {'max |dparam|':>13}")
  for name in names:
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(reference, jax.tree.leaves(states[name]["params"])))
    print(f"{name:26} {medians[name] * 1e3:10.2f} {medians[name] / medians['float32']:10.3f} {wire[name]:11,} "
          f"{wire[name] / wire['float32']:10.3f} {diff:13.3g}")


if __name__ == "__main__":
  main()
