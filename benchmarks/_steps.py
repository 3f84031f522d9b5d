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
