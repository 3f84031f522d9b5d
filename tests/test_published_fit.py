"""The chips' efficiencies (hetspmd.hardware.efficiency.CHIPS) are what benchmarks/published.py fits to Cephalo's
per-layer times, and pricing at them reproduces those times."""

import importlib.util
import math
import pathlib
import sys

import pytest

from hetspmd.hardware.devices import DEVICE_PRESETS
from hetspmd.hardware.efficiency import CHIPS, DATASHEET

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "published.py"


@pytest.fixture(scope="module")
def published():
  spec = importlib.util.spec_from_file_location("published", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def pricers(published):
  return published._layer_pricers()


@pytest.mark.slow
def test_the_table_is_the_fit(published, pricers):
  fitted = published.fit_chips(pricers)
  assert fitted == CHIPS  # refit with `python benchmarks/published.py --fit` after changing the cost model


@pytest.mark.slow
def test_each_fitted_kind_is_priced_near_its_measured_layer_and_the_datasheet_is_not(published, pricers):
  rows = published.cephalo_rows(pricers)
  assert len(rows) == 2 * len(published.CEPHALO_SLOPES_MS)
  # two decimals of efficiency move a time by at most 0.005 / (the smallest fitted value); a chip without matrix
  # units has one efficiency for both rows, which leaves each at least half their measured/predicted spread
  rounding = math.log(1 + 0.005 / min(min(e.matrix, e.vector) for e, _ in CHIPS.values()))
  spread = 0.0
  for half, full in zip(rows[::2], rows[1::2]):
    if DEVICE_PRESETS[half["setup"].split(":")[0]].float16_flops == DEVICE_PRESETS[half["setup"].split(":")[0]].fp32_flops:
      spread = max(spread, abs(math.log(half["predicted"] / half["measured"] * full["measured"] / full["predicted"])))
  bound = rounding + spread / 2 + 1e-9
  for r in rows:
    assert abs(math.log(r["predicted"] / r["measured"])) <= bound, r
  # the uniform datasheet efficiencies miss some kind by more than 2x: what the table corrects
  assert max(abs(math.log(r["datasheet"] / r["measured"])) for r in rows) > math.log(2)
  assert all(DEVICE_PRESETS[k].chip in CHIPS for k in published.CEPHALO_SLOPES_MS)
  assert DEVICE_PRESETS["A100-80GB"].efficiency == DATASHEET  # no source timed a GA100 layer
