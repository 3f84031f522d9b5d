"""Plan quality: efficiency and speedup of the best plan over every baseline.

    python benchmarks/plan_quality.py

For each (cluster preset, zoo model, global batch) of the reference
experiments that the zoo already holds, prints the best plan's efficiency
(throughput / ideal, where ideal adds every device's own throughput with no
communication) and its speedup over dp_even, dp_proportional, fastest_only
and best_homogeneous, all under the same cost model. The HAP models (BERT,
ViT, VGG19, BERT-MoE) and GPT 1.3B join the table when they join the zoo.
"""

from __future__ import annotations

import time

CASES = [
    # (cluster, model, global batch, sequence)
    ("amp-t4-v100", "gpt2-medium", 128, 1024),    # AMP: GPT-2, 24 layers, hidden 1024
    ("a100-v100-mix", "gpt2-xl", 256, 1024),
    ("h100-a100-l4-mix", "gpt2-xl", 256, 1024),
    ("hap-v100-p100", "gpt2-small", 512, 1024),
    ("v100x16", "gpt2-medium", 128, 1024),       # homogeneous: must equal the best uniform plan
]


def main() -> None:
  from hetspmd import Cluster, models
  from hetspmd.search import BASELINES, profile_step, search

  profiles = {}
  print(f"{'cluster':<17} {'model':<12} {'batch':>5} {'efficiency':>10} "
        + " ".join(f"{'vs ' + b:>20}" for b in BASELINES) + f" {'search s':>9}  best plan")
  for preset, name, batch, seq in CASES:
    if name not in profiles:
      w = models.get(name)
      profiles[name] = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2, seq))
    cluster = Cluster.preset(preset)
    start = time.perf_counter()
    result = search(cluster, profiles[name], batch)
    seconds = time.perf_counter() - start
    best = result.plans[0]
    speedups = " ".join(f"{best.throughput / result.baselines[b].throughput:20.2f}" for b in BASELINES)
    print(f"{preset:<17} {name:<12} {batch:>5} {best.throughput / result.ideal_throughput:10.1%} {speedups} "
          f"{seconds:9.2f}  {best.name}, mb {best.microbatch}, ZeRO-{best.zero_stage}")


if __name__ == "__main__":
  main()
