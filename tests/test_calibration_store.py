"""Calibrations kept on disk (``parallelize(..., calibrate=directory)``): reused for the same step on the same
pool, timed again for another pool or for sizes and policies not kept, and used across processes only where
every process holds the same one."""

import dataclasses
import json

import jax
import pytest

import hetspmd as hs
from exactness import Reference
from hetspmd import models
from hetspmd.errors import InvalidValueError
from hetspmd.hardware.calibration import Calibration
from hetspmd.models.mlp import MLPConfig
from hetspmd.runtime import calibrating, calibration_store


def _workload():
  return dataclasses.replace(models.get("mlp"), name="mlp-store", config=MLPConfig((32, 64, 10)))


def _pool(kinds):
  if jax.device_count() < len(kinds):
    pytest.skip(f"needs {len(kinds)} devices")
  return hs.Cluster.emulate(jax.devices()[:len(kinds)], kinds=list(kinds))


def _no_timing(monkeypatch):
  def refused(*args, **kwargs):
    raise AssertionError("timed although a kept calibration covers the search")

  monkeypatch.setattr(calibrating.KindTimer, "runs", refused)


def _searched(w, pool, directory, batch):
  step = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=pool, plan="search", global_batch=32,
                        calibrate=str(directory), verify=False)
  ref = Reference(w.make_train_step(), w.init_state(0))
  state, metrics = step(w.init_state(0), batch)
  ref.step(batch)
  ref.check_metrics(metrics, 0)
  ref.check(state)
  return step


def test_a_kept_calibration_is_reused_for_the_same_step_and_pool(tmp_path, monkeypatch):
  """The first search times the step and keeps the calibration in the directory, named by the step and the
  pool; a second parallelize of the same step on the same pool reads it and times nothing; both exact."""
  w, pool = _workload(), _pool(["V100-32GB", "P100-16GB"])
  batch = w.synthetic_batch(0, batch=32)
  first = _searched(w, pool, tmp_path, batch)
  (kept,) = tmp_path.glob("calibration-*.json")
  assert kept.name.startswith(f"calibration-{first.calibration.fingerprint[:16]}-")
  data = json.loads(kept.read_text())
  assert Calibration.from_json(data) == first.calibration
  assert data["pool"] == [["P100-16GB", ["cpu"], 1], ["V100-32GB", ["cpu"], 1], ["processes", 1]]
  _no_timing(monkeypatch)
  second = _searched(w, pool, tmp_path, batch)
  assert second.calibration == first.calibration and second.plan == first.plan


def test_another_pool_or_policy_is_timed_and_kept_beside(tmp_path):
  """Another pool (other kinds) is another file; a policy not kept is timed, and the file then holds it beside
  the policies kept before; a file that is not a calibration is timed over."""
  w = _workload()
  state, batch = w.init_state(0), w.synthetic_batch(0, batch=8)
  pool = _pool(["V100-32GB", "P100-16GB"])
  step = hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=pool, plan="search", global_batch=32,
                        calibrate=str(tmp_path))
  plain = step.calibrate(state, batch, sizes=(4,))
  both = step.calibrate(state, batch, sizes=(4,), remats=("full",))
  assert [t.remat for t in both.kinds] == ["full", "full"]
  (kept,) = tmp_path.glob("calibration-*.json")
  stored = Calibration.load(kept)
  assert {(t.kind, t.remat) for t in stored.kinds} == {(k, r) for k in pool.kinds for r in ("none", "full")}
  assert stored.of("V100-32GB", "none") == plain.of("V100-32GB", "none")
  other = hs.Cluster.emulate(jax.devices()[:2], kinds=["A100-80GB", "A100-80GB"])
  hs.parallelize(w.make_train_step(hs.value_and_grad), cluster=other, plan="search", global_batch=32,
                 calibrate=str(tmp_path)).calibrate(state, batch, sizes=(4,))
  assert len(list(tmp_path.glob("calibration-*.json"))) == 2
  kept.write_text("not json")
  again = step.calibrate(state, batch, sizes=(4,))
  assert Calibration.load(kept) == again
  assert calibration_store.covers(again, pool.kinds, (4,), ("none",))
  assert not calibration_store.covers(again, pool.kinds, (4, 8), ("none",))
  assert not calibration_store.covers(again, pool.kinds, (4,), ("none", "dots"))


def test_sizes_asked_for_count_as_covered_and_a_directory_that_cannot_be_written_warns(tmp_path, monkeypatch):
  """A size that did not run on some kind (out of memory) is left out of its timing; the store records the sizes
  asked for, so the same request reads the file instead of timing again. A write that fails warns and loses
  nothing (the search goes on with the new timing)."""
  from hetspmd.hardware.calibration import KindTiming

  cal = Calibration("a" * 64, (KindTiming("V100-32GB", ((4, 1e-3), (16, 3e-3))), KindTiming("P100-16GB", ((4, 2e-3),))))
  kinds = ("V100-32GB", "P100-16GB")
  assert not calibration_store.covers(cal, kinds, (4, 16), ("none",))
  assert calibration_store.covers(cal, kinds, (4, 16), ("none",), {"none": [4, 16]})
  assert not calibration_store.covers(cal, kinds, (4, 16), ("none", "full"), {"none": [4, 16]})
  pool = _pool(kinds)
  calibration_store.save(tmp_path, cal, None, pool, (4, 16))
  usable, (kept, asked) = calibration_store.load(tmp_path, cal.fingerprint, pool, (4, 16), ("none",))
  assert usable == cal == kept and asked == {"none": [4, 16]}
  monkeypatch.setattr(calibration_store.tempfile, "mkstemp", lambda **kw: (_ for _ in ()).throw(OSError("read-only")))
  with pytest.warns(UserWarning, match="could not be kept in .*read-only"):
    calibration_store.save(tmp_path, cal, None, pool, (4,))


