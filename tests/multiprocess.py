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
      results.append(json.loads(lines[-1]))
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  return results
