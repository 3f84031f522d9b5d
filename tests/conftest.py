"""Test setup: 8 emulated CPU devices, set before JAX is imported."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")
) + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must follow the environment above)
import pytest  # noqa: E402


def require_devices(n: int) -> None:
  """Skips the calling test when fewer than ``n`` devices exist."""
  if jax.device_count() < n:
    pytest.skip(f"needs {n} devices, have {jax.device_count()}")


def xla_flops(fn, *args) -> float:
  """XLA's own FLOP count for ``fn(*args)`` compiled for one CPU device."""
  analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0]
  return float(analysis["flops"])
