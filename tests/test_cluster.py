"""Cluster model: presets, the compact grammar, TOML round trips, bad input."""

import dataclasses

import jax
import pytest

import hetspmd
from hetspmd import Cluster, DeviceSpec
from hetspmd.hardware.cluster import CLUSTER_PRESETS
from hetspmd.hardware.devices import DEVICE_PRESETS, GB, GiB, parse_bandwidth, parse_latency, preset_for_device_kind

REQUIRED_KINDS = ["P100-16GB", "V100-16GB", "V100-32GB", "T4", "A10G", "L4", "A100-40GB", "A100-80GB", "H100-80GB",
                  "H200", "RTX3090", "RTX4090", "MI250X", "MI300X", "TPU-v4", "TPU-v5e"]


@pytest.mark.parametrize("kind", REQUIRED_KINDS)
def test_device_presets_exist_and_are_positive(kind):
  spec = DEVICE_PRESETS[kind]
  assert spec.fp32_flops > 0 and spec.bf16_flops >= spec.fp32_flops
  assert spec.memory_bytes > 0 and spec.memory_bandwidth > 0 and not spec.measured


def test_preset_sanity_against_datasheets():
  v100, p100 = DEVICE_PRESETS["V100-32GB"], DEVICE_PRESETS["P100-16GB"]
  assert v100.fp32_flops > p100.fp32_flops and v100.bf16_flops > p100.bf16_flops
  assert v100.memory_bytes == 32 * GiB and p100.memory_bytes == 16 * GiB
  assert DEVICE_PRESETS["V100-16GB"].memory_bytes == 16 * GiB
  assert DEVICE_PRESETS["A100-80GB"].memory_bandwidth > DEVICE_PRESETS["A100-40GB"].memory_bandwidth
  assert DEVICE_PRESETS["H100-80GB"].bf16_flops > DEVICE_PRESETS["A100-80GB"].bf16_flops > DEVICE_PRESETS["L4"].bf16_flops


def test_a_workstation_that_mixes_kinds():
  """Cephalo's workstation (2 L4, an RTX A6000, a P40): the preset, the spec and its TOML agree. Pascal's P40
  computes float16 dots with float32 accumulation at its float32 rate (not GP102's 1/64 fp16 arithmetic); the
  A6000 has twice an L4's memory."""
  cluster = Cluster.preset("cephalo-workstation")
  assert [d.spec.name for d in cluster.devices] == ["L4", "L4", "RTX-A6000", "P40"]
  assert cluster.inter.name == "pcie3" and Cluster.parse(cluster.describe()).devices == cluster.devices
  p40, a6000 = DEVICE_PRESETS["P40"], DEVICE_PRESETS["RTX-A6000"]
  assert p40.peak_flops("float16") == p40.peak_flops("bfloat16") == p40.fp32_flops and p40.memory_bytes == 24 * GiB
  assert a6000.memory_bytes == 2 * DEVICE_PRESETS["L4"].memory_bytes and a6000.bf16_flops > a6000.fp32_flops


def test_half_precision_before_ampere_is_priced_as_xla_runs_it():
  """No preset is slower in reduced precision than in float32; before Ampere a bfloat16 dot runs at the float32
  rate, a float16 dot on the tensor cores (Volta, Turing) or at the float32 rate (Pascal); from Ampere on the
  two are one rate."""
  for spec in DEVICE_PRESETS.values():
    assert min(spec.peak_flops("float16"), spec.peak_flops("bfloat16")) >= spec.fp32_flops, spec.name
  for kind, fp16 in (("V100-16GB", 125e12), ("V100-32GB", 125e12), ("T4", 65e12), ("P100-16GB", 9.3e12)):
    spec = DEVICE_PRESETS[kind]
    assert spec.peak_flops("bfloat16") == spec.fp32_flops and spec.peak_flops("float16") == pytest.approx(fp16)
  a100 = DEVICE_PRESETS["A100-80GB"]
  assert a100.peak_flops("float16") == a100.peak_flops("bfloat16") == 312e12
  plain = {k: DEVICE_PRESETS[k].replace(chip=None) for k in ("T4", "A100-80GB")}
  mixed = hetspmd.hardware.devices.mean_spec(list(plain.values()))
  assert mixed.float16_flops == pytest.approx((65e12 + 312e12) / 2) and mixed.bf16_flops == pytest.approx(
      (8.1e12 + 312e12) / 2)


