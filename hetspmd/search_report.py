"""The search's findings for people and for machines: the table ``hetspmd search`` prints and ``print`` of
``hetspmd.search``'s result shows (at most 100 columns), and the one JSON object both give.

Both read one :class:`~hetspmd.runtime.searching.Priced` (what was priced, what ``parallelize(plan="search")``
runs) and a :class:`Subject` (what was searched: a zoo model or the user's own step).
"""

from __future__ import annotations

import dataclasses
import functools
import textwrap
from typing import Any

from hetspmd._format import si
from hetspmd.hardware.cluster import Cluster
from hetspmd.planner.ranking import BASELINES, GROUP_PLAN_CONDITIONS, GROUP_PLAN_MARGIN
from hetspmd.planner.stages import describe

WIDTH = 100  # columns: a terminal's
_si = functools.partial(si, small=".0f")  # counts and rates below a thousand as integers
_INDENT = " " * 5
_DTYPE_SHORT = {"float32": "f32", "bfloat16": "bf16"}


@dataclasses.dataclass(frozen=True)
class Subject:
  """What was searched: a name (a zoo model, or the step's ``module:function``), its global batch and, for a
  zoo model, its compute dtype and sequence length (None for a user's step)."""

  name: str
  global_batch: int
  dtype: str | None = None
  seq: int | None = None


def to_json(subject: Subject, cluster: Cluster, priced: Any) -> dict[str, Any]:
  """One JSON object: the plans, baselines, homogeneous equivalent, group plan, stage plans, and the choice
  ``parallelize(plan="search")`` makes (for how many processes it holds). Keys are the same whether a single
  program fits or not."""
  result, ideal = priced.result, priced.ideal_throughput
  best = result.plans[0] if result is not None else None
  group = priced.group_plan
  return {
      "model": subject.name, "cluster": str(cluster), "devices": cluster.num_devices,
      "global_batch": subject.global_batch, "dtype": subject.dtype, "seq": subject.seq,
      "remat_policies": list(priced.remat_policies),
      "plans": [p.to_json(ideal) for p in result.plans] if result is not None else [],
      "baselines": {} if result is None else {
          name: {**result.baselines[name].to_json(ideal), "speedup_of_best": best.throughput /
                 result.baselines[name].throughput} for name in BASELINES if name in result.baselines},
      "homogeneous_equivalent": (None if result is None or result.homogeneous_equivalent is None else
                                 result.homogeneous_equivalent.to_json(ideal)),
      "heterogeneity_tax": None if result is None else result.heterogeneity_tax,
      "throughput_vs_homogeneous": None if result is None else result.throughput_vs_homogeneous,
      "homogeneous_ideal_throughput": None if result is None else result.homogeneous_ideal,
      "group_plan": None if group is None else {
          **group.to_json(ideal), "speedup_over_best": None if best is None else group.throughput / best.throughput,
          "parallelize": {"margin": GROUP_PLAN_MARGIN, "conditions": GROUP_PLAN_CONDITIONS,
                          "priced_past_margin": best is not None and group.throughput >= GROUP_PLAN_MARGIN * best.throughput}},
      "choice": {"form": choice_form(priced), "processes": priced.processes, "note": priced.note},
      "no_single_program": priced.error or None,
      "ideal_throughput": ideal, "trace_seconds": priced.trace_seconds, "pricing": cluster.pricing(),
      "search_seconds": None if result is None else result.search_seconds,
      "candidates": 0 if result is None else result.candidates,
      "stage_plans": [{**p.to_json(), "speedup_over_best": best.step_seconds / p.step_seconds}
                      for p in priced.stage_plans],
  }


def choice_form(priced: Any) -> str | None:
  """``"group plan"``, ``"single program"``, or None where ``parallelize(plan="search")`` runs none."""
  return None if priced.choice is None else "group plan" if priced.grouped else "single program"


