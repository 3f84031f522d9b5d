"""Device and link specifications: datasheet presets and unit parsing.

A :class:`DeviceSpec` is what the cost model knows about one accelerator:
dense peak FLOP/s in fp32, in bf16/fp16 (tensor cores where the device
has them) and for float32 matmuls with reduced-precision inputs (what JAX
computes them with by default: TF32 on Ampere and later NVIDIA GPUs, one
bfloat16 pass on TPUs), memory size and memory bandwidth. A :class:`Link` is a bandwidth
(bytes/s, one direction) and a latency (s).

Preset numbers are dense (no structured sparsity) peaks from the vendors'
datasheets, named beside each entry. The ``cpu`` spec is never assumed:
:func:`hetspmd.hardware.profiler.device_spec` measures it on this machine
the first time it is asked for. This module measures nothing.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Sequence

from hetspmd.errors import InvalidValueError, UnknownNameError, closest
from hetspmd.hardware.efficiency import DATASHEET, Efficiency, check_chip, efficiency_for
from hetspmd.passes._jax_adapter import reduced_precision_f32_matmuls

GiB = 2**30
GB = 10**9
TFLOPS = 1e12


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceSpec:
  """One accelerator kind.

  Attributes:
    name: the kind, e.g. ``V100-32GB``.
    fp32_flops: dense fp32 peak, FLOP/s.
    bf16_flops: dense bf16/fp16 peak (tensor cores), FLOP/s.
    memory_bytes: device memory, bytes.
    memory_bandwidth: device memory bandwidth, bytes/s, as a copy counts it
      (bytes read plus bytes written, per second).
    read_bandwidth: bytes/s a read-only pass (a reduction) reaches; ``None``:
      the same as ``memory_bandwidth``. Where writes cost more than reads
      (on CPUs, a program's fresh output pages fault in on first write), a
      copy's rate understates reads; the cost model then times reads at
      :attr:`read_rate` and writes at :attr:`write_rate`.
    measured: True when the numbers come from :func:`hetspmd.profile`.
    cache_bytes: the largest value a kernel writes into cache rather than
      memory (a core's private cache on CPUs); ``None``: no cache modelled.
    cache_write_bandwidth: bytes/s written into a value of at most
      ``cache_bytes`` whose memory the step has already touched (a
      microbatch after the first reuses the first one's buffers). Set with
      ``cache_bytes`` or not at all.
    reduced_f32_flops: dense peak of float32 matmuls computed with
      reduced-precision inputs, FLOP/s: TF32 tensor cores on NVIDIA Ampere
      and later, one bfloat16 pass on TPUs. JAX computes float32 matmuls
      so unless ``jax_default_matmul_precision`` asks for full float32
      (see :meth:`f32_matmul_flops`). ``None``: float32 matmuls run at
      ``fp32_flops``. A measured spec leaves it ``None``: its
      ``fp32_flops`` already is what float32 matmuls reach.
    fp16_flops: dense peak of float16 matmuls where it differs from
      ``bf16_flops``, FLOP/s; ``None``: the same. Before Ampere, NVIDIA
      GPUs have no bfloat16 math: XLA hands a bfloat16 dot to cuBLAS, which
      computes it at the float32 rate, while float16 dots use the tensor
      cores (Volta, Turing) or run with float32 accumulation at the
      float32 rate (Pascal). See docs/cost-model.md.
    chip: the chip (``gv100``, ``ga102``...) whose fitted efficiencies the
      cost model prices a datasheet spec with
      (:mod:`hetspmd.hardware.efficiency`); ``None``, or a chip no source
      has measured: the uniform datasheet efficiencies.
  """

  name: str
  fp32_flops: float
  bf16_flops: float
  memory_bytes: int
  memory_bandwidth: float
  measured: bool = False
  read_bandwidth: float | None = None
  cache_bytes: int | None = None
  cache_write_bandwidth: float | None = None
  reduced_f32_flops: float | None = None
  fp16_flops: float | None = None
  chip: str | None = None

  def __post_init__(self):
    check_chip(self.chip, f"DeviceSpec {self.name!r}")
    if not self.name or not isinstance(self.name, str):
      raise InvalidValueError(f"DeviceSpec needs a non-empty name, got {self.name!r}")
    for field in ("fp32_flops", "bf16_flops", "memory_bytes", "memory_bandwidth"):
      value = getattr(self, field)
      if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidValueError(f"DeviceSpec {self.name!r}: {field} must be a positive number, got {value!r}")
    read = self.read_bandwidth
    if read is not None and (not isinstance(read, (int, float)) or not math.isfinite(read)
                             or read <= self.memory_bandwidth / 2):
      raise InvalidValueError(
          f"DeviceSpec {self.name!r}: read_bandwidth must be a number above half the copy bandwidth "
          f"({self.memory_bandwidth / 2:.4g} bytes/s: a copy reads and writes every byte), got {read!r}")
    cache = (self.cache_bytes, self.cache_write_bandwidth)
    if (cache[0] is None) != (cache[1] is None):
      raise InvalidValueError(f"DeviceSpec {self.name!r}: give cache_bytes and cache_write_bandwidth together "
                              f"(or neither), got cache_bytes={cache[0]!r}, cache_write_bandwidth={cache[1]!r}")
    for field, value in zip(("cache_bytes", "cache_write_bandwidth"), cache):
      if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0):
        raise InvalidValueError(f"DeviceSpec {self.name!r}: {field} must be a positive number, got {value!r}")

    half = self.fp16_flops
    if half is not None and (isinstance(half, bool) or not isinstance(half, (int, float)) or not math.isfinite(half)
                             or half <= 0):
      raise InvalidValueError(f"DeviceSpec {self.name!r}: fp16_flops must be a positive number, got {half!r}")
    tf32 = self.reduced_f32_flops
    if tf32 is not None and (isinstance(tf32, bool) or not isinstance(tf32, (int, float)) or not math.isfinite(tf32)
                             or tf32 <= 0):
      raise InvalidValueError(f"DeviceSpec {self.name!r}: reduced_f32_flops must be a positive number, got {tf32!r}")
    if tf32 is not None and tf32 < self.fp32_flops:
      raise InvalidValueError(
          f"DeviceSpec {self.name!r}: reduced_f32_flops ({tf32:.4g}) is below fp32_flops ({self.fp32_flops:.4g}); "
          "it is the faster reduced-precision rate (TF32, one bfloat16 pass): leave it unset if there is none")

  def replace(self, **changes: Any) -> "DeviceSpec":
    return dataclasses.replace(self, **changes)

  @property
  def efficiency(self) -> Efficiency:
    """Fractions of peak the cost model prices with: 1 when measured, else the chip's, else the datasheet's."""
    return efficiency_for(self.chip, self.measured)

  def f32_matmul_flops(self, reduced_precision: bool = True) -> float:
    """FLOP/s of float32 matmuls: reduced-precision inputs where the device has them and ``reduced_precision`` allows.

    ``reduced_precision``: whether JAX's default matmul precision lets XLA
    round float32 inputs (its default on GPUs; see
    :func:`hetspmd.passes._jax_adapter.reduced_precision_f32_matmuls`).
    """
    return (self.reduced_f32_flops or self.fp32_flops) if reduced_precision else self.fp32_flops

  @property
  def read_rate(self) -> float:
    """Bytes/s read: ``read_bandwidth``, else the copy rate."""
    return self.read_bandwidth or self.memory_bandwidth

  @property
  def write_rate(self) -> float:
    """Bytes/s written, from a copy's rate less its reads: ``2/copy = 1/read + 1/write``."""
    return 1.0 / (2.0 / self.memory_bandwidth - 1.0 / self.read_rate)

  @property
  def cached_write_rate(self) -> float:
    """Bytes/s written into a touched value of at most :attr:`cache_bytes`; :attr:`write_rate` without a cache."""
    return self.cache_write_bandwidth or self.write_rate

  @property
  def float16_flops(self) -> float:
    """FLOP/s of float16 matmuls: ``fp16_flops``, else ``bf16_flops``."""
    return self.fp16_flops or self.bf16_flops

  def peak_flops(self, dtype: str = "float32") -> float:
    """Dense matmul peak for ``dtype`` (``bfloat16``/``float16``; ``float32`` at JAX's default precision)."""
    if dtype in ("float16", "fp16"):
      return self.float16_flops
    if dtype in ("bfloat16", "bf16"):
      return self.bf16_flops
    return self.f32_matmul_flops(reduced_precision_f32_matmuls())


def mean_spec(specs: Sequence[DeviceSpec], name: str = "") -> DeviceSpec:
  """One device kind with the means of ``specs`` (one entry per device): each peak (float32, float32 matmuls
  with reduced-precision inputs, bfloat16), memory bandwidth (copy, read, cache write) and memory. A pool of
  these has the same total peak, bandwidth and memory as the pool of ``specs``, as the cost model prices them:
  where the specs' efficiencies differ (:attr:`DeviceSpec.efficiency`), each rate is the mean of the achieved
  rates over the datasheet efficiency."""
  specs = tuple(specs)
  if not specs:
    raise InvalidValueError("mean_spec needs at least one device spec")
  measured = all(s.measured for s in specs)
  chips = {s.chip for s in specs}
  alike = measured or (len(chips) == 1 and not any(s.measured for s in specs))
  chip = next(iter(chips)) if alike and not measured else None

  def mean(values, work):  # work(spec, value): "matrix", "vector" or "memory"
    pairs = [(s, float(v)) for s, v in zip(specs, values)]
    if alike:
      return sum(v for _, v in pairs) / len(specs)
    return sum(v * getattr(s.efficiency, work(s, v)) / getattr(DATASHEET, work(s, v)) for s, v in pairs) / len(specs)

  peak = lambda s, value: "matrix" if value > s.fp32_flops else "vector"
  vector = lambda s, value: "vector"
  memory = lambda s, value: "memory"
  cached = all(s.cache_bytes is not None for s in specs)
  reduced = any(s.reduced_f32_flops is not None for s in specs)
  half = any(s.fp16_flops is not None for s in specs)
  fp32 = mean((s.fp32_flops for s in specs), vector)
  return DeviceSpec(
      name=name or "mean(" + ",".join(dict.fromkeys(s.name for s in specs)) + ")",
      fp32_flops=fp32, bf16_flops=mean((s.bf16_flops for s in specs), peak),
      memory_bytes=int(sum(s.memory_bytes for s in specs) / len(specs)),
      memory_bandwidth=mean((s.memory_bandwidth for s in specs), memory),
      measured=measured,
      read_bandwidth=(mean((s.read_rate for s in specs), memory) if any(s.read_bandwidth is not None for s in specs)
                      else None),
      cache_bytes=int(sum(s.cache_bytes for s in specs) / len(specs)) if cached else None,
      cache_write_bandwidth=mean((s.cache_write_bandwidth for s in specs), memory) if cached else None,
      reduced_f32_flops=max(fp32, mean((s.f32_matmul_flops(True) for s in specs), peak)) if reduced else None,
      fp16_flops=mean((s.float16_flops for s in specs), peak) if half else None,
      chip=chip)


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
  """A link class: one-direction bandwidth (bytes/s) and latency (s)."""

  name: str
  bandwidth: float
  latency: float

  def __post_init__(self):
    if not math.isfinite(self.bandwidth) or self.bandwidth <= 0:
      raise InvalidValueError(f"link {self.name!r}: bandwidth must be positive, got {self.bandwidth!r} bytes/s")
    if not math.isfinite(self.latency) or self.latency < 0:
      raise InvalidValueError(f"link {self.name!r}: latency must be non-negative, got {self.latency!r} s")

  def replace(self, **changes: Any) -> "Link":
    return dataclasses.replace(self, **changes)

  def transfer_seconds(self, nbytes: float) -> float:
    return self.latency + nbytes / self.bandwidth


def _spec(name: str, fp32_tflops: float, bf16_tflops: float, memory_gib: float, bandwidth_gbs: float, *,
          reduced_f32_tflops: float | None = None, fp16_tflops: float | None = None,
          chip: str | None = None) -> DeviceSpec:
  return DeviceSpec(name, fp32_tflops * TFLOPS, bf16_tflops * TFLOPS, int(memory_gib * GiB), bandwidth_gbs * GB,
                    reduced_f32_flops=reduced_f32_tflops * TFLOPS if reduced_f32_tflops else None,
                    fp16_flops=fp16_tflops * TFLOPS if fp16_tflops else None, chip=chip)


# name: DeviceSpec. Memory sizes are the marketed GB read as GiB (HBM stacks
# are binary sized); bandwidth in GB/s as published. ``chip`` picks the efficiencies the cost model prices a
# preset with (hetspmd.hardware.efficiency: fitted where a published source timed a kind with that chip, the
# datasheet's elsewhere).
DEVICE_PRESETS: dict[str, DeviceSpec] = {s.name: s for s in (
    # Before Ampere (sm_80) there is no bfloat16 math: a bfloat16 dot runs at the float32 rate (the second
    # number below); float16 dots (the last) use the tensor cores on Volta and Turing, and on Pascal run with
    # float32 accumulation, which XLA asks cuBLAS for, at the float32 rate (docs/cost-model.md).
    # NVIDIA Tesla P100 PCIe datasheet: 9.3 TF fp32, 18.7 TF fp16 (fp16 accumulation, which XLA does not use),
    # 16 GB, 732 GB/s
    _spec("P100-16GB", 9.3, 9.3, 16, 732, fp16_tflops=9.3, chip="gp100"),
    # NVIDIA V100 datasheet (SXM2): 15.7 TF fp32, 125 TF fp16 tensor (fp32 accumulation), 900 GB/s
    _spec("V100-16GB", 15.7, 15.7, 16, 900, fp16_tflops=125, chip="gv100"),
    _spec("V100-32GB", 15.7, 15.7, 32, 900, fp16_tflops=125, chip="gv100"),
    # NVIDIA T4 datasheet: 8.1 TF fp32, 65 TF fp16 tensor (fp32 accumulation), 16 GB GDDR6, 320 GB/s
    _spec("T4", 8.1, 8.1, 16, 320, fp16_tflops=65, chip="tu104"),
    # NVIDIA A10 datasheet (A10G is AWS's A10): 31.2 TF fp32, 62.5 TF tf32 / 125 TF bf16 tensor, 24 GB, 600 GB/s
    _spec("A10G", 31.2, 125, 24, 600, reduced_f32_tflops=62.5, chip="ga102"),
    # NVIDIA L4 datasheet: 30.3 TF fp32, 60 TF tf32 / 121 TF bf16 tensor (dense), 24 GB, 300 GB/s
    _spec("L4", 30.3, 121, 24, 300, reduced_f32_tflops=60, chip="ad104"),
    # NVIDIA A100 datasheet (SXM): 19.5 TF fp32, 156 TF tf32 / 312 TF bf16 tensor, 1555 / 2039 GB/s
    _spec("A100-40GB", 19.5, 312, 40, 1555, reduced_f32_tflops=156, chip="ga100"),
    _spec("A100-80GB", 19.5, 312, 80, 2039, reduced_f32_tflops=156, chip="ga100"),
    # NVIDIA H100 datasheet (SXM): 67 TF fp32, 494.5 TF tf32 / 989 TF bf16 tensor (dense), 80 GB, 3.35 TB/s
    _spec("H100-80GB", 67, 989, 80, 3350, reduced_f32_tflops=494.5, chip="gh100"),
    # NVIDIA H200 datasheet (SXM): 67 TF fp32, 494.5 TF tf32 / 989 TF bf16 tensor (dense), 141 GB, 4.8 TB/s
    _spec("H200", 67, 989, 141, 4800, reduced_f32_tflops=494.5, chip="gh100"),
    # NVIDIA Tesla P40 datasheet: 11.76 TF fp32, 24 GB GDDR5, 346 GB/s. GP102's own fp16 arithmetic runs at 1/64
    # of fp32, but a float16 dot with float32 accumulation (what XLA asks cuBLAS for) runs at the float32 rate:
    # Cephalo measured the P40's fp16 layers at about 5.7 TF/s (benson-guo/cephalo data/model_latencies.json)
    _spec("P40", 11.76, 11.76, 24, 346, fp16_tflops=11.76, chip="gp102"),
    # NVIDIA RTX A6000 datasheet: 38.7 TF fp32, 77.4 TF tf32 / 154.8 TF fp16/bf16 tensor (dense), 48 GB GDDR6,
    # 768 GB/s
    _spec("RTX-A6000", 38.7, 154.8, 48, 768, reduced_f32_tflops=77.4, chip="ga102"),
    # NVIDIA Ampere GA102 whitepaper (RTX 3090): 35.6 TF fp32, 71 TF fp16 tensor (fp32 acc.), 936 GB/s
    _spec("RTX3090", 35.6, 71, 24, 936, chip="ga102"),
    # NVIDIA Ada whitepaper (RTX 4090): 82.6 TF fp32, 165.2 TF fp16 tensor (fp32 acc.), 1008 GB/s
    _spec("RTX4090", 82.6, 165.2, 24, 1008, chip="ad102"),
    # AMD Instinct MI250X datasheet: 47.9 TF fp32 vector, 383 TF bf16 matrix, 128 GB, 3.2 TB/s
    _spec("MI250X", 47.9, 383, 128, 3277, chip="cdna2"),
    # AMD Instinct MI300X datasheet: 163.4 TF fp32, 1307 TF bf16 (dense), 192 GB, 5.3 TB/s
    _spec("MI300X", 163.4, 1307.4, 192, 5300, chip="cdna3"),
    # Google Cloud TPU v4 docs: 275 TF bf16, 32 GiB HBM2, 1200 GB/s; float32 matmuls at HIGHEST precision
    # as 6 bf16 passes (lax.Precision), at JAX's default precision one
    _spec("TPU-v4", 275 / 6, 275, 32, 1200, reduced_f32_tflops=275, chip="tpu-v4"),
    # Google Cloud TPU v5e docs: 197 TF bf16, 16 GiB HBM2, 819 GB/s; the same float32 passes
    _spec("TPU-v5e", 197 / 6, 197, 16, 819, reduced_f32_tflops=197, chip="tpu-v5e"),
)}

# The names JAX reports as ``device.device_kind`` → preset names.
_DEVICE_KIND_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"P100", "P100-16GB"),
    (r"V100.*32", "V100-32GB"),
    (r"V100", "V100-16GB"),
    (r"\bT4\b", "T4"),
    (r"A10G|\bA10\b", "A10G"),
    (r"\bL4\b", "L4"),
    (r"A100.*80", "A100-80GB"),
    (r"A100", "A100-40GB"),
    (r"H200", "H200"),
    (r"H100", "H100-80GB"),
    (r"\bP40\b", "P40"),
    (r"RTX A6000", "RTX-A6000"),
    (r"3090", "RTX3090"),
    (r"4090", "RTX4090"),
    (r"MI250", "MI250X"),
    (r"MI300", "MI300X"),
    (r"TPU v4", "TPU-v4"),
    (r"TPU v5 lite|TPU v5e", "TPU-v5e"),
)


def preset_for_device_kind(device_kind: str) -> str | None:
  """The preset name for a JAX ``device_kind`` string, or None."""
  for pattern, name in _DEVICE_KIND_PATTERNS:
    if re.search(pattern, device_kind, re.IGNORECASE):
      return name
  return None


def known_device_names() -> list[str]:
  return sorted(DEVICE_PRESETS) + ["cpu"]


def preset_spec(name: str, custom: dict[str, DeviceSpec] | None = None) -> DeviceSpec | None:
  """The spec of kind ``name`` from ``custom``, else from the presets (any letter case); None for other kinds."""
  if custom and name in custom:
    return custom[name]
  if name in DEVICE_PRESETS:
    return DEVICE_PRESETS[name]
  lower = {k.lower(): k for k in DEVICE_PRESETS}
  if name.lower() in lower:
    return DEVICE_PRESETS[lower[name.lower()]]
  return None


def unknown_device_error(name: str) -> UnknownNameError:
  """The error for a device kind that is neither a preset, ``cpu``, nor given: it names the known kinds."""
  close = closest(name, known_device_names())
  return UnknownNameError(
      f"unknown device kind {name!r}; known kinds: {', '.join(known_device_names())}. "
      f"{f'Did you mean {close!r}? ' if close else ''}"
      f"For other hardware give its numbers: Cluster.parse(spec, devices={{{name!r}: "
      f"hetspmd.DeviceSpec({name!r}, fp32_flops=..., bf16_flops=..., memory_bytes=..., memory_bandwidth=...)}}) "
      f"or a [devices.{name!r}] table in a cluster TOML file")


# --- links -----------------------------------------------------------------

# name: Link. Bandwidth is one direction per device.
LINK_PRESETS: dict[str, Link] = {l.name: l for l in (
    # PCIe 3.0 x16: 15.75 GB/s per direction; PCIe 4.0 / 5.0 double it each generation
    Link("pcie", 15.75 * GB, 5e-6),
    Link("pcie3", 15.75 * GB, 5e-6),
    Link("pcie4", 31.5 * GB, 5e-6),
    Link("pcie5", 63.0 * GB, 5e-6),
    # NVLink 2 (V100 SXM2): 150 GB/s per direction; NVLink 3 (A100): 300; NVLink 4 (H100/H200): 450
    Link("nvlink", 150 * GB, 3e-6),
    Link("nvlink2", 150 * GB, 3e-6),
    Link("nvlink3", 300 * GB, 3e-6),
    Link("nvlink4", 450 * GB, 3e-6),
    # AMD Infinity Fabric (MI250X/MI300X): 50 GB/s per link per direction, 7 links on MI300X
    Link("xgmi", 350 * GB, 3e-6),
    # TPU v4 ICI: 6 links x 50 GB/s; v5e: 4 links x 50 GB/s
    Link("ici", 300 * GB, 2e-6),
    # One host's memory shared by emulated devices
    Link("host", 20 * GB, 2e-6),
)}

_UNITS = {
    "bps": 1 / 8, "kbps": 1e3 / 8, "mbps": 1e6 / 8, "gbps": 1e9 / 8, "tbps": 1e12 / 8,
    "b/s": 1, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12,
    "bytes/s": 1, "kib/s": 2**10, "mib/s": 2**20, "gib/s": 2**30,
}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
               "gib": 2**30, "tib": 2**40}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