def test_cpu_spec_is_measured():
  spec = hetspmd.hardware.device_spec("cpu")
  assert spec.measured and spec.fp32_flops > 1e8 and spec.memory_bandwidth > 1e7
  # a read rate is kept only where reading beats copying; then writes are the slower direction
  assert spec.read_bandwidth is None or spec.write_rate < spec.memory_bandwidth < spec.read_bandwidth


@pytest.mark.parametrize("device_kind,preset", [
    ("Tesla V100-SXM2-32GB", "V100-32GB"), ("Tesla V100-PCIE-16GB", "V100-16GB"), ("Tesla P100-PCIE-16GB", "P100-16GB"),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"), ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("NVIDIA H100 80GB HBM3", "H100-80GB"),
    ("NVIDIA H200", "H200"), ("NVIDIA L4", "L4"), ("Tesla T4", "T4"), ("NVIDIA A10G", "A10G"), ("TPU v4", "TPU-v4"),
    ("TPU v5 lite", "TPU-v5e"), ("NVIDIA RTX A6000", "RTX-A6000"), ("Tesla P40", "P40"), ("cpu", None),
])
def test_device_kind_to_preset(device_kind, preset):
  assert preset_for_device_kind(device_kind) == preset


@pytest.mark.parametrize("text,bytes_per_s", [("10.4Gbps", 1.3e9), ("12GB/s", 12e9), ("800Mbps", 1e8), ("1e9B/s", 1e9)])
def test_bandwidth_units(text, bytes_per_s):
  assert parse_bandwidth(text) == pytest.approx(bytes_per_s)


def test_latency_units():
  assert parse_latency("20us") == pytest.approx(20e-6) and parse_latency("0.5ms") == pytest.approx(5e-4)


# --- grammar -------------------------------------------------------------------

PARSE_CASES = [
    # spec, hosts, devices per host (in order), kinds, inter bytes/s
    ("2x8xV100-32GB+6x8xP100-16GB;inter=10.4Gbps", 8, [8] * 8, ("V100-32GB", "P100-16GB"), 1.3e9),
    ("4xT4", 1, [4], ("T4",), 25e9 / 8),
    ("L4", 1, [1], ("L4",), 25e9 / 8),
    ("1x4xA100-80GB+2x2xL4;inter=100Gbps", 3, [4, 2, 2], ("A100-80GB", "L4"), 12.5e9),
]


@pytest.mark.parametrize("spec,n_hosts,counts,kinds,inter", PARSE_CASES)
def test_parse(spec, n_hosts, counts, kinds, inter):
  cluster = Cluster.parse(spec)
  assert len(cluster.hosts) == n_hosts
  assert [h.count for h in cluster.hosts] == counts
  assert cluster.kinds == kinds
  assert cluster.inter.bandwidth == pytest.approx(inter)
  assert [d.id for d in cluster.devices] == list(range(sum(counts)))
  assert Cluster.parse(cluster.describe()).hosts == cluster.hosts


def test_intra_links_default_by_kind_and_can_be_overridden():
  default = Cluster.parse("8xV100-32GB+4xT4")
  assert [h.intra.name for h in default.hosts] == ["nvlink2", "pcie3"]
  everywhere = Cluster.parse("8xV100-32GB+4xT4;intra=pcie4")
  assert {h.intra.name for h in everywhere.hosts} == {"pcie4"}
  per_group = Cluster.parse("8xV100-32GB@pcie+4xT4;intra=nvlink;intra_latency=1us")
  assert per_group.hosts[0].intra.name == "pcie" and per_group.hosts[1].intra.name == "nvlink"
  assert per_group.hosts[1].intra.latency == pytest.approx(1e-6)


