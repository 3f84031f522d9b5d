"""Test setup: 8 emulated CPU devices, set before JAX is imported."""

import os
import subprocess
import sys

# The tests check numbers, not speed: XLA compiles their programs without LLVM's expensive optimisations and with
# its older CPU fusion emitters, which halves the suite's time on two cores (15:50 to 7:27; most of a test's time
# is compilation). Every comparison is against a float64 reference with derived bounds (tests/exactness.py), so
# another instruction order cannot fail one. The flags are
# probed once (the controller's environment passes the answer to workers and child processes): a jaxlib that
# no longer knows one of them runs the tests with XLA's defaults instead of aborting.
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                "--xla_cpu_use_fusion_emitters=false")


def _known(flags: tuple[str, ...]) -> str:
  probe = "import jax, jax.numpy as jnp; jax.jit(lambda x: x + 1)(jnp.ones(2)).block_until_ready()"
  try:
    ok = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "XLA_FLAGS": " ".join(flags),
                        "JAX_PLATFORMS": "cpu"}, capture_output=True, timeout=120).returncode == 0
  except (OSError, subprocess.TimeoutExpired):
    ok = False
  return " ".join(flags) if ok else ""


if "HETSPMD_TEST_XLA_FLAGS" not in os.environ:
  os.environ["HETSPMD_TEST_XLA_FLAGS"] = _known(FAST_COMPILE)
os.environ["XLA_FLAGS"] = " ".join(
    f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")
    and f not in FAST_COMPILE) + " " + os.environ["HETSPMD_TEST_XLA_FLAGS"] + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent XLA compilation cache for the session, in a temporary folder. Tests build the same programs
# again and again (a single-device reference per case, one plan's step per parametrization); XLA CPU
# executables serialize, so a recompilation of an identical program is a cache read. The multi-process tests'
# children inherit the folder through the environment.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

#
# Under pytest-xdist the controller imports this file first and makes the folder; each worker inherits it and
# keeps its own subfolder (two processes never write one cache entry at once), and the controller removes the
# whole folder when it exits, after its workers.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE = tempfile.mkdtemp(prefix="hetspmd-xla-cache-")
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
if os.environ.get("PYTEST_XDIST_WORKER") and "HETSPMD_WORKER_CACHE" not in os.environ:
  _WORKER_CACHE = os.path.join(os.environ["JAX_COMPILATION_CACHE_DIR"], os.environ["PYTEST_XDIST_WORKER"])
  os.makedirs(_WORKER_CACHE, exist_ok=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["HETSPMD_WORKER_CACHE"] = _WORKER_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402  (must follow the environment above)
import pytest  # noqa: E402


# The files holding the longest tests of a serial run's --durations (the multi-process, pipeline and stage tests)
# go first, so that the two workers finish together rather than one waiting on a long file started last.
LONGEST_FIRST = ("test_staged_step.py", "test_pipeline.py", "test_runtime.py", "test_gradient_reduction.py",
                 "test_unmodified_steps.py", "test_group_programs.py", "test_pmap_steps.py", "test_wmt_step.py",
                 "test_imagenet_step.py", "test_expert_parallel.py", "test_sst2_step.py", "test_models.py")


def pytest_collection_modifyitems(items):
  """The longest files first (:data:`LONGEST_FIRST`), every file's tests in their own order."""
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


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
