"""The profiler on the emulated CPU devices: positive, monotone, fitted."""

import dataclasses
import json

import jax
import numpy as np
import pytest

import hetspmd
from hetspmd import Cluster, enumerate_layouts
from hetspmd.cli import main
from hetspmd.hardware.profiler import COLLECTIVES, CollectiveFit, fit_alpha_beta, measured_alpha_beta

from conftest import require_devices

SMALL_MESSAGES = (4096, 65536, 1 << 20)


@pytest.fixture(scope="module")
def profile():
  require_devices(8)
  return hetspmd.profile(jax.devices()[:8], message_bytes=SMALL_MESSAGES, progress=False)


def test_compute_and_memory_figures_are_positive(profile):
  assert len(profile.devices) == 8 and profile.backend == "cpu"
  for d in profile.devices:
    for table in (d.alone_flops, d.busy_flops):
      assert set(table) == {"float32", "bfloat16"}
      assert all(rate > 0 for rows in table.values() for _, rate in rows)
    assert d.copy_bandwidth > 0 and d.memory_bytes > 0


def test_collective_tables_are_monotone_and_fitted(profile):
  assert {f.op for f in profile.collectives} == set(COLLECTIVES)
  for fit in profile.collectives:
    assert fit.sizes == SMALL_MESSAGES and fit.group_size == 8
    assert all(np.diff(fit.seconds) >= 0) and fit.seconds[0] > 0
    assert fit.alpha >= 0 and fit.beta >= 0
    assert fit.predict(2 * SMALL_MESSAGES[-1]) >= fit.seconds[-1]
    assert fit.predict(SMALL_MESSAGES[0]) == pytest.approx(fit.seconds[0])


def test_profile_becomes_a_measured_cluster(profile, tmp_path):
  cluster = Cluster.from_profile(profile)
  assert cluster.num_devices == 8 and cluster.kinds == ("cpu",) and cluster.processes == 1
  spec = cluster.hosts[0].device
  assert spec.measured and spec.fp32_flops == min(d.peak("float32") for d in profile.devices)
  cluster.save(tmp_path / "cpu.toml")
  assert Cluster.load(tmp_path / "cpu.toml") == cluster


def test_profile_over_mesh_axes():
  require_devices(8)
  cluster = Cluster.emulate(jax.devices()[:8], kinds=["T4"] * 8)
  mesh = next(m for m in enumerate_layouts(cluster) if m.shape == (4, 2))
  result = hetspmd.profile(jax.devices()[:8], mesh=mesh, message_bytes=(4096, 65536), progress=False)
  assert {(f.axis, f.group_size) for f in result.collectives} == {("data", 4), ("model", 2)}


@pytest.mark.parametrize("alpha,beta", [(1e-5, 1e-9), (0.0, 5e-10), (3e-4, 0.0)])
def test_alpha_beta_fit_recovers_a_line(alpha, beta):
  sizes = [2**k for k in range(10, 24, 2)]
  got_alpha, got_beta = fit_alpha_beta(sizes, [alpha + beta * s for s in sizes])
  assert got_alpha == pytest.approx(alpha, abs=1e-9) and got_beta == pytest.approx(beta, abs=1e-15)


@pytest.mark.parametrize("times", [[4e-4] * 7, [9e-4, 5e-4, 4e-4, 4e-4, 4.1e-4, 4e-4, 3.9e-4]])
def test_timed_collective_flat_in_size_keeps_a_finite_bandwidth(times):
  """Noise that hides the bytes bounds the bandwidth by the largest message over the longest time."""
  sizes = [4**k * 1024 for k in range(7)]
  alpha, beta = measured_alpha_beta(sizes, times)
  assert beta == pytest.approx(max(times) / sizes[-1]) and alpha == pytest.approx(min(times))
  line = measured_alpha_beta(sizes, [1e-5 + 1e-9 * s for s in sizes])
  assert line == pytest.approx((1e-5, 1e-9))


def test_profile_cli_json_and_out(tmp_path, capsys):
  require_devices(2)
  out = tmp_path / "cluster.toml"
  assert main(["profile", "--devices", "2", "--json", "--out", str(out)]) == 0
  report = json.loads(capsys.readouterr().out)
  assert len(report["devices"]) == 2 and report["backend"] == "cpu"
  assert Cluster.load(out).num_devices == 2