def test_custom_device_numbers():
  mine = DeviceSpec("MyChip", fp32_flops=1e13, bf16_flops=4e13, memory_bytes=8 * GiB, memory_bandwidth=500 * GB)
  cluster = Cluster.parse("2x4xMyChip+4xV100-16GB", devices={"MyChip": mine})
  assert cluster.spec_of("MyChip") == mine


BAD_SPECS = [
    ("2x8xV1000", "unknown device kind 'V1000'; known kinds:.*V100-32GB.*DeviceSpec"),
    ("2x8x", "malformed cluster spec at '2x8x'"),
    ("4xT4++2xL4", "malformed cluster spec at ''"),
    ("0x8xV100-32GB", "counts must be positive, got 0 x 8"),
    ("4xT4;inter=fast", "unknown link 'fast'"),
    ("4xT4;inter=-3Gbps", "cannot read bandwidth"),
    ("4xT4;inter=0Gbps", "bandwidth must be positive"),
    ("4xT4;speed=3", "malformed cluster spec at 'speed=3'"),
    ("4xT4@warp", "unknown link 'warp'"),
    ("4xT4;processes=0", "processes must be a whole number from 1 to the cluster's 4 devices, got 0"),
    ("4xT4;processes=5", "processes must be a whole number from 1 to the cluster's 4 devices, got 5"),
    ("4xT4;processes=two", "expected a whole number of processes, got 'two'"),
    ("", "non-empty string"),
]


@pytest.mark.parametrize("spec,match", BAD_SPECS)
def test_bad_specs_point_at_the_token(spec, match):
  with pytest.raises(hetspmd.HetSpmdError, match=match):
    Cluster.parse(spec)


def test_malformed_spec_message_marks_the_position():
  with pytest.raises(hetspmd.HetSpmdError) as info:
    Cluster.parse("4xT4+2x8x+L4")
  spec_line, marker_line = str(info.value).splitlines()[1:3]
  assert spec_line.strip() == "4xT4+2x8x+L4"
  assert marker_line.index("^") - spec_line.index("4") == 5


@pytest.mark.parametrize("field,value", [("fp32_flops", 0), ("memory_bytes", -1), ("memory_bandwidth", float("nan"))])
def test_device_spec_refuses_non_positive_numbers(field, value):
  fields = dict(name="X", fp32_flops=1e12, bf16_flops=2e12, memory_bytes=GiB, memory_bandwidth=1e11)
  fields[field] = value
  with pytest.raises(hetspmd.InvalidValueError, match=rf"{field} must be a positive number, got {value}"):
    DeviceSpec(**fields)


def test_cluster_values_are_frozen():
  cluster = Cluster.preset("amp-t4-v100")
  with pytest.raises(dataclasses.FrozenInstanceError):
    cluster.name = "x"


# --- presets and files -----------------------------------------------------------


def test_required_cluster_presets():
  hap = Cluster.preset("hap-v100-p100")
  assert hap.num_devices == 64 and [h.count for h in hap.hosts] == [8] * 8
  assert hap.kinds == ("V100-32GB", "P100-16GB") and hap.inter.bandwidth == pytest.approx(1.3e9)
  amp = Cluster.preset("amp-t4-v100")  # as AMP's src/het_cluster.py ran it: 3 hosts of 4 V100 + 1 host of 4 T4
  assert amp.num_devices == 16 and [(h.device.name, h.count) for h in amp.hosts] == [("V100-16GB", 4)] * 3 + [("T4", 4)]
  assert amp.inter.bandwidth == pytest.approx(10e9 / 8) and amp.hosts[0].intra.name == "nvlink2"
  heavy = Cluster.preset("t4-heavy-v100")
  assert [h.device.name for h in heavy.hosts] == ["T4"] * 3 + ["V100-16GB"]
  for name in ("a100-v100-mix", "h100-a100-l4-mix"):
    assert not Cluster.preset(name).is_homogeneous
  assert any(Cluster.preset(n).is_homogeneous for n in CLUSTER_PRESETS)


def test_unknown_preset_lists_presets():
  with pytest.raises(hetspmd.UnknownNameError, match="unknown cluster preset 'hap'; presets: hap-v100-p100"):
    Cluster.preset("hap")


