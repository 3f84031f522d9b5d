"""``hetspmd explain``: a plan's per-position work, time and memory, as text or PNG; a group plan's per group
and per device.

Per data position of the plan: the device kind, its microbatch count, and,
where the planner filled them in (``Plan.predicted_per_position``), the
predicted compute and communication seconds and memory bytes against the
device's capacity. Plans made without the planner (``plan_for``) show only
the microbatch shares.
"""

from __future__ import annotations

import re

from pathlib import Path

import numpy as np

from hetspmd._format import quantity, si
from hetspmd.hardware.devices import DEVICE_PRESETS
from hetspmd.errors import InvalidValueError
from hetspmd.plan.groups import GroupPlan
from hetspmd.plan.value import Plan

BAR = 30


def _bar(value: float, full: float, char: str = "#") -> str:
  return char * round(BAR * value / full) if full > 0 else ""


def positions(plan: Plan) -> list[dict]:
  """One row per data position: kind, devices, count, and any per-position predictions."""
  per = dict(plan.predicted_per_position)
  group = len(plan.device_ids) // plan.data_size
  rows = []
  for i, count in enumerate(plan.microbatch_counts):
    kinds = list(dict.fromkeys(plan.device_kinds[i * group:(i + 1) * group])) if plan.device_kinds else ["?"]
    kind = "+".join(kinds)  # a pipeline position spans every stage's devices, of one kind or several
    row = {"position": i, "kind": kind, "devices": list(plan.device_ids[i * group:(i + 1) * group]),
           "microbatches": count, "examples": count * plan.microbatch}
    for key, values in per.items():
      row[key] = values[i]
    if "memory_capacity_bytes" not in row and all(k in DEVICE_PRESETS for k in kinds):
      row["memory_capacity_bytes"] = float(min(DEVICE_PRESETS[k].memory_bytes for k in kinds))
    rows.append(row)
  return rows


def _runs(plan: Plan, rows: list[dict]) -> list[tuple[str, dict]]:
  """Consecutive positions with the same figures, as (label, first row): ``data[0-11]``."""
  keys = [tuple((k, v) for k, v in r.items() if k not in ("position", "devices")) for r in rows]
  out: list[tuple[str, dict]] = []
  start = 0
  for i in range(1, len(rows) + 1):
    if i == len(rows) or keys[i] != keys[start]:
      label = f"{plan.data_axis}[{start}]" if i - start == 1 else f"{plan.data_axis}[{start}-{i - 1}]"
      out.append((label, rows[start]))
      start = i
  return out


def _model_splits(plan: Plan) -> list[tuple[str, int]]:
  """(parameter path, dimension) of every parameter the plan splits over a ``model`` axis."""
  if "model" not in plan.axis_names or plan.mesh_shape[plan.axis_names.index("model")] < 2:
    return []
  out = []
  for path, spec in plan.state_specs:
    if path.startswith("params/"):
      dims = [d for d, entry in enumerate(spec) if entry == "model" or (isinstance(entry, tuple) and "model" in entry)]
      out += [(path[len("params/"):], d) for d in dims[:1]]
  return out


