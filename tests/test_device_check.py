"""benchmarks/device_check.py, the script a machine with an accelerator runs, works end to end on a CPU."""

import importlib.util
import json
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "device_check.py"


@pytest.mark.timeout(300)
def test_device_check_runs_every_remat_policy_and_reports_time_and_memory(tmp_path, capsys, monkeypatch):
  from hetspmd.plan.options import REMAT_POLICIES

  monkeypatch.syspath_prepend(str(SCRIPT.parent))  # as when run as a script: its folder first on the path

  spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  out = tmp_path / "check.json"
  assert module.main(["--no-profile", "--steps", "1", "--json", str(out)]) == 0
  report = json.loads(out.read_text())
  rows = report["rows"]
  assert {r["remat"] for r in rows} == set(REMAT_POLICIES) and len(rows) == len(module.plans_for("cpu"))
  for row in rows:
    assert "error" not in row, row
    assert row["measured_s"] > 0 and row["predicted_datasheet_s"] > 0
    assert row["compiled_bytes"] > 0 and row["predicted_bytes"] > 0
  summary = report["summary"]
  assert -1 <= summary["predicted_datasheet_s"]["spearman"] <= 1
  assert set(summary) >= {f"memory_{r}" for r in REMAT_POLICIES}
  assert "predicted s (datasheet)" in capsys.readouterr().out