def test_one_process_driving_a_machine_that_mixes_kinds(tmp_path):
  """A host is one device kind, so Cephalo's workstation is one host per kind; ``processes=1`` says that one
  process drives them all (the group search then prices the path the runtime takes in one process), in the
  spec, in ``describe()`` and in TOML."""
  mixed = Cluster.parse("2xL4+RTX-A6000+P40;inter=pcie3;processes=1")
  assert [h.device.name for h in mixed.hosts] == ["L4", "RTX-A6000", "P40"] and mixed.processes == 1
  assert Cluster.parse(mixed.describe()) == mixed
  mixed.save(tmp_path / "workstation.toml")
  assert Cluster.load(tmp_path / "workstation.toml") == mixed
  assert Cluster.parse("2xL4+RTX-A6000+P40;inter=pcie3").processes is None  # each host taken to be a process
  assert Cluster.preset("cephalo-workstation") == mixed.replace(name="cephalo-workstation")
  (tmp_path / "bad.toml").write_text((tmp_path / "workstation.toml").read_text().replace(
      "processes = 1", "processes = 9"))
  with pytest.raises(hetspmd.HetSpmdError, match="bad.toml: processes must be a whole number from 1"):
    Cluster.load(tmp_path / "bad.toml")


@pytest.mark.parametrize("name", list(CLUSTER_PRESETS))
def test_toml_round_trip_is_exact(tmp_path, name):
  cluster = Cluster.preset(name)
  path = tmp_path / "cluster.toml"
  cluster.save(path)
  assert Cluster.load(path) == cluster


@pytest.mark.parametrize("read_bandwidth,cache", [(None, None), (2.345e12, None), (2.345e12, (2097152, 1.8765e9))])
def test_toml_round_trip_keeps_measured_and_custom_specs(tmp_path, read_bandwidth, cache):
  mine = DeviceSpec("Odd", 1.2345678901234e13, 3.3e13, 12345678901, 7.77e11, measured=True,
                    read_bandwidth=read_bandwidth, cache_bytes=cache and cache[0], cache_write_bandwidth=cache and cache[1])
  cluster = Cluster.parse("2x2xOdd+2xT4;inter=3.3Gbps", devices={"Odd": mine}).replace(
      jax_device_ids=(5, 4, 3, 2, 1, 0))
  cluster.save(tmp_path / "c.toml")
  assert Cluster.load(tmp_path / "c.toml") == cluster
  text = (tmp_path / "c.toml").read_text()
  assert ("read_bandwidth" in text) == (read_bandwidth is not None)
  assert ("cache_bytes" in text) == ("cache_write_bandwidth" in text) == (cache is not None)


def test_toml_round_trip_keeps_shared_compute(tmp_path):
  cluster = Cluster.parse("1x8xT4")
  shared = cluster.replace(hosts=(dataclasses.replace(cluster.hosts[0], alone_speedup=6.5),))
  shared.save(tmp_path / "c.toml")
  assert Cluster.load(tmp_path / "c.toml") == shared and "alone_speedup = 6.5" in (tmp_path / "c.toml").read_text()
  cluster.save(tmp_path / "plain.toml")
  assert "alone_speedup" not in (tmp_path / "plain.toml").read_text()


@pytest.mark.parametrize("speedup", [0.5, 9.0])
def test_alone_speedup_is_between_one_and_the_device_count(speedup):
  with pytest.raises(hetspmd.InvalidValueError, match=f"between 1 and its device count \\(8\\), got {speedup}"):
    dataclasses.replace(Cluster.parse("1x8xT4").hosts[0], alone_speedup=speedup)