def explain_text(plan: Plan) -> str:
  """The plan as text: header, then per-position bars for work, time and memory.

  Consecutive positions with the same figures share one line.
  """
  rows = positions(plan)
  runs = _runs(plan, rows)
  width = max(len(label) for label, _ in runs)
  predicted = dict(plan.predicted)
  lines = [f"mesh {dict(zip(plan.axis_names, plan.mesh_shape))}, global batch {plan.global_batch} = "
           f"{sum(plan.microbatch_counts)} microbatches of {plan.microbatch}, ZeRO-{plan.zero_stage}"
           f"{f' (groups of {plan.zero_shards} where a leaf does not split {plan.data_size} ways)' if plan.zero_shards else ''}"
           f", remat {plan.remat}",
           f"gradients reduced over {plan.data_axis} in {plan.grad_reduce_dtype} (accumulated in float32)"
           + (", overlapped with each position's last microbatch" if plan.overlap_reduction
              and plan.overlap_microbatches == 1 else "")
           + (f", overlapped with each position's last {plan.overlap_microbatches} microbatches, run as one batch of "
              f"{plan.overlap_microbatches * plan.microbatch}" if plan.overlap_microbatches > 1 else "")]
  split = _model_splits(plan)
  if split:
    # layers' indices folded: one entry per place in a repeated layer
    folded = dict.fromkeys(f"{re.sub(r'/[0-9]+/', '/*/', f'/{path}/').strip('/')} (dim {dim})" for path, dim in split)
    lines.append(f"parameters split over model ({len(split)}): {', '.join(folded)}")
  if plan.stages:
    grid = np.asarray(plan.device_ids).reshape(plan.mesh_shape)
    kinds = np.asarray(plan.device_kinds or ["?"] * len(plan.device_ids), dtype=object).reshape(plan.mesh_shape)
    stage = plan.axis_names.index("stage")
    lines += ["", "pipeline stages (lockstep GPipe ticks; every data position below spans them all)"]
    for s, layers in enumerate(plan.stages):
      ids, names = np.take(grid, s, axis=stage), np.take(kinds, s, axis=stage)
      lines.append(f"  stage[{s}] devices {list(map(int, ids))} ({', '.join(sorted(set(names)))}): {layers} layer"
                   f"{'s' if layers != 1 else ''} {_bar(layers, max(plan.stages))}")
  if predicted:
    parts = [f"step {predicted['step_seconds']:.4g} s" if "step_seconds" in predicted else "",
             f"{predicted['throughput']:.4g} samples/s" if "throughput" in predicted else "",
             f"efficiency {predicted['efficiency']:.1%}" if "efficiency" in predicted else "",
             f"{predicted['hidden_communication_seconds']:.4g} s of communication hidden"
             if predicted.get("hidden_communication_seconds") else ""]
    lines.append("predicted: " + ", ".join(p for p in parts if p))
  total = sum(plan.microbatch_counts)
  lines += ["", "work (share of the global batch)"]
  for label, r in runs:
    lines.append(f"  {label:<{width}} {r['kind']:<12} {r['microbatches']:>4} mb "
                 f"{r['microbatches'] / total:>5.1%} {_bar(r['microbatches'], max(plan.microbatch_counts))}")
  if all("compute_seconds" in r for r in rows):
    longest = max(r["compute_seconds"] + r.get("communication_seconds", 0.0) for r in rows)
    lines += ["", "time per step (# compute, ~ communication not hidden)"]
    for label, r in runs:
      comm = r.get("communication_seconds", 0.0)
      lines.append(f"  {label:<{width}} {r['kind']:<12} {r['compute_seconds']:>8.4g} s + {comm:<8.4g} s "
                   f"{_bar(r['compute_seconds'], longest)}{_bar(comm, longest, '~')}")
  if all("memory_bytes" in r for r in rows):
    lines += ["", "memory per device (predicted / capacity)"]
    for label, r in runs:
      cap = r.get("memory_capacity_bytes")
      lines.append(f"  {label:<{width}} {r['kind']:<12} {si(r['memory_bytes'], 'B'):>10} / "
                   f"{si(cap, 'B') if cap else '?':>10} {_bar(r['memory_bytes'], cap) if cap else ''}")
  elif "memory_bytes_per_device" in predicted:
    lines += ["", f"memory per device (predicted): {si(predicted['memory_bytes_per_device'], 'B')}"]
  return "\n".join(lines)


def group_devices(plan: GroupPlan) -> list[dict]:
  """One row per device of a group plan, in group order: its group, microbatch, count, examples (tail
  included), state share and any per-device predictions."""
  per = dict(plan.predicted_per_device)
  shares = dict(zip(plan.devices, plan.state_shares))
  rows = []
  for g, group in enumerate(plan.groups):
    for device, count in zip(group.devices, group.counts):
      at = plan.devices.index(device)
      row = {"device": device, "group": g, "microbatch": group.microbatch, "microbatches": count,
             "examples": (count * group.microbatch) // group.model + plan.tail_count * plan.tail_microbatch,
             "remat": group.remat, "model": group.model, "shard_params": group.shard_params}
      if device in shares:
        row["state_share"] = shares[device]
      row.update({key: values[at] for key, values in per.items()})
      rows.append(row)
  return rows


def _device_runs(rows: list[dict]) -> list[tuple[str, dict]]:
  """Consecutive devices with the same figures, as (label, first row): ``devices 0-11``."""
  out: list[tuple[str, dict]] = []
  start = 0
  for i in range(1, len(rows) + 1):
    if (i == len(rows) or {**rows[i], "device": 0} != {**rows[start], "device": 0}
        or rows[i]["device"] != rows[i - 1]["device"] + 1):
      first, last = rows[start]["device"], rows[i - 1]["device"]
      out.append((f"device {first}" if i - start == 1 else f"devices {first}-{last}", rows[start]))
      start = i
  return out


