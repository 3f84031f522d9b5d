"""Runs a script in several processes joined by jax.distributed on 127.0.0.1.

Each process gets ``devices_per_process`` CPU devices and gloo collectives.
The script body runs after ``jax.distributed.initialize``; it prints one JSON
line, which is returned per process. Every process is killed after
``timeout`` seconds, so a deadlocked collective fails the test instead of
hanging it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

PRELUDE = """
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("HETSPMD_TEST_XLA_FLAGS", "") + " --xla_force_host_platform_device_count={devices}"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize("127.0.0.1:{port}", num_processes={n}, process_id=int(sys.argv[1]),
                           initialization_timeout=60)
"""


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_processes(body: str, num_processes: int = 2, devices_per_process: int = 2, timeout: float = 180) -> list:
  script = PRELUDE.format(devices=devices_per_process, port=free_port(), n=num_processes) + textwrap.dedent(body)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [subprocess.Popen([sys.executable, "-c", script, str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env) for i in range(num_processes)]
  results = []
  try:
    for i, proc in enumerate(procs):
      out, err = proc.communicate(timeout=timeout)
      if proc.returncode != 0:
        raise AssertionError(f"process {i} exited with {proc.returncode}:\n{err[-4000:]}")
      lines = [l for l in out.splitlines() if l.startswith("{")]
      if not lines:
        raise AssertionError(f"process {i} printed no JSON line:\n{out[-2000:]}\n{err[-2000:]}")
      # the object alone: a native library (gloo) may write its own log onto the same line, unflushed before it
      results.append(json.JSONDecoder().raw_decode(lines[-1])[0])
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  return results


def group_child(module: str = "test_group_programs") -> str:
  """The start of a child script (for :func:`run_processes`) that runs a step under groups: the tests' folder
  on the path, the backend started with this process's devices (before conftest asks for 8), ``module``
  imported as ``t``; ``ids``: each process's device ids; ``local(x)``: this process's first shard of ``x`` as
  NumPy (None where it holds none); ``fed(step, batch)``: the examples of ``batch`` this process feeds ``step``;
  ``reference(step, state, batches)``: the one-device reference, run on this
  process's first device."""
  return textwrap.dedent(f"""
      import json, sys
      import numpy as np, jax
      sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
      jax.devices()
      import {module} as t
      from exactness import Reference

      ids = [[d.id for d in jax.devices() if d.process_index == p] for p in range(jax.process_count())]
      local = lambda x: np.asarray(x.addressable_shards[0].data) if x.addressable_shards else None
      fed = lambda step, batch: jax.tree.map(lambda x: np.asarray(x)[step.process_examples()], batch)

      def reference(step, state, batches):
        return Reference(step, state, jit=jax.jit(step, device=jax.local_devices()[0])).run(batches)
  """)

