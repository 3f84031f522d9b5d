"""Shared by the benchmarks: time a parallelized train step; run a worker script on a slowed pair of cores."""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from typing import Any, Sequence


def run_slowed_pair(worker: str, worker_args: Sequence[Any], slowdown_seconds: int, switch: str | None = None
                    ) -> dict:
  """Runs ``worker`` (a script taking ``rank port *worker_args``) as two processes pinned to cores 0 and 1, with a
  busy loop sharing core 1 for at most ``slowdown_seconds``; the JSON line rank 0 prints last. With ``switch`` (a
  file path, passed to the workers as ``HETSPMD_BUSY_SWITCH``), the loop spins only while that file exists, so a
  worker can slow and free core 1 mid-run. Exits with a message when the machine lacks ``taskset`` or a second
  core, or a worker fails."""
  if shutil.which("taskset") is None or (os.cpu_count() or 1) < 2:
    sys.exit("needs taskset and at least 2 cores")
  spin = "pass" if switch is None else f"time.sleep(0.001) if not os.path.exists({switch!r}) else None"
  busy = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c",
                           f"import os, time\nend = time.time() + {slowdown_seconds}\nwhile time.time() < end: {spin}"])
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  if switch is not None:
    env["HETSPMD_BUSY_SWITCH"] = switch
  workers = [subprocess.Popen(["taskset", "-c", str(rank), sys.executable, "-c", worker, str(rank), str(port),
                               *map(str, worker_args)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
  try:
    outputs = [w.communicate(timeout=slowdown_seconds) for w in workers]
  finally:
    for p in workers + [busy]:
      if p.poll() is None:
        p.kill()
  for w, (_, err) in zip(workers, outputs):
    if w.returncode != 0:
      sys.exit(f"worker failed:\n{err[-3000:]}")
  return json.loads([line for line in outputs[0][0].splitlines() if line.startswith("{")][-1])


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
