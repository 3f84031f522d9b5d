"""Measured step times per device kind: what the cost model prices compute with where they exist.

The cost model predicts a microbatch's seconds from datasheet (or profiled) FLOP/s and bandwidths at efficiencies
fitted to one published stack (:mod:`hetspmd.hardware.efficiency`); another stack runs up to 1.6x apart from it. A :class:`Calibration` holds the step's own times,
measured on each kind (:func:`hetspmd.runtime.calibrating.calibrate`): per kind, seconds per microbatch at one
or more microbatch sizes (fitted as ``a + b x microbatch``, as Cephalo fits its layers) and the seconds per
step that do not scale with the batch (the optimizer update). A :class:`~hetspmd.hardware.cluster.Cluster`
carrying one (``cluster.calibrated(calibration)``) is priced on it: each kind's per-node seconds are scaled so
that a microbatch takes the measured time, and its per-step seconds are the measured ones. Communication stays
modelled.

A calibration carries the step's jaxpr fingerprint (its primitives and input dtypes), which tells one step's
calibration from another's. Where the step fits no one device, a kind's timing may be of one layer of its layer
scan instead (``part="layer"``), or of one numbered block's forward and backward where the step unrolls its
layers (``part="unrolled"``: :mod:`hetspmd.runtime.layer_timing`; ``part="block"``, its forward alone, as earlier
versions timed it, is still read).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Sequence

from hetspmd.errors import InvalidValueError

FORMAT = "hetspmd.calibration/1"
# what a KindTiming timed (:attr:`KindTiming.part`), in words: the step's microbatches, or one layer of it
PARTS = {"step": "the step's microbatches", "layer": "one layer of the step",
         "block": "one unrolled layer's forward", "unrolled": "one unrolled layer's forward and backward"}


@dataclasses.dataclass(frozen=True)
class KindTiming:
  """One kind's measured step times.

  Attributes:
    kind: the device kind (a cluster's kind name).
    points: ``(microbatch, seconds)`` pairs: one microbatch's seconds at that size, in the step's loop (the
      difference between runs of different microbatch counts), ascending by size.
    fixed: seconds per step besides the microbatches on one device (the optimizer update, the first
      microbatch's extra over a later one, the program's dispatch).
    remat: the remat policy the points were measured under.
    devices: how many devices of the kind ran together while timed (one data-parallel program over them, whose
      gradient reduction is part of ``fixed``).
    part: what was timed: ``"step"``, the step's microbatches; for a step that fits no one device
      (:mod:`hetspmd.runtime.layer_timing`), ``"layer"``, one layer of the step's layer scan (forward and
      backward), or ``"unrolled"``, the forward and backward of one numbered layer of a step that unrolls its
      layers (``"block"``: its forward alone): ``points`` are then that part's seconds, and ``fixed`` is not
      measured (the search models it).
  """

  kind: str
  points: tuple[tuple[int, float], ...]
  fixed: float = 0.0
  remat: str = "none"
  devices: int = 1
  part: str = "step"

  def __post_init__(self):
    if not self.points:
      raise InvalidValueError(f"a KindTiming for {self.kind!r} needs at least one (microbatch, seconds) point")
    for size, seconds in self.points:
      if not isinstance(size, int) or size < 1 or not math.isfinite(seconds) or seconds <= 0:
        raise InvalidValueError(f"{self.kind!r}: each point is (a positive microbatch, positive seconds), "
                                f"got {(size, seconds)!r}")
    if not math.isfinite(self.fixed) or self.fixed < 0:
      raise InvalidValueError(f"{self.kind!r}: fixed seconds must be a finite number >= 0, got {self.fixed!r}")
    if self.part not in PARTS:
      raise InvalidValueError(f"{self.kind!r}: part must be one of {tuple(PARTS)}, got {self.part!r}")

  def line(self) -> tuple[float, float]:
    """``(a, b)``: seconds per microbatch ``a + b x microbatch``, least squares over the points (one point: a
    line through the origin)."""
    sizes = [float(m) for m, _ in self.points]
    times = [t for _, t in self.points]
    if len(set(sizes)) < 2:
      return 0.0, sum(times) / sum(sizes)
    mean_m, mean_t = sum(sizes) / len(sizes), sum(times) / len(times)
    b = (sum((m - mean_m) * (t - mean_t) for m, t in zip(sizes, times))
         / sum((m - mean_m) ** 2 for m in sizes))
    if b <= 0:  # noise on a flat curve: no slope to extrapolate with
      return mean_t, 0.0
    return mean_t - b * mean_m, b

  def micro(self, microbatch: int) -> float:
    """Seconds of one microbatch of ``microbatch`` examples: the measured point where there is one, between two
    measured sizes the line through them, else the fitted line, no lower than the smallest measured size's time
    scaled down by size."""
    for size, seconds in self.points:
      if size == microbatch:
        return seconds
    ordered = sorted(self.points)
    for (m0, t0), (m1, t1) in zip(ordered, ordered[1:]):
      if m0 < microbatch < m1:
        return t0 + (t1 - t0) * (microbatch - m0) / (m1 - m0)
    a, b = self.line()
    smallest, at = min(self.points)
    return max(a + b * microbatch, at * microbatch / smallest * 0.5)

  def to_json(self) -> dict[str, Any]:
    out = {"kind": self.kind, "points": [[m, t] for m, t in self.points], "fixed": self.fixed,
           "remat": self.remat, "devices": self.devices}
    return out if self.part == "step" else {**out, "part": self.part}

  @classmethod
  def from_json(cls, data: dict[str, Any]) -> "KindTiming":
    return cls(str(data["kind"]), tuple((int(m), float(t)) for m, t in data["points"]), float(data["fixed"]),
               str(data.get("remat", "none")), int(data.get("devices", 1)), str(data.get("part", "step")))


@dataclasses.dataclass(frozen=True)
class Calibration:
  """The step's measured times per kind (:class:`KindTiming`), for the step whose jaxpr has ``fingerprint``.

  A kind may be timed under several remat policies, one :class:`KindTiming` each: the search prices a policy's
  recomputation from its own timing where there is one (a policy's cost on a device is what a model of its
  recomputed operations misses most: on 8 CPU devices GPT-2 tiny's steps under ``dots``, ``all_dots`` and
  ``full`` ran 1.16x, 1.27x and 1.49x its step without, where the operations they recompute price 1.02x to
  1.19x), else from the model of the recomputed operations scaled by the kind's timing (:meth:`of`)."""

  fingerprint: str
  kinds: tuple[KindTiming, ...]

  def __post_init__(self):
    names = [(t.kind, t.remat) for t in self.kinds]
    if len(set(names)) != len(names):
      raise InvalidValueError(f"a calibration times each kind once per remat policy, got {names}")

  def of(self, kind: str, remat: str | None = None) -> KindTiming | None:
    """``kind``'s timing under ``remat``, None where that policy was not timed; without ``remat``, the timing
    the kind's compute is scaled by: its timing without remat where there is one, else its first."""
    mine = [t for t in self.kinds if t.kind == kind]
    if remat is not None:
      return next((t for t in mine if t.remat == remat), None)
    return next((t for t in mine if t.remat == "none"), mine[0] if mine else None)

  @property
  def kind_names(self) -> tuple[str, ...]:
    return tuple(dict.fromkeys(t.kind for t in self.kinds))

  def remats(self, kind: str) -> tuple[str, ...]:
    """The remat policies ``kind`` was timed under."""
    return tuple(t.remat for t in self.kinds if t.kind == kind)

  def merged(self, other: "Calibration") -> "Calibration":
    """This calibration with ``other``'s timings added (its own kept where both timed a kind under one policy)."""
    if other.fingerprint != self.fingerprint:
      raise InvalidValueError("calibrations of two different steps cannot be merged "
                              f"({self.fingerprint[:12]} and {other.fingerprint[:12]})")
    return Calibration(self.fingerprint, self.kinds + tuple(t for t in other.kinds
                                                            if self.of(t.kind, t.remat) is None))

  def check_step(self, fingerprint: str) -> None:
    if fingerprint != self.fingerprint:
      raise InvalidValueError(f"the calibration was measured on another step (fingerprint {self.fingerprint[:12]}, "
                              f"this step's {fingerprint[:12]}): time this step (step.calibrate(state, batch), or "
                              "hetspmd calibrate for a zoo model), or search without it")

  def to_json(self) -> dict[str, Any]:
    return {"format": FORMAT, "fingerprint": self.fingerprint, "kinds": [t.to_json() for t in self.kinds]}

  @classmethod
  def from_json(cls, data: dict[str, Any]) -> "Calibration":
    if not isinstance(data, dict) or data.get("format") != FORMAT:
      raise InvalidValueError(f"not a hetspmd calibration (expected format {FORMAT!r})")
    return cls(str(data["fingerprint"]), tuple(KindTiming.from_json(k) for k in data["kinds"]))

  def save(self, path: str | Path) -> None:
    Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

  @classmethod
  def load(cls, path: str | Path) -> "Calibration":
    return cls.from_json(json.loads(Path(path).read_text()))

  def describe(self) -> list[str]:
    lines = []
    for t in self.kinds:
      points = ", ".join(f"{m}: {s * 1e3:.3g} ms" for m, s in t.points)
      if t.part != "step":
        what = "one layer (forward and backward)" if t.part == "layer" else PARTS[t.part]
        lines.append(f"{t.kind}: {what} per microbatch {points}")
        continue
      lines.append(f"{t.kind}: per microbatch {points}; per step {t.fixed * 1e3:.3g} ms (remat {t.remat}, "
                   f"{t.devices} device(s) together)")
    return lines


