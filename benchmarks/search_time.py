"""Search time against cluster size (the trace is done once, outside the timing).

    python benchmarks/search_time.py [--model gpt2-medium] [--global-batch 1024] [--repeats 3]

Clusters of 8, 64, 256 and 1024 devices, half A100-80GB and half V100-32GB,
8 per host, 100 Gbps between hosts. Prints the median search seconds, with
every axis in the space: overlapped reductions and the choice of float32 or
bfloat16 reduction included; then the same search as the CLI runs it, with
the pool's homogeneous equivalent and group plans (per-kind microbatches,
tails, the optimizer state replicated or in memory shares, over every kind
and the fastest kinds). Goals: <= 2 s at 64 devices, <= 20 s at 1024.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="gpt2-medium")
  parser.add_argument("--global-batch", type=int, default=1024)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()

  from hetspmd import Cluster, models
  from hetspmd.passes.profile import profile_step
  from hetspmd.planner.ranking import search

  workload = models.get(args.model)
  start = time.perf_counter()
  profile = profile_step(workload.make_train_step(), workload.abstract_state(), workload.example_batch(2))
  print(f"{args.model}: traced and costed once in {time.perf_counter() - start:.1f} s; global batch {args.global_batch}")
  print(f"{'devices':>8} {'median search s':>16} {'candidates':>11} {'goal':>8} {'+ homog. eq. + groups s':>24} "
        f"{'goal':>8}")
  goals = {64: 2.0, 1024: 20.0}
  for n in (8, 64, 256, 1024):
    hosts = n // 8
    spec = (f"{max(1, hosts // 2)}x8xA100-80GB+{max(1, hosts - hosts // 2)}x8xV100-32GB" if hosts > 1
            else "1x4xA100-80GB+1x4xV100-32GB")
    cluster = Cluster.parse(spec + ";inter=100Gbps")
    times, full, result = [], [], None
    for _ in range(args.repeats):
      t = time.perf_counter()
      result = search(cluster, profile, args.global_batch, grad_reduce_dtypes=("float32", "bfloat16"))
      times.append(time.perf_counter() - t)
      t = time.perf_counter()
      search(cluster, profile, args.global_batch, grad_reduce_dtypes=("float32", "bfloat16"), homogeneous=True,
             groups=True)
      full.append(time.perf_counter() - t)
    median, median_full = statistics.median(times), statistics.median(full)
    goal = goals.get(n)
    verdict = lambda s: "" if goal is None else ("met" if s <= goal else "NOT met")
    print(f"{cluster.num_devices:>8} {median:16.3f} {result.candidates:>11} {verdict(median):>8} {median_full:24.3f} "
          f"{verdict(median_full):>8}")


if __name__ == "__main__":
  main()
