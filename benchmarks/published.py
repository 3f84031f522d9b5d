"""The cost model against published measurements.

    python benchmarks/published.py [--json] [--quick] [--fit]

Each row is one published measurement, the same setup priced by hetspmd
(cluster, zoo model, precision, global batch; the best plan of
``hetspmd.planner.ranking.search``), and their ratio (predicted speed over
measured speed, whether the row is a throughput or a time: above 1 the model
is optimistic). Then the ratios the papers
report (mixed precision over float32, one pool over another) against the
same ratios predicted. Every number's source is named beside it.

Every setup is priced twice: with the efficiencies of each kind's chip
(``hetspmd.hardware.efficiency``, what the search uses) and with the
uniform datasheet ones. The chips' efficiencies are fitted to
Cephalo's layer timings (``--fit`` refits them and prints the table the
module holds); NVIDIA's tuned tables and AMP's runs are the check.

Three sources:

- NVIDIA DeepLearningExamples, ``PyTorch/LanguageModeling/BERT/README.md``,
  table "Pre-training NVIDIA DGX-1 With 32G" (pytorch:19.07-py3 container,
  8x V100-32GB SXM2, NVLink): BERT-large pretraining throughput at sequence
  128 and 512, float32 and mixed precision. Tuned kernels (apex fused
  LAMB, fused LayerNorm/GELU): what the datasheet efficiencies should reach.
  The same README at the pytorch:21.11-py3 container adds "Pre-training
  NVIDIA DGX A100 (8x A100 80GB)" (TF32 and mixed precision) and new DGX-1
  rows, with gradient accumulation (8192 sequences per GPU per step on the
  A100s, 4096 on the V100s); its sequence-128 rows are used. Its
  sequence-512 rows are phase 2 with binned sequences (LDDL, bin size 64),
  shorter than 512 on average: at full length the V100's float32 row (149.6
  seq/s) would exceed its float32 peak. They are left out.
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
  TF32, PyTorch's default, so its float32 rows are priced at full float32
  precision). Priced as the same layer of the zoo's ``gpt3-2.7b``; then the
  measured float16 over float32 speed per GPU against hetspmd's. These rows
  are what the chips' efficiencies are fitted to: they agree by
  construction, and check nothing.

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
# pytorch:21.11-py3 tables, sequence 128, 8 GPUs, with gradient accumulation:
# (cluster, sequences per GPU per step, float32 or TF32 seq/s, mixed precision seq/s)
NVIDIA_2111_SEQ128 = [
    # "Pre-training NVIDIA DGX A100 (8x A100 80GB)": "| 8 | 128 and 256 | 8192 and 8192 | 64 and 32 | 128 | 2505 | 4591 |"
    ("1x8xA100-80GB", 8192, 2505.0, 4591.0),
    # "Pre-training NVIDIA DGX-1 With 32G": "| 8 | 4096 and 4096 | 128 and 64 | 128 | 387 | 1746 |"
    ("1x8xV100-32GB", 4096, 387.0, 1746.0),
]

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


def _datasheet(cluster):
  """``cluster`` with every kind priced at the uniform datasheet efficiencies."""
  import dataclasses

  return dataclasses.replace(cluster, hosts=tuple(dataclasses.replace(h, device=h.device.replace(chip=None))
                                                   for h in cluster.hosts))


def _predicted_throughput(cluster: str, model: str, seq: int, dtype: str, batch: int, profiles: dict
                          ) -> tuple[float, float]:
  """Throughput of the best plan, priced at the chips' efficiencies and at the datasheet's."""
  from hetspmd import Cluster, models
  from hetspmd.passes.profile import profile_step
  from hetspmd.planner.ranking import search

  w = models.get(model).with_dtype(dtype)
  key = (w.name, seq)
  if key not in profiles:
    profiles[key] = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2, seq))
  pool = Cluster.resolve(cluster)
  return tuple(search(c, profiles[key], batch, overlap=True).plans[0].throughput for c in (pool, _datasheet(pool)))


def _row(source: str, setup: str, unit: str, predicted: tuple[float, float], measured: float) -> dict:
  return dict(source=source, setup=setup, unit=unit, predicted=predicted[0], datasheet=predicted[1],
              measured=measured)


def nvidia_rows(profiles: dict) -> list[dict]:
  rows = []
  for seq, dtype, per_gpu, measured in NVIDIA_DGX1_V100_32G:
    predicted = _predicted_throughput(NVIDIA_CLUSTER, "bert-large", seq, dtype, 8 * per_gpu, profiles)
    rows.append(_row("NVIDIA DLE PyTorch BERT, DGX-1 32G", f"bert-large seq {seq} {dtype} batch {8 * per_gpu} on "
                     "8xV100-32GB", "seq/s", predicted, measured))
  for cluster, per_gpu, *measured in NVIDIA_2111_SEQ128:
    for dtype, seconds in zip(("float32", "float16"), measured):
      predicted = _predicted_throughput(cluster, "bert-large", 128, dtype, 8 * per_gpu, profiles)
      rows.append(_row("NVIDIA DLE PyTorch BERT, 21.11", f"bert-large seq 128 {dtype} batch {8 * per_gpu} on "
                       f"{cluster.split('x', 1)[1]} (21.11)", "seq/s", predicted, seconds))
  return rows


def amp_rows(profiles: dict) -> list[dict]:
  rows = []
  for cluster, seconds in AMP_MEASURED:
    speed = _predicted_throughput(cluster, "gpt2-medium", 1024, "float16", 32, profiles)
    rows.append(_row("AMP src/results", f"gpt2-medium seq 1024 float16 batch 32 on {cluster}", "s/step",
                     tuple(32 / t for t in speed), seconds))
  return rows


class _At:
  """A device spec priced at other efficiencies (what the fit varies)."""

  def __init__(self, spec, efficiency):
    self._spec, self.efficiency = spec, efficiency

  def __getattr__(self, name):
    return getattr(self._spec, name)


def _layer_pricers() -> dict:
  """dtype -> spec -> hetspmd's price of one GPT-3 2.7B layer, forward and backward, per sample at sequence 512
  (ms): the difference of the 2-layer and 1-layer models' microbatch times, between microbatches of 8 and 4.
  Float32 matmuls at full float32 precision, as Cephalo ran them (PyTorch leaves TF32 off)."""
  import dataclasses

  import jax

  from hetspmd import models
  from hetspmd.passes.profile import profile_step

  base = models.get("gpt3-2.7b")
  pricers = {}
  for dtype in ("float16", "float32"):
    profiles = []
    for layers in (1, 2):
      w = dataclasses.replace(base, name=f"gpt3-2.7b-{layers}l",
                              config=dataclasses.replace(base.config, n_layer=layers)).with_dtype(dtype)
      profiles.append(profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2, 512)))

    def price(spec, profiles=profiles):
      with jax.default_matmul_precision("float32"):
        t = lambda p, b: p.microbatch_seconds(spec, b)
        return ((t(profiles[1], 8) - t(profiles[0], 8)) - (t(profiles[1], 4) - t(profiles[0], 4))) / 4 * 1e3
    pricers[dtype] = price
  return pricers


def cephalo_rows(pricers: dict) -> list[dict]:
  from hetspmd.hardware.devices import DEVICE_PRESETS

  rows = []
  for kind, (f16_fwd, f16_bwd, f32_fwd, f32_bwd) in CEPHALO_SLOPES_MS.items():
    spec = DEVICE_PRESETS[kind]
    for dtype, measured in (("float16", f16_fwd + f16_bwd), ("float32", f32_fwd + f32_bwd)):
      predicted = (pricers[dtype](spec), pricers[dtype](spec.replace(chip=None)))
      rows.append(_row("Cephalo model_latencies.json", f"{kind}: GPT-3 2.7B layer, {dtype}, per sample", "ms",
                       predicted, measured))
  return rows


def fit_chips(pricers: dict) -> dict:
  """chip -> (Efficiency fitted to Cephalo's layer times of its kinds, the kinds): least squares on the log of
  predicted over measured time, matrix and vector efficiencies (matrix only where a kind's float16 rate is above
  its float32 one), memory at the datasheet's; two decimals."""
  import numpy as np
  from scipy.optimize import least_squares

  from hetspmd.hardware.devices import DEVICE_PRESETS
  from hetspmd.hardware.efficiency import DATASHEET, Efficiency

  by_chip: dict = {}
  for kind in CEPHALO_SLOPES_MS:
    by_chip.setdefault(DEVICE_PRESETS[kind].chip, []).append(kind)
  fitted = {}
  for chip, kinds in by_chip.items():
    specs = [DEVICE_PRESETS[k] for k in kinds]
    matrix = any(s.float16_flops > s.fp32_flops for s in specs)

    def efficiency(x):
      vector = float(np.exp(x[-1]))
      return Efficiency(matrix=float(np.exp(x[0])) if matrix else vector, vector=vector, memory=DATASHEET.memory)

    def residuals(x):
      e = efficiency(x)
      out = []
      for kind, spec in zip(kinds, specs):
        f16_fwd, f16_bwd, f32_fwd, f32_bwd = CEPHALO_SLOPES_MS[kind]
        out += [math.log(pricers["float16"](_At(spec, e)) / (f16_fwd + f16_bwd)),
                math.log(pricers["float32"](_At(spec, e)) / (f32_fwd + f32_bwd))]
      return out

    start = np.log([DATASHEET.matrix, DATASHEET.vector][(0 if matrix else 1):])
    x = least_squares(residuals, start, bounds=(np.log(0.01), 0.0)).x
    e = efficiency(x)
    fitted[chip] = (Efficiency(round(e.matrix, 2), round(e.vector, 2), e.memory), tuple(kinds))
  return fitted


def cephalo_ratio_rows(cephalo: list[dict]) -> list[dict]:
  rows = []
  for half, full in zip(cephalo[::2], cephalo[1::2]):  # float16 over float32 speed per GPU, as Cephalo measured it
    kind = half["setup"].split(":")[0]
    rows.append(dict(source="Cephalo (derived)", setup=f"{kind}: float16 / float32 layer speed", unit="x", kind=kind,
                     predicted=full["predicted"] / half["predicted"], datasheet=full["datasheet"] / half["datasheet"],
                     measured=full["measured"] / half["measured"]))
  return rows


def ratio_rows(nvidia: list[dict], amp: list[dict]) -> list[dict]:
  rows = []
  # the tables' "Throughput speedup (FP32 - mixed precision)" columns; each setup's float32 row, then its float16 one
  for f32, f16 in zip(nvidia[::2], nvidia[1::2]):
    setup = f32["setup"].replace(" float32", "").split(" batch ")[0] + " on " + f32["setup"].split(" on ")[1]
    kind = f32["setup"].split(" on 8x")[1].split(" ")[0]
    rows.append(dict(source="NVIDIA DLE (derived)", setup=f"{setup}: mixed / float32", unit="x", kind=kind,
                     predicted=f16["predicted"] / f32["predicted"], datasheet=f16["datasheet"] / f32["datasheet"],
                     measured=f16["measured"] / f32["measured"]))
  het, homo = amp  # AMP's two best measured runs: the mixed pool's speed over the T4 pool's
  rows.append(dict(source="AMP src/results (derived)", setup="amp-t4-v100 speed / t4x16 speed", unit="x",
                   predicted=homo["predicted"] / het["predicted"], datasheet=homo["datasheet"] / het["datasheet"],
                   measured=homo["measured"] / het["measured"]))
  return rows


def _print(title: str, rows: list[dict]) -> None:
  print(title)
  print(f"  {'setup':<58} {'unit':>6} {'predicted':>10} {'measured':>10} {'ratio':>6} {'datasheet':>9}")
  for r in rows:
    print(f"  {r['setup']:<58} {r['unit']:>6} {r['predicted']:10.3f} {r['measured']:10.3f} {r['ratio']:6.2f} "
          f"{r['datasheet_ratio']:9.2f}")


def precision_ceilings(ratios: list[dict]) -> dict[str, tuple[float, float, float]]:
  """chip -> (lowest, highest predicted/measured half-over-float32 speed ratio among its rows, the least worst error
  any one efficiency pair can give): a chip's matrix and vector efficiencies scale all its rows' predicted ratios
  together (where its matmuls bound the step), so rows from sources that disagree keep their spread."""
  from hetspmd.hardware.devices import DEVICE_PRESETS

  by_chip: dict = {}
  for r in ratios:
    if "kind" in r:
      by_chip.setdefault(DEVICE_PRESETS[r["kind"]].chip, []).append(r["ratio"])
  return {c: (min(v), max(v), math.sqrt(max(v) / min(v))) for c, v in by_chip.items() if len(v) > 1}


def _print_fit(fitted: dict) -> bool:
  from hetspmd.hardware.efficiency import CHIPS

  print("efficiencies fitted to Cephalo's layer times (hetspmd/hardware/efficiency.py CHIPS holds them):")
  for chip, (e, kinds) in fitted.items():
    print(f"    {chip!r}: (Efficiency(matrix={e.matrix}, vector={e.vector}, memory={e.memory}), {kinds!r}),")
  same = fitted == CHIPS
  print(f"  the module's table {'matches' if same else 'DIFFERS: copy the lines above into it'}")
  return same


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--json", action="store_true", help="print the rows as JSON")
  parser.add_argument("--quick", action="store_true", help="only Cephalo's per-layer rows (no NVIDIA or AMP rows, no search)")
  parser.add_argument("--fit", action="store_true",
                      help="first refit the chips' efficiencies to Cephalo's rows and say if the module holds them")
  args = parser.parse_args(argv)
  pricers = _layer_pricers()
  fitted = fit_chips(pricers) if args.fit else None
  profiles: dict = {}
  nvidia = [] if args.quick else nvidia_rows(profiles)
  amp = [] if args.quick else amp_rows(profiles)
  cephalo = cephalo_rows(pricers)
  tables = {"nvidia": nvidia, "amp": amp, "cephalo": cephalo,
            "ratios": ([] if args.quick else ratio_rows(nvidia, amp)) + cephalo_ratio_rows(cephalo)}
  for rows in tables.values():
    for r in rows:  # predicted speed over measured speed: above 1 the model is optimistic
      timed = r["unit"] in ("s/step", "ms")
      ratio = lambda predicted: r["measured"] / predicted if timed else predicted / r["measured"]
      r["ratio"], r["datasheet_ratio"] = ratio(r["predicted"]), ratio(r["datasheet"])
  if args.json:
    if fitted is not None:
      tables["fitted"] = {c: dict(matrix=e.matrix, vector=e.vector, memory=e.memory, kinds=list(k))
                          for c, (e, k) in fitted.items()}
    print(json.dumps(tables, indent=1))
    return tables
  if fitted is not None:
    _print_fit(fitted)
  print("ratio: predicted speed over measured, each kind at its chip's efficiencies; datasheet: at the uniform "
        "datasheet ones")
  _print("NVIDIA's tuned BERT-large (throughput; goal: ratio within 1 +- 30%)", nvidia)
  _print("AMP's measured runs (step seconds; a slower framework)", amp)
  _print("Cephalo's per-layer measurements (PyTorch autocast; what the chips are fitted to)", tables["cephalo"])
  _print("ratios the papers report (goal: ratio within 1 +- 15%)", tables["ratios"])
  for name, goal in GOALS.items():
    rows = tables["nvidia"] if name == "nvidia" else tables["ratios"]
    if rows:
      worst = {k: math.exp(max(abs(math.log(r[k])) for r in rows)) for k in ("ratio", "datasheet_ratio")}
      print(f"{name}: worst ratio {worst['ratio']:.2f}x off, {worst['datasheet_ratio']:.2f}x at the datasheet "
            f"efficiencies (goal within {goal:.0%}: {'met' if worst['ratio'] - 1 <= goal else 'NOT met'})")
  for chip, (low, high, least) in precision_ceilings(tables["ratios"]).items():
    print(f"ceiling: {chip}'s half/float32 speed ratios are {low:.2f}-{high:.2f}x of measured across sources; one "
          f"efficiency pair per chip moves them together, so the best it can do is {least:.2f}x off")
  return tables


if __name__ == "__main__":
  main()
