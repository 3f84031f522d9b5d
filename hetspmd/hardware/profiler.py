"""Measure the devices that are actually here: compute, memory, collectives.

``profile(devices)`` measures, on whatever backend is present:

* per device, matmul throughput at several sizes in float32 (at full
  precision and, on accelerators, at JAX's default: TF32 on NVIDIA GPUs)
  and bfloat16, once with the device alone and once with every device busy
  at once (as in a training step);
* per device, memory copy bandwidth (read + write of one large array),
  alone and with every device copying at once (the busy figure is the
  spec's bandwidth: on CPU emulation the devices share one memory bus);
* over the devices as one mesh axis (or each axis of a given ``HetMesh``),
  all-reduce, all-gather and reduce-scatter time over message sizes, fitted
  to ``time = alpha + bytes * beta`` (non-negative least squares) next to a
  piecewise-linear table made monotone in size.

A :class:`Profile` gives the numbers as values: a measured ``DeviceSpec``
per kind (``measured=True``, peak = best busy throughput), a ``Link`` from
the all-reduce fit, and how much faster a device runs alone
(:func:`alone_speedup`: CPU devices of one process share its cores);
:meth:`hetspmd.Cluster.from_profile` builds the cluster from them. This
module knows nothing of clusters. With ``jax.distributed`` initialised,
every process measures its own devices and the results are gathered, so
every process returns the same profile.

:func:`device_spec` is the spec of a device kind by name: a preset, or
for ``cpu`` this machine's CPU, measured once per process.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import socket
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

from hetspmd.errors import UnknownNameError
from hetspmd.hardware.devices import (DeviceSpec, Link, allocator_stats, preset_for_device_kind, preset_spec,
                                      unknown_device_error)

_MATMUL_SIZES = {"cpu": (128, 256, 512), "default": (1024, 2048, 4096)}
_COPY_BYTES = {"cpu": 32 * 2**20, "default": 512 * 2**20}
_CACHE_PROBE_BYTES = 2**20  # at most; half the private cache when that is smaller
_MESSAGE_BYTES = tuple(4**k * 1024 for k in range(0, 7))  # 1 KiB .. 4 MiB per device
_DTYPES = ("float32", "bfloat16")
# Matmul tables: "float32" at full precision (HIGHEST), "bfloat16", and on accelerators "float32_reduced":
# float32 at JAX's default precision (TF32 on NVIDIA GPUs, one bfloat16 pass on TPUs; the same as full on CPUs)
REDUCED_F32 = "float32_reduced"
_PRECISION = {"float32": "highest", "bfloat16": None, REDUCED_F32: None}
_DTYPE_OF = {"float32": "float32", "bfloat16": "bfloat16", REDUCED_F32: "float32"}


def _reduced_f32(reduced: float, full: float) -> float | None:
  """The default-precision float32 matmul rate, where it is a faster path than full float32 (not noise)."""
  return reduced if reduced > 1.1 * full else None


def _tables(platform_key: str) -> tuple[str, ...]:
  return _DTYPES if platform_key == "cpu" else _DTYPES + (REDUCED_F32,)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceMeasurement:
  id: int
  kind: str
  process: int
  alone_flops: dict[str, tuple[tuple[int, float], ...]]  # dtype → ((size, FLOP/s), ...)
  busy_flops: dict[str, tuple[tuple[int, float], ...]]
  copy_bandwidth: float  # bytes/s, alone
  memory_bytes: int
  busy_copy_bandwidth: float = 0.0  # bytes/s per device, every device copying at once (0: not measured)
  busy_read_bandwidth: float = 0.0  # bytes/s per device, every device summing an array at once (0: not measured)
  cache_bytes: int = 0  # a core's private cache (CPU; 0: not known)
  busy_cache_write_bandwidth: float = 0.0  # bytes/s per device into a cache-sized value in a loop (0: not measured)
  machine: int = -1  # the machine its process runs on (process_machines: its processes share links); -1: not known

  @property
  def bandwidth(self) -> float:
    """Memory bandwidth as in a training step: every device busy at once."""
    return self.busy_copy_bandwidth or self.copy_bandwidth

  def peak(self, dtype: str, busy: bool = True) -> float:
    table = (self.busy_flops if busy else self.alone_flops)[dtype]
    return max(rate for _, rate in table)


@dataclasses.dataclass(frozen=True, slots=True)
class CollectiveFit:
  """Time of one collective over one group size, fitted and tabulated."""

  op: str
  axis: str
  group_size: int
  sizes: tuple[int, ...]      # bytes per device
  seconds: tuple[float, ...]  # monotone non-decreasing in size
  alpha: float                # s
  beta: float                 # s per byte

  def predict(self, nbytes: float) -> float:
    """Piecewise-linear in the table; the α–β line beyond it."""
    if nbytes >= self.sizes[-1]:
      return max(self.seconds[-1], self.alpha + self.beta * nbytes)
    return float(np.interp(nbytes, self.sizes, self.seconds))


@dataclasses.dataclass(frozen=True, slots=True)
class Profile:
  devices: tuple[DeviceMeasurement, ...]
  collectives: tuple[CollectiveFit, ...]
  backend: str
  process_count: int
  seconds: float

  def fit(self, op: str, axis: str | None = None) -> CollectiveFit:
    for f in self.collectives:
      if f.op == op and (axis is None or f.axis == axis):
        return f
    measured = ", ".join(f"{f.op} over {f.axis!r}" for f in self.collectives) or "none"
    raise UnknownNameError(f"no {op} measured{' over ' + repr(axis) if axis else ''}; measured: {measured}")

  def device_spec(self, kind: str) -> DeviceSpec:
    members = [d for d in self.devices if d.kind == kind]
    return DeviceSpec(
        name=kind,
        fp32_flops=min(d.peak("float32") for d in members),
        bf16_flops=min(d.peak("bfloat16") for d in members),
        reduced_f32_flops=_kind_reduced_f32(members),
        memory_bytes=min(d.memory_bytes for d in members),
        memory_bandwidth=min(d.bandwidth for d in members),
        measured=True,
        read_bandwidth=_kind_read_bandwidth(members),
        **_kind_cache(members),
    )

  def link(self, name: str) -> Link | None:
    """A link from the all-reduce fit (ring: 2(p-1)/p bytes moved per byte)."""
    try:
      fit = self.fit("all_reduce")
    except UnknownNameError:
      return None
    p = fit.group_size
    if p < 2 or fit.beta <= 0:
      return None
    return Link(name, (2 * (p - 1) / p) / fit.beta, fit.alpha / (2 * (p - 1)))

  def to_json(self) -> dict[str, Any]:
    return {
        "backend": self.backend,
        "process_count": self.process_count,
        "seconds": self.seconds,
        "devices": [dataclasses.asdict(d) for d in self.devices],
        "collectives": [dataclasses.asdict(c) for c in self.collectives],
    }


# Below this ratio of alone to busy matmul throughput, devices are taken as
# independent (measurement noise); above it they share compute.
SHARED_COMPUTE_RATIO = 1.5


def alone_speedup(devices: Sequence[DeviceMeasurement]) -> float:
  """How much faster one of ``devices`` runs alone than with all of them busy (1: independent)."""
  ratio = min(d.peak("float32", busy=False) / d.peak("float32") for d in devices)
  return 1.0 if ratio < SHARED_COMPUTE_RATIO else float(min(ratio, len(devices)))


# --- progress ---------------------------------------------------------------


class _Progress:
  """One status line on stderr (redrawn on a terminal, a line per step otherwise)."""

  def __init__(self, total: int, enabled: bool):
    self.total, self.done, self.enabled = total, 0, enabled
    self.tty = enabled and sys.stderr.isatty()
    self.start = time.perf_counter()

  def step(self, message: str) -> None:
    self.done += 1
    if not self.enabled:
      return
    line = f"[{self.done:>3}/{self.total}] {time.perf_counter() - self.start:5.1f}s  {message}"
    if self.tty:
      sys.stderr.write("\r" + line.ljust(78)[:78])
      if self.done == self.total:
        sys.stderr.write("\n")
    else:
      sys.stderr.write(line + "\n")
    sys.stderr.flush()


# --- timing -----------------------------------------------------------------


# Shortest time one sample runs: a single call of a small kernel can fit in one
# scheduler time slice and miss that the device is shared (another process on
# the same core, a GPU under MPS), so a sample repeats the call until it lasts
# this long and the rate is averaged over the window.
MIN_SAMPLE_SECONDS = 0.01


def _median_seconds(fn: Callable[[], Any], repeats: int = 5, min_seconds: float = MIN_SAMPLE_SECONDS) -> float:
  """Median seconds per call, each sample averaging back-to-back calls over at least ``min_seconds``."""
  import jax

  jax.block_until_ready(fn())  # compile and warm up
  start = time.perf_counter()
  jax.block_until_ready(fn())
  calls = max(1, math.ceil(min_seconds / max(time.perf_counter() - start, 1e-9)))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):  # one at a time: several collectives in flight can deadlock XLA's CPU rendezvous
      jax.block_until_ready(fn())
    times.append((time.perf_counter() - start) / calls)
  return statistics.median(times)


def _platform_key(device: Any) -> str:
  return "cpu" if device.platform == "cpu" else "default"


def first_cpu_device():
  import jax

  return jax.devices("cpu")[0]


def _memory_bytes(device: Any) -> int:
  stats = allocator_stats(device)
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  import jax

  total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  local = max(1, len([d for d in jax.local_devices() if d.platform == device.platform]))
  return int(total // local)


def matmul_flops(device: Any, size: int, dtype: str) -> float:
  """FLOP/s of one ``size``-square matmul on ``device`` alone; ``dtype``: a matmul table (see ``_PRECISION``)."""
  import jax
  import jax.numpy as jnp

  a = jax.device_put(jnp.ones((size, size), _DTYPE_OF[dtype]), device)
  f = jax.jit(lambda x: jnp.matmul(x, x, precision=_PRECISION[dtype]))
  return 2.0 * size**3 / _median_seconds(lambda: f(a))


def _busy_seconds(devices: Sequence[Any], fn: Callable[[Any], Any], shape: tuple[int, ...], dtype: str) -> float:
  """Median seconds of ``fn`` run by every device at once on its own ``shape`` array of ones."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  mesh = Mesh(np.asarray(devices, dtype=object), ("d",))
  x = jax.device_put(jnp.ones((len(devices) * shape[0],) + shape[1:], dtype), NamedSharding(mesh, P("d")))
  f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
  return _median_seconds(lambda: f(x))


