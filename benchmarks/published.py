"""The cost model against published measurements.

    python benchmarks/published.py [--json] [--quick]

Each row is one published measurement, the same setup priced by hetspmd
(cluster, zoo model, precision, global batch; the best plan of
``hetspmd.planner.ranking.search``), and their ratio (predicted speed over
measured speed, whether the row is a throughput or a time: above 1 the model
is optimistic). Then the ratios the papers
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
  DeepSpeed/Megatron in mixed precision (``examples/ds_pretrain_gpt2_pipe.sh``
  passes ``--fp16``; ``examples/ds_config.json``: ``"fp16": {"enabled": true}``,
  ``"fp32_allreduce": true``). The best measured plan of each file is the row;
  AMP's best plans are pipelines (``pp_deg`` 8 and 4), which the search does
  not consider (``hetspmd.search`` prices data and tensor parallelism; pipeline
  stages are priced apart, ``benchmarks/pipeline_estimate.py``). The zoo's
  ``gpt2-medium`` has GPT-2's 50,257-token vocabulary, AMP's config 52,256.
- Cephalo (github benson-guo/cephalo): ``data/model_latencies.json``, one
  GPT-2.7B layer (hidden 2560, sequence 512) per sample, forward and
  backward, float16 and float32, per GPU (PyTorch autocast; float32 without
  TF32, PyTorch's default). Priced as the same layer of the zoo's
  ``gpt3-2.7b``; then the measured float16 over float32 speed per GPU
  against hetspmd's.

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
    predicted = 32 / _predicted_throughput(cluster, "gpt2-medium", 1024, "float16", 32, profiles)
    rows.append(dict(source="AMP src/results", setup=f"gpt2-medium seq 1024 float16 batch 32 on {cluster}",
                     unit="s/step", predicted=predicted, measured=seconds))
  return rows


def _layer_ms(dtype: str, kinds: list[str]) -> dict[str, float]:
  """hetspmd's price of one GPT-3 2.7B layer, forward and backward, per sample at sequence 512 (ms): the
  difference of the 2-layer and 1-layer models' microbatch times, between microbatches of 8 and 4."""
  import dataclasses

  from hetspmd import models
  from hetspmd.hardware.devices import DEVICE_PRESETS
  from hetspmd.passes.profile import profile_step

  base = models.get("gpt3-2.7b")
  profiles = []
  for layers in (1, 2):
    w = dataclasses.replace(base, name=f"gpt3-2.7b-{layers}l", config=dataclasses.replace(base.config, n_layer=layers))
    w = w.with_dtype(dtype)
    profiles.append(profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2, 512)))
  out = {}
  for kind in kinds:
    t = lambda p, b: p.microbatch_seconds(DEVICE_PRESETS[kind], b)
    out[kind] = ((t(profiles[1], 8) - t(profiles[0], 8)) - (t(profiles[1], 4) - t(profiles[0], 4))) / 4 * 1e3
  return out


def cephalo_rows() -> list[dict]:
  kinds = list(CEPHALO_SLOPES_MS)
  f16, f32 = _layer_ms("float16", kinds), _layer_ms("float32", kinds)
  rows = []
  for kind, (f16_fwd, f16_bwd, f32_fwd, f32_bwd) in CEPHALO_SLOPES_MS.items():
    for dtype, predicted, measured in (("float16", f16[kind], f16_fwd + f16_bwd), ("float32", f32[kind],
                                                                                     f32_fwd + f32_bwd)):
      rows.append(dict(source="Cephalo model_latencies.json", setup=f"{kind}: GPT-3 2.7B layer, {dtype}, per sample",
                       unit="ms", predicted=predicted, measured=measured))
  return rows


def cephalo_ratio_rows(cephalo: list[dict]) -> list[dict]:
  rows = []
  for half, full in zip(cephalo[::2], cephalo[1::2]):  # float16 over float32 speed per GPU, as Cephalo measured it
    kind = half["setup"].split(":")[0]
    rows.append(dict(source="Cephalo (derived)", setup=f"{kind}: float16 / float32 layer speed", unit="x",
                     predicted=full["predicted"] / half["predicted"], measured=full["measured"] / half["measured"]))
  return rows


def ratio_rows(nvidia: list[dict], amp: list[dict]) -> list[dict]:
  rows = []
  for seq in (128, 512):  # README's "Throughput speedup (FP32 - mixed precision)" column: 4.21 and 3.69
    f32, f16 = (r for r in nvidia if f" seq {seq} " in r["setup"])
    rows.append(dict(source="NVIDIA DLE (derived)", setup=f"bert-large seq {seq}: mixed precision / float32",
                     unit="x", predicted=f16["predicted"] / f32["predicted"], measured=f16["measured"] / f32["measured"]))
  het, homo = amp  # AMP's two best measured runs: the mixed pool's speed over the T4 pool's
  rows.append(dict(source="AMP src/results (derived)", setup="amp-t4-v100 speed / t4x16 speed", unit="x",
                   predicted=homo["predicted"] / het["predicted"], measured=homo["measured"] / het["measured"]))
  return rows


def _print(title: str, rows: list[dict]) -> None:
  print(title)
  print(f"  {'setup':<58} {'unit':>6} {'predicted':>10} {'measured':>10} {'ratio':>6}")
  for r in rows:
    print(f"  {r['setup']:<58} {r['unit']:>6} {r['predicted']:10.3f} {r['measured']:10.3f} {r['ratio']:6.2f}")


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--json", action="store_true", help="print the rows as JSON")
  parser.add_argument("--quick", action="store_true", help="only Cephalo's per-layer rows (no NVIDIA or AMP rows, no search)")
  args = parser.parse_args(argv)
  profiles: dict = {}
  nvidia = [] if args.quick else nvidia_rows(profiles)
  amp = [] if args.quick else amp_rows(profiles)
  cephalo = cephalo_rows()
  tables = {"nvidia": nvidia, "amp": amp, "cephalo": cephalo,
            "ratios": ([] if args.quick else ratio_rows(nvidia, amp)) + cephalo_ratio_rows(cephalo)}
  for rows in tables.values():
    for r in rows:  # predicted speed over measured speed: above 1 the model is optimistic
      timed = r["unit"] in ("s/step", "ms")
      r["ratio"] = r["measured"] / r["predicted"] if timed else r["predicted"] / r["measured"]
  if args.json:
    print(json.dumps(tables, indent=1))
    return tables
  _print("NVIDIA's tuned BERT-large (throughput; goal: ratio within 1 +- 30%)", nvidia)
  _print("AMP's measured runs (step seconds; a slower framework: ratio is what the datasheet spec misses)", amp)
  _print("Cephalo's per-layer measurements (PyTorch autocast; ratio is what the datasheet spec misses)",
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