def explain_group_text(plan: GroupPlan) -> str:
  """A group plan as text: a line per group, then per device (consecutive equal devices on one line) its work,
  predicted compute time and memory."""
  rows = group_devices(plan)
  runs = _device_runs(rows)
  width = max(len(label) for label, _ in runs)
  lines = [f"group plan: {len(plan.groups)} group program(s), global batch {plan.global_batch}"
           + (f", then {plan.tail_count} microbatch(es) of {plan.tail_microbatch} on every device in the "
              "exchange program" if plan.tail_count else "")
           + f", gradients' partial sums in {plan.grad_reduce_dtype}"]
  for g, group in enumerate(plan.groups):
    lines.append(f"  group {g}: devices {list(group.devices)}, {sum(group.positions)} microbatches of "
                 f"{group.microbatch} ({group.examples} examples), remat {group.remat}"
                 + (f", model axis {group.model}" if group.model > 1 else "")
                 + (f", parameters sharded over its devices (FSDP: gathered per reader, gradients reduce-scattered;"
                    f" every device runs {max(group.counts)} microbatch(es) in lockstep, the ones it lacks masked)"
                    if group.shard_params else ""))
  if plan.hybrid:
    lines.append("  hybrid: each group holds its parameters and optimizer state split over its devices between steps, "
                 "its own copy; the exchange adds the groups' parts and updates each part where it is held")
  predicted = dict(plan.predicted)
  if predicted:
    names = {"step_seconds": "step", "throughput": "", "compute_seconds": "compute",
             "communication_seconds": "communication", "hidden_communication_seconds": "hidden"}
    lines.append("predicted: " + ", ".join(f"{names.get(key, key.replace('_', ' '))} {quantity(key, value)}".strip()
                                           for key, value in predicted.items()))
  most = max(r["examples"] for r in rows)
  lines += ["", "work per device (microbatches x size, examples with the tail, share of the global batch)"]
  for label, r in runs:
    lines.append(f"  {label:<{width}} group {r['group']:<2} {r['microbatches']:>4} x {r['microbatch']:<5}"
                 f"{r['examples']:>7} {r['examples'] / plan.global_batch:>6.1%} {_bar(r['examples'], most)}")
  if all("compute_seconds" in r for r in rows):
    longest = max(r["compute_seconds"] for r in rows)
    lines += ["", "compute time per step (predicted)"]
    lines += [f"  {label:<{width}} group {r['group']:<2} {quantity('compute_seconds', r['compute_seconds']):>10} "
              f"{_bar(r['compute_seconds'], longest)}" for label, r in runs]
  if all("memory_bytes" in r for r in rows):
    lines += ["", "memory per device (predicted / capacity)" + (", state share" if plan.state_shares else "")]
    for label, r in runs:
      cap = r.get("memory_capacity_bytes")
      lines.append(f"  {label:<{width}} group {r['group']:<2} {si(r['memory_bytes'], 'B'):>10} / "
                   f"{si(cap, 'B') if cap else '?':>10} {_bar(r['memory_bytes'], cap) if cap else ''}"
                   + (f" {r['state_share']:.1%}" if "state_share" in r else ""))
  elif plan.state_shares:
    lines += ["", f"state (ZeRO-{plan.zero_stage}) in shares by device: "
              + ", ".join(f"{r['device']}: {r['state_share']:.1%}" for r in rows)]
  return "\n".join(lines)


def explain_png(plan: Plan, path: str | Path) -> Path:
  """Per-position time and memory bars as a PNG (needs matplotlib: ``pip install 'hetspmd[plot]'``)."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    raise InvalidValueError("--png needs matplotlib; install it with pip install 'hetspmd[plot]'") from None
  rows = positions(plan)
  labels = [f"{plan.data_axis}[{r['position']}] {r['kind']}" for r in rows]
  ys = range(len(rows))
  timed = all("compute_seconds" in r for r in rows)
  sized = all("memory_bytes" in r for r in rows)
  fig, axes = plt.subplots(1, 1 + timed + sized, figsize=(4 * (1 + timed + sized), 0.35 * len(rows) + 1.5),
                           sharey=True, squeeze=False)
  axes = list(axes[0])
  ax = axes.pop(0)
  ax.barh(ys, [r["examples"] for r in rows], color="tab:gray")
  ax.set_yticks(list(ys), labels)
  ax.invert_yaxis()
  ax.set_xlabel("examples per step")
  if timed:
    ax = axes.pop(0)
    compute = [r["compute_seconds"] for r in rows]
    comm = [r.get("communication_seconds", 0.0) for r in rows]
    ax.barh(ys, compute, color="tab:blue", label="compute")
    ax.barh(ys, comm, left=compute, color="tab:orange", label="communication")
    ax.set_xlabel("seconds per step (predicted)")
    ax.legend(loc="lower right", fontsize="small")
  if sized:
    ax = axes.pop(0)
    caps = [r.get("memory_capacity_bytes", 0.0) / 2**30 for r in rows]
    ax.barh(ys, caps, color="none", edgecolor="black", label="capacity")
    ax.barh(ys, [r["memory_bytes"] / 2**30 for r in rows], color="tab:green", label="predicted")
    ax.set_xlabel("memory per device (GiB)")
    ax.legend(loc="lower right", fontsize="small")
  fig.suptitle(f"mesh {dict(zip(plan.axis_names, plan.mesh_shape))}, batch {plan.global_batch}, "
               f"microbatch {plan.microbatch}, ZeRO-{plan.zero_stage}", fontsize="medium")
  fig.tight_layout()
  path = Path(path)
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path
