"""The installed package: public names, and passes/models importable only under hetspmd."""

import subprocess
import sys

import hetspmd
import hetspmd.hardware
import hetspmd.lowering
import hetspmd.models
import hetspmd.passes
import hetspmd.plan
import hetspmd.planner
import hetspmd.runtime

STAGES = (hetspmd.hardware, hetspmd.plan, hetspmd.planner, hetspmd.lowering, hetspmd.runtime)


def test_every_public_name_imports():
  for module in (hetspmd, hetspmd.passes, hetspmd.models) + STAGES:
    for name in module.__all__:
      assert getattr(module, name) is not None, f"{module.__name__}.{name}"


def test_errors_share_one_base():
  for name in ("TraceError", "UnknownNameError", "UnpartitionableError", "InvalidValueError", "PlanDoesNotFitError"):
    assert issubclass(getattr(hetspmd, name), hetspmd.HetSpmdError)


def _import_in_clean_dir(tmp_path, statement: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", statement], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_passes_and_models_import_only_under_hetspmd(tmp_path):
  ok = _import_in_clean_dir(tmp_path, "import hetspmd.passes, hetspmd.models; print(hetspmd.passes.Graph.__module__)")
  assert ok.returncode == 0, ok.stderr
  assert ok.stdout.strip() == "hetspmd.passes.ir"
  for bare in ("passes", "models"):
    bad = _import_in_clean_dir(tmp_path, f"import {bare}")
    assert bad.returncode != 0
    assert "ModuleNotFoundError" in bad.stderr


def test_version_is_a_string():
  assert isinstance(hetspmd.__version__, str) and hetspmd.__version__.count(".") >= 1
