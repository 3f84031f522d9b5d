"""Numbers for people: SI prefixes."""

from __future__ import annotations


def si(value: float, unit: str = "", small: str = ".3g") -> str:
  """``value`` with an SI prefix (``1.50 GFLOP``); below a thousand formatted with ``small``."""
  for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(value) >= scale:
      return f"{value / scale:.2f} {prefix}{unit}"
  return f"{value:{small}} {unit}".rstrip()


def seconds(value: float) -> str:
  """``value`` seconds in s, ms or µs: ``1.072 s``, ``0.817 ms``."""
  for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
    if abs(value) >= scale:
      return f"{value / scale:.4g} {unit}"
  return f"{value:.4g} s" if value else "0 s"


def quantity(key: str, value: float) -> str:
  """A predicted figure by its name, as ``hetspmd explain`` prints it: seconds, samples/s, a share, bytes."""
  if key == "efficiency":
    return f"{value:.1%}"
  if key == "throughput":
    return f"{si(value, small='.4g')} samples/s"
  if key.endswith("seconds"):
    return seconds(value)
  if "bytes" in key:
    return si(value, "B")
  return f"{value:.4g}"