def test_a_path_that_is_neither_a_calibration_nor_a_directory_is_refused(tmp_path):
  with pytest.raises(InvalidValueError, match="an existing directory to keep calibrations in"):
    hs.parallelize(_workload().make_train_step(), global_batch=32, calibrate=str(tmp_path / "missing"))


@pytest.mark.timeout(300)
def test_two_processes_reuse_only_a_calibration_both_hold(tmp_path):
  """2 processes x 2 CPU devices over gloo, each with its own directory. Both time and keep the same
  calibration; where then only the first still holds it, both time again (neither waits for the other in a
  timing the other skips); where both hold the same one, both reuse it without timing. Exact against one
  device."""
  import textwrap

  from multiprocess import group_child, run_processes

  results = run_processes(group_child() + textwrap.dedent(f"""
      import hashlib, pathlib
      import hetspmd as hs
      from hetspmd.runtime import calibrating

      mine = pathlib.Path({str(tmp_path)!r}) / str(jax.process_index())
      mine.mkdir()
      pool = hs.Cluster.emulate(jax.devices(), kinds=["V100-32GB"] * 2 + ["P100-16GB"] * 2)
      batches = t._batches(64)
      timed, runs = [], calibrating.KindTimer.runs

      def counted(self, *args, **kwargs):
        timed.append(1)
        return runs(self, *args, **kwargs)

      calibrating.KindTimer.runs = counted

      def searched():
        step = hs.parallelize(t.dropout_step, cluster=pool, plan="search", global_batch=64,
                              example_batch=batches[0], calibrate=str(mine), verify=False, group_plans=False)
        return step, step.shard_state(t._state())

      counts, digests = [], []
      for phase in range(3):
        if phase == 1 and jax.process_index() == 1:
          for f in mine.glob("calibration-*.json"):
            f.unlink()
        step, state = searched()
        counts.append(len(timed))
        digests.append(hashlib.sha256(json.dumps(step.calibration.to_json()).encode()).hexdigest())
      ref = reference(t.dropout_step, t._state(), batches)
      for i, batch in enumerate(batches):
        state, metrics = step(state, fed(step, batch))
        ref.check_metrics(jax.tree.map(local, metrics), i)
      ref.check(jax.tree.map(local, state.params), lambda s: s.params)
      print(json.dumps({{"counts": counts, "digests": digests, "files": len(list(mine.glob("calibration-*")))}}))
  """), num_processes=2, devices_per_process=2, timeout=240)
  first, second = results
  assert first["digests"] == second["digests"], results  # every process searches on the same times
  for r in results:
    assert 0 < r["counts"][0] < r["counts"][1] == r["counts"][2], results  # timed, timed again, reused
    assert r["digests"][2] == r["digests"][1] and r["files"] == 1


@pytest.mark.timeout(300)
def test_a_timing_that_fails_on_one_process_fails_on_both():
  """2 processes: the second cannot time its kind (an error before the calibration gathers its times). Both
  hear of it at the same point and take the same way on (one layer timed instead, or the same error), so
  neither waits in a gather the other never reaches."""
  import textwrap

  from multiprocess import group_child, run_processes

  results = run_processes(group_child() + textwrap.dedent("""
      import hetspmd as hs
      from hetspmd.runtime import calibrating

      runs = calibrating.KindTimer.runs

      def failing(self, *args, **kwargs):
        if jax.process_index() == 1:
          raise hs.HetSpmdError("cannot time here")
        return runs(self, *args, **kwargs)

      calibrating.KindTimer.runs = failing
      pool = hs.Cluster.emulate(jax.devices(), kinds=["V100-32GB"] * 2 + ["P100-16GB"] * 2)
      batches = t._batches(64)
      step = hs.parallelize(t.dropout_step, cluster=pool, plan="search", global_batch=64, example_batch=batches[0])
      try:
        calibration = step.calibrate(t._state(), batches[0], sizes=(4,))
        outcome = sorted({k.part for k in calibration.kinds})
      except hs.HetSpmdError as e:
        outcome = "error: " + str(e)[:300]
      print(json.dumps({"outcome": outcome}))
  """), num_processes=2, devices_per_process=2, timeout=240)
  first, second = results
  assert type(first["outcome"]) is type(second["outcome"]), results
  if isinstance(first["outcome"], str):
    assert "cannot time here" in second["outcome"] and "another process" in first["outcome"], results
  else:
    assert first["outcome"] == second["outcome"] != ["step"], results
