"""Plan quality: efficiency and speedup of the best plan over every baseline.

    python benchmarks/plan_quality.py

For each (cluster preset, zoo model, global batch) of the reference
experiments that the zoo already holds, prints the best plan's efficiency
(throughput / ideal, where ideal adds every device's own throughput with no
communication), its speedup over dp_even, dp_proportional, fastest_only
and best_homogeneous, all under the same cost model, and over the best plan
with data parallelism only (``model`` axis 1, what the search did before it
costed tensor parallelism), then the best plan's layout and tensor-parallel
choice. The HAP models (BERT, ViT, VGG19, BERT-MoE) and GPT 1.3B join the
table when they join the zoo.
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
    # fewer examples than devices: a model axis puts idle devices to work
    ("a100-v100-mix", "gpt2-xl", 16, 1024),
    ("v100x16", "gpt2-xl", 8, 1024),
]


def main() -> None:
  from hetspmd import Cluster, models
  from hetspmd.search import BASELINES, profile_step, search

  profiles = {}
  print(f"{'cluster':<17} {'model':<12} {'batch':>5} {'efficiency':>10} "
        + " ".join(f"{'vs ' + b:>20}" for b in BASELINES) + f" {'vs data only':>12} {'search s':>9}  best plan")
  for preset, name, batch, seq in CASES:
    if name not in profiles:
      w = models.get(name)
      profiles[name] = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2, seq))
    cluster = Cluster.preset(preset)
    start = time.perf_counter()
    result = search(cluster, profiles[name], batch)
    seconds = time.perf_counter() - start
    best = result.plans[0]
    data_only = search(cluster, profiles[name], batch, models=(1,)).plans[0]
    speedups = " ".join(f"{best.throughput / result.baselines[b].throughput:20.2f}" for b in BASELINES)
    print(f"{preset:<17} {name:<12} {batch:>5} {best.throughput / result.ideal_throughput:10.1%} {speedups} "
          f"{best.throughput / data_only.throughput:12.2f} {seconds:9.2f}  {best.name}, mb {best.microbatch}, "
          f"ZeRO-{best.zero_stage}, remat {'on' if best.remat else 'off'}; tensor parallel: "
          f"{best.tensor_parallel.description}")


if __name__ == "__main__":
  main()
