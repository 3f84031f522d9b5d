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
def test_example_trains_and_resumes_under_another_plan(tmp_path):
  require_devices(8)
  example = _example()
  common = ["--global-batch", "16", "--seq", "16", "--quiet"]
  first = example.main(["--steps", "8", "--save-every", "4", "--ckpt", str(tmp_path / "a"), *common])
  losses = np.array([r["loss"] for r in first])
  assert [r["step"] for r in first] == list(range(8))
  assert np.isfinite(losses).all() and losses[-1] < losses[0]
  assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["step_4", "step_8"]

  # Continue from step 4 on another cluster: a different plan (other kinds, other counts).
  (tmp_path / "b").mkdir()
  shutil.copytree(tmp_path / "a" / "step_4", tmp_path / "b" / "step_4")
  resumed = example.main(["--steps", "8", "--ckpt", str(tmp_path / "b"), "--resume",
                          "--cluster", "2xA100-40GB+6xT4", *common])
  assert [r["step"] for r in resumed] == [4, 5, 6, 7]
  np.testing.assert_allclose([r["loss"] for r in resumed], losses[4:], rtol=2e-4)
  assert (tmp_path / "b" / "step_8").is_dir()


def test_example_refuses_a_cluster_of_another_size():
  require_devices(8)
  with pytest.raises(SystemExit, match="has 16 devices but JAX sees 8"):
    _example().main(["--cluster", "amp-t4-v100", "--steps", "1", "--quiet"])


def test_example_resume_without_a_checkpoint_says_so(tmp_path):
  require_devices(8)
  with pytest.raises(SystemExit, match="no checkpoint"):
    _example().main(["--steps", "2", "--ckpt", str(tmp_path), "--resume", "--quiet"])