def fit_points(runs: Sequence[tuple[int, int, float]]) -> tuple[tuple[tuple[int, float], ...], float]:
  """``(points, fixed)`` from timed runs ``(microbatch, count, seconds)``: per microbatch size, the seconds a
  microbatch adds (slope over the counts, least squares), and per step the mean intercept (the seconds at no
  microbatch). A slope that noise makes non-positive is floored at a thousandth of the smallest run per
  microbatch."""
  by_size: dict[int, list[tuple[int, float]]] = {}
  for size, count, seconds in runs:
    by_size.setdefault(size, []).append((count, seconds))
  points, intercepts = [], []
  for size in sorted(by_size):
    pairs = by_size[size]
    counts = [float(c) for c, _ in pairs]
    if len(set(counts)) < 2:
      raise InvalidValueError(f"microbatch {size}: timing needs runs of at least two microbatch counts")
    mean_c, mean_t = sum(counts) / len(counts), sum(t for _, t in pairs) / len(pairs)
    slope = (sum((c - mean_c) * (t - mean_t) for c, (_, t) in zip(counts, pairs))
             / sum((c - mean_c) ** 2 for c in counts))
    floor = min(t / c for c, (_, t) in zip(counts, pairs) if c > 0) * 1e-3
    slope = max(slope, floor)
    points.append((size, slope))
    intercepts.append(max(0.0, mean_t - slope * mean_c))
  return tuple(points), sum(intercepts) / len(intercepts)