def table(subject: Subject, cluster: Cluster, priced: Any) -> str:
  """The search as a table of at most :data:`WIDTH` columns: the ranked plans (each with its counts below it),
  the baselines, the homogeneous equivalent, the group plan and stage plans, and what ``parallelize`` runs."""
  result, ideal = priced.result, priced.ideal_throughput
  kinds = ", ".join(f"{sum(1 for d in cluster.devices if d.spec.name == k)} {k}" for k in cluster.kinds)
  said = (f", seq {subject.seq}" if subject.seq else "") + (
      f", {subject.dtype} compute" if subject.dtype not in (None, "float32") else "")
  lines = _wrap(f"{subject.name} on {cluster} ({cluster.num_devices} devices: {kinds}), global batch "
                f"{subject.global_batch}{said}")
  searched = (f"searched {result.candidates} candidates in {result.search_seconds:.2f} s after "
              f"{priced.trace_seconds:.2f} s of tracing" if result is not None else
              f"traced in {priced.trace_seconds:.2f} s; no single program fits")
  lines += _wrap(f"{searched}; ideal throughput {ideal:.1f} samples/s")
  if cluster.calibration is not None:
    lines += _wrap("compute priced from " + "; ".join(cluster.pricing()))
  lines += _wrap(choice_line(priced))
  if result is None:
    lines += ["", *_wrap(f"no single program fits: {priced.error}")]
  else:
    lines += ["", _HEADER]
    for i, p in enumerate(result.plans, 1):
      lines += _row(str(i), p.name, p, _counts(p), ideal)
    if _unranked(priced):
      lines += _row("", "runs: " + priced.choice.name, priced.choice,
                    f"the best plan giving every process devices; {_counts(priced.choice)}", ideal)
    lines += ["", f"{'':>2} baseline"]
    best = result.plans[0]
    for name in BASELINES:
      if name in result.baselines:
        b = result.baselines[name]
        lines += _row("", name, b, f"best is {best.throughput / b.throughput:.2f}x; {_counts(b)}", ideal)
    equivalent = result.homogeneous_equivalent
    if equivalent is not None:
      lines += _row("", "homogeneous_equivalent", equivalent,
                    f"heterogeneity tax {result.heterogeneity_tax:.1%}: every device the pool's mean reaches "
                    f"{equivalent.throughput / result.homogeneous_ideal:.1%} of its own ideal; best is "
                    f"{result.throughput_vs_homogeneous:.2f}x its throughput", ideal)
  if priced.group_plan is not None:
    g = priced.group_plan
    lines += ["", f"{'':>2} group plan (one program per device kind, or the fsdp plan's one group)"]
    ratio = "" if result is None else f"; {g.throughput / result.plans[0].throughput:.2f}x the best plan"
    lines += _row("", "best group plan", g, group_description(g) + ratio, ideal)
  if priced.stage_plans:
    best = result.plans[0]
    lines += ["", f"{'':>2} pipeline stages (the step scans its layers; run with plan_for(..., stages=layers))"]
    for p in priced.stage_plans:
      lines += _wrap(f"{'':>2} {describe(p, cluster)}: {p.step_seconds:.3f} s, "
                     f"{subject.global_batch / p.step_seconds:.1f} samples/s, {_si(p.memory_bytes, 'B')}/device, "
                     f"{best.step_seconds / p.step_seconds:.2f}x the best plan", indent=_INDENT)
  return "\n".join(lines)


_HEADER = (f"{'#':>2} {'plan':<27} {'mb':>4} {'ZeRO':>4} {'remat':>8} {'step s':>8} {'samples/s':>9} {'eff':>6} "
           f"{'comm s':>7} {'hidden':>6} {'mem/dev':>9}")


def _unranked(priced: Any) -> bool:
  """Whether the choice is a single program the ranked plans do not show (the best that gives every process
  devices, where each ranked one leaves a process idle)."""
  result, choice = priced.result, priced.choice
  return (result is not None and choice is not None and choice is not priced.group_plan
          and all(p is not choice for p in result.plans))