@pytest.mark.timeout(240)
def test_profile_across_two_processes():
  """Each process measures its own devices; every process gets all of them. The processes of one machine make
  one host (they share its links); told there are two machines, two hosts, each device keeping its process."""
  from multiprocess import run_processes

  results = run_processes("""
      import json, hetspmd
      from hetspmd.hardware import profiler
      p = hetspmd.profile(message_bytes=(4096, 65536), progress=False)
      c = hetspmd.Cluster.from_profile(p)
      profiler.hostname = lambda: f"machine-{jax.process_index()}"
      two = hetspmd.Cluster.from_profile(hetspmd.profile(message_bytes=(4096,), progress=False))
      print(json.dumps({"ids": [d.id for d in p.devices], "processes": [d.process for d in p.devices],
                        "machines": [d.machine for d in p.devices],
                        "hosts": [h.count for h in c.hosts], "groups": [f.group_size for f in p.collectives],
                        "cluster_processes": c.processes, "two": [h.count for h in two.hosts],
                        "of": list(two.device_processes)}))
  """)
  assert results[0] == results[1]
  assert results[0]["processes"] == [0, 0, 1, 1] and results[0]["machines"] == [0, 0, 0, 0]
  assert results[0]["hosts"] == [4] and results[0]["groups"] == [4, 4, 4] and results[0]["cluster_processes"] == 2
  assert results[0]["two"] == [2, 2] and results[0]["of"] == [0, 0, 1, 1]


def test_a_profile_without_machines_makes_a_host_per_process():
  """A profile that does not say which machine each device is on (machine -1) keeps a host per process and
  kind."""
  from hetspmd.hardware.profiler import Profile

  devices = tuple(dataclasses.replace(_measured("cpu", 1e10), id=i, process=i // 2) for i in range(4))
  cluster = Cluster.from_profile(Profile(devices, (), "cpu", 2, 0.0))
  assert [h.count for h in cluster.hosts] == [2, 2] and cluster.device_processes == (0, 0, 1, 1)
  on_one = tuple(dataclasses.replace(d, machine=0) for d in devices)
  assert [h.count for h in Cluster.from_profile(Profile(on_one, (), "cpu", 2, 0.0)).hosts] == [4]


def _measured(kind, float32, reduced=None):
  from hetspmd.hardware.profiler import REDUCED_F32, DeviceMeasurement

  flops = {"float32": ((1024, float32),), "bfloat16": ((1024, 4 * float32),)}
  if reduced is not None:
    flops[REDUCED_F32] = ((1024, reduced),)
  return DeviceMeasurement(0, kind, 0, flops, flops, 1e12, 2**34)


@pytest.mark.parametrize("members,expected", [
    ([_measured("A100-40GB", 19e12, 150e12), _measured("A100-40GB", 19e12, 140e12)], 140e12),  # TF32: the slower
    ([_measured("V100-32GB", 15e12, 15.2e12)], None),       # no faster path: float32 matmuls are full anyway
    ([_measured("A100-40GB", 19e12, 150e12), _measured("A100-40GB", 19e12)], None),  # not measured on every member
])
def test_a_profiled_spec_keeps_the_default_precision_rate_apart_from_full_float32(members, expected):
  # hetspmd.profile times float32 matmuls at HIGHEST (fp32_flops) and, on accelerators, at JAX's default
  # precision (reduced_f32_flops), so a matmul that asks for full float32 is priced at the full rate
  from hetspmd.hardware.profiler import Profile

  spec = Profile(tuple(members), (), "gpu", 1, 0.0).device_spec(members[0].kind)
  assert spec.fp32_flops == 19e12 or spec.fp32_flops == 15e12
  assert spec.reduced_f32_flops == expected
  assert spec.f32_matmul_flops() == (expected or spec.fp32_flops) and spec.f32_matmul_flops(False) == spec.fp32_flops


def test_matmul_tables_time_float32_at_full_and_default_precision():
  from hetspmd.hardware.profiler import REDUCED_F32, matmul_flops

  device = jax.devices()[0]
  assert matmul_flops(device, 128, "float32") > 0 and matmul_flops(device, 128, REDUCED_F32) > 0


def test_a_collective_that_was_not_measured_is_an_unknown_name():
  from hetspmd.hardware.profiler import Profile

  fit = CollectiveFit("all_gather", "data", 4, (1024,), (1e-5,), 1e-5, 0.0)
  profile = Profile((), (fit,), "cpu", 1, 0.0)
  with pytest.raises(hetspmd.UnknownNameError, match="no all_reduce measured; measured: all_gather over 'data'"):
    profile.fit("all_reduce")
  with pytest.raises(KeyError):
    profile.fit("all_gather", axis="model")
  assert profile.link("measured") is None
