"""Stage plans against the search's best plan, for zoo models that scan their layers, on the reference clusters.

    python benchmarks/stage_plans.py [--case amp-t4-v100:gpt2-medium-scan:32 ...]

Both columns are the cost model's predictions on the same traced step (the ``-scan`` variant of the model,
its blocks stacked and run by one ``nnx.scan``): the best plan ``hetspmd.search`` finds over data and model
axes, and the best stage plan ``hetspmd.planner.stages`` finds (lockstep GPipe ticks over stages of whole
hosts, layers split by the stages' speed). The schedule itself is measured in ``pipeline_hetero.py``.
"""

from __future__ import annotations

import argparse

CASES = [  # (cluster, model, global batch)
    ("amp-t4-v100", "gpt2-medium-scan", 32),
    ("amp-t4-v100", "gpt2-medium-scan", 128),
    ("hap-v100-p100", "gpt2-small-scan", 512),
    ("hap-v100-p100", "gpt2-medium-scan", 512),
    ("a100-v100-mix", "gpt2-large-scan", 256),
]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--case", action="append", default=[], help="cluster:model:batch; repeatable")
  args = parser.parse_args()
  cases = [(c, m, int(b)) for c, m, b in (x.split(":") for x in args.case)] or CASES

  from hetspmd import Cluster, models
  from hetspmd.passes.profile import profile_step
  from hetspmd.planner.ranking import search
  from hetspmd.planner.stages import describe, search_stages

  print(f"{'cluster':<15} {'model':<18} {'batch':>5} {'best plan s':>11} {'stages s':>9} {'ratio':>6}  stage plan")
  for preset, name, batch in cases:
    w = models.get(name)
    profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))
    cluster = Cluster.preset(preset)
    best = search(cluster, profile, batch, overlap=True, grad_reduce_dtypes=("float32", "bfloat16")).plans[0]
    stages = search_stages(cluster, profile, batch, top=1, grad_reduce_dtypes=("float32", "bfloat16"))
    if not stages:
      print(f"{preset:<15} {name:<18} {batch:>5} {best.step_seconds:11.3f} {'no fit':>9}", flush=True)
      continue
    s = stages[0]
    print(f"{preset:<15} {name:<18} {batch:>5} {best.step_seconds:11.3f} {s.step_seconds:9.3f} "
          f"{best.step_seconds / s.step_seconds:6.2f}  {describe(s, cluster)}", flush=True)
  print("ratio = the best plan's step / the best stage plan's (> 1: stages are predicted faster)")


if __name__ == "__main__":
  main()
