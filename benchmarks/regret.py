"""What datasheet speeds cost a plan: the regret of planning on them, where published measurements say otherwise.

    python benchmarks/regret.py [--json]

Predicted (the cost model; no device runs). benchmarks/published.py compares the cost model's price of one
GPT-3 2.7B layer (float16, sequence 512) with the per-layer times Cephalo measured on six GPUs: at the uniform
datasheet efficiencies, measured over predicted is 0.75 to 4.2. Here each reference pool is searched three times:

* at the uniform datasheet efficiencies (every spec's ``chip`` unset),
* at each chip's efficiencies (``hetspmd.hardware.efficiency``, fitted to those same layer times: what a user
  without measurements gets), and
* on corrected specs: each kind's microbatch compute and per-step work scaled by Cephalo's measured over the
  chip's predicted time (a :class:`~hetspmd.hardware.calibration.Calibration` built from those ratios, as a
  calibrated search would measure them; a V100-32GB takes the V100-16GB's ratio).

Each plan is then priced on the corrected specs. The regret of a plan is how much faster the corrected plan is
where both run on the corrected speeds: the throughput a pool loses by trusting that pricing. The chips'
efficiencies are fitted to the measurements the correction comes from, so their regret is small by
construction: it says what the fitted table recovers of the datasheet's regret on these pools, not how well it
carries to other stacks (published.py checks that against NVIDIA's tables).
Single programs only (data and model axes, no group plans), the overlapped last microbatch not fused, so that
each plan can be priced again as it is.
"""

from __future__ import annotations

import argparse
import json

# (pool, model, global batch, sequence, dtype)
CASES = [
    ("cephalo-workstation", "gpt2-large", 64, 512, "float16"),  # GPT-3 2.7B fits only group plans there
    ("amp-t4-v100", "gpt2-medium", 32, 1024, "float16"),
    ("t4-heavy-v100", "gpt2-medium", 32, 1024, "float16"),
    ("hap-v100-p100", "gpt2-medium", 256, 1024, "float16"),
]
SAME_CHIP = {"V100-32GB": "V100-16GB"}


def measured_ratios() -> dict[str, float]:
  """Per kind: Cephalo's measured float16 layer time over hetspmd's predicted one at the kind's chip's
  efficiencies (published.py's rows)."""
  from published import _layer_pricers, cephalo_rows

  return {r["setup"].split(":")[0]: r["measured"] / r["predicted"] for r in cephalo_rows(_layer_pricers())
          if "float16" in r["setup"]}


def corrected(cluster, profile, ratios: dict[str, float], sizes):
  """``cluster`` priced as if each kind ran at its measured/predicted ratio: a calibration whose points are the
  datasheet prediction times the ratio at every microbatch size the search tries."""
  from hetspmd.hardware.calibration import Calibration, KindTiming

  timings = []
  for kind in cluster.kinds:
    ratio = ratios.get(SAME_CHIP.get(kind, kind))
    if ratio is None:
      continue
    spec = cluster.spec_of(kind)
    points = tuple((m, profile.microbatch_seconds(spec, m) * ratio) for m in sizes)
    timings.append(KindTiming(kind, points, profile.step_fixed_seconds(spec) * ratio))
  return cluster.calibrated(Calibration("published-ratios", tuple(timings)))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true", help="end with one JSON line of the rows")
  args = parser.parse_args()

  from hetspmd import Cluster, models
  from hetspmd.passes.profile import profile_step
  from hetspmd.planner.pricing import evaluate
  from hetspmd.planner.ranking import microbatch_sizes, search

  from published import _datasheet

  ratios = measured_ratios()
  print("measured / predicted float16 GPT-3 2.7B layer time at the chips' efficiencies (Cephalo): "
        + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
  print(f"{'pool':<20} {'model':<12} {'batch':>5} {'datasheet plan':<30} {'chip plan':<30} {'corrected plan':<30} "
        f"{'regret':>7} {'chips':>7}")
  rows = []
  for pool, model, batch, seq, dtype in CASES:
    cluster = Cluster.resolve(pool)
    w = models.get(model).with_dtype(dtype)
    profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2, seq))
    fixed = corrected(cluster, profile, ratios, microbatch_sizes(batch))
    options = dict(top=1, fuse_overlap=False, remat_policies=("none", "dots", "full"))
    naive = search(_datasheet(cluster), profile, batch, **options).plans[0]
    chips = search(cluster, profile, batch, **options).plans[0]
    best = search(fixed, profile, batch, **options).plans[0]
    again = lambda e: evaluate(fixed, profile, e.device_positions, e.microbatch, e.zero_stage, e.remat,
                               global_batch=batch, counts_rule=e.counts, name=e.name,
                               tensor_parallel=e.tensor_parallel, reduce_dtype=e.grad_reduce_dtype, overlap=e.overlap)
    on_naive, on_chips = again(naive), again(chips)
    regret, chips_regret = best.throughput / on_naive.throughput - 1, best.throughput / on_chips.throughput - 1
    describe = lambda e: f"{e.name[:10]} mb {e.microbatch} {list(e.counts)[:6]}"
    print(f"{pool:<20} {model:<12} {batch:>5} {describe(naive):<30} {describe(chips):<30} {describe(best):<30} "
          f"{regret:7.1%} {chips_regret:7.1%}")
    print(f"{'':<20} on corrected speeds: datasheet plan {on_naive.throughput:.2f} samples/s, chip plan "
          f"{on_chips.throughput:.2f}, corrected plan {best.throughput:.2f}")
    rows.append({"pool": pool, "model": model, "batch": batch, "regret": regret, "chips_regret": chips_regret,
                 "datasheet_plan_on_corrected": on_naive.throughput, "chip_plan_on_corrected": on_chips.throughput,
                 "corrected_plan": best.throughput, "datasheet_plan_predicted": naive.throughput})
  worst = max(rows, key=lambda r: r["regret"])
  print(f"largest regret: {worst['regret']:.1%} at the datasheet efficiencies ({worst['pool']}, {worst['model']}); "
        f"at the chips' efficiencies {max(r['chips_regret'] for r in rows):.1%}")
  if args.json:
    print(json.dumps(rows))


if __name__ == "__main__":
  main()