@pytest.mark.parametrize("text,match", [
    ("[[hosts]]\ncount = 2\n", "missing key 'device'"),
    ("name = 'x'\n", "missing key 'hosts'"),
    ("[[hosts]]\ndevice = 'V100-32GB'\ncount = 0\n", "positive device count, got 0"),
    ("[[hosts]\n", "not valid TOML"),
    ("[[hosts]]\ndevice = 'Z'\ncount = 1\n[devices.Z]\nfp32_flops = 1.0\n", r"\[devices.'Z'\] needs fp32_flops"),
    ("[[hosts]]\ndevice = 'Z'\ncount = 1\n[devices.Z]\nfp32_flops = 1.0\ntf32_flops = 2.0\n",
     r"\[devices.'Z'\] has unknown keys \['tf32_flops'\]; known: fp32_flops, .*reduced_f32_flops"),
])
def test_bad_cluster_files(tmp_path, text, match):
  path = tmp_path / "bad.toml"
  path.write_text(text)
  with pytest.raises(hetspmd.HetSpmdError, match=match):
    Cluster.load(path)


def test_missing_cluster_file():
  with pytest.raises(hetspmd.InvalidValueError, match="does not exist"):
    Cluster.load("/nonexistent/cluster.toml")


def test_resolve_accepts_presets_files_and_specs(tmp_path):
  assert Cluster.resolve("amp-t4-v100").name == "amp-t4-v100"
  Cluster.parse("4xT4").save(tmp_path / "c.toml")
  assert Cluster.resolve(str(tmp_path / "c.toml")).num_devices == 4
  assert Cluster.resolve("2xL4").num_devices == 2


# --- real and emulated devices ----------------------------------------------------


def test_emulate_maps_real_devices_to_virtual_kinds():
  devices = jax.devices()[:8]
  if len(devices) < 8:
    pytest.skip("needs 8 devices")
  cluster = Cluster.emulate(devices, kinds=["V100-32GB"] * 4 + ["P100-16GB"] * 4)
  assert [h.device.name for h in cluster.hosts] == ["V100-32GB", "P100-16GB"]
  assert cluster.jax_device_ids == tuple(d.id for d in devices)


def test_emulate_refuses_count_mismatch():
  with pytest.raises(hetspmd.InvalidValueError, match="got 2 devices but 3 kinds"):
    Cluster.emulate(jax.devices()[:2], kinds=["T4"] * 3)


class _FakeGpu:
  platform, device_kind, process_index = "gpu", "Tesla V100-SXM2-32GB", 0

  def __init__(self, id, limit):
    self.id, self.limit = id, limit

  def memory_stats(self):
    return {"bytes_limit": self.limit} if self.limit else None


@pytest.mark.parametrize("limits,expected", [
    ((24 * 2**30, 24 * 2**30), 24 * 2**30),   # JAX's default: 75% of the GPU preallocated
    ((30 * 2**30, 25 * 2**30), 25 * 2**30),   # the tightest device of a kind
    ((None, None), 32 * 2**30),               # no stats: the datasheet
    ((40 * 2**30, 40 * 2**30), 32 * 2**30),   # never above the datasheet
])
def test_from_devices_caps_preset_memory_at_the_allocator_limit(limits, expected):
  cluster = Cluster.from_devices([_FakeGpu(i, limit) for i, limit in enumerate(limits)])
  assert cluster.kinds == ("V100-32GB",)
  assert cluster.hosts[0].device.memory_bytes == expected
  assert cluster.hosts[0].device.fp32_flops == DEVICE_PRESETS["V100-32GB"].fp32_flops


def test_from_devices_measures_cpu():
  cluster = Cluster.from_devices(jax.devices())
  assert cluster.num_devices == jax.device_count()
  assert cluster.kinds == ("cpu",) and cluster.hosts[0].device.measured


def test_emulate_takes_the_link_between_its_hosts():
  """Two kinds make two virtual hosts. Processes joined over TCP (gloo) are slower than one process's memory: ``inter`` says so."""
  gloo = hetspmd.Link("gloo", 0.5e9, 1e-4)
  cluster = Cluster.emulate(jax.devices()[:2], kinds=["V100-32GB", "P100-16GB"], inter=gloo)
  assert cluster.inter == gloo and len(cluster.hosts) == 2
  assert Cluster.emulate(jax.devices()[:2], kinds=["V100-32GB", "P100-16GB"]).inter.name == "host"
  with pytest.raises(hetspmd.InvalidValueError, match="takes a Link"):
    Cluster.emulate(jax.devices()[:2], kinds=["T4", "T4"], inter=10e9)


