"""benchmarks/pipeline_estimate.py: the layer split is optimal, the units and their boundaries are the model's."""

import importlib.util
import itertools
import pathlib
import sys

import numpy as np
import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "pipeline_estimate.py"


@pytest.fixture(scope="module")
def estimate():
  spec = importlib.util.spec_from_file_location("pipeline_estimate", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # its dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def _brute_force(cost):
  stages, n = cost.shape[0], cost.shape[1] - 1
  best = None
  for cuts in itertools.combinations(range(1, n), stages - 1):
    bounds = (0,) + cuts + (n,)
    value = max(cost[s, bounds[s], bounds[s + 1]] for s in range(stages))
    counts = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    if best is None or value < best[0]:
      best = (value, counts)
  return best


@pytest.mark.parametrize("stages,units,seed", [(2, 5, 0), (3, 7, 1), (4, 9, 2), (3, 4, 3)])
def test_split_is_the_best_consecutive_split(estimate, stages, units, seed):
  rng = np.random.default_rng(seed)
  speed = rng.uniform(0.5, 2.0, stages)
  work = rng.uniform(0.1, 1.0, units)
  prefix = np.concatenate([[0.0], np.cumsum(work)])
  cost = np.full((stages, units + 1, units + 1), np.inf)
  for s in range(stages):
    for i in range(units):
      for j in range(i + 1, units + 1):
        cost[s, i, j] = (prefix[j] - prefix[i]) / speed[s] + (0.05 if j < units else 0.0)
  cost[0, 0, units - stages + 1] = np.inf  # a split that does not fit memory
  value, counts = estimate.split_units(cost)
  expected = _brute_force(cost)
  assert value == pytest.approx(expected[0])
  assert sum(counts) == units and min(counts) >= 1
  bounds = np.concatenate([[0], np.cumsum(counts)])
  assert max(cost[s, bounds[s], bounds[s + 1]] for s in range(stages)) == pytest.approx(value)


def test_nothing_fits_gives_none(estimate):
  assert estimate.split_units(np.full((2, 4, 4), np.inf)) is None


def test_units_of_gpt2_tiny(estimate):
  from hetspmd import models
  from hetspmd.passes.profile import profile_step

  w = models.get("gpt2-tiny")
  seq, d, vocab = 32, w.config.d_model, w.config.vocab_size
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2, seq))
  units = estimate.units_of(profile)
  assert units.names == ("embed", "h_0", "h_1", "ln_f", "lm_head", "loss")
  # the residual stream crosses between blocks; the logits cross into the loss; nothing leaves the loss
  assert units.boundary[:4] == pytest.approx([seq * d * 4] * 4)
  assert units.boundary[4] == pytest.approx(seq * vocab * 4)
  assert units.boundary[5] == 0
  assert sum(units.params) == profile.param_count
  assert units.residual[1] == pytest.approx(units.residual[2]) and units.residual[1] > 0
  masks = np.array(units.nodes)
  assert not (masks.sum(axis=0) > 1).any()  # every node in one unit at most
  assert masks.any(axis=0).sum() == (~profile.per_step).sum()  # every per-microbatch node in one
  forward = np.array(units.forward)
  assert forward.any() and not (forward & ~masks).any()  # each unit's forward is part of it


def test_lockstep_gpipe_is_never_faster_than_1f1b(estimate):
  """The built schedule waits for the slowest stage twice a tick and keeps every microbatch's buffers."""
  from hetspmd import Cluster, models
  from hetspmd.passes.profile import profile_step

  w = models.get("gpt2-tiny")
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2, 32))
  units = estimate.units_of(profile)
  cluster = Cluster.parse("1x4xV100-32GB+1x4xP100-16GB;inter=10Gbps")
  one = estimate.estimate(cluster, profile, units, 64)
  built = estimate.estimate(cluster, profile, units, 64, schedule="gpipe")
  assert one is not None and built is not None
  assert built.step_seconds >= one.step_seconds * (1 - 1e-9)
  assert len(built.stages) == 2 and sum(built.units) == len(units.names)
