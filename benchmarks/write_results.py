"""Runs the CPU benchmarks one at a time and writes their printed tables to benchmarks/RESULTS.md.

    python benchmarks/write_results.py [--only NAME ...] [--skip-slow] [--timeout 300] [--out benchmarks/RESULTS.md]

Each benchmark is run as its own process with this interpreter, from the repository root, its standard
output captured as printed (progress on standard error is dropped). RESULTS.md gets one section per
benchmark: what it measures, whether its figures are predicted (the cost model, no device runs) or
measured (emulated CPU devices on this machine), the command that produced them and their output. The
header names the date, the commit and the machine. A benchmark that runs past ``--timeout`` seconds or
fails is listed with the reason instead of figures. The sections of benchmarks not run this time (``--only``,
``--skip-slow``) are kept from the existing file, so one benchmark can be refreshed alone. Git keeps the history
of the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import platform
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Bench:
  name: str
  args: tuple[str, ...]
  source: str  # "predicted", "measured" or "published"
  what: str
  slow: bool = False  # minutes of a busy loop on a second core, a long search, or calibrations
  script: str = ""  # benchmarks/<script>.py when it is not the name (one script, two sections)

  @property
  def path(self) -> str:
    return f"benchmarks/{self.script or self.name}.py"


BENCHES = (
    Bench("plan_quality", (), "predicted",
          "The best plan's efficiency (throughput / ideal, the ideal adding every device's own throughput with "
          "no communication) and its speedup over the baselines on the reference clusters; the best group plan "
          "against it; the cases only a group plan fits.", slow=True),
    Bench("search_time", (), "measured",
          "Search seconds after one trace, GPT-2 medium, clusters of 8 to 1024 devices of two and three kinds, "
          "the median of 5; goals (single program / the CLI's search with group plans and the homogeneous "
          "equivalent): 0.5 / 1 s at 64 devices, 2 / 3 s at 1024; three kinds 1.5 s and 6 s. The plans are "
          "predicted; the seconds are measured here.",
          slow=True),
    Bench("step_search", (), "measured",
          "`hetspmd search --step` on a Gemma-3-1B-shaped NNX step written as Flax's example writes it: seconds "
          "end to end (a fresh process, tracing included), the median of 3, against the goal of 15 s."),
    Bench("published", ("--fit",), "published",
          "The cost model against published step times (NVIDIA's BERT-large on 8 V100s and 8 A100s, AMP's and "
          "Cephalo's measured runs): predicted, measured, and their ratio at each chip's efficiencies and at the "
          "uniform datasheet ones, each source in the script; first the chips' efficiencies refitted to "
          "Cephalo's rows."),
    Bench("stage_plans", (), "predicted",
          "The best pipeline-stage plan against the best plan of the search, on the `-scan` zoo models."),
    Bench("pipeline_estimate", (), "predicted",
          "What uneven pipeline stages (1F1B, a bound with every transfer hidden, and the lockstep schedule "
          "that is built) would give against today's best plan on the slow-network clusters."),
    Bench("expert_estimate", (), "predicted",
          "Experts split across host groups (all-to-alls of the dispatched tokens) against today's best plan."),
    Bench("uneven_state", (), "measured",
          "Bytes per device of an Adam state split evenly and split by memory (padded, as one SPMD program "
          "must hold it), on 8 emulated CPU devices."),
    Bench("layer_remat", (), "measured",
          "Remat `layers` (each block recomputed from its input before its backward pass, on the traced step) "
          "against none and the whole-loss policies: each program's compiled temporaries on 8 emulated CPU "
          "devices for a 24-block stack written with `jax.value_and_grad`, unrolled and as a layer scan, beside "
          "the cost model's prediction, and the step time against none in the same run (goal, scanned: "
          "temporaries at most the layers' inputs plus about 2 layers' activations)."),
    Bench("group_memory", (), "measured",
          "What each device holds under a group plan with the optimizer state in memory shares (ZeRO-1, "
          "ZeRO-3, a model axis), and each program's compiled memory, on 8 emulated CPU devices; then a group "
          "sharding its parameters (FSDP in the group, unrolled and as a layer scan) against the same plan "
          "unsharded (goals: arguments about 1/4 of the parameters, temporaries beside the accumulator about 3 "
          "layers; under shares, the sums handed to their owners as 1/4 parts; between steps under ZeRO-3 "
          "shares, each device its share)."),
    Bench("reduction", (), "measured",
          "Gradient reduction after the loop, overlapped, in bfloat16, and both: step time, wire bytes and "
          "parameter drift on 8 emulated CPU devices (the CPU runs collectives in line: nothing hides)."),
    Bench("overhead", (), "measured",
          "A uniform plan against hand-written `jax.jit` with the same shardings, and an unmodified step "
          "against one marked with `hs.value_and_grad`, on 8 emulated CPU devices; the same microbatches as a "
          "group plan of one group of every device, unsharded and sharding its parameters (FSDP)."),
    Bench("fidelity", (), "measured",
          "Predicted against measured step time for plans of the MLP and GPT-tiny on 8 profiled CPU devices "
          "(goals: Spearman >= 0.8, median absolute error <= 25%), and priced on the step's calibrated times "
          "(goals: Spearman >= 0.9, median error <= 10%), each model calibrated in each pass just before its plans "
          "are measured; every plan measured in two passes, whose difference is this machine's run-to-run "
          "spread.", slow=True),
    Bench("verify", (), "measured",
          "The calibrated search's choice against the same search with its choice timed whole before it runs "
          "(re-planned to the fastest measured of its runners-up where it misses its prediction by 25%), on 8 "
          "profiled CPU devices: each step timed in turns, and each first call's seconds."),
    Bench("layer_calibration", (), "measured",
          "Scanned and unrolled GPTs on 8 profiled CPU devices, each plan priced on the specs, on the whole step's "
          "timing and on one layer's timing (the calibration of a step too large for a device: a layer scan's layer, "
          "or an unrolled block's forward and backward), against its measured step (goal: each layer-calibrated median error "
          "within 10 points of the step-calibrated one)."),
    Bench("trace_time", (), "measured",
          "Seconds to trace GPT-2 medium's step and to run the microbatch pass on its jaxpr."),
    Bench("emulated_hetero", (), "measured",
          "Two processes (gloo), one core slowed by a busy loop: the weighted plan and the group plan against "
          "the uniform split and the step ideal (goal: 90% of the step ideal); then two devices per process, the "
          "group plan against the same plan with each group sharding its parameters (goal: within 5 points).",
          slow=True),
    Bench("regret", (), "predicted",
          "What planning on datasheet speeds costs where Cephalo's per-layer measurements say otherwise: each pool "
          "searched at the uniform datasheet efficiencies, at the chips' fitted ones and on corrected speeds, each "
          "plan priced on the corrected ones."),
    Bench("emulated_hetero_adaptive", ("--adaptive", "--steps", "10"), "measured",
          "The same slowed pair planned as if equally fast: the static split, the best static split (each "
          "device's measured rate) and the same plan rebalanced while training (hetspmd.Rebalance, loop times "
          "read inside the step), and a group plan rebalanced; each form also run static at the best splits "
          "(its ceiling); then the busy loop stops mid-run (goals: 90% of the step ideal "
          "within 5 steps, again within 5 steps of the drift).", slow=True, script="emulated_hetero"),
    Bench("pipeline_hetero", (), "measured",
          "Two processes (gloo), one core slowed by a busy loop: pipeline layers split evenly and by measured "
          "speed, predicted against measured.", slow=True),
)

MARK = "<!-- benchmark: {} -->"


def command(bench: Bench) -> str:
  return " ".join(["python", bench.path, *bench.args])


def run(bench: Bench, timeout: float) -> tuple[str, float, str | None]:
  """The benchmark's standard output, its seconds, and why it has no figures (None when it ran)."""
  start = time.perf_counter()
  try:
    done = subprocess.run([sys.executable, bench.path, *bench.args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return "", time.perf_counter() - start, f"skipped: ran past {timeout:.0f} s on this machine"
  seconds = time.perf_counter() - start
  if done.returncode != 0:
    tail = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
    return done.stdout, seconds, f"failed (exit {done.returncode}): {tail}"
  return done.stdout, seconds, None


def revision() -> str:
  done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
  return done.stdout.strip() or "unknown"


def section(bench: Bench, output: str, seconds: float, reason: str | None, load: float) -> str:
  source = {"predicted": "predicted by the cost model (no device runs the plans)",
            "measured": "measured on the machine named above (steps on emulated CPU devices)",
            "published": "predicted by the cost model, against measurements others published (each source in "
                         "the script)"}[bench.source]
  lines = [MARK.format(bench.name), f"## {bench.name}", "", bench.what, "",
           f"Figures: {source}. Command: `{command(bench)}`"]
  if reason:
    lines += ["", f"Not run this time: {reason}."]
  else:
    lines[-1] += (f" ({seconds:.0f} s; {datetime.date.today().isoformat()}, commit {revision()}; load average "
                  f"{load:.1f} on {os.cpu_count()} cores when it started).")
    lines += ["", "```text", output.rstrip(), "```"]
  return "\n".join(lines) + "\n"


def header(benches: list[Bench]) -> str:
  commit = revision()
  import jax

  machine = f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores, jax {jax.__version__}"
  today = datetime.date.today().isoformat()
  return "\n".join([
      "# Benchmark results", "",
      f"Written by `python benchmarks/write_results.py` on {today} at commit {commit} ({machine}).",
      "Do not edit by hand: rerun the script (`--only NAME` refreshes one section). Git keeps the history.", "",
      "**Predicted** figures come from the cost model with datasheet device specs: no accelerator has checked",
      "them yet. **Measured** figures come from emulated CPU devices on a small shared machine: they are",
      "noisy (other work shares the cores: each section gives the load average when it started), so compare",
      "ratios within one run, not across runs.", "",
      "| benchmark | figures |", "|---|---|",
      *[f"| [{b.name}](#{b.name}) | {b.source} |" for b in benches], "", ""])


def kept_sections(path: pathlib.Path) -> dict[str, str]:
  """The sections of an existing RESULTS.md, by benchmark name."""
  if not path.exists():
    return {}
  parts = re.split(r"(?=^<!-- benchmark: )", path.read_text(), flags=re.M)
  found = {}
  for part in parts:
    m = re.match(r"<!-- benchmark: (\S+) -->", part)
    if m:
      found[m.group(1)] = part.rstrip() + "\n"
  return found


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", action="append", default=[], help="run only this benchmark; repeatable")
  parser.add_argument("--skip-slow", action="store_true", help="leave out the benchmarks marked slow")
  parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a benchmark is skipped")
  parser.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS.md"))
  args = parser.parse_args()
  unknown = set(args.only) - {b.name for b in BENCHES}
  if unknown:
    sys.exit(f"unknown benchmark(s) {sorted(unknown)}; known: {[b.name for b in BENCHES]}")
  out = pathlib.Path(args.out)
  sections = kept_sections(out)
  for bench in BENCHES:
    if (args.only and bench.name not in args.only) or (args.skip_slow and bench.slow and not args.only):
      continue
    print(f"running {command(bench)} ...", file=sys.stderr, flush=True)
    load = os.getloadavg()[0]
    output, seconds, reason = run(bench, args.timeout)
    print(f"  {seconds:.0f} s{': ' + reason if reason else ''}", file=sys.stderr, flush=True)
    sections[bench.name] = section(bench, output, seconds, reason, load)
  listed = [b for b in BENCHES if b.name in sections]
  out.write_text(header(listed) + "\n".join(sections[b.name] for b in listed))
  print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
  main()
