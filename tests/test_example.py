"""examples/train_gpt2.py: trains, checkpoints, and resumes under another plan."""

import importlib.util
import pathlib
import shutil

import numpy as np
import pytest

from conftest import require_devices

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_gpt2.py"


def _example():
  spec = importlib.util.spec_from_file_location("train_gpt2", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.timeout(600)
def test_example_trains_and_resumes_under_another_plan(tmp_path, capsys):
  require_devices(8)
  example = _example()
  common = ["--global-batch", "16", "--seq", "16", "--quiet"]
  first = example.main(["--steps", "8", "--save-every", "4", "--ckpt", str(tmp_path / "a"), *common])
  losses = np.array([r["loss"] for r in first])
  assert [r["step"] for r in first] == list(range(8))
  assert np.isfinite(losses).all() and losses[-1] < losses[0]
  assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["step_4", "step_8"]
  out, err = capsys.readouterr()
  assert [line for line in out.splitlines() if line.startswith("saving")] == [
      f"saving step {n} to {tmp_path / 'a' / f'step_{n}'}" for n in (4, 8)]
  assert "\r" not in err + out  # --quiet, and no terminal: no progress bar

  # Continue from step 4 on another cluster: a different plan (other kinds, other counts).
  (tmp_path / "b").mkdir()
  shutil.copytree(tmp_path / "a" / "step_4", tmp_path / "b" / "step_4")
  resumed = example.main(["--steps", "8", "--ckpt", str(tmp_path / "b"), "--resume",
                          "--cluster", "2xA100-40GB+6xT4", *common])
  assert [r["step"] for r in resumed] == [4, 5, 6, 7]
  np.testing.assert_allclose([r["loss"] for r in resumed], losses[4:], rtol=2e-4)
  assert (tmp_path / "b" / "step_8").is_dir()
  restored = [line for line in capsys.readouterr().out.splitlines() if line.startswith("restored")]
  assert len(restored) == 1 and restored[0].startswith(f"restored step 4 from {tmp_path / 'b' / 'step_4'} into "
                                                       "the plan mesh {'data': ")
  assert "xA100-40GB" in restored[0]  # the plan on the new cluster


@pytest.mark.timeout(300)
def test_example_defaults_weight_both_kinds(capsys):
  """The default model, batch and cluster get a plan that runs every kind, the V100s on more microbatches."""
  require_devices(8)
  example = _example()
  args = example.parse_args([])
  from hetspmd import models

  workload = models.get(args.model)
  cluster = example.build_cluster(args.cluster, False)
  plan = example.searched_plan(example.make_train_step(workload), workload, cluster, args)
  per = len(plan.device_ids) // plan.data_size
  counts: dict[str, set[int]] = {}
  for i, count in enumerate(plan.microbatch_counts):
    for kind in plan.device_kinds[i * per:(i + 1) * per]:
      counts.setdefault(kind, set()).add(count)
  assert set(counts) == {"V100-32GB", "P100-16GB"} and min(map(max, counts.values())) > 0, counts
  assert min(counts["V100-32GB"]) > max(counts["P100-16GB"]), counts
  line = example.plan_line(plan)
  assert "4xV100-32GB" in line and "4xP100-16GB" in line


@pytest.mark.timeout(300)
def test_example_writes_one_line_per_step_off_a_terminal(capsys):
  require_devices(8)
  records = _example().main(["--steps", "2", "--global-batch", "16", "--seq", "16"])
  out, err = capsys.readouterr()
  assert [r["step"] for r in records] == [0, 1]
  assert "\r" not in out + err
  assert [line.split(" loss")[0] for line in out.splitlines() if line.startswith("step ")] == ["step 1/2", "step 2/2"]
  assert "median step" in out and "median step" not in err


def test_example_refuses_a_cluster_of_another_size():
  require_devices(8)
  with pytest.raises(SystemExit, match="has 16 devices but JAX sees 8"):
    _example().main(["--cluster", "amp-t4-v100", "--steps", "1", "--quiet"])


def test_example_resume_without_a_checkpoint_says_so(tmp_path):
  require_devices(8)
  with pytest.raises(SystemExit, match="no checkpoint"):
    _example().main(["--steps", "2", "--ckpt", str(tmp_path), "--resume", "--quiet"])