def _parse_with_units(text: str, units: dict[str, float], what: str, example: str) -> float:
  match = re.fullmatch(_NUMBER + r"\s*([A-Za-zµ/]*)", text.strip())
  if match is None:
    raise InvalidValueError(f"cannot read {what} {text!r}; expected a number with a unit, e.g. {example}")
  number, unit = float(match.group(1)), match.group(2).lower()
  if unit not in units:
    raise InvalidValueError(f"unknown unit {match.group(2)!r} in {what} {text!r}; use one of {', '.join(units)}")
  value = number * units[unit]
  if value <= 0 and what != "latency":
    raise InvalidValueError(f"{what} must be positive, got {text!r}")
  return value


def parse_bandwidth(text: str) -> float:
  """``10.4Gbps`` (bits) or ``12GB/s`` (bytes) → bytes/s."""
  return _parse_with_units(text, _UNITS, "bandwidth", "10.4Gbps or 12GB/s")


def parse_latency(text: str) -> float:
  """``20us``, ``0.1ms`` → seconds."""
  return _parse_with_units(text, _TIME_UNITS, "latency", "20us")


def parse_size(text: str) -> int:
  """``16GiB``, ``512MB`` → bytes."""
  return int(_parse_with_units(text, _SIZE_UNITS, "size", "16GiB"))


def link(name_or_bandwidth: str, latency: float | None = None) -> Link:
  """A preset link by name, or a custom one from a bandwidth such as ``25Gbps``."""
  key = name_or_bandwidth.strip().lower()
  if key in LINK_PRESETS:
    base = LINK_PRESETS[key]
    return base if latency is None else base.replace(latency=latency)
  if re.match(r"^[-+0-9.]", key):
    return Link(name_or_bandwidth.strip(), parse_bandwidth(name_or_bandwidth), 20e-6 if latency is None else latency)
  raise UnknownNameError(
      f"unknown link {name_or_bandwidth!r}; use one of {', '.join(LINK_PRESETS)} or a bandwidth such as 25Gbps")


def allocator_stats(device: Any) -> dict:
  """``device.memory_stats()`` (``bytes_limit``, ``bytes_in_use``, ...), or ``{}`` where its backend keeps none
  (CPU)."""
  try:
    return dict(device.memory_stats() or {})
  except Exception:  # noqa: BLE001 (backends without memory stats raise different errors)
    return {}
