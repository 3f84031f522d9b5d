"""The cost model against published measurements.

    python benchmarks/published.py [--json] [--quick]

Each row is one published measurement, the same setup priced by hetspmd
(cluster, zoo model, precision, global batch; the best plan of
``hetspmd.planner.ranking.search``), and their ratio (predicted / measured
throughput: above 1 the model is optimistic). Then the ratios the papers
report (mixed precision over float32, one pool over another) against the
same ratios predicted. Every number's source is named beside it.

Three sources:

- NVIDIA DeepLearningExamples, ``PyTorch/LanguageModeling/BERT/README.md``,
  table "Pre-training NVIDIA DGX-1 With 32G" (pytorch:19.07-py3 container,
  8x V100-32GB SXM2, NVLink): BERT-large pretraining throughput at sequence
  128 and 512, float32 and mixed precision. Tuned kernels (apex fused
  LAMB, fused LayerNorm/GELU): what the datasheet efficiencies should reach.
- AMP (github DachengLi1/AMP): the measured step times (``r_cost``, s) of
  ``src/results/het_cluster_results.txt`` (3 p3.8xlarge + 1 g4dn.12xlarge)
  and ``src/results/homogeneous_results.txt`` (4 g4dn.12xlarge), GPT-2 with
  24 layers, hidden 1024, sequence 1024, global batch 32, on
  DeepSpeed/Megatron. The best measured plan of each file is the row.
- Cephalo (github benson-guo/cephalo): ``data/model_latencies.json``, one
  GPT-2.7B layer (hidden 2560, sequence 512) per sample, forward and
  backward, float16 and float32, per GPU (PyTorch autocast). These bound the
  half-precision rates: the measured float16 over float32 speed per GPU
  against hetspmd's priced ratio, and the P40's achieved float16 rate.

AMP's and Cephalo's frameworks are not tuned like NVIDIA's; their absolute
ratios say how far a datasheet spec is from that stack. To plan for your own
stack, price with measured numbers: ``hetspmd profile --out cluster.toml`` on
the machines, then ``hetspmd search --cluster cluster.toml``.
"""

from __future__ import annotations

import argparse
import json
import math

# --- NVIDIA DeepLearningExamples, PyTorch BERT README, "Pre-training NVIDIA DGX-1 With 32G" (8 GPUs rows) ---
# (sequence, dtype, batch per GPU, measured sequences/s on 8 GPUs)
NVIDIA_DGX1_V100_32G = [
    (128, "float32", 32, 309.76),   # "|8 |32 | 64| 128|309.76 |1305.6| 4.21| 7.68 | 7.62"
    (128, "float16", 64, 1305.6),
    (512, "float32", 4, 62.72),     # "| 8| 4| 8| 512|62.72 |231.68 | 3.69| 7.68| 7.61"
    (512, "float16", 8, 231.68),
]
NVIDIA_CLUSTER = "1x8xV100-32GB"  # DGX-1: 8 V100-32GB SXM2 on NVLink

# --- AMP: best measured step (r_cost, s) in each results file, GPT-2 24 x 1024, seq 1024, global batch 32 ---
AMP_MEASURED = [
    # src/results/het_cluster_results.txt: "[0, 5, 9, 12, 15, 18, 21, 24, 30], 1, {'mp_deg': 1, 'dp_deg': 2,
    # 'pp_deg': 8}, with p_cost: 1.1402, r_cost: 1.28" (the lowest r_cost in the file)
    ("amp-t4-v100", 1.28),
    # src/results/homogeneous_results.txt: "[0, 9, 15, 21, 30], 1, {'mp_deg': 1, 'dp_deg': 4, 'pp_deg': 4},
    # with p_cost: 1.2841, r_cost: 1.2" (the lowest r_cost in the file)
    ("t4x16", 1.20),
]

# --- Cephalo: data/model_latencies.json["deepspeedgpt_2.7b"][gpu]["512"][dtype] = [[fwd slope, fwd intercept],
# [bwd slope, bwd intercept]], ms per layer, slope per sample ---
CEPHALO_SLOPES_MS = {  # gpu: (float16 fwd, float16 bwd, float32 fwd, float32 bwd)
    "P40": (15.637, 28.017, 18.481, 29.041),
    "P100-16GB": (15.724, 23.995, 17.265, 25.689),
    "T4": (8.612, 8.624, 25.016, 36.910),
    "V100-16GB": (2.746, 4.011, 7.773, 12.707),   # "v100x16"
    "L4": (7.415, 10.946, 13.930, 28.147),
    "RTX-A6000": (2.835, 4.221, 6.069, 11.429),
}
CEPHALO_LAYER_FLOPS = 3 * (24 * 512 * 2560**2 + 4 * 512**2 * 2560)  # forward + backward, one sample, one layer

GOALS = {"nvidia": 0.30, "ratio": 0.15}


def _predicted_throughput(cluster: str, model: str, seq: int, dtype: str, batch: int, profiles: dict) -> float:
  from hetspmd import Cluster, models
  from hetspmd.passes.profile import profile_step
  from hetspmd.planner.ranking import search

  w = models.get(model).with_dtype(dtype)
  key = (w.name, seq)
  if key not in profiles:
    profiles[key] = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2, seq))
  result = search(Cluster.resolve(cluster), profiles[key], batch, overlap=True)
  return result.plans[0].throughput


