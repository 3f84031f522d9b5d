"""Time to trace + annotate a zoo model's train step (abstract arguments).

    python benchmarks/trace_time.py [--model gpt2-medium] [--batch 8] [--seq 1024] [--repeats 5]

Each repeat traces a freshly built step function, so JAX's trace cache never
helps; the abstract state is built once beforehand (it is not part of the
trace). Prints the median, the spread, and the split between JAX's own
tracing and hetspmd's walk over the jaxpr measured in the same run, and the
time of the microbatch pass (:mod:`hetspmd.passes.batch_axis.analysis`: inlining the
step's calls, propagating the example axis, scheduling the cuts) on the
step's jaxpr at that batch (goal: at most 1 s beyond the trace).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="gpt2-medium")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=1024)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()

  import jax

  import hetspmd
  from hetspmd import models
  from hetspmd.passes import _jax_adapter

  workload = models.get(args.model)
  state, batch = workload.abstract_state(), workload.example_batch(args.batch, args.seq)
  totals, jax_only = [], []
  for _ in range(args.repeats):
    step = workload.make_train_step()
    start = time.perf_counter()
    graph = hetspmd.trace(step, state, batch)
    totals.append(time.perf_counter() - start)
    step = workload.make_train_step()
    start = time.perf_counter()
    _jax_adapter.trace_to_jaxpr(step, (state, batch), {})
    jax_only.append(time.perf_counter() - start)

  from hetspmd.passes.batch_axis import analysis as microbatch

  passes = []
  for _ in range(args.repeats):
    closed = jax.make_jaxpr(workload.make_train_step())(state, batch)
    n_state = len(jax.tree.leaves(state))
    start = time.perf_counter()
    analysis = microbatch.analyse(closed, range(n_state, n_state + len(jax.tree.leaves(batch))), args.batch)
    passes.append(time.perf_counter() - start)

  total, jax_t = statistics.median(totals), statistics.median(jax_only)
  print(f"model {args.model}, batch {args.batch}, seq {args.seq}, {len(graph.nodes):,} nodes, "
        f"{graph.total_flops:.3e} FLOPs/step, {os.cpu_count()} CPUs")
  print(f"{'':28} {'median s':>9} {'min s':>7} {'max s':>7}")
  print(f"{'hetspmd.trace (total)':28} {total:9.3f} {min(totals):7.3f} {max(totals):7.3f}")
  print(f"{'  jax.jit(...).trace only':28} {jax_t:9.3f} {min(jax_only):7.3f} {max(jax_only):7.3f}")
  print(f"{'  hetspmd walk (difference)':28} {total - jax_t:9.3f}")
  print(f"goal < 3 s: {'met' if total < 3.0 else 'NOT met'} (ratio to goal {total / 3.0:.2f})")
  pass_t = statistics.median(passes)
  print(f"{'microbatch pass':28} {pass_t:9.3f} {min(passes):7.3f} {max(passes):7.3f}  "
        f"({len(analysis.cuts)} cuts, {analysis.loops} loop(s), {len(analysis.jaxpr.jaxpr.eqns):,} equations)")
  print(f"goal <= 1 s beyond the trace: {'met' if pass_t <= 1.0 else 'NOT met'}")


if __name__ == "__main__":
  main()
