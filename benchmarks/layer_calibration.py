"""Calibrating on one layer against calibrating on the whole step: GPTs on 8 profiled CPU devices.

A step too large for one device is calibrated on one layer (``hetspmd.runtime.layer_timing``): one layer of its
layer scan (the ``-scan`` models), or the forward and backward of its middle block where it unrolls its layers
(the others).
The search scales each kind's predicted microbatch by the timed part's measured over predicted seconds. Here the
models fit, so the same plans are priced three ways and run:

* predicted from the profiled specs (``hetspmd profile``);
* priced on the whole step's timing (``ParallelStep.calibrate``);
* priced on one layer's timing;
* measured: the plan's median step, in two passes over all plans.

Goal: the layer-calibrated median absolute error within 10 points of the step-calibrated one (what timing one
layer gives up against timing the step), for scanned and for unrolled layers. With ``--json`` the last line is
one JSON object: ``median_error``, ``median_error_step``, ``median_error_layer`` (over every row),
``median_error_scan`` and ``median_error_block`` (its rows of each form) and ``median_spread``.

    python benchmarks/layer_calibration.py [--steps 5] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# (model, global batch, microbatch, counts per device)
PLANS = [
    ("gpt2-tiny-scan", 64, 8, (1,) * 8),
    ("gpt2-tiny-scan", 64, 2, (4,) * 8),
    ("gpt2-tiny-scan", 128, 4, (4,) * 8),
    ("gpt2-tiny-scan", 64, 2, (8, 8, 4, 4, 2, 2, 2, 2)),
    ("gpt2-narrow-scan", 64, 8, (1,) * 8),
    ("gpt2-narrow-scan", 64, 2, (4,) * 8),
    ("gpt2-narrow-scan", 128, 4, (4,) * 8),
    ("gpt2-tiny", 64, 8, (1,) * 8),
    ("gpt2-tiny", 64, 2, (4,) * 8),
    ("gpt2-tiny", 64, 2, (8, 8, 4, 4, 2, 2, 2, 2)),
    ("gpt2-narrow", 64, 8, (1,) * 8),
    ("gpt2-narrow", 128, 4, (4,) * 8),
]


def _workload(name: str):
  from hetspmd import models

  if name.startswith("gpt2-narrow"):  # more, wider layers: the layers a larger share of the step
    base = models.get(name.replace("narrow", "tiny"))
    return dataclasses.replace(base, name=name, config=dataclasses.replace(base.config, n_layer=8, d_model=128))
  return models.get(name)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
  args = parser.parse_args()

  import hetspmd as hs
  from hetspmd.planner.building import plan_from
  from hetspmd.planner.pricing import evaluate
  from hetspmd.passes.profile import profile_step
  from hetspmd.runtime.layer_timing import layer_calibration

  from _steps import median_step_seconds

  cluster = hs.Cluster.from_profile(hs.profile(progress=False))
  print(f"profiled {cluster.num_devices} CPU devices: {cluster.hosts[0].device.fp32_flops / 1e9:.1f} GFLOP/s each "
        f"busy, link {cluster.hosts[0].intra.bandwidth / 1e9:.2f} GB/s")
  priced: dict[str, tuple] = {}
  rows, runs = [], []
  for name, batch, microbatch, counts in PLANS:
    w = _workload(name)
    if name not in priced:
      profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))
      sizes = sorted({p[2] for p in PLANS if p[0] == name})
      front = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=cluster, plan="search", global_batch=batch)
      whole = front.calibrate(w.init_state(0), w.synthetic_batch(0, batch=8), sizes=sizes)
      layer = layer_calibration(lambda state, b, f=w.make_train_step(hs.value_and_grad): f(state, b),
                                w.abstract_state(), w.example_batch(2), cluster, sizes)
      priced[name] = (profile, cluster.calibrated(whole), cluster.calibrated(layer))
    profile, by_step, by_layer = priced[name]
    positions = tuple(range(cluster.num_devices))
    seconds = [evaluate(c, profile, positions, microbatch, 0, "none", global_batch=batch, counts_rule=counts,
                        name="layer_calibration") for c in (cluster, by_step, by_layer)]
    plan = plan_from(seconds[0], cluster, w.abstract_state())
    runs.append((hs.parallelize(w.make_train_step(hs.value_and_grad), plan=plan, global_batch=batch), w, batch))
    rows.append([name, batch, microbatch, counts, *(s.step_seconds for s in seconds), []])
  for _ in range(2):  # two passes: each plan's steps at two times of the run (its program compiled once)
    for row, (step, w, batch) in zip(rows, runs):
      state = step.shard_state(w.init_state(0))
      row[-1].append(median_step_seconds(step, state, step.shard_batch(w.synthetic_batch(0, batch=batch)),
                                         args.steps)[1])
      del state

  print(f"{'model':<17} {'batch':>5} {'mb':>3} {'counts':<25} {'measured s':>10} {'spread':>6} {'predicted':>9} "
        f"{'error':>7} {'step cal.':>9} {'error':>7} {'layer cal.':>10} {'error':>7}")
  errors: dict[str, list[float]] = {"predicted": [], "step": [], "layer": [], "scan": [], "block": []}
  spreads = []
  for name, batch, microbatch, counts, predicted, by_step, by_layer, measured in rows:
    m = statistics.median(measured)
    spreads.append(abs(measured[0] - measured[1]) / min(measured))
    line = f"{name:<17} {batch:>5} {microbatch:>3} {str(counts):<25} {m:>10.4f} {spreads[-1]:>6.0%}"
    for key, value, width in (("predicted", predicted, 9), ("step", by_step, 9), ("layer", by_layer, 10)):
      error = value / m - 1
      errors[key].append(abs(error))
      line += f" {value:>{width}.4f} {error:>+7.0%}"
    errors["scan" if name.endswith("-scan") else "block"].append(errors["layer"][-1])
    print(line)
  medians = {k: statistics.median(v) for k, v in errors.items()}
  met = all(medians[k] - medians["step"] <= 0.10 for k in ("scan", "block"))
  print(f"median absolute error: predicted {medians['predicted']:.0%}, step-calibrated {medians['step']:.0%}, "
        f"layer-calibrated {medians['layer']:.0%} (a layer scan's layer {medians['scan']:.0%}, an unrolled "
        f"block's forward and backward {medians['block']:.0%}; goal: each within 10 points of step-calibrated: "
        f"{'met' if met else 'NOT met'})")
  print(f"run to run: the two passes differ by {statistics.median(spreads):.0%} (median), the floor under any "
        "error here")
  if args.json:
    print(json.dumps({"median_error": medians["predicted"], "median_error_step": medians["step"],
                      "median_error_layer": medians["layer"], "median_error_scan": medians["scan"],
                      "median_error_block": medians["block"], "median_spread": statistics.median(spreads)}))


if __name__ == "__main__":
  main()
