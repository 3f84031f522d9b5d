"""Device check: predicted vs measured step time and memory on the local accelerator.

    python benchmarks/device_check.py [--model NAME] [--seq S] [--steps 5] [--no-profile] [--json FILE]
                                      [--max-seconds T]

One prepared run for a machine with an accelerator. It runs plans of one zoo
model on the first local device (microbatch sizes, microbatch counts and every
remat policy) through ``hetspmd.parallelize`` and prints, per plan:

* the predicted step time from the device's datasheet spec
  (``Cluster.from_devices``) and, unless ``--no-profile``, from a profile of
  the device (``hetspmd.profile``), against the measured median;
* the predicted memory (``data_axis.memory_per_device``, before its 1.1
  headroom) against XLA's buffer assignment of the compiled step (arguments +
  temporaries) and, where the backend reports it, the device's peak bytes in
  use so far (a running maximum: it tells a plan's peak where it grows).

The memory columns check what the search assumes of remat (that ``dots`` and
``all_dots`` lower a step's peak, docs/cost-model.md); a plan that does not
fit is reported as such and the run goes on. Plans run from the smallest
predicted memory up, so the running peak grows with each. On recent NVIDIA
GPUs JAX computes float32 matmuls with TF32 by default, which the datasheet
spec's ``reduced_f32_flops`` prices. Defaults: GPT-2 small at sequence 1024 on a
GPU, GPT-tiny on a CPU (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _spearman(a, b) -> float:
  from scipy.stats import spearmanr

  return float(spearmanr(a, b).statistic) if len(a) > 2 else float("nan")


def plans_for(platform: str) -> list[tuple[int, int, str]]:
  """(microbatch, count, remat policy) of every plan run on ``platform``."""
  from hetspmd.plan.options import REMAT_POLICIES

  shapes = [(4, 2), (8, 1)] if platform != "cpu" else [(2, 2), (4, 1)]
  return [(mb, count, remat) for mb, count in shapes for remat in REMAT_POLICIES]


def _compiled_bytes(compiled) -> int | None:
  m = compiled.memory_analysis()
  if m is None:
    return None
  return m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes


def _peak_in_use(device) -> int | None:
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  return (stats or {}).get("peak_bytes_in_use")


def run(args) -> list[dict]:
  import jax

  import hetspmd as hs
  from hetspmd import models
  from hetspmd.planner.data_axis import WORKSPACE
  from hetspmd.planner.pricing import evaluate
  from hetspmd.planner.building import plan_from
  from hetspmd.passes.profile import profile_step

  from _steps import median_step_seconds

  device = jax.devices()[0]
  name = args.model or ("gpt2-tiny" if device.platform == "cpu" else "gpt2-small")
  workload = models.get(name)
  seq = args.seq if args.seq else (None if device.platform == "cpu" else 1024)
  clusters = {"datasheet": hs.Cluster.from_devices([device])}
  if not args.no_profile:
    clusters["profiled"] = hs.Cluster.from_profile(hs.profile([device], progress=True))
  spec = clusters["datasheet"].devices[0].spec
  print(f"{name} (sequence {seq or 'default'}) on one {device.device_kind}: datasheet {spec.name}, "
        f"{spec.memory_bytes / 2**30:.1f} GiB", flush=True)
  profile = profile_step(workload.make_train_step(), workload.abstract_state(), workload.example_batch(2, seq))
  # smallest predicted memory first: the device's peak in use, a running maximum, then grows plan by plan
  plans = []
  for microbatch, count, remat in plans_for(device.platform):
    batch = microbatch * count
    predicted = {key: evaluate(c, profile, (0,), microbatch, 0, remat, global_batch=batch, counts_rule=(count,), name="check")
                 for key, c in clusters.items()}
    plans.append((predicted["datasheet"].memory_bytes[0], microbatch, count, remat, predicted))
  plans.sort(key=lambda p: p[0])
  rows = []
  start = time.perf_counter()
  baseline = _peak_in_use(device)
  for _, microbatch, count, remat, predicted in plans:
    if args.max_seconds and time.perf_counter() - start > args.max_seconds:
      print(f"stopping after {len(rows)} plans: --max-seconds {args.max_seconds} reached", flush=True)
      break
    batch = microbatch * count
    row = {"microbatch": microbatch, "count": count, "remat": remat,
           **{f"predicted_{key}_s": e.step_seconds for key, e in predicted.items()},
           "predicted_bytes": predicted["datasheet"].memory_bytes[0] / WORKSPACE, "peak_before_bytes": baseline}
    step = state = sharded = None
    try:
      plan = plan_from(predicted["datasheet"], clusters["datasheet"], workload.abstract_state())
      step = hs.parallelize(workload.make_train_step(hs.value_and_grad), plan=plan, global_batch=batch)
      state = step.shard_state(workload.init_state(0))
      sharded = step.shard_batch(workload.synthetic_batch(0, batch=batch, seq=seq))
      row["compiled_bytes"] = _compiled_bytes(step.lower(state, sharded).compile())
      state, row["measured_s"] = median_step_seconds(step, state, sharded, args.steps)
      row["peak_in_use_bytes"] = baseline = _peak_in_use(device)
    except Exception as error:  # an out-of-memory plan is a result, not the end of the run
      row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    finally:
      del step, state, sharded
    rows.append(row)
    _print_row(row, list(clusters))
    if args.json:  # written after every plan: a run cut short keeps what it measured
      _write(args.json, rows)
  return rows


def _write(path: str, rows: list[dict]) -> None:
  with open(path, "w") as f:
    json.dump({"rows": rows, "summary": summarize(rows)}, f, indent=1)


def _print_row(row: dict, keys: list[str]) -> None:
  mb = lambda b: f"{b / 1e6:10.1f}" if b else f"{'-':>10}"
  times = " ".join(f"{row[f'predicted_{k}_s']:10.4f}" for k in keys)
  measured = f"{row['measured_s']:10.4f}" if "measured_s" in row else f"{'-':>10}"
  print(f"mb {row['microbatch']:3} x{row['count']} {row['remat']:<8} predicted s ({', '.join(keys)}) {times} "
        f"measured {measured}  MB predicted {mb(row['predicted_bytes'])} compiled {mb(row.get('compiled_bytes'))} "
        f"peak so far {mb(row.get('peak_in_use_bytes'))}" + (f"  {row['error']}" if "error" in row else ""),
        flush=True)


def summarize(rows: list[dict]) -> dict:
  """Rank correlation and median error of each prediction, and predicted / compiled memory per remat policy."""
  done = [r for r in rows if "measured_s" in r]
  summary = {}
  for key in sorted({k for r in rows for k in r if k.startswith("predicted_") and k.endswith("_s")}):
    if done:
      errors = [abs(r[key] - r["measured_s"]) / r["measured_s"] for r in done]
      summary[key] = {"spearman": _spearman([r[key] for r in done], [r["measured_s"] for r in done]),
                      "median_abs_error": statistics.median(errors)}
  for remat in sorted({r["remat"] for r in rows}):
    ratios = [r["predicted_bytes"] / r["compiled_bytes"] for r in rows if r["remat"] == remat and r.get("compiled_bytes")]
    if ratios:
      summary[f"memory_{remat}"] = {"predicted_over_compiled": statistics.median(ratios)}
  return summary


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default=None, help="zoo model (default: gpt2-small on a GPU, gpt2-tiny on a CPU)")
  parser.add_argument("--seq", type=int, default=None, help="sequence length (default: 1024 on a GPU)")
  parser.add_argument("--steps", type=int, default=5, help="timed steps per plan (median)")
  parser.add_argument("--no-profile", action="store_true", help="predict from the datasheet spec only")
  parser.add_argument("--json", default=None, help="also write the rows and summary to this file (after every plan)")
  parser.add_argument("--max-seconds", type=float, default=None, help="start no plan after this many seconds")
  args = parser.parse_args(argv)
  rows = run(args)
  summary = summarize(rows)
  for key, value in summary.items():
    print(key, " ".join(f"{k} {v:.3f}" for k, v in value.items()))
  if args.json:
    _write(args.json, rows)
  return 0


if __name__ == "__main__":
  sys.exit(main())
