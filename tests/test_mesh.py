"""HetMesh: layouts worked out by hand, group validation, weights, JAX meshes."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import hetspmd
from hetspmd import Cluster, HetMesh, enumerate_layouts

from conftest import require_devices

LAYOUT_CASES = [
    # spec, expected (data, model) shapes
    ("2x8xV100-32GB+6x8xP100-16GB", [(64, 1), (32, 2), (16, 4), (8, 8)]),
    ("3x4xT4+1x4xV100-16GB", [(16, 1), (8, 2), (4, 4)]),
    ("1x4xA100-80GB+2x2xL4", [(8, 1), (4, 2)]),
    ("6xT4", [(6, 1), (3, 2), (2, 3), (1, 6)]),
    ("1xL4+1x3xT4", [(4, 1)]),
]


@pytest.mark.parametrize("spec,shapes", LAYOUT_CASES)
def test_layout_counts_by_hand(spec, shapes):
  layouts = list(enumerate_layouts(Cluster.parse(spec)))
  assert [m.shape for m in layouts] == shapes
  for mesh in layouts:
    assert mesh.axis_names == ("data", "model")
    assert mesh.device_ids == tuple(range(mesh.cluster.num_devices))  # host-major


def test_single_axis_layout():
  (mesh,) = enumerate_layouts(Cluster.parse("2x8xV100-32GB+6x8xP100-16GB"), axes=("data",))
  assert mesh.shape == (64,)


def test_three_axes_are_refused():
  with pytest.raises(hetspmd.InvalidValueError, match="one or two axes"):
    list(enumerate_layouts(Cluster.parse("8xT4"), axes=("pipe", "data", "model")))


def test_model_group_mixing_kinds_and_hosts_is_named():
  cluster = Cluster.parse("2xL4+2xT4")
  with pytest.raises(hetspmd.InvalidValueError, match=r"'model' group of devices \[0, 1, 2, 3\] mixes kinds L4, T4 "
                     r"and hosts 0, 1"):
    HetMesh(cluster, ("data", "model"), (1, 4), (0, 1, 2, 3))


def test_model_group_across_hosts_of_one_kind_is_refused():
  with pytest.raises(hetspmd.InvalidValueError, match=r"\[0, 1, 4, 5\] mixes hosts 0, 1"):
    HetMesh(Cluster.parse("2x4xT4"), ("data", "model"), (2, 4), (0, 1, 4, 5, 2, 3, 6, 7))
  # the same shape with an order that keeps groups inside hosts is fine
  HetMesh(Cluster.parse("2x4xT4"), ("data", "model"), (2, 4), tuple(range(8)))


@pytest.mark.parametrize("shape,ids,match", [
    ((3, 2), tuple(range(8)), "holds 6 devices; the cluster has 8"),
    ((4, 2), (0, 0, 1, 2, 3, 4, 5, 6), "permutation"),
    ((8, 0), tuple(range(8)), "must be positive"),
])
def test_bad_mesh_values(shape, ids, match):
  with pytest.raises(hetspmd.InvalidValueError, match=match):
    HetMesh(Cluster.parse("2x4xT4"), ("data", "model"), shape, ids)


def test_weights_follow_device_speed_and_memory():
  mesh = list(enumerate_layouts(Cluster.parse("1x4xA100-80GB+2x2xL4")))[1]  # (4, 2)
  weights = mesh.weights()
  a100, l4 = hetspmd.hardware.devices.DEVICE_PRESETS["A100-80GB"], hetspmd.hardware.devices.DEVICE_PRESETS["L4"]
  # float32 matmuls at JAX's default precision: TF32 tensor cores on both (156 and 60 TF/s)
  expected = np.array([a100.reduced_f32_flops] * 2 + [l4.reduced_f32_flops] * 2)
  np.testing.assert_allclose(weights["data"], expected / expected.sum())
  assert weights["model"] == (0.5, 0.5)
  assert mesh.memory_bytes() == (a100.memory_bytes,) * 2 + (l4.memory_bytes,) * 2
  bf16 = np.array([a100.bf16_flops] * 2 + [l4.bf16_flops] * 2)
  np.testing.assert_allclose(mesh.speed_weights("bfloat16"), bf16 / bf16.sum())
  with jax.default_matmul_precision("float32"):  # full float32: the CUDA cores, where the L4 is faster
    full = mesh.speed_weights()
  expected = np.array([a100.fp32_flops] * 2 + [l4.fp32_flops] * 2)
  np.testing.assert_allclose(full, expected / expected.sum())


@pytest.mark.parametrize("shape", [(8, 1), (4, 2), (2, 4)])
def test_jax_mesh_on_emulated_devices(shape):
  require_devices(8)
  cluster = Cluster.emulate(jax.devices()[:8], kinds=["V100-32GB"] * 4 + ["P100-16GB"] * 4)
  mesh = next(m for m in enumerate_layouts(cluster) if m.shape == shape)
  jmesh = mesh.jax_mesh()
  assert jmesh.shape == {"data": shape[0], "model": shape[1]}
  assert all(t == AxisType.Auto for t in jmesh.axis_types)
  assert [d.id for d in jmesh.devices.ravel()] == list(cluster.jax_device_ids)
  explicit = mesh.jax_mesh(axis_types=(AxisType.Explicit, AxisType.Explicit))
  assert all(t == AxisType.Explicit for t in explicit.axis_types)


def test_jax_mesh_needs_bound_devices():
  mesh = next(enumerate_layouts(Cluster.parse("8xT4")))
  with pytest.raises(hetspmd.InvalidValueError, match="not bound to JAX devices"):
    mesh.jax_mesh()
