"""Search time against cluster size (the trace is done once, outside the timing).

    python benchmarks/search_time.py [--model gpt2-medium] [--global-batch 1024] [--repeats 5]

Clusters of 8, 64, 256 and 1024 devices, half A100-80GB and half V100-32GB,
8 per host, 100 Gbps between hosts; then 64 and 1024 devices of three kinds
(A100-80GB, V100-32GB and T4, 3:3:2) at eight times the batch, where the
group search has the most per-kind microbatch sizes to combine. Prints the
median search seconds, with every axis in the space: overlapped reductions
and the choice of float32 or bfloat16 reduction included; then the same
search as the CLI runs it, with the pool's homogeneous equivalent and group
plans (per-kind microbatches, tails, the optimizer state replicated or in
memory shares, over every kind and the fastest kinds). Goals (:data:`GOALS`):
one program <= 0.5 s at 64 devices and <= 2 s at 1024; the CLI's search <= 1 s
and <= 3 s, and with three kinds <= 1.5 s and <= 6 s.
"""

from __future__ import annotations

import argparse
import statistics
import time

# (devices, kinds) -> (goal of the one-program search, goal of the CLI's search) in seconds, None for no goal
GOALS = {(64, 2): (0.5, 1.0), (1024, 2): (2.0, 3.0), (64, 3): (None, 1.5), (1024, 3): (None, 6.0)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="gpt2-medium")
  parser.add_argument("--global-batch", type=int, default=1024)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()

  from hetspmd import models
  from hetspmd.passes.profile import profile_step
  from hetspmd.planner.ranking import search

  workload = models.get(args.model)
  start = time.perf_counter()
  profile = profile_step(workload.make_train_step(), workload.abstract_state(), workload.example_batch(2))
  print(f"{args.model}: traced and costed once in {time.perf_counter() - start:.1f} s; global batch {args.global_batch}")
  print(f"{'devices':>8} {'kinds':>6} {'batch':>6} {'median search s':>16} {'candidates':>11} {'goal':>8} "
        f"{'+ homog. eq. + groups s':>24} {'goal':>8}")
  for n, kinds, batch in _pools(args.global_batch):
    cluster = _cluster(n, kinds)
    times, full, result = [], [], None
    for _ in range(args.repeats):
      t = time.perf_counter()
      result = search(cluster, profile, batch, grad_reduce_dtypes=("float32", "bfloat16"))
      times.append(time.perf_counter() - t)
      t = time.perf_counter()
      search(cluster, profile, batch, grad_reduce_dtypes=("float32", "bfloat16"), homogeneous=True, groups=True)
      full.append(time.perf_counter() - t)
    median, median_full = statistics.median(times), statistics.median(full)
    goal, goal_full = GOALS.get((n, kinds), (None, None))
    verdict = lambda s, g: "" if g is None else ("met" if s <= g else "NOT met")
    print(f"{cluster.num_devices:>8} {kinds:>6} {batch:>6} {median:16.3f} {result.candidates:>11} "
          f"{verdict(median, goal):>8} {median_full:24.3f} {verdict(median_full, goal_full):>8}", flush=True)


def _pools(global_batch: int) -> list[tuple[int, int, int]]:
  """(devices, kinds, global batch) of each row."""
  return [(n, 2, global_batch) for n in (8, 64, 256, 1024)] + [(n, 3, 8 * global_batch) for n in (64, 1024)]


def _cluster(n: int, kinds: int):
  """``n`` devices, 8 per host, of two kinds (half each) or three (3:3:2 hosts of A100, V100 and T4)."""
  from hetspmd import Cluster

  hosts = n // 8
  if kinds == 3:
    fast, mid = 3 * hosts // 8, 3 * hosts // 8
    spec = f"{fast}x8xA100-80GB+{mid}x8xV100-32GB+{hosts - fast - mid}x8xT4"
  elif hosts > 1:
    spec = f"{hosts // 2}x8xA100-80GB+{hosts - hosts // 2}x8xV100-32GB"
  else:
    spec = "1x4xA100-80GB+1x4xV100-32GB"
  return Cluster.parse(spec + ";inter=100Gbps")


if __name__ == "__main__":
  main()