def nvidia_rows(profiles: dict) -> list[dict]:
  rows = []
  for seq, dtype, per_gpu, measured in NVIDIA_DGX1_V100_32G:
    predicted = _predicted_throughput(NVIDIA_CLUSTER, "bert-large", seq, dtype, 8 * per_gpu, profiles)
    rows.append(dict(source="NVIDIA DLE PyTorch BERT, DGX-1 32G", setup=f"bert-large seq {seq} {dtype} "
                     f"batch {8 * per_gpu} on 8xV100-32GB", unit="seq/s", predicted=predicted, measured=measured))
  return rows


def amp_rows(profiles: dict) -> list[dict]:
  rows = []
  for cluster, seconds in AMP_MEASURED:
    predicted = 32 / _predicted_throughput(cluster, "gpt2-medium", 1024, "float32", 32, profiles)
    rows.append(dict(source="AMP src/results", setup=f"gpt2-medium seq 1024 float32 batch 32 on {cluster}",
                     unit="s/step", predicted=predicted, measured=seconds))
  return rows


def cephalo_rows() -> list[dict]:
  from hetspmd.hardware.devices import DEVICE_PRESETS
  from hetspmd.passes import _jax_adapter as jx
  from hetspmd.passes.costing.step_cost import EFFICIENCY

  rows = []
  for kind, (f16_fwd, f16_bwd, f32_fwd, f32_bwd) in CEPHALO_SLOPES_MS.items():
    spec = DEVICE_PRESETS[kind]
    f32 = spec.f32_matmul_flops(jx.reduced_precision_f32_matmuls())
    rows.append(dict(source="Cephalo model_latencies.json", setup=f"{kind}: float16 / float32 layer speed",
                     unit="x", predicted=spec.float16_flops / f32, measured=(f32_fwd + f32_bwd) / (f16_fwd + f16_bwd)))
    if kind == "P40":
      achieved = CEPHALO_LAYER_FLOPS / ((f16_fwd + f16_bwd) * 1e-3) / 1e12
      rows.append(dict(source="Cephalo model_latencies.json", setup="P40 float16 matmul rate (layer FLOPs / time)",
                       unit="TF/s", predicted=spec.float16_flops * EFFICIENCY["matmul"] / 1e12, measured=achieved))
  return rows


def ratio_rows(nvidia: list[dict], amp: list[dict]) -> list[dict]:
  rows = []
  for seq in (128, 512):  # README's "Throughput speedup (FP32 - mixed precision)" column: 4.21 and 3.69
    f32, f16 = (r for r in nvidia if f" seq {seq} " in r["setup"])
    rows.append(dict(source="NVIDIA DLE (derived)", setup=f"bert-large seq {seq}: mixed precision / float32",
                     unit="x", predicted=f16["predicted"] / f32["predicted"], measured=f16["measured"] / f32["measured"]))
  het, homo = amp  # AMP's two best measured runs: the mixed pool's step over the T4 pool's
  rows.append(dict(source="AMP src/results (derived)", setup="amp-t4-v100 step / t4x16 step", unit="x",
                   predicted=het["predicted"] / homo["predicted"], measured=het["measured"] / homo["measured"]))
  return rows


def _print(title: str, rows: list[dict]) -> None:
  print(title)
  print(f"  {'setup':<58} {'unit':>6} {'predicted':>10} {'measured':>10} {'ratio':>6}")
  for r in rows:
    print(f"  {r['setup']:<58} {r['unit']:>6} {r['predicted']:10.3f} {r['measured']:10.3f} {r['ratio']:6.2f}")


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--json", action="store_true", help="print the rows as JSON")
  parser.add_argument("--quick", action="store_true", help="only the rows that need no tracing (Cephalo's)")
  args = parser.parse_args(argv)
  profiles: dict = {}
  nvidia = [] if args.quick else nvidia_rows(profiles)
  amp = [] if args.quick else amp_rows(profiles)
  tables = {"nvidia": nvidia, "amp": amp, "cephalo": cephalo_rows(),
            "ratios": [] if args.quick else ratio_rows(nvidia, amp)}
  for rows in tables.values():
    for r in rows:
      r["ratio"] = r["predicted"] / r["measured"]
  if args.json:
    print(json.dumps(tables, indent=1))
    return tables
  _print("NVIDIA's tuned BERT-large (throughput; goal: ratio within 1 +- 30%)", nvidia)
  _print("AMP's measured runs (step seconds; a slower framework: ratio is what the datasheet spec misses)", amp)
  _print("Cephalo's per-layer measurements (half-precision speed over float32; the P40's float16 rate)",
         tables["cephalo"])
  _print("ratios the papers report (goal: ratio within 1 +- 15%)", tables["ratios"])
  for name, goal in GOALS.items():
    rows = tables["nvidia"] if name == "nvidia" else tables["ratios"]
    if rows:
      worst = max(abs(math.log(r["ratio"])) for r in rows)
      print(f"{name}: worst ratio {math.exp(worst):.2f}x off (goal within {goal:.0%}: "
            f"{'met' if math.exp(worst) - 1 <= goal else 'NOT met'})")
  return tables


if __name__ == "__main__":
  main()
