"""Shared by the benchmarks: time a parallelized train step."""

from __future__ import annotations

import statistics
import time
from typing import Any


def median_step_seconds(step: Any, state: Any, batch: Any, steps: int) -> tuple[Any, float]:
  """Runs ``step`` once to compile and warm up, then ``steps`` times; returns the last state and the median."""
  import jax

  state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  return state, statistics.median(times)


def rotated_step_seconds(runs: dict[str, tuple[Any, Any]], states: dict[str, Any], steps: int
                         ) -> dict[str, list[float]]:
  """Seconds of every step of each ``name: (step, batch)`` in ``runs``, after two warm-up steps each.

  The programs take turns, each going first in turn, so machine noise hits all alike; ``states`` (by name)
  is updated in place.
  """
  import jax

  for _ in range(2):  # compile and warm up
    for name, (fn, batch) in runs.items():
      states[name], _ = fn(states[name], batch)
  jax.block_until_ready(states)
  names = list(runs)
  times: dict[str, list[float]] = {name: [] for name in names}
  for i in range(steps):
    for name in names[i % len(names):] + names[:i % len(names)]:
      fn, batch = runs[name]
      start = time.perf_counter()
      states[name], _ = fn(states[name], batch)
      jax.block_until_ready(states[name])
      times[name].append(time.perf_counter() - start)
  return times
