"""Searching a user's own step from the command line: a Gemma-3-1B-shaped NNX step, written as Flax's example
writes its step (``examples/nnx_lm.py:gemma3_1b``: bfloat16, sequences of 1024, batch 64), on
``1x8xA100-80GB+1x8xV100-32GB;inter=100Gbps``, nothing allocated.

    python benchmarks/step_search.py [--runs 3]

Times ``hetspmd search --step ... --json`` end to end (a fresh process each run: Python, imports, tracing and the
search, every plan form priced), the median of ``--runs``, against the goal of 15 s; and the parts the JSON
reports (tracing, the search after it). The seconds are measured on this machine; the plans are predicted.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEP = "examples/nnx_lm.py:gemma3_1b"
CLUSTER = "1x8xA100-80GB+1x8xV100-32GB;inter=100Gbps"
GOAL_SECONDS = 15.0


def one_run() -> tuple[float, dict]:
  start = time.perf_counter()
  done = subprocess.run([sys.executable, "-m", "hetspmd", "search", "--step", STEP, "--cluster", CLUSTER, "--json"],
                        capture_output=True, text=True, cwd=ROOT, check=True)
  return time.perf_counter() - start, json.loads(done.stdout)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=3)
  args = parser.parse_args(argv)
  runs = [one_run() for _ in range(args.runs)]
  wall = statistics.median(w for w, _ in runs)
  report = runs[-1][1]
  trace = statistics.median(r["trace_seconds"] for _, r in runs)
  search = statistics.median(r["search_seconds"] for _, r in runs)
  print(f"hetspmd search --step {STEP} --cluster '{CLUSTER}' (median of {args.runs} fresh processes)")
  print(f"{'end to end':<32} {wall:7.2f} s   goal {GOAL_SECONDS:.0f} s: {wall / GOAL_SECONDS:.2f}x the goal "
        f"({'met' if wall <= GOAL_SECONDS else 'NOT met'})")
  print(f"{'tracing (two batch sizes)':<32} {trace:7.2f} s")
  print(f"{'search after tracing':<32} {search:7.2f} s   {report['candidates']} candidates")
  print(f"{'rest (Python, imports, shapes)':<32} {wall - trace - search:7.2f} s")
  group = report["group_plan"]
  print(f"group plans priced: {'yes' if group else 'no'}"
        + (f" (best {group['speedup_over_best']:.2f}x the best single program)" if group else "")
        + f"; parallelize(plan='search') from {report['choice']['processes']} processes runs a "
          f"{report['choice']['form']}")


if __name__ == "__main__":
  main()
