"""The cluster model: hosts of devices, the links inside and between them.

Devices are numbered host-major (host 0's devices first), the order
``jax.experimental.mesh_utils.create_hybrid_device_mesh(process_is_granule=True)``
uses, and every plan names devices by these global ids.

Cluster spec grammar (``Cluster.parse``)::

    spec   := group ("+" group)* (";" option)*
    group  := [HOSTS "x"] [DEVICES "x"] KIND ["@" LINK]
    option := "inter=" LINK | "intra=" LINK | "inter_latency=" TIME | "intra_latency=" TIME | "processes=" N

``2x8xV100-32GB`` is 2 hosts of 8 V100s; ``4xT4`` one host of 4 T4s; ``L4``
one host of one L4. ``LINK`` is a preset (``pcie``, ``pcie4``, ``nvlink``,
``nvlink3``, ``nvlink4``, ``xgmi``, ``ici``, ``host``) or a bandwidth
(``10.4Gbps``, ``12GB/s``). ``intra=`` sets every group's link unless the
group names its own with ``@``; without either, each kind gets its usual
link (NVLink for SXM parts, PCIe otherwise). The default network between
hosts is 25 Gbps with 20 µs latency. A host is one device kind: a machine
that mixes kinds is one host per kind, and ``processes=1`` says that one
process drives them all (otherwise each host is taken to be a process).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import tomllib
from pathlib import Path
from typing import Any, Sequence

from hetspmd.errors import InvalidValueError, UnknownNameError, closest
from hetspmd.hardware.devices import (LINK_PRESETS, DeviceSpec, Link, allocator_stats, link, mean_spec, parse_latency,
                                      preset_for_device_kind)
from hetspmd.hardware.calibration import PARTS
from hetspmd.hardware.efficiency import CHIPS
from hetspmd.hardware.profiler import Profile, alone_speedup, device_spec, measure_device_spec, process_machines

DEFAULT_INTER = "25Gbps"
DEFAULT_INTER_LATENCY = 20e-6

# Usual intra-host link per device kind.
_DEFAULT_INTRA = {
    "P100-16GB": "pcie3", "V100-16GB": "nvlink2", "V100-32GB": "nvlink2", "T4": "pcie3", "A10G": "pcie4",
    "L4": "pcie4", "A100-40GB": "nvlink3", "A100-80GB": "nvlink3", "H100-80GB": "nvlink4", "H200": "nvlink4",
    "RTX3090": "pcie4", "RTX-A6000": "pcie4", "P40": "pcie3", "RTX4090": "pcie4", "MI250X": "xgmi", "MI300X": "xgmi", "TPU-v4": "ici",
    "TPU-v5e": "ici", "cpu": "host",
}

CLUSTER_PRESETS: dict[str, str] = {
    # HAP (Zhang et al., EuroSys 2024; github ylxdzsw/hap readme.txt: "2 machines each equipped with 8 NVIDIA V100
    # GPUs and 6 machines each equipped with 8 NVIDIA P100 GPUs. The inter-machine bandwidth is about 10.4Gbps").
    # The V100s' memory size is not stated there; 32 GB is assumed
    "hap-v100-p100": "2x8xV100-32GB+6x8xP100-16GB;inter=10.4Gbps",
    # AMP (Li et al., NeurIPS 2022) as its code ran it (github DachengLi1/AMP src/het_cluster.py: "M = 4, N = 4";
    # nodes 0-2 "[10 * 1e9 / 32, 170 * 1e9 / 32]", node 3 "[50 * 1e9 / 32, 50 * 1e9 / 32]"; src/cost_het_cluster.py
    # weights "0.75 + 0.25"): three p3.8xlarge (4 V100-16GB on NVLink, 10 Gbps NIC) and one g4dn.12xlarge (4 T4,
    # 50 Gbps NIC). One link joins all hosts here: a ring over the four hosts runs at the slowest NIC, 10 Gbps.
    "amp-t4-v100": "3x4xV100-16GB+1x4xT4;inter=10Gbps",
    # the opposite mix (12 T4, 4 V100), which this preset named before it followed AMP's code
    "t4-heavy-v100": "3x4xT4+1x4xV100-16GB;inter=10Gbps",
    "a100-v100-mix": "1x8xA100-40GB+2x8xV100-32GB;inter=100Gbps",
    "h100-a100-l4-mix": "1x8xH100-80GB+1x8xA100-80GB+2x8xL4;inter=200Gbps",
    # Cephalo (Guo et al., 2024; github benson-guo/cephalo README: "a cluster of 4 GPUS: 2xL4, 1xA6000, 1xP40",
    # split_workload.py "--gpus l4 l4 a6000 p40"): one workstation. One device kind per host in
    # this model, so the kinds are hosts joined by the workstation's PCIe 3 (the P40's link bounds it)
    "cephalo-workstation": "2xL4+RTX-A6000+P40;inter=pcie3;processes=1",
    # homogeneous references
    "v100x16": "2x8xV100-32GB;inter=10.4Gbps",
    "p100x48": "6x8xP100-16GB;inter=10.4Gbps",
    # AMP's homogeneous run (src/homogeneous.py: 4 nodes of 4, every node "[50 * 1e9 / 32, 50 * 1e9 / 32]"; the
    # profiles it reads are known_cost/gpt2_G4_*: g4dn, T4)
    "t4x16": "4x4xT4;inter=50Gbps",
    "a100x8": "1x8xA100-80GB",
    "a100x64": "8x8xA100-80GB;inter=200Gbps",
    "h100x16": "2x8xH100-80GB;inter=400Gbps",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Host:
  """``count`` devices of one kind joined by ``intra``.

  ``alone_speedup``: how many times faster one device runs while the
  host's other devices are idle. 1 for devices with their own compute
  (GPUs, TPUs); CPU devices of one process share its cores, so one device
  alone runs up to ``count`` times faster (``hetspmd profile`` measures
  it), and devices that finish early leave their share to the others.
  """

  device: DeviceSpec
  count: int
  intra: Link
  alone_speedup: float = 1.0

  def __post_init__(self):
    if not isinstance(self.count, int) or self.count < 1:
      raise InvalidValueError(f"a host needs a positive device count, got {self.count!r} x {self.device.name}")
    if not 1.0 <= self.alone_speedup <= self.count:
      raise InvalidValueError(f"a host's alone_speedup must be between 1 and its device count ({self.count}), "
                              f"got {self.alone_speedup!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterDevice:
  """One device of a cluster: global id (host-major), host, index in host."""

  id: int
  host: int
  local: int
  spec: DeviceSpec


@dataclasses.dataclass(frozen=True, slots=True)
class Cluster:
  """Hosts of devices and the network between them.

  ``jax_device_ids`` maps cluster positions to real JAX device ids when the
  cluster describes (or emulates) devices this process can see; ``processes``
  how many JAX processes drive them, where known (else each host is taken to
  be one); ``device_processes`` each position's process, where the cluster was
  made from JAX's devices (else the planner derives it from ``processes``).
  """

  hosts: tuple[Host, ...]
  inter: Link = Link(DEFAULT_INTER, 25e9 / 8, DEFAULT_INTER_LATENCY)
  name: str = ""
  jax_device_ids: tuple[int, ...] | None = None
  processes: int | None = None
  calibration: Any = None  # a hetspmd.hardware.calibration.Calibration: the step's measured times per kind
  device_processes: tuple[int, ...] | None = None
  _devices: tuple | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

  def __post_init__(self):
    if not self.hosts:
      raise InvalidValueError("a cluster needs at least one host")
    if self.jax_device_ids is not None:
      ids = tuple(self.jax_device_ids)
      if len(ids) != self.num_devices:
        raise InvalidValueError(
            f"cluster has {self.num_devices} devices but {len(ids)} jax_device_ids were given")
      if len(set(ids)) != len(ids):
        raise InvalidValueError(f"jax_device_ids repeat a device: {ids}")
    if self.processes is not None and (not isinstance(self.processes, int) or isinstance(self.processes, bool)
                                       or not 1 <= self.processes <= self.num_devices):
      raise InvalidValueError(f"processes must be a whole number from 1 to the cluster's {self.num_devices} "
                              f"devices, got {self.processes!r}")
    if self.device_processes is not None and (len(self.device_processes) != self.num_devices or (
        self.processes is not None and len(set(self.device_processes)) != self.processes)):
      raise InvalidValueError(f"device_processes names each of the cluster's {self.num_devices} devices' process "
                              f"({self.processes} processes), got {self.device_processes!r}")

  def replace(self, **changes: Any) -> "Cluster":
    return dataclasses.replace(self, **changes)

  def calibrated(self, calibration: Any) -> "Cluster":
    """This cluster priced on ``calibration`` (a :class:`~hetspmd.hardware.calibration.Calibration`, or None to
    drop one): its kinds' compute takes the step's measured times (:mod:`hetspmd.hardware.calibration`)."""
    if calibration is not None:
      unknown = [k for k in calibration.kind_names if k not in self.kinds]
      if unknown:
        raise InvalidValueError(f"the calibration times kinds {unknown} that this cluster does not have "
                                f"(it has {', '.join(self.kinds)})")
    return dataclasses.replace(self, calibration=calibration)

  def pricing(self) -> list[str]:
    """One line per kind: what its compute is priced from (the step's measured times, a measured spec, or datasheet
    peaks at its chip's efficiencies or the datasheet's)."""
    lines = []
    for kind in self.kinds:
      spec, timing = self.spec_of(kind), self.calibration.of(kind) if self.calibration else None
      e = spec.efficiency
      if timing is not None and timing.part != "step":
        what = PARTS[timing.part]
        how = (f"{what} timed ({len(timing.points)} microbatch size(s)), its measured over predicted "
               "seconds scaling the whole microbatch")
      elif timing is not None:
        remats = self.calibration.remats(kind)
        how = (f"the step's measured times ({len(timing.points)} microbatch size(s); remat "
               f"{', '.join(remats)} timed)")
      elif spec.measured:
        how = "a measured spec (hetspmd profile)"
      else:
        whose = f"{spec.chip}'s fitted" if spec.chip in CHIPS else "the datasheet"
        how = (f"datasheet peaks at {whose} efficiencies (matrix {e.matrix:.2f}, vector {e.vector:.2f}, "
               f"memory {e.memory:.2f})")
      lines.append(f"{kind}: {how}")
    return lines

  # --- views -------------------------------------------------------------

  @property
  def num_devices(self) -> int:
    return sum(h.count for h in self.hosts)

  @property
  def devices(self) -> tuple[ClusterDevice, ...]:
    """Every device, by cluster position (made once per cluster: the search reads it per priced plan)."""
    if self._devices is None:
      out, gid = [], 0
      for h, host in enumerate(self.hosts):
        for local in range(host.count):
          out.append(ClusterDevice(gid, h, local, host.device))
          gid += 1
      object.__setattr__(self, "_devices", tuple(out))
    return self._devices

  @property
  def kinds(self) -> tuple[str, ...]:
    """Device kinds in order of first appearance."""
    return tuple(dict.fromkeys(h.device.name for h in self.hosts))

  @property
  def is_homogeneous(self) -> bool:
    return len(self.kinds) == 1

  def homogeneous_equivalent(self) -> "Cluster":
    """The same hosts, device counts and links, every device the pool's mean device
    (:func:`~hetspmd.hardware.devices.mean_spec`): what the pool would be without its differences."""
    mean = mean_spec([d.spec for d in self.devices])
    hosts = tuple(dataclasses.replace(h, device=mean) for h in self.hosts)
    return dataclasses.replace(self, hosts=hosts, name=f"homogeneous equivalent of {self}")

  def spec_of(self, kind: str) -> DeviceSpec:
    for host in self.hosts:
      if host.device.name == kind:
        return host.device
    raise UnknownNameError(f"no {kind!r} devices in this cluster; it has {', '.join(self.kinds)}")

  def describe(self) -> str:
    """A compact spec that :meth:`parse` reads back (for preset kinds)."""
    groups: list[list[Any]] = []
    for host in self.hosts:
      if groups and groups[-1][1] == host:
        groups[-1][0] += 1
      else:
        groups.append([1, host])
    parts = [f"{n}x{h.count}x{h.device.name}@{h.intra.name}" for n, h in groups]
    return "+".join(parts) + f";inter={self.inter.name}" + (
        f";processes={self.processes}" if self.processes is not None else "")

  def __str__(self) -> str:
    return self.name or self.describe()

  # --- constructors ------------------------------------------------------

  @classmethod
  def parse(cls, spec: str, devices: dict[str, DeviceSpec] | None = None, name: str = "") -> "Cluster":
    """Reads the compact grammar in this module's docstring."""
    return _parse(spec, devices or {}, name)

  @classmethod
  def preset(cls, name: str) -> "Cluster":
    """A named cluster from :data:`CLUSTER_PRESETS`."""
    if name not in CLUSTER_PRESETS:
      raise UnknownNameError(f"unknown cluster preset {name!r}; presets: {', '.join(CLUSTER_PRESETS)}."
                             f"{_did_you_mean(name, CLUSTER_PRESETS)}")
    return _parse(CLUSTER_PRESETS[name], {}, name)

  @classmethod
  def load(cls, path: str | Path) -> "Cluster":
    """Reads a cluster TOML file written by :meth:`save`."""
    path = Path(path)
    try:
      data = tomllib.loads(path.read_text())
    except FileNotFoundError:
      raise InvalidValueError(f"cluster file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
      raise InvalidValueError(f"cluster file {str(path)!r} is not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
      raise InvalidValueError(f"cannot read cluster file {str(path)!r}: {getattr(e, 'strerror', None) or e}") from None
    return from_dict(data, where=str(path))

  def save(self, path: str | Path) -> None:
    Path(path).write_text(to_toml(self))

  @classmethod
  def resolve(cls, text: str) -> "Cluster":
    """A preset name, a path to a TOML file, or a compact spec."""
    if not isinstance(text, (str, Path)):
      raise InvalidValueError(f"a cluster is a preset name, a cluster TOML file or a spec such as "
                              f"'4xV100-32GB+4xP100-16GB', got {text!r}")
    text = str(text)
    if text in CLUSTER_PRESETS:
      return cls.preset(text)
    if text.endswith(".toml") or Path(text).is_file():
      return cls.load(text)
    if Path(text).is_dir():
      raise InvalidValueError(f"cluster {text!r} is a folder: give a preset name, a cluster TOML file or a spec")
    try:
      return cls.parse(text)
    except (InvalidValueError, UnknownNameError) as e:
      if any(c in text for c in "+;@") or re.match(r"\s*\d+\s*x", text):
        raise  # a spec: its parse error points at the part that is wrong
      why = str(e).split(";")[0].split("\n")[0]
      raise UnknownNameError(
          f"{text!r} is neither a cluster preset, a cluster TOML file, nor a valid cluster spec ({why})."
          f"{_did_you_mean(text, CLUSTER_PRESETS)} Presets: {', '.join(CLUSTER_PRESETS)}; a spec reads like "
          "'4xV100-32GB+4xP100-16GB' (hetspmd search --help gives its grammar)") from None

  @classmethod
  def from_devices(cls, devices: Sequence[Any], inter: str = DEFAULT_INTER) -> "Cluster":
    """The cluster of real JAX devices: ``device_kind`` → preset, others measured.

    Devices are grouped into hosts by machine and then by kind. Where ``devices`` span processes, every
    process must call this (each process's host name is gathered from all: :func:`process_machines`): under
    one process per GPU, a machine's processes make one host, whose devices share its links.
    Kinds without a preset (``cpu`` included) are profiled once each. A
    preset's memory is capped at what the device's allocator may hand out
    (``memory_stats()["bytes_limit"]``: by default JAX preallocates 75% of a
    GPU, see ``XLA_PYTHON_CLIENT_MEM_FRACTION``), so plans fit the process
    that runs them.
    """
    # which processes share a machine, asked first: every process gets here, before any of them can fail
    machines = process_machines(devices) if len({getattr(d, "process_index", 0) for d in devices}) > 1 else None
    specs: dict[str, DeviceSpec] = {}
    kinds = []
    for d in devices:
      preset = preset_for_device_kind(getattr(d, "device_kind", ""))
      if preset is None:
        kind = "cpu" if d.platform == "cpu" else str(d.device_kind)
        if kind not in specs:
          specs[kind] = measure_device_spec(d, name=kind)
      else:
        kind = preset
        spec = specs.get(kind) or device_spec(kind)
        limit = _allocator_limit(d)
        if limit is not None and limit < spec.memory_bytes:
          spec = spec.replace(memory_bytes=limit)
        specs[kind] = spec
      kinds.append(kind)
    return _grouped(devices, kinds, specs, link(inter), name="local", machines=machines)

  @classmethod
  def from_profile(cls, profile: Profile) -> "Cluster":
    """The measured cluster of :func:`hetspmd.profile`'s result: a host per machine and kind (a machine's
    processes share its links: one process per GPU still makes one host; by process where the profile does not
    say), and the number of processes that measured it (so that group plans are priced on the path one process
    runs).

    Each kind's spec is the profile's (``measured=True``); each host records
    how much faster one device runs alone (:func:`~hetspmd.hardware.profiler.alone_speedup`);
    links come from the all-reduce fit, where there is one.
    """
    specs = {k: profile.device_spec(k) for k in dict.fromkeys(d.kind for d in profile.devices)}
    measured = profile.link("measured")
    known = all(d.machine >= 0 for d in profile.devices)
    machine = {d.id: d.machine if known else d.process for d in profile.devices}
    order = _host_order([d.process for d in profile.devices], [d.kind for d in profile.devices],
                        [machine[d.id] for d in profile.devices] if known else None, [d.id for d in profile.devices])
    ordered = [profile.devices[i] for i in order]
    hosts = []
    for (_, kind), group in itertools.groupby(ordered, key=lambda d: (machine[d.id], d.kind)):
      members = list(group)
      hosts.append(Host(specs[kind], len(members), measured or _default_intra(kind), alone_speedup(members)))
    ids = tuple(d.id for d in ordered)
    processes = tuple(d.process for d in ordered)
    if profile.process_count > 1 and measured is not None:
      return cls(tuple(hosts), measured, "profiled", ids, profile.process_count, device_processes=processes)
    return cls(tuple(hosts), name="profiled", jax_device_ids=ids, processes=profile.process_count,
               device_processes=processes)

  @classmethod
  def emulate(cls, devices: Sequence[Any], kinds: Sequence[str],
              custom: dict[str, DeviceSpec] | None = None, inter: Link | None = None) -> "Cluster":
    """Real devices (e.g. 8 emulated CPU devices) standing in for ``kinds``.

    Plans for the result run on ``devices``; costs use the virtual kinds, one
    per device (a bare string is refused: ``[kind] * len(devices)`` for one kind).
    Consecutive devices of one kind in one process form one virtual host.
    ``inter``: the link between virtual hosts (default the ``host`` preset,
    20 GB/s: one process's memory); processes joined by ``jax.distributed``
    over TCP (gloo on CPU) are better described by a measured link.
    """
    if isinstance(kinds, str):
      raise InvalidValueError(f"emulate(kinds=...) takes one kind per device, got the string {kinds!r}: for "
                              f"{len(list(devices))} devices of one kind pass kinds=[{kinds!r}] * "
                              f"{len(list(devices))}; for a spec use Cluster.resolve({kinds!r}) or "
                              f"parallelize(cluster={kinds!r})")
    devices, kinds = list(devices), list(kinds)
    if len(devices) != len(kinds):
      raise InvalidValueError(f"emulate() got {len(devices)} devices but {len(kinds)} kinds; give one kind per device")
    if inter is not None and not isinstance(inter, Link):
      raise InvalidValueError(f"emulate(inter=...) takes a Link (bandwidth bytes/s, latency s), got {inter!r}")
    specs = {k: device_spec(k, custom) for k in dict.fromkeys(kinds)}
    return _grouped(devices, kinds, specs, inter or LINK_PRESETS["host"], name="emulated",
                    intra=LINK_PRESETS["host"])


def _did_you_mean(name: str, names: Any) -> str:
  close = closest(name, names)
  return f" Did you mean {close!r}?" if close else ""


def _grouped(devices: Sequence[Any], kinds: Sequence[str], specs: dict[str, DeviceSpec], inter: Link, name: str, *,
             intra: Link | None = None, machines: Sequence[int] | None = None) -> Cluster:
  """``devices`` as hosts: consecutive devices of one kind in one process; or where ``machines`` (per process
  index, its machine) says which processes share a machine, each machine's devices of one kind, ordered by
  machine, kind (in order of first appearance), then process."""
  process = [getattr(d, "process_index", 0) for d in devices]
  machine = [machines[p] if machines is not None else p for p in process]
  order = _host_order(process, kinds, machine if machines is not None else None, range(len(devices)))
  hosts: list[Host] = []
  ids: list[int] = []
  previous = None
  for i in order:
    key = (machine[i], kinds[i])
    spec = specs.get(kinds[i]) or device_spec(kinds[i])
    if key == previous:
      hosts[-1] = dataclasses.replace(hosts[-1], count=hosts[-1].count + 1)
    else:
      hosts.append(Host(spec, 1, intra or _default_intra(spec.name)))
    previous = key
    ids.append(int(devices[i].id))
  return Cluster(tuple(hosts), inter, name, tuple(ids), len(set(process)),
                 device_processes=tuple(process[i] for i in order))


def _host_order(process: Sequence[int], kinds: Sequence[str], machine: Sequence[int] | None,
                tiebreak: Sequence[int]) -> list[int]:
  """The order of devices (given per device: their ``process``, ``kinds``, ``machine`` or None where not known,
  and a last ``tiebreak``) in which each host's devices come together: by machine, kind (in order of first
  appearance), then process; or, without machines, by process."""
  first = {k: i for i, k in reversed(list(enumerate(kinds)))}
  tiebreak = list(tiebreak)
  if machine is None:
    return sorted(range(len(process)), key=lambda i: (process[i], tiebreak[i]))
  return sorted(range(len(process)), key=lambda i: (machine[i], first[kinds[i]], process[i], tiebreak[i]))


def _allocator_limit(device: Any) -> int | None:
  """Bytes the device's allocator may hand out, where the backend says (``None`` otherwise)."""
  limit = allocator_stats(device).get("bytes_limit")
  return int(limit) if limit else None


def _default_intra(kind: str) -> Link:
  return LINK_PRESETS[_DEFAULT_INTRA.get(kind, "pcie")]


# --- the compact grammar ----------------------------------------------------

_GROUP = re.compile(r"^(?:(\d+)x)?(?:(\d+)x)?([A-Za-z][A-Za-z0-9._-]*)(?:@(\S+))?$")
_GROUP_FORM = "[HOSTSx][DEVICESx]KIND[@LINK], e.g. 2x8xV100-32GB or 4xT4@pcie"


def _spec_error(spec: str, token: str, position: int, why: str) -> InvalidValueError:
  marker = " " * position + "^" * max(1, len(token))
  return InvalidValueError(f"malformed cluster spec at {token!r}: {why}\n  {spec}\n  {marker}")


def _parse(spec: str, custom: dict[str, DeviceSpec], name: str) -> Cluster:
  if not isinstance(spec, str) or not spec.strip():
    raise InvalidValueError(f"a cluster spec is a non-empty string such as '2x8xV100-32GB+6x8xP100-16GB', got {spec!r}")
  head, *options = spec.split(";")
  settings, option_pos = {}, len(head) + 1
  for option in options:
    key, sep, value = option.partition("=")
    key = key.strip()
    if not sep or key not in ("inter", "intra", "inter_latency", "intra_latency", "processes") or not value.strip():
      raise _spec_error(spec, option, option_pos, "expected inter=LINK, intra=LINK, inter_latency=TIME, "
                        "intra_latency=TIME or processes=N")
    settings[key] = (value.strip(), option_pos)
    option_pos += len(option) + 1

  def option_value(key, parse):
    value, position = settings[key]
    try:
      return parse(value)
    except (InvalidValueError, UnknownNameError) as e:
      raise _spec_error(spec, value, position + len(key) + 1, str(e)) from None

  intra_latency = option_value("intra_latency", parse_latency) if "intra_latency" in settings else None
  inter_latency = option_value("inter_latency", parse_latency) if "inter_latency" in settings else None
  inter = option_value("inter", lambda v: link(v, inter_latency)) if "inter" in settings else link(
      DEFAULT_INTER, inter_latency)
  intra_all = option_value("intra", lambda v: link(v, intra_latency)) if "intra" in settings else None

  hosts: list[Host] = []
  position = 0
  for token in head.split("+"):
    hosts += _parse_group(spec, token, position, custom, intra_all, intra_latency)
    position += len(token) + 1
  processes = option_value("processes", _whole) if "processes" in settings else None
  try:
    return Cluster(tuple(hosts), inter, name, processes=processes)
  except InvalidValueError as e:
    raise _spec_error(spec, settings["processes"][0], settings["processes"][1] + len("processes="), str(e)) from None


def _whole(text: str) -> int:
  if not text.strip().isdigit():
    raise InvalidValueError(f"expected a whole number of processes, got {text!r}")
  return int(text)


def _parse_group(spec, token, position, custom, intra_all, intra_latency) -> list[Host]:
  match = _GROUP.match(token.strip())
  if match is None:
    raise _spec_error(spec, token, position, f"expected {_GROUP_FORM}")
  first, second, kind, link_name = match.groups()
  if second is None:
    n_hosts, per_host = 1, int(first or 1)
  else:
    n_hosts, per_host = int(first), int(second)
  if n_hosts < 1 or per_host < 1:
    raise _spec_error(spec, token, position, f"host and device counts must be positive, got {n_hosts} x {per_host}")
  try:
    device = device_spec(kind, custom)
    intra = link(link_name, intra_latency) if link_name else intra_all or _default_intra(device.name)
    if intra_latency is not None and not link_name and intra_all is None:
      intra = intra.replace(latency=intra_latency)
  except (UnknownNameError, InvalidValueError) as e:
    raise _spec_error(spec, token, position, str(e)) from None
  return [Host(device, per_host, intra) for _ in range(n_hosts)]


# --- TOML -------------------------------------------------------------------


def _toml_value(value: Any) -> str:
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, (int, float)):
    return repr(value)
  if isinstance(value, str):
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
  if isinstance(value, (list, tuple)):
    return "[" + ", ".join(_toml_value(v) for v in value) + "]"
  raise InvalidValueError(f"cannot write {value!r} (a {type(value).__name__}) to a cluster TOML file; "
                          "expected a bool, number, string, or list of them")


def _table(fields: dict[str, Any]) -> list[str]:
  return [f"{k} = {_toml_value(v)}" for k, v in fields.items()]


def to_toml(cluster: Cluster) -> str:
  """Exact TOML text of ``cluster``: every number written so it reads back equal."""
  lines = ["# hetspmd cluster: bandwidths in bytes/s, latencies in s, memory in bytes, FLOP/s"]
  top = {"name": cluster.name}
  if cluster.jax_device_ids is not None:
    top["jax_device_ids"] = list(cluster.jax_device_ids)
  if cluster.processes is not None:
    top["processes"] = cluster.processes
  if cluster.device_processes is not None:
    top["device_processes"] = list(cluster.device_processes)
  lines += _table(top)
  lines += ["", "[inter]"] + _table(dataclasses.asdict(cluster.inter))
  for host in cluster.hosts:
    fields = {"device": host.device.name, "count": host.count}
    if host.alone_speedup != 1.0:
      fields["alone_speedup"] = host.alone_speedup
    lines += ["", "[[hosts]]"] + _table(fields)
    lines += ["[hosts.intra]"] + _table(dataclasses.asdict(host.intra))
  for kind in cluster.kinds:
    spec = {k: v for k, v in dataclasses.asdict(cluster.spec_of(kind)).items() if v is not None}
    del spec["name"]
    lines += ["", f"[devices.{_toml_value(kind)}]"] + _table(spec)
  return "\n".join(lines) + "\n"


def _need(table: dict[str, Any], key: str, where: str) -> Any:
  if key not in table:
    raise InvalidValueError(f"{where}: missing key {key!r}")
  return table[key]


def _link_from(table: Any, where: str) -> Link:
  if isinstance(table, str):
    return link(table)
  if not isinstance(table, dict):
    raise InvalidValueError(f"{where}: expected a link name or a table with bandwidth and latency, got {table!r}")
  return Link(str(table.get("name", "custom")), float(_need(table, "bandwidth", where)),
              float(table.get("latency", DEFAULT_INTER_LATENCY)))


def from_dict(data: dict[str, Any], where: str = "cluster") -> Cluster:
  """A cluster from parsed TOML (the layout written by :func:`to_toml`)."""
  custom = {}
  for kind, fields in data.get("devices", {}).items():
    try:
      custom[kind] = DeviceSpec(kind, **fields)
    except TypeError as e:
      known = [f.name for f in dataclasses.fields(DeviceSpec) if f.name != "name"]
      unknown = sorted(set(fields) - set(known))
      if unknown:
        raise InvalidValueError(f"{where}: [devices.{kind!r}] has unknown keys {unknown}; known: {', '.join(known)}") from None
      raise InvalidValueError(
          f"{where}: [devices.{kind!r}] needs fp32_flops, bf16_flops, memory_bytes, memory_bandwidth ({e})") from None
  hosts = []
  for i, table in enumerate(_need(data, "hosts", where)):
    kind = _need(table, "device", f"{where} hosts[{i}]")
    device = device_spec(kind, custom)
    intra = _link_from(table["intra"], f"{where} hosts[{i}].intra") if "intra" in table else _default_intra(kind)
    hosts.append(Host(device, _need(table, "count", f"{where} hosts[{i}]"), intra,
                      float(table.get("alone_speedup", 1.0))))
  inter = _link_from(data["inter"], f"{where} [inter]") if "inter" in data else link(DEFAULT_INTER)
  ids = data.get("jax_device_ids")
  try:
    every = data.get("device_processes")
    return Cluster(tuple(hosts), inter, str(data.get("name", "")), tuple(ids) if ids is not None else None,
                   data.get("processes"), device_processes=tuple(every) if every is not None else None)
  except InvalidValueError as e:
    raise InvalidValueError(f"{where}: {e}") from None