# --- efficiencies per chip (hetspmd.hardware.efficiency) ---

def test_a_spec_is_priced_at_its_chips_efficiency():
  from hetspmd.hardware.efficiency import DATASHEET, CHIPS, MEASURED

  for name, spec in DEVICE_PRESETS.items():
    fitted = CHIPS.get(spec.chip)
    assert spec.efficiency == (fitted[0] if fitted else DATASHEET), name
  for chip, (efficiency, kinds) in CHIPS.items():  # each fitted chip names presets of its own
    assert kinds and all(DEVICE_PRESETS[k].chip == chip for k in kinds), chip
  assert DEVICE_PRESETS["V100-32GB"].replace(measured=True).efficiency == MEASURED
  assert DEVICE_PRESETS["V100-32GB"].replace(chip=None).efficiency == DATASHEET


@pytest.mark.parametrize("kinds", [("T4", "A100-80GB"), ("L4", "P40", "V100-16GB"), ("V100-16GB", "V100-32GB")])
def test_the_mean_spec_keeps_the_pools_achieved_rates(kinds):
  from hetspmd.hardware.devices import mean_spec

  specs = [DEVICE_PRESETS[k] for k in kinds]
  mean = mean_spec(specs)
  achieved = lambda s, peak: peak * (s.efficiency.matrix if peak > s.fp32_flops else s.efficiency.vector)
  for rate in ("fp32_flops", "bf16_flops", "float16_flops"):
    expected = sum(achieved(s, getattr(s, rate)) for s in specs) / len(specs)
    assert achieved(mean, getattr(mean, rate)) == pytest.approx(expected, rel=1e-12), rate
  expected = sum(s.memory_bandwidth * s.efficiency.memory for s in specs) / len(specs)
  assert mean.memory_bandwidth * mean.efficiency.memory == pytest.approx(expected, rel=1e-12)


def test_an_unknown_chip_is_refused_and_a_known_one_survives_toml(tmp_path):
  from hetspmd.errors import InvalidValueError

  with pytest.raises(InvalidValueError, match="unknown chip 'kepler'.*known: gp102, gp100"):
    DeviceSpec("K80", 4e12, 4e12, 12 * GiB, 240 * GB, chip="kepler")
  with pytest.raises(InvalidValueError, match=r"Efficiency.matrix must be a fraction of peak in \(0, 1\]"):
    hetspmd.hardware.efficiency.Efficiency(matrix=1.5, vector=0.5, memory=0.5)
  custom = DeviceSpec("V100-PCIe", 14e12, 14e12, 16 * GiB, 900 * GB, fp16_flops=112e12, chip="gv100")
  cluster = Cluster.parse("4xV100-PCIe", devices={"V100-PCIe": custom})
  path = tmp_path / "cluster.toml"
  path.write_text(hetspmd.hardware.cluster.to_toml(cluster))
  back = Cluster.load(path)
  assert back.spec_of("V100-PCIe") == custom and back.spec_of("V100-PCIe").efficiency.matrix < 0.6


def test_a_cluster_says_what_each_kinds_compute_is_priced_from():
  from hetspmd.hardware.calibration import Calibration, KindTiming

  cluster = Cluster.parse("2xA100-80GB+2xV100-32GB")
  assert cluster.pricing() == [
      "A100-80GB: datasheet peaks at the datasheet efficiencies (matrix 0.60, vector 0.60, memory 0.70)",
      "V100-32GB: datasheet peaks at gv100's fitted efficiencies (matrix 0.31, vector 0.80, memory 0.70)"]
  timed = cluster.calibrated(Calibration("step", (KindTiming("V100-32GB", ((2, 0.01), (4, 0.02)), 0.001),)))
  assert timed.pricing()[1] == "V100-32GB: the step's measured times (2 microbatch size(s); remat none timed)"
  measured = hetspmd.hardware.device_spec("cpu")
  assert Cluster.parse("2xcpu").pricing() == [f"{measured.name}: a measured spec (hetspmd profile)"]