def busy_matmul_flops(devices: Sequence[Any], size: int, dtype: str) -> float:
  """Per-device FLOP/s with every device running its own matmul at once; ``dtype``: a matmul table."""
  import jax.numpy as jnp

  precision = _PRECISION[dtype]
  return 2.0 * size**3 / _busy_seconds(devices, lambda b: jnp.matmul(b, b.T, precision=precision), (size, size),
                                       _DTYPE_OF[dtype])


def copy_bandwidth(device: Any, nbytes: int) -> float:
  import jax
  import jax.numpy as jnp

  x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), device)
  f = jax.jit(lambda v: v + 1.0)
  return 2.0 * nbytes / _median_seconds(lambda: f(x))


def read_bandwidth(device: Any, nbytes: int) -> float:
  """Bytes/s of a read-only pass (a sum) over ``nbytes`` on ``device`` alone."""
  import jax
  import jax.numpy as jnp

  x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), device)
  f = jax.jit(jnp.sum)
  return nbytes / _median_seconds(lambda: f(x))


def busy_copy_bandwidth(devices: Sequence[Any], nbytes: int) -> float:
  """Per-device copy bandwidth with every device copying its own array at once."""
  return 2.0 * nbytes / _busy_seconds(devices, lambda v: v + 1.0, (nbytes // 4,), "float32")


def busy_read_bandwidth(devices: Sequence[Any], nbytes: int) -> float:
  """Per-device read bandwidth with every device summing its own array at once."""
  import jax.numpy as jnp

  return nbytes / _busy_seconds(devices, lambda v: jnp.sum(v, keepdims=True), (nbytes // 4,), "float32")


def _kind_reduced_f32(members: Sequence[DeviceMeasurement]) -> float | None:
  """The float32 matmul rate at JAX's default precision, where measured on every member and faster than full."""
  if not all(REDUCED_F32 in d.busy_flops for d in members):
    return None
  return _reduced_f32(min(d.peak(REDUCED_F32) for d in members), min(d.peak("float32") for d in members))


def _kind_read_bandwidth(members: Sequence[DeviceMeasurement]) -> float | None:
  """The kind's read bandwidth for :class:`DeviceSpec`; ``None`` when unmeasured or not above the copy rate."""
  if not all(d.busy_read_bandwidth for d in members):
    return None
  read = min(d.busy_read_bandwidth for d in members)
  return read if read > min(d.bandwidth for d in members) else None


def _kind_cache(members: Sequence[DeviceMeasurement]) -> dict[str, Any]:
  """``cache_bytes`` and ``cache_write_bandwidth`` for :class:`DeviceSpec`; empty unless measured on every member."""
  if not all(d.cache_bytes and d.busy_cache_write_bandwidth for d in members):
    return {}
  return {"cache_bytes": min(d.cache_bytes for d in members),
          "cache_write_bandwidth": min(d.busy_cache_write_bandwidth for d in members)}


def private_cache_bytes(cpu: str = "/sys/devices/system/cpu/cpu0") -> int:
  """Bytes of the largest data cache that one core of this CPU has to itself (Linux sysfs); 0 when unknown.

  A cache is private when the CPUs sharing it are the core's own hardware
  threads (``topology/thread_siblings_list``).
  """
  def read(*parts: str) -> str:
    with open(os.path.join(cpu, *parts)) as f:
      return f.read().strip()

  try:
    siblings = read("topology", "thread_siblings_list")
    entries = sorted(os.listdir(os.path.join(cpu, "cache")))
  except OSError:
    return 0
  best = 0
  for entry in entries:
    try:
      kind, size, shared = read("cache", entry, "type"), read("cache", entry, "size"), read("cache", entry, "shared_cpu_list")
    except OSError:
      continue
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
    digits = size[:-1] if scale > 1 else size
    if kind != "Instruction" and shared == siblings and digits.isdigit():
      best = max(best, int(digits) * scale)
  return best


# Rows of the rank-k update that probes the cache write rate, and its k.
_CACHE_PROBE_COLUMNS, _CACHE_PROBE_RANK = 512, 4


def busy_cache_write_bandwidth(devices: Sequence[Any], nbytes: int, iterations: int = 8, rounds: int = 3) -> float:
  """Per-device bytes/s written into an ``nbytes`` value that stays in cache, every device at once.

  Each device runs a loop of rank-4 updates of one float32 matrix (the
  shape of a weight gradient at a small microbatch) that it carries from
  one iteration to the next, so the matrix's memory is touched before the
  timed iterations: the output's bytes over the time of one iteration
  (the difference between ``2 × iterations`` and ``iterations``), the
  median over ``rounds`` such differences (one alone varied by nearly 2x
  between runs on a busy 2-core machine).
  """
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  columns = _CACHE_PROBE_COLUMNS
  rows = max(1, nbytes // 4 // columns)
  mesh = Mesh(np.asarray(devices, dtype=object), ("d",))
  acc = jax.device_put(jnp.zeros((len(devices) * rows, columns), jnp.float32), NamedSharding(mesh, P("d")))
  a = jnp.full((_CACHE_PROBE_RANK, rows), 1e-3, jnp.float32)
  b = jnp.ones((_CACHE_PROBE_RANK, columns), jnp.float32)

  def program(count):
    def body(i, m):
      return m + jax.lax.dot_general(a * i.astype(jnp.float32), b, (((0,), (0,)), ((), ())))
    return jax.jit(jax.shard_map(lambda m: jax.lax.fori_loop(0, count, body, m), mesh=mesh, in_specs=P("d"),
                                 out_specs=P("d")))

  short, long = program(iterations), program(2 * iterations)
  seconds = statistics.median(_median_seconds(lambda: long(acc)) - _median_seconds(lambda: short(acc))
                              for _ in range(rounds)) / iterations
  return rows * columns * 4 / seconds if seconds > 0 else 0.0


def measure_device_spec(device: Any, name: str) -> DeviceSpec:
  """A quick spec of one device alone (for kinds without a preset)."""
  key = _platform_key(device)
  size = _MATMUL_SIZES[key][-1]
  copy, read = copy_bandwidth(device, _COPY_BYTES[key]), read_bandwidth(device, _COPY_BYTES[key])
  fp32 = matmul_flops(device, size, "float32")
  reduced = matmul_flops(device, size, REDUCED_F32) if key != "cpu" else 0.0
  return DeviceSpec(
      name=name,
      fp32_flops=fp32,
      bf16_flops=matmul_flops(device, size, "bfloat16"),
      reduced_f32_flops=_reduced_f32(reduced, fp32),
      memory_bytes=_memory_bytes(device),
      memory_bandwidth=copy,
      measured=True,
      read_bandwidth=read if read > copy else None,
  )


def device_spec(name: str, custom: dict[str, DeviceSpec] | None = None) -> DeviceSpec:
  """The spec of kind ``name``: ``custom`` first, then presets, then ``cpu`` (measured)."""
  spec = preset_spec(name, custom)
  if spec is not None:
    return spec
  if name.lower() == "cpu":
    return measured_cpu_spec()
  raise unknown_device_error(name)


@functools.cache
def measured_cpu_spec() -> DeviceSpec:
  """This machine's CPU, measured once per process (about a second)."""
  return measure_device_spec(first_cpu_device(), name="cpu")


def collective_seconds(devices: Sequence[Any], op: str, nbytes: int) -> float:
  """Median time of ``op`` over ``devices`` with ``nbytes`` per device."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  n = len(devices)
  mesh = Mesh(np.asarray(devices, dtype=object), ("x",))
  per_device = max(n, nbytes // 4 // n * n)  # divisible for reduce-scatter
  x = jax.device_put(jnp.ones((n * per_device,), jnp.float32), NamedSharding(mesh, P("x")))
  body = {
      "all_reduce": lambda v: jax.lax.psum(v, "x"),
      "all_gather": lambda v: jax.lax.all_gather(v, "x", tiled=True),
      "reduce_scatter": lambda v: jax.lax.psum_scatter(v, "x", tiled=True),
  }[op]
  out_spec = P() if op == "all_gather" else P("x")
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=out_spec, check_vma=False))
  # One call per sample: every process must run the same number of collectives
  # (a window sized by each process's own timing would not agree).
  return _median_seconds(lambda: f(x), repeats=5, min_seconds=0.0)


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
  """Non-negative least squares fit of ``seconds = alpha + beta * size``."""
  from scipy.optimize import nnls

  a = np.stack([np.ones(len(sizes)), np.asarray(sizes, float)], axis=1)
  scale = np.array([1.0, 1.0 / max(sizes)])
  solution, _ = nnls(a * scale, np.asarray(seconds, float))
  alpha, beta = solution * scale
  return float(alpha), float(beta)


def measured_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
  """:func:`fit_alpha_beta` of timed collectives, whose bandwidth is never infinite.

  Where noise swamps the bytes (times flat or falling in size, so the fitted
  slope explains under 1% of the longest time), the bandwidth is bounded
  below by the largest message over the longest time and the latency is the
  shortest time: the line beyond the table still grows, and the link is
  still priced.
  """
  alpha, beta = fit_alpha_beta(sizes, seconds)
  if beta * max(sizes) >= 0.01 * max(seconds):
    return alpha, beta
  return float(min(seconds)), float(max(seconds)) / float(max(sizes))


def _fit_collective(devices, op, axis, sizes, progress) -> CollectiveFit:
  times = []
  for nbytes in sizes:
    times.append(collective_seconds(devices, op, nbytes))
    progress.step(f"{op} {nbytes // 1024} KiB over {len(devices)} devices ({axis})")
  monotone = tuple(float(t) for t in np.maximum.accumulate(times))
  alpha, beta = measured_alpha_beta(sizes, times)
  return CollectiveFit(op, axis, len(devices), tuple(sizes), monotone, alpha, beta)


def _axis_groups(devices: Sequence[Any], mesh) -> list[tuple[str, list[Any]]]:
  """(axis name, devices of the first group along it) for each mesh axis."""
  if mesh is None:
    return [("all", list(devices))] if len(devices) > 1 else []
  grid = np.asarray(mesh.device_grid())
  by_id = {d.id: d for d in devices}
  ids = mesh.cluster.jax_device_ids or tuple(range(len(devices)))
  out = []
  for axis, name in enumerate(mesh.axis_names):
    if mesh.shape[axis] < 2:
      continue
    first = np.moveaxis(grid, axis, 0).reshape(mesh.shape[axis], -1)[:, 0]
    out.append((name, [by_id[ids[int(i)]] for i in first]))
  return out


def profile(devices: Sequence[Any] | None = None, *, mesh=None, message_bytes: Sequence[int] = _MESSAGE_BYTES,
            progress: bool = True) -> Profile:
  """Measures ``devices`` (default: every JAX device) and returns a :class:`Profile`.

  Args:
    devices: JAX devices to measure; with several processes, each process
      measures the ones it can address and the results are gathered.
    mesh: optional :class:`hetspmd.HetMesh` whose axes the collectives are
      measured over; by default one axis over all devices.
    message_bytes: per-device message sizes for the collectives.
    progress: print a status line to stderr while measuring.
  """
  import jax

  start = time.perf_counter()
  devices = list(jax.devices() if devices is None else devices)
  machines = process_machines(devices)  # a collective: first, before anything one process alone could fail in
  local = [d for d in devices if d.process_index == jax.process_index()]
  key = _platform_key(local[0])
  sizes = _MATMUL_SIZES[key]
  groups = _axis_groups(devices, mesh)
  tables = _tables(key)
  total = len(local) * len(sizes) * len(tables) + len(sizes) * len(tables) + len(local) + 3
  total += len(groups) * len(COLLECTIVES) * len(message_bytes)
  bar = _Progress(total, progress)

  busy: dict[str, list[tuple[int, float]]] = {dt: [] for dt in tables}
  for dtype in tables:
    for size in sizes:
      busy[dtype].append((size, busy_matmul_flops(local, size, dtype)))
      bar.step(f"matmul {dtype} {size} on {len(local)} devices at once")
  busy_bandwidth = busy_copy_bandwidth(local, _COPY_BYTES[key])
  bar.step(f"memory copy on {len(local)} devices at once")
  busy_read = busy_read_bandwidth(local, _COPY_BYTES[key])
  bar.step(f"memory read on {len(local)} devices at once")
  cache = private_cache_bytes() if key == "cpu" else 0
  cache_write = busy_cache_write_bandwidth(local, min(cache // 2, _CACHE_PROBE_BYTES)) if cache else 0.0
  bar.step(f"cache writes on {len(local)} devices at once")
  measurements = []
  for d in local:
    alone = {}
    for dtype in tables:
      alone[dtype] = []
      for size in sizes:
        alone[dtype].append((size, matmul_flops(d, size, dtype)))
        bar.step(f"matmul {dtype} {size} on device {d.id} alone")
    bandwidth = copy_bandwidth(d, _COPY_BYTES[key])
    bar.step(f"memory copy on device {d.id}")
    measurements.append(DeviceMeasurement(
        d.id, _kind_name(d), d.process_index, {k: tuple(v) for k, v in alone.items()},
        {k: tuple(v) for k, v in busy.items()}, bandwidth, _memory_bytes(d), busy_bandwidth, busy_read, cache,
        cache_write, machines[d.process_index]))
  fits = tuple(_fit_collective(g, op, axis, tuple(message_bytes), bar) for axis, g in groups for op in COLLECTIVES)
  measurements = _gather_across_processes(measurements)
  return Profile(tuple(measurements), fits, local[0].platform, jax.process_count(), time.perf_counter() - start)


def _kind_name(device: Any) -> str:
  if device.platform == "cpu":
    return "cpu"
  return preset_for_device_kind(device.device_kind) or str(device.device_kind)


def process_machines(devices: Sequence[Any]) -> tuple[int, ...]:
  """Per JAX process (by index), the machine it runs on, numbered in order of first appearance: each process's
  host name (:func:`hostname`), gathered from every process (a collective: every process calls it). Under one
  process per GPU, the processes of one machine share its links. Where processes hold different numbers of
  ``devices`` (JAX's gather needs equal ones), each process is taken for a machine of its own."""
  import jax

  counts = {}
  for d in devices:
    counts[d.process_index] = counts.get(d.process_index, 0) + 1
  if jax.process_count() == 1 or len(set(counts.values())) > 1:
    return tuple(range(jax.process_count()))
  from jax.experimental import multihost_utils

  digest = np.frombuffer(hashlib.sha256(hostname().encode()).digest()[:8], np.int64)
  every = np.asarray(multihost_utils.process_allgather(digest)).ravel().tolist()
  first: dict[int, int] = {}
  return tuple(first.setdefault(h, len(first)) for h in every)


def hostname() -> str:
  """This process's machine, as :func:`process_machines` tells machines apart."""
  return socket.gethostname()


def _gather_across_processes(local: list[DeviceMeasurement]) -> list[DeviceMeasurement]:
  import jax

  if jax.process_count() == 1:
    return local
  from jax.experimental import multihost_utils

  payload = json.dumps([dataclasses.asdict(m) for m in local]).encode()
  width = int(np.max(multihost_utils.process_allgather(np.array([len(payload)]))))
  buffer = np.zeros(width, np.uint8)
  buffer[:len(payload)] = np.frombuffer(payload, np.uint8)
  gathered = multihost_utils.process_allgather(buffer)
  out = []
  for row in np.asarray(gathered).reshape(jax.process_count(), width):
    for item in json.loads(bytes(row).rstrip(b"\0").decode()):
      for field in ("alone_flops", "busy_flops"):
        item[field] = {k: tuple(tuple(p) for p in v) for k, v in item[field].items()}
      out.append(DeviceMeasurement(**item))
  return sorted(out, key=lambda m: m.id)
