"""How much of a datasheet peak a device kind reaches, per chip.

A datasheet spec holds peaks. The cost model divides a node's work by
``peak × efficiency``: matmuls on matrix units (tensor cores: float16 and
bfloat16 where the kind has them, TF32) at :attr:`Efficiency.matrix`,
matmuls on the vector units (float32, and half precision on kinds whose
half-precision rate is the float32 one) at :attr:`Efficiency.vector`,
memory traffic at :attr:`Efficiency.memory`. A measured spec
(``hetspmd profile``) holds achieved rates: :data:`MEASURED`.

:data:`CHIPS` holds efficiencies fitted to one published source,
Cephalo's per-layer timings (github benson-guo/cephalo,
``data/model_latencies.json``: one GPT-3 2.7B layer, sequence 512, forward
and backward per sample, float16 and float32 without TF32, PyTorch
autocast). ``python benchmarks/published.py --fit`` refits them and checks
them against the other source, NVIDIA's tuned BERT-large tables. Chips no
source has timed, and specs whose ``chip`` is ``None``, use
:data:`DATASHEET`. The key is the chip, not its generation: a P40 (GP102)
and a P100 (GP100) reach 0.48 and 0.66 of their float32 peaks in those
timings, and the L4's 0.12 (AD104, capped at 72 W) says nothing of an
RTX 4090 (AD102), which keeps the datasheet's. Memory efficiency is not
fitted: the layer is matmul-bound on every kind, so its time does not
constrain it.

This module measures nothing; of the package it imports only the errors.
"""

from __future__ import annotations

import dataclasses
import math

from hetspmd.errors import InvalidValueError


@dataclasses.dataclass(frozen=True, slots=True)
class Efficiency:
  """Fractions of peak reached: matmuls on matrix units, matmuls on vector units, memory traffic."""

  matrix: float
  vector: float
  memory: float

  def __post_init__(self):
    for field in ("matrix", "vector", "memory"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 < value <= 1:
        raise InvalidValueError(f"Efficiency.{field} must be a fraction of peak in (0, 1], got {value!r}")


# The uniform efficiencies of a datasheet spec without a fitted chip: typical of tuned kernels. NVIDIA's
# BERT-large tables on DGX A100 reach 0.92-0.99 of what they price (benchmarks/published.py).
DATASHEET = Efficiency(matrix=0.6, vector=0.6, memory=0.7)

# A measured spec's numbers are achieved rates.
MEASURED = Efficiency(matrix=1.0, vector=1.0, memory=1.0)

# chip: (fitted efficiency, the kinds fitted on). Written by ``python benchmarks/published.py --fit`` (least
# squares on the log of predicted over measured layer time, per chip; two decimals).
CHIPS: dict[str, tuple[Efficiency, tuple[str, ...]]] = {
    'gp102': (Efficiency(matrix=0.48, vector=0.48, memory=0.7), ('P40',)),
    'gp100': (Efficiency(matrix=0.66, vector=0.66, memory=0.7), ('P100-16GB',)),
    'tu104': (Efficiency(matrix=0.24, vector=0.51, memory=0.7), ('T4',)),
    'gv100': (Efficiency(matrix=0.31, vector=0.8, memory=0.7), ('V100-16GB',)),
    'ad104': (Efficiency(matrix=0.12, vector=0.21, memory=0.7), ('L4',)),
    'ga102': (Efficiency(matrix=0.24, vector=0.39, memory=0.7), ('RTX-A6000',)),
}

# Chips a spec may name: the fitted ones and those priced at DATASHEET until a source times them.
KNOWN_CHIPS: tuple[str, ...] = tuple(CHIPS) + tuple(
    c for c in ("gp100", "gp102", "gv100", "tu104", "ga100", "ga102", "ad102", "ad104", "gh100", "cdna2", "cdna3",
                "tpu-v4", "tpu-v5e") if c not in CHIPS)


def check_chip(name: str | None, where: str) -> None:
  """Raise unless ``name`` is ``None`` or a known chip."""
  if name is not None and name not in KNOWN_CHIPS:
    raise InvalidValueError(f"{where}: unknown chip {name!r}; known: {', '.join(KNOWN_CHIPS)} "
                            "(or leave it unset for the datasheet efficiencies)")


def efficiency_for(chip: str | None, measured: bool = False) -> Efficiency:
  """The efficiencies of a spec: :data:`MEASURED` for a measured one, else its chip's, else :data:`DATASHEET`."""
  if measured:
    return MEASURED
  fitted = CHIPS.get(chip) if chip else None
  return fitted[0] if fitted else DATASHEET
