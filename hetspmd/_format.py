"""Numbers for people: SI prefixes."""

from __future__ import annotations


def si(value: float, unit: str = "", small: str = ".3g") -> str:
  """``value`` with an SI prefix (``1.50 GFLOP``); below a thousand formatted with ``small``."""
  for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(value) >= scale:
      return f"{value / scale:.2f} {prefix}{unit}"
  return f"{value:{small}} {unit}".rstrip()
