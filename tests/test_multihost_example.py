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
