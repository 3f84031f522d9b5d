"""Cost-model fidelity: predicted vs measured step time on 8 CPU devices.

    python benchmarks/fidelity.py [--steps 5] [--json]

Profiles the 8 emulated CPU devices (``hetspmd.profile``), then runs several
plans of the MLP and GPT-tiny (different microbatch sizes, uniform and
uneven counts, remat policies, ZeRO stages) through ``hetspmd.parallelize`` and prints
each plan's predicted step time next to the measured median. Goals: Spearman rank
correlation >= 0.8, median absolute error <= 25%.

Beside each prediction, the same plan priced on a calibrated cluster: each model's step timed on the devices at
its plans' microbatch sizes, under each of its plans' remat policies (``ParallelStep.calibrate(remats=...)``),
in each pass just before its plans are measured, as a user calibrates and then trains (a calibration made once
at the start had priced whole passes 17-37% fast where the machine slowed between them), the cost model's
compute scaled to those times
(``Cluster.calibrated``; communication stays modelled). Goal: calibrated median absolute error <= 10%,
Spearman >= 0.9.

Every plan is measured twice, in two passes over all the plans (the second after the first has ended), and its
measured time is the median of both passes' steps; its calibrated error, the median of each pass's error
against that pass's calibration. The two passes' difference is printed as the run-to-run
spread: how far this machine's own timings move, the floor under any prediction's error. ``--json`` ends with
one line: ``median_error``, ``median_error_calibrated``, ``spearman``, ``spearman_calibrated`` and
``median_spread``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# (model, global batch, microbatch, counts per device, remat policy, ZeRO stage)
PLANS = [
    ("mlp", 256, 32, (1,) * 8, "none", 0),
    ("mlp", 256, 8, (4,) * 8, "none", 0),
    ("mlp", 256, 8, (8, 8, 4, 4, 2, 2, 2, 2), "none", 0),
    ("mlp", 512, 16, (4,) * 8, "none", 0),
    ("mlp", 256, 32, (1,) * 8, "none", 1),
    ("mlp", 256, 8, (8, 8, 4, 4, 2, 2, 2, 2), "none", 3),
    ("gpt2-tiny", 64, 8, (1,) * 8, "none", 0),
    ("gpt2-tiny", 64, 2, (4,) * 8, "none", 0),
    ("gpt2-tiny", 64, 2, (8, 8, 4, 4, 2, 2, 2, 2), "none", 0),
    ("gpt2-tiny", 128, 4, (4,) * 8, "none", 0),
    ("gpt2-tiny", 128, 4, (4,) * 8, "all_dots", 0),
    ("gpt2-tiny", 128, 4, (4,) * 8, "dots", 0),
    ("gpt2-tiny", 128, 4, (4,) * 8, "full", 0),
    ("gpt2-tiny", 64, 2, (4,) * 8, "none", 1),
]


def _spearman(a, b) -> float:
  from scipy.stats import spearmanr

  return float(spearmanr(a, b).statistic)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
  args = parser.parse_args()

  import hetspmd as hs
  from hetspmd import models
  from hetspmd.planner.pricing import evaluate
  from hetspmd.planner.building import plan_from
  from hetspmd.passes.profile import profile_step

  from _steps import median_step_seconds

  measured_profile = hs.profile(progress=False)
  cluster = hs.Cluster.from_profile(measured_profile)
  print(f"profiled {cluster.num_devices} CPU devices: {cluster.hosts[0].device.fp32_flops / 1e9:.1f} GFLOP/s each "
        f"busy, link {cluster.hosts[0].intra.bandwidth / 1e9:.2f} GB/s")
  profiles = {}
  rows, runs = [], []
  positions = tuple(range(cluster.num_devices))
  for name, batch, microbatch, counts, remat, zero in PLANS:
    workload = models.get(name)
    if name not in profiles:
      profiles[name] = profile_step(workload.make_train_step(), workload.abstract_state(), workload.example_batch(2))
    predicted = evaluate(cluster, profiles[name], positions, microbatch, zero, remat, global_batch=batch,
                         counts_rule=counts, name="fidelity")
    plan = plan_from(predicted, cluster, workload.abstract_state())
    step = hs.parallelize(workload.make_train_step(hs.value_and_grad), plan=plan, global_batch=batch)
    runs.append((step, workload, batch))
    rows.append([name, batch, microbatch, counts, remat, zero, predicted.step_seconds, [], []])
  for _ in range(2):  # two passes: each plan's steps at two times of the run (its program compiled once)
    for name in profiles:  # each model calibrated, then its plans priced on it and measured, in each pass
      mine = [i for i, row in enumerate(rows) if row[0] == name]
      workload = runs[mine[0]][1]
      front = hs.parallelize(workload.make_train_step(hs.value_and_grad), cluster=cluster, plan="search",
                             global_batch=rows[mine[0]][1])
      calibration = front.calibrate(workload.init_state(0), workload.synthetic_batch(0, batch=8),
                                    sizes=sorted({rows[i][2] for i in mine}),
                                    remats=["none", *sorted({rows[i][4] for i in mine} - {"none"})])
      for i in mine:
        _, batch, microbatch, counts, remat, zero = rows[i][:6]
        rows[i][8].append(evaluate(cluster.calibrated(calibration), profiles[name], positions, microbatch, zero,
                                   remat, global_batch=batch, counts_rule=counts, name="fidelity").step_seconds)
        step, workload, batch = runs[i]
        state = step.shard_state(workload.init_state(0))
        sharded = step.shard_batch(workload.synthetic_batch(0, batch=batch))
        rows[i][7].append(median_step_seconds(step, state, sharded, args.steps)[1])
        del state, sharded

  print(f"{'model':<10} {'batch':>5} {'mb':>3} {'counts':<26} {'remat':<8} {'ZeRO':>4} {'predicted s':>11} "
        f"{'measured s':>10} {'spread':>6} {'error':>7} {'calibrated s':>12} {'error':>7}")
  errors, calibrated_errors, spreads = [], [], []
  for row in rows:
    name, batch, microbatch, counts, remat, zero, predicted, passes, afters = row
    row[7] = measured = statistics.median(passes)
    row[8] = after = statistics.median(afters)
    spread = abs(passes[1] - passes[0]) / measured
    spreads.append(spread)
    error = (predicted - measured) / measured
    error_after = statistics.median((a - m) / m for a, m in zip(afters, passes))  # each pass on its calibration
    errors.append(abs(error))
    calibrated_errors.append(abs(error_after))
    print(f"{name:<10} {batch:>5} {microbatch:>3} {str(counts):<26} {remat:<8} {zero:>4} {predicted:11.4f} "
          f"{measured:10.4f} {spread:6.0%} {error:+7.0%} {after:12.4f} {error_after:+7.0%}")
  rho = _spearman([r[6] for r in rows], [r[7] for r in rows])
  rho_after = _spearman([r[8] for r in rows], [r[7] for r in rows])
  median_error, median_after = statistics.median(errors), statistics.median(calibrated_errors)
  median_spread = statistics.median(spreads)
  print(f"Spearman rank correlation {rho:.2f} (goal >= 0.8: {'met' if rho >= 0.8 else 'NOT met'}); "
        f"median absolute error {median_error:.0%} (goal <= 25%: {'met' if median_error <= 0.25 else 'NOT met'})")
  print(f"calibrated: Spearman {rho_after:.2f} (goal >= 0.9: {'met' if rho_after >= 0.9 else 'NOT met'}); median "
        f"absolute error {median_after:.0%} (goal <= 10%: {'met' if median_after <= 0.10 else 'NOT met'})")
  print(f"run to run: the two passes' measurements differ by {median_spread:.0%} (median; largest "
        f"{max(spreads):.0%}), the floor under any prediction's error on this machine")
  if args.json:
    print(json.dumps({"median_error": median_error, "median_error_calibrated": median_after, "spearman": rho,
                      "spearman_calibrated": rho_after, "median_spread": median_spread}))


if __name__ == "__main__":
  main()