@pytest.mark.timeout(300)
def test_a_machines_processes_make_one_host():
  """4 processes x 1 CPU device (one process per GPU, as launchers start them): from_devices gathers each
  process's machine, so on this one machine the four make one host; told there are two machines of two
  processes, two hosts of two, each process's devices where the planner takes them, and a kind that shards its
  parameters is cut per host, across the host's processes."""
  from multiprocess import run_processes

  results = run_processes("""
      import json
      import hetspmd as hs
      from hetspmd.hardware import cluster as c, profiler
      from hetspmd.planner.group_execution import process_of, shard_key

      fixed = lambda device, name: hs.DeviceSpec(name, memory_bytes=2**30, fp32_flops=1e11, bf16_flops=1e11,
                                                 memory_bandwidth=1e10)
      c.measure_device_spec = fixed  # no timing: the structure is under test
      one = hs.Cluster.from_devices(jax.devices())
      profiler.hostname = lambda: f"machine-{jax.process_index() // 2}"
      two = hs.Cluster.from_devices(jax.devices())
      print(json.dumps({"one": [h.count for h in one.hosts], "two": [h.count for h in two.hosts],
                        "processes": [one.processes, two.processes], "of": list(process_of(two)),
                        "keys": [list(k) for k in shard_key(two)], "ids": list(two.jax_device_ids),
                        "jax": {str(d.id): d.process_index for d in jax.devices()}}))
  """, num_processes=4, devices_per_process=1, timeout=240)
  for r in results:
    assert r["one"] == [4] and r["two"] == [2, 2] and r["processes"] == [4, 4], r
    assert r["of"] == [r["jax"][str(i)] for i in r["ids"]] == [0, 1, 2, 3]
    assert r["keys"] == [["host", 0], ["host", 0], ["host", 1], ["host", 1]]


def test_a_machines_devices_of_one_kind_are_one_host_in_any_order():
  """One process per GPU on a workstation whose kinds alternate in PCI order (L4, A6000, L4, P40), beside a
  second machine: each machine's devices of a kind are one host, whatever order their processes come in, and
  each device keeps its own process, which the planner takes."""
  from types import SimpleNamespace

  from hetspmd.hardware.cluster import _grouped
  from hetspmd.hardware.devices import LINK_PRESETS
  from hetspmd.hardware.profiler import device_spec
  from hetspmd.planner.group_execution import process_of, shard_key

  kinds = ["L4", "RTX-A6000", "L4", "P40", "L4", "L4"]
  devices = [SimpleNamespace(id=10 + p, process_index=p) for p in range(6)]
  specs = {k: device_spec(k) for k in kinds}
  cluster = _grouped(devices, kinds, specs, LINK_PRESETS["pcie3"], "mixed", machines=(0, 0, 0, 0, 1, 1))
  assert [(h.device.name, h.count) for h in cluster.hosts] == [("L4", 2), ("RTX-A6000", 1), ("P40", 1), ("L4", 2)]
  assert cluster.jax_device_ids == (10, 12, 11, 13, 14, 15) and cluster.processes == 6
  assert process_of(cluster) == cluster.device_processes == (0, 2, 1, 3, 4, 5)
  assert [k for k in shard_key(cluster)] == [("host", 0), ("host", 0), ("host", 1), ("host", 2), ("host", 3),
                                             ("host", 3)]



def test_a_clusters_device_processes_survive_its_file(tmp_path):
  from types import SimpleNamespace

  from hetspmd.hardware.cluster import _grouped
  from hetspmd.hardware.devices import LINK_PRESETS
  from hetspmd.hardware.profiler import device_spec

  devices = [SimpleNamespace(id=p, process_index=p // 2) for p in range(4)]
  cluster = _grouped(devices, ["V100-32GB"] * 4, {"V100-32GB": device_spec("V100-32GB")}, LINK_PRESETS["pcie"], "c",
                     machines=(0, 0))
  assert [h.count for h in cluster.hosts] == [4] and cluster.device_processes == (0, 0, 1, 1)
  cluster.save(tmp_path / "c.toml")
  assert Cluster.load(tmp_path / "c.toml") == cluster
  with pytest.raises(hetspmd.errors.InvalidValueError, match="device_processes"):
    cluster.replace(device_processes=(0, 1))
