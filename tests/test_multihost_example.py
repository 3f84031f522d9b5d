"""examples/multihost.py, run as a job of several processes (gloo on 127.0.0.1): each process feeds only its own
examples, under the search's choice or a group plan, and the losses match one device."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from exactness import Reference

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "multihost.py"


def _example():
  spec = importlib.util.spec_from_file_location("multihost_example", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.timeout(300)
@pytest.mark.parametrize("processes,devices,plan", [(2, 2, "search"), (2, 2, "groups"), (4, 1, "groups")],
                         ids=["2x2-search", "2x2-group-plan", "4x1-group-plan"])
def test_the_multihost_example_matches_one_device(processes, devices, plan):
  example = _example()
  done = subprocess.run([sys.executable, str(EXAMPLE), "--processes", str(processes), "--devices", str(devices),
                         "--plan", plan, "--steps", "3"], capture_output=True, text=True, timeout=240)
  assert done.returncode == 0, done.stderr[-4000:]
  result = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
  assert result["processes"] == processes and result["form"] == ("group plan" if plan == "groups" else result["form"])
  assert 0 < result["examples"] < 128  # this process's share, not the global batch
  ref = Reference(example.train_step, example.make_state()).run(example.global_batches(128, 3))
  for i, loss in enumerate(result["losses"]):
    ref.check_metrics({"loss": np.float32(loss)}, i)


@pytest.mark.timeout(180)
def test_a_dead_process_fails_the_others_within_the_heartbeat_and_loses_nothing_written(tmp_path):
  """Two processes train a searched plan; process 1 dies after its first step. Process 0, in its next step's
  collective, is stopped by JAX's coordination service once process 1 misses its heartbeats (10 s here): it exits
  with an error naming the unhealthy task instead of waiting, and the plan it saved after the first step is
  whole."""
  import os
  import time

  from multiprocess import PRELUDE, free_port

  saved = tmp_path / "plan.json"
  prelude = PRELUDE.format(devices=2, port=free_port(), n=2).replace(
      "initialization_timeout=60)", "initialization_timeout=60, heartbeat_timeout_seconds=10)")
  body = f"""
import numpy as np
import hetspmd as hs
sys.path.insert(0, {str(EXAMPLE.parent)!r})
import multihost as example
batches = example.global_batches(64, 3)
cluster = hs.Cluster.emulate(jax.devices(), kinds=["V100-32GB"] * 2 + ["P100-16GB"] * 2)
step = hs.parallelize(example.train_step, cluster=cluster, plan="search", global_batch=64, example_batch=batches[0])
state = step.shard_state(example.make_state())
mine = step.process_examples()
state, metrics = step(state, {{k: v[mine] for k, v in batches[0].items()}})
jax.block_until_ready(metrics)
if jax.process_index() == 0:
  step.plan.save({str(saved)!r})
print("first step done", flush=True)
if jax.process_index() == 1:
  os._exit(3)
for batch in batches[1:]:
  state, metrics = step(state, {{k: v[mine] for k, v in batch.items()}})
  jax.block_until_ready(metrics)
print("the survivor finished", flush=True)
"""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [subprocess.Popen([sys.executable, "-c", prelude + body, str(i)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
  start = time.monotonic()
  try:
    out, err = procs[0].communicate(timeout=150)
    elapsed = time.monotonic() - start
    procs[1].communicate(timeout=30)
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  assert procs[1].returncode == 3
  assert "first step done" in out and "the survivor finished" not in out
  assert procs[0].returncode != 0 and "stopped sending heartbeats" in err, err[-3000:]
  assert elapsed < 120, elapsed  # the heartbeat (10 s) after the first step, not an endless wait
  assert json.loads(saved.read_text())["global_batch"] == 64