def _row(rank: str, label: str, p: Any, below: str, ideal: float) -> list[str]:
  """A plan's columns, then ``below`` (its counts, or how it compares) wrapped under it."""
  head = (f"{rank:>2} {label[:27]:<27} {p.microbatch:>4} {p.zero_stage:>4} {p.remat:>8} "
          f"{_fixed(p.step_seconds, 8, 3)} {_fixed(p.throughput, 9, 1)} {p.throughput / ideal:6.1%} {p.comm_seconds:7.3f} {p.hidden_seconds:6.3f} "
          f"{_si(max(p.memory_bytes), 'B'):>9}")
  return [head] + _wrap(below, indent=_INDENT)


def _fixed(value: float, width: int, places: int) -> str:
  """``value`` with ``places`` decimals in ``width`` columns, or in three significant figures where that would not
  fit or would show no digit."""
  text = f"{value:.{places}f}"
  if len(text) > width or (value and abs(value) < 10 ** -places):
    text = f"{value:.3g}"
  return f"{text:>{width}}"


def _counts(p: Any) -> str:
  """Microbatches per device kind (``8xV100-16GB:3``), the overlapped pass and the reduction's dtype."""
  groups: dict[tuple[str, int], int] = {}
  for k, c in zip(p.kinds, p.counts):
    groups[(k, c)] = groups.get((k, c), 0) + 1
  text = ", ".join(f"{n}x{k}:{c}" for (k, c), n in groups.items())
  if p.overlap_microbatches > 1:
    text += f"; last {p.overlap_microbatches} as one pass"
  if p.grad_reduce_dtype != "float32":
    text += f"; gradients reduced in {p.grad_reduce_dtype}"
  return text


def group_description(g: Any) -> str:
  """A group plan in words: each kind's microbatch, remat, model axis and state share, the tail, and how its
  parameters are held."""
  n = len(g.kinds)
  part = g.group
  axes = [tp.m for tp in part.group_models] or [1] * n
  rows = dict.fromkeys(zip(g.kinds, part.microbatches, part.remats or (g.remat,) * n, axes,
                           part.state_shares or (None,) * n))
  text = "; ".join(f"{k}: mb {m}, remat {r}" + (f", model axis {axis}" if axis > 1 else "") + (
      f", {share:.1%} of the {'parameters and ' if g.zero_stage == 3 else ''}optimizer state per device"
      if share else "") for k, m, r, axis, share in rows)
  if part.tail[1]:
    text += f"; a tail of {part.tail[1]} x {part.tail[0]} per device overlapping the reduction"
  sharded = [k for k, s in dict.fromkeys(zip(g.kinds, part.shard_params)) if s]
  if sharded:
    text += ("; plain FSDP: one group of every device, its parameters and optimizer state split over them"
             if part.execution.hybrid and part.execution.groups[0][1] == len(g.device_positions) else
             "; hybrid: every group its parameters and optimizer state split over its devices"
             if part.execution.hybrid else "; parameters sharded (FSDP) on " + ", ".join(sharded))
  return text


def choice_line(priced: Any) -> str:
  """What ``parallelize(plan="search")`` runs from this search, and why."""
  processes = f"{priced.processes} process{'es' if priced.processes != 1 else ''}"
  form = choice_form(priced)
  plans = priced.result.plans if priced.result is not None else ()
  rank = next((i for i, p in enumerate(plans, 1) if p is priced.choice), None)
  what = ("no plan" if form is None else
          "the group plan (where its programs take the step; else the best single program)" if form == "group plan"
          else f"plan {rank}, a single program" if rank else "the single program shown as 'runs:' below the plans")
  note = f" ({priced.note})" if priced.note else ""
  return f"parallelize(plan='search') from {processes} runs {what}{note}"


def _wrap(text: str, indent: str = "") -> list[str]:
  """``text`` wrapped to :data:`WIDTH` columns, every line after ``indent``."""
  return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + ("  " if not indent else ""),
                       break_on_hyphens=False) or [indent.rstrip()]
