"""Stage plans for a step that scans its layers: where the stack is in the profile, the layer split, the price."""

import dataclasses
import itertools
import json

import numpy as np
import pytest

from hetspmd import Cluster, models
from hetspmd.cli import main
from hetspmd.passes.profile import profile_step
from hetspmd.planner.stages import describe, find_stack, price, search_stages, split_layers

SEQ = 32


@pytest.fixture(scope="module")
def scanned():
  w = models.get("gpt2-tiny-scan")
  return w, profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2, SEQ))


def test_the_stack_is_found_with_its_boundary(scanned):
  w, profile = scanned
  stack = find_stack(profile)
  assert stack.layers == w.config.n_layer
  masks = np.array([stack.forward, stack.backward, stack.first, stack.last])
  assert not (masks.sum(axis=0) > 1).any()  # every node in one part
  assert (masks.any(axis=0) == ~profile.per_step).all()  # every per-microbatch node in one
  assert stack.carry == SEQ * w.config.d_model * 4  # the residual stream enters the stack, float32
  per_layer = sum(np.prod(s) for s in profile.param_leaf_shapes if s and s[0] == w.config.n_layer)
  assert stack.stack_params == per_layer and stack.kept > 0


def test_unrolled_layers_have_no_stack(scanned):
  w, _ = scanned
  unrolled = dataclasses.replace(w, name="unrolled", config=dataclasses.replace(w.config, scan_layers=False))
  assert find_stack(profile_step(unrolled.make_train_step(), unrolled.abstract_state(),
                                 unrolled.example_batch(2, SEQ))) is None


@pytest.mark.parametrize("seed", range(4))
def test_split_minimises_the_slowest_stage(seed):
  rng = np.random.default_rng(seed)
  stages, layers = int(rng.integers(2, 5)), int(rng.integers(5, 12))
  per_layer, fixed = rng.uniform(0.5, 2.0, stages), rng.uniform(0.0, 2.0, stages)
  split = split_layers(per_layer, fixed, layers)
  assert sum(split) == layers and min(split) >= 1
  best = min(max(f + n * c for f, n, c in zip(fixed, counts, per_layer))
             for counts in itertools.product(range(1, layers + 1), repeat=stages) if sum(counts) == layers)
  assert max(f + n * c for f, n, c in zip(fixed, split, per_layer)) == pytest.approx(best)


def test_faster_hosts_take_more_layers_and_the_price_adds_up(scanned):
  _, profile = scanned
  cluster = Cluster.parse("1x4xV100-32GB+1x4xP100-16GB;inter=10Gbps")
  plans = search_stages(cluster, profile, 64)
  assert plans and [p.step_seconds for p in plans] == sorted(p.step_seconds for p in plans)
  best = plans[0]
  assert best.stages[0] >= best.stages[1]  # the V100 host first, at least as many layers
  assert best.step_seconds >= (best.microbatches + 1) * best.tick_seconds
  assert best.transfer_seconds > 0 and best.reduce_seconds > 0
  stack = find_stack(profile)
  slower = price(cluster, profile, stack, best.hosts, best.stages[::-1], best.microbatch, global_batch=64)
  assert slower is None or slower.step_seconds >= best.step_seconds * (1 - 1e-9)
  assert price(cluster, profile, stack, best.hosts, best.stages, 3, global_batch=64) is None  # 64 does not split by 3
  assert price(cluster, profile, stack, best.hosts, best.stages, 32, global_batch=64) is None  # 4 positions, 2 microbatches


def test_a_batch_the_positions_do_not_divide_runs_the_most_ticks_any_takes(scanned):
  """60 examples in microbatches of 2 over 4 data positions: counts (8, 8, 7, 7), priced as 8 lockstep ticks,
  as 64 examples are: a position past its count skips its ticks' work but not their time."""
  _, profile = scanned
  cluster = Cluster.parse("1x4xV100-32GB+1x4xP100-16GB;inter=10Gbps")
  stack = find_stack(profile)
  hosts, stages = ((0,), (1,)), (3, 1)
  uneven, even = (price(cluster, profile, stack, hosts, stages, 2, global_batch=b) for b in (60, 64))
  assert uneven.counts == (8, 8, 7, 7) and uneven.microbatches == 8 and even.counts == (8,) * 4
  assert uneven.step_seconds == pytest.approx(even.step_seconds)
  assert uneven.to_json()["counts"] == [8, 8, 7, 7]
  assert "some positions one fewer" in describe(uneven, cluster) and "fewer" not in describe(even, cluster)


def test_search_cli_ranks_stage_plans_for_a_scanned_model(capsys):
  assert main(["search", "--model", "gpt2-tiny-scan", "--cluster", "hap-v100-p100", "--global-batch", "64",
               "--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["stage_plans"] and all(sum(p["stages"]) == 4 for p in report["stage_plans"])
  assert main(["search", "--model", "gpt2-tiny", "--cluster", "hap-v100-p100", "--global-batch", "64",
               "--json"]) == 0
  assert json.loads(capsys.readouterr().out)["stage_plans"] == []


def test_bfloat16_reduction_halves_the_gradient_bytes_and_is_taken_on_a_slow_network(scanned):
  _, profile = scanned
  stack = find_stack(profile)
  slow = Cluster.parse("1x4xV100-32GB+1x4xP100-16GB;inter=1Gbps;inter_latency=0us;intra_latency=0us")
  best = search_stages(slow, profile, 64)[0]
  assert best.grad_reduce_dtype == "float32"   # float32 unless asked
  narrow = price(slow, profile, stack, best.hosts, best.stages, best.microbatch, global_batch=64, grad_reduce_dtype="bfloat16")
  assert narrow.reduce_seconds == pytest.approx(best.reduce_seconds / 2)   # no latency: pure bytes
  assert narrow.step_seconds == pytest.approx(best.step_seconds - best.reduce_seconds / 2)
  chosen = search_stages(slow, profile, 64, grad_reduce_dtypes=("float32", "bfloat16"))[0]
  assert chosen.grad_reduce_dtype == "bfloat16" and chosen.to_json()["grad_reduce_dtype"] == "bfloat16"
