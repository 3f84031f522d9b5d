"""What timing the searched plan before it runs buys: the calibrated search's choice against the verified one.

    python benchmarks/verify.py [--steps 7] [--json]

On 8 profiled CPU devices, each model's step is calibrated (``ParallelStep.calibrate``), then searched twice
on that calibration: ``verify=False`` runs the search's choice as priced; ``verify=True`` times the choice whole
on its first call (a single program, or a group plan's programs and exchange) and, where it runs more than 25%
slower than predicted, times the best single programs after it too and runs the fastest measured (:mod:`hetspmd.runtime.verifying`). Both steps are then timed in turns (ABAB, the median
of ``--steps`` steps per turn, two turns each), and the first call's seconds of each (search, timing, compile)
are printed beside them. Where the choice is within its prediction, both run the same plan: the ratio is the
machine's noise. ``--json`` ends with one line: ``median_ratio`` (verified over unverified step time),
``replanned`` (how many models re-planned) and ``median_first_call_ratio``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# (model, global batch)
WORKLOADS = [("mlp", 256), ("mlp", 1024), ("gpt2-tiny", 64), ("gpt2-tiny", 128)]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=7)
  parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
  args = parser.parse_args()

  import jax
  import hetspmd as hs
  from hetspmd import models

  from _steps import median_step_seconds

  cluster = hs.Cluster.from_profile(hs.profile(progress=False))
  print(f"profiled {cluster.num_devices} CPU devices; each step calibrated on them, then searched on its times")
  rows = []
  for name, batch in WORKLOADS:
    workload = models.get(name)
    probe = hs.parallelize(workload.make_train_step(hs.value_and_grad), cluster=cluster, plan="search",
                           global_batch=batch)
    calibration = probe.calibrate(workload.init_state(0), workload.synthetic_batch(0, batch=8))
    steps, first = {}, {}
    for verify in (False, True):
      step = hs.parallelize(workload.make_train_step(hs.value_and_grad), cluster=cluster, plan="search",
                            global_batch=batch, calibrate=calibration, verify=verify)
      start = time.perf_counter()
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the verified step warns where even its best misses; the table says so
        jax.block_until_ready(step(workload.init_state(0), workload.synthetic_batch(0, batch=batch)))
      first[verify] = time.perf_counter() - start
      steps[verify] = step
    measured = {False: [], True: []}
    for turn in (False, True, False, True):
      step = steps[turn]
      state = step.shard_state(workload.init_state(0))
      sharded = step.shard_batch(workload.synthetic_batch(0, batch=batch))
      measured[turn].append(median_step_seconds(step, state, sharded, args.steps)[1])
      del state, sharded
    v = steps[True].verification
    rows.append((name, batch, v, statistics.median(measured[False]), statistics.median(measured[True]),
                 first[False], first[True]))

  print(f"{'model':<10} {'batch':>5} {'predicted ms':>12} {'choice ms':>9} {'timed':>5} {'re-planned':>10} "
        f"{'unverified ms':>13} {'verified ms':>11} {'ratio':>6} {'first call s':>12} {'verified':>8}")
  ratios, firsts = [], []
  for name, batch, v, plain, verified, first_plain, first_verified in rows:
    ratios.append(verified / plain)
    firsts.append(first_verified / first_plain)
    choice = v.timed[0]
    print(f"{name:<10} {batch:>5} {choice.predicted * 1e3:12.3f} {choice.measured * 1e3:9.3f} {len(v.timed):>5} "
          f"{'yes' if v.replanned else 'no':>10} {plain * 1e3:13.3f} {verified * 1e3:11.3f} {verified / plain:6.2f} "
          f"{first_plain:12.2f} {first_verified:8.2f}")
    for i, t in enumerate(v.timed):
      print(f"    {'->' if i == v.runs else '  '} {t.label}: predicted {t.predicted * 1e3:.3f} ms, "
            f"measured {t.measured * 1e3:.3f} ms ({t.off:+.0%})")
  replanned = sum(r[2].replanned for r in rows)
  print(f"verified over unverified step time: median {statistics.median(ratios):.2f} (best {min(ratios):.2f}, "
        f"worst {max(ratios):.2f}); {replanned} of {len(rows)} re-planned; first call "
        f"{statistics.median(firsts):.2f}x as long (median)")
  if args.json:
    print(json.dumps({"median_ratio": statistics.median(ratios), "replanned": replanned,
                      "median_first_call_ratio": statistics.median(firsts)}))


if __name__ == "__main__":
  main()
