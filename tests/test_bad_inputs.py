"""Bad inputs, tried as a new user would: each is answered by a HetSpmdError (or, for the command line, a usage
error with exit status 2) that says what was wrong and what would be right, before anything is lost: no raw
traceback, no crash, no results thrown away."""

import os
import re

import jax
import numpy as np
import pytest

import hetspmd as hs
from hetspmd import models
from hetspmd.cli import main
from hetspmd.plan.groups import group_plan

from conftest import require_devices
from exactness import Reference

KINDS = ["V100-32GB"] * 4 + ["P100-16GB"] * 4
SPEC = "4xV100-32GB+4xP100-16GB"
WORKLOAD = models.get("mlp-tiny")


def _cluster(kinds=KINDS):
  require_devices(len(kinds))
  return hs.Cluster.emulate(jax.devices()[:len(kinds)], kinds=kinds)


def _step(**options):
  return hs.parallelize(WORKLOAD.make_train_step(), **{"cluster": _cluster(), "global_batch": 16, **options})


def _batch(seed=0, size=16):
  return WORKLOAD.synthetic_batch(seed=seed, batch=size)


# --- a training loop's slips ----------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("grouped", [False, True], ids=["one-program", "group-plan"])
def test_a_donated_state_is_refused_and_the_returned_one_trains_on(grouped):
  """``step(state, batch)`` again with the state the last call donated: refused before dispatch (it crashed the
  process with a segmentation fault), and training goes on from the state that call returned, as on one device."""
  plan = group_plan([((0, 1, 2, 3), 2, (1, 1, 1, 1)), ((4, 5, 6, 7), 2, (1, 1, 1, 1))], 16,
                    state_shares=(0.2,) * 4 + (0.05,) * 4) if grouped else "auto"
  step = _step(plan=plan)
  batches = [_batch(seed=i) for i in range(2)]
  ref = Reference(WORKLOAD.make_train_step(), WORKLOAD.init_state(0)).run(batches)
  old = step.shard_state(WORKLOAD.init_state(0))
  state, metrics = step(old, batches[0])
  ref.check_metrics(metrics, 0)
  if not any(x.is_deleted() for x in jax.tree.leaves(old)):
    pytest.fail("the step donated none of the state it was given")
  with pytest.raises(hs.HetSpmdError, match="donated to an earlier call.*pass the state the last call returned"):
    step(old, batches[1])
  state, metrics = step(state, batches[1])
  ref.check_metrics(metrics, 1)


@pytest.mark.timeout(120)
def test_a_state_placed_by_another_plans_step_points_to_shard_state():
  other = hs.parallelize(WORKLOAD.make_train_step(), cluster=_cluster(KINDS[:4]), global_batch=16)
  state = other.shard_state(WORKLOAD.init_state(0))
  step = _step()
  with pytest.raises(hs.HetSpmdError, match=r"lies on devices \[0, 1, 2, 3\].*step.shard_state\(state\)"):
    step(state, _batch())
  ref = Reference(WORKLOAD.make_train_step(), WORKLOAD.init_state(0)).run([_batch()])
  _, metrics = step(step.shard_state(state), _batch())  # the way the message points to
  ref.check_metrics(metrics, 0)


def test_a_plan_file_for_other_device_kinds_is_refused(tmp_path):
  path = tmp_path / "plan.json"
  hs.plan_for(_cluster(), WORKLOAD.init_state(0), global_batch=16).save(path)
  step = hs.parallelize(WORKLOAD.make_train_step(), cluster=_cluster(["A100-40GB"] * 8), plan=str(path),
                        global_batch=16)
  with pytest.raises(hs.HetSpmdError, match="made for devices 4 V100-32GB, 4 P100-16GB.*are 8 A100-40GB"):
    step.shard_state(WORKLOAD.init_state(0))


def test_a_cluster_spec_string_is_the_cluster_on_jaxs_devices():
  """``parallelize(cluster="4xV100-32GB+4xP100-16GB")``: the spec, bound to JAX's devices in order, as
  ``Cluster.emulate`` binds them (it raised AttributeError)."""
  state = WORKLOAD.init_state(0)
  by_spec = hs.parallelize(WORKLOAD.make_train_step(), cluster=SPEC, global_batch=16)
  by_spec.shard_state(state)
  emulated = _step()
  emulated.shard_state(state)
  assert by_spec.plan.device_kinds == tuple(KINDS) and by_spec.plan.device_ids == tuple(range(8))
  assert by_spec.plan.microbatch_counts == emulated.plan.microbatch_counts


# --- the library, one bad input each ---------------------------------------------------------------------------


def _plan_json(**changes):
  plan = hs.plan_for(_cluster(), WORKLOAD.init_state(0), global_batch=16)
  return hs.Plan.from_json({**plan.to_json(), **changes})


def _search(**options):
  return hs.search(WORKLOAD.make_train_step(), WORKLOAD.abstract_state(), WORKLOAD.example_batch(2, None),
                   _cluster(), **{"global_batch": 16, **options})


def _feature_cut():
  batch = dict(_batch())
  batch["inputs"] = batch["inputs"][:, :3]
  return batch


# (case, the bad call, the error, what the message must say); each raised a raw error or said too little before,
# unless marked "clear already"
LIBRARY = [
    ("preset typo in a spec", lambda: hs.Cluster.resolve("amp-t4-v10"), hs.UnknownNameError,
     r"neither a cluster preset.*Did you mean 'amp-t4-v100'\?.*Presets: hap-v100-p100"),
    ("preset typo", lambda: hs.Cluster.preset("hap-v100"), hs.UnknownNameError, "Did you mean 'hap-v100-p100'"),
    ("device kind typo", lambda: hs.Cluster.parse("4xV100"), hs.InvalidValueError, "Did you mean 'V100-"),
    ("emulate kinds a bare string", lambda: hs.Cluster.emulate(jax.devices()[:8], kinds="V100-32GB"),
     hs.InvalidValueError, r"one kind per device.*kinds=\['V100-32GB'\] \* 8"),
    ("emulate kinds of another length (clear already)", lambda: hs.Cluster.emulate(jax.devices()[:8], kinds=KINDS[:7]),
     hs.InvalidValueError, "got 8 devices but 7 kinds"),
    ("resolve None", lambda: hs.Cluster.resolve(None), hs.InvalidValueError, "preset name, a cluster TOML file"),
    ("resolve a folder", lambda: hs.Cluster.resolve(os.path.dirname(__file__)), hs.InvalidValueError,
     "is a folder"),
    ("empty spec (clear already)", lambda: hs.Cluster.parse(""), hs.InvalidValueError, "non-empty string"),
    ("bad link (clear already)", lambda: hs.Cluster.parse("4xV100-32GB;inter=fast"), hs.InvalidValueError,
     "unknown link 'fast'"),
    ("zero devices (clear already)", lambda: hs.Cluster.parse("0xV100-32GB"), hs.InvalidValueError,
     "must be positive"),
    ("plan typo", lambda: _step(plan="serach"), hs.InvalidValueError,
     r"'auto', 'search', a Plan, a GroupPlan, a plan's JSON object.*or the path.*did you mean plan='search'\?"),
    ("plan a number (clear already, now at parallelize())", lambda: _step(plan=3), hs.InvalidValueError,
     "plan must be 'auto', 'search'"),
    ("plan a folder", lambda: _step(plan=os.path.dirname(__file__)), hs.InvalidValueError, "a directory"),
    ("cluster a number", lambda: _step(cluster=8), hs.InvalidValueError, "preset name, cluster TOML file or spec"),
    ("cluster spec of another size", lambda: _step(cluster="2xV100-32GB"), hs.InvalidValueError,
     "has 2 devices but JAX sees"),
    ("donate_state a string", lambda: _step(donate_state="yes"), hs.InvalidValueError, "True or False"),
    ("group_plans a string", lambda: _step(group_plans="no"), hs.InvalidValueError, "True or False"),
    ("global_batch 0 (clear already)", lambda: _step(global_batch=0), hs.InvalidValueError, "positive integer"),
    ("global_batch a float (clear already)", lambda: _step(global_batch=16.0), hs.InvalidValueError,
     "positive integer, got 16.0"),
    ("microbatch not dividing (clear already)", lambda: _step(microbatch=3), hs.InvalidValueError,
     "positive divisor of the global batch 16"),
    ("batch_stats typo (clear already)", lambda: _step(batch_stats="exactly"), hs.InvalidValueError,
     "'local'.*or 'exact'"),
    ("batch too small for the step (clear already)", lambda: _step()(WORKLOAD.init_state(0), _batch(size=8)),
     hs.HetSpmdError, "no argument of the step is a batch of 16 examples"),
    ("batch of other features", lambda: _step()(WORKLOAD.init_state(0), _feature_cut()), hs.TraceError,
     r"raised TypeError when traced on the batch \{'inputs': 'float32\[16, 3\]'"),
    # the step's own KeyError stays its own, with the batch it was traced on as a note (pytest matches notes too)
    ("batch missing a key", lambda: _step()(WORKLOAD.init_state(0), {"inputs": _batch()["inputs"]}), KeyError,
     r"'labels'[\s\S]*hetspmd: the step raised this when traced on the batch \{'inputs': 'float32\[16, 32\]'\}"),
    ("example_batch of other keys", lambda: _step(plan="search", example_batch={"x": np.ones((2, 3))})(
        WORKLOAD.init_state(0), _batch()), KeyError,
     r"'inputs'[\s\S]*hetspmd: the step raised this when traced on the batch \{'x': 'float64\[2, 3\]'\}"),
    ("search top 0", lambda: _search(top=0), hs.InvalidValueError, "top .* positive integer, got 0"),
    ("search global_batch -1 (clear already)", lambda: _search(global_batch=-1), hs.InvalidValueError,
     "positive integer"),
    ("unknown remat policy (clear already)", lambda: hs.plan_for(_cluster(), WORKLOAD.init_state(0), global_batch=16,
                                                                 remat="everything"),
     hs.InvalidValueError, "remat policy must be one of"),
    ("plan of another global batch (clear already)", lambda: hs.parallelize(
        WORKLOAD.make_train_step(), plan=_plan_json(), global_batch=32).shard_state(WORKLOAD.init_state(0)),
     hs.HetSpmdError, "global batch of 16"),
    ("plan JSON schema 99 (clear already)", lambda: _plan_json(schema=99), hs.InvalidValueError,
     r"schema 99 is not supported.*\[1, 2, 3, 4\]"),
    ("plan JSON of wrong types", lambda: _plan_json(global_batch="x"), hs.InvalidValueError, "wrong type"),
    ("plan JSON mesh a list", lambda: _plan_json(mesh=[1, 2]), hs.InvalidValueError, "wrong type"),
    ("plan JSON not an object", lambda: hs.Plan.from_json([1, 2]), hs.InvalidValueError, "got a list"),
    ("model typo", lambda: models.get("gpt2-tinyy"), hs.UnknownNameError, "Did you mean 'gpt2-tiny'"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("call,error,message", [c[1:] for c in LIBRARY], ids=[c[0] for c in LIBRARY])
def test_library_bad_inputs_say_what_would_be_right(call, error, message):
  require_devices(8)
  with pytest.raises(error, match=message):
    call()


# --- the command line -------------------------------------------------------------------------------------------


@pytest.fixture
def files(tmp_path):
  (tmp_path / "bad.toml").write_text("not = [valid")
  (tmp_path / "schema.toml").write_text("[hosts]\nfoo = 1\n")
  (tmp_path / "dir.toml").mkdir()
  (tmp_path / "folder").mkdir()
  (tmp_path / "list.json").write_text("[1, 2]")
  (tmp_path / "text.json").write_text("hello")
  (tmp_path / "schema99.json").write_text('{"schema": 99}')
  group_plan([((0, 1), 1, (2, 2))], 4).save(tmp_path / "groups.json")
  return tmp_path


SEARCH = ["search", "--model", "mlp-tiny", "--global-batch", "8"]

# (case, argv with {tmp} for the fixture's folder, exit status, what stderr must say)
CLI = [
    ("preset typo", SEARCH + ["--cluster", "amp-t4-v10"], 2,
     r"neither a cluster preset.*Did you mean 'amp-t4-v100'\?.*Presets: hap-v100-p100"),
    ("spec cut short (clear already)", SEARCH + ["--cluster", "4xV100-32GB+"], 2, "malformed cluster spec at ''"),
    ("negative global batch (clear already)", ["search", "--global-batch", "-4"], 2, "positive integer, got -4"),
    ("--top 0 (clear already)", ["search", "--top", "0"], 2, "positive integer, got 0"),
    ("--model without a name (clear already)", ["search", "--model"], 2, "expected one argument"),
    ("unknown model", ["search", "--model", "gpt2-tyni"], 2, "Did you mean 'gpt2-tiny'"),
    ("missing cluster file (clear already)", SEARCH + ["--cluster", "{tmp}/missing.toml"], 2, "does not exist"),
    ("malformed TOML (clear already)", SEARCH + ["--cluster", "{tmp}/bad.toml"], 2, "not valid TOML"),
    ("cluster TOML of another schema (clear already)", SEARCH + ["--cluster", "{tmp}/schema.toml"], 2,
     "missing key 'device'"),
    ("unreadable cluster file", SEARCH + ["--cluster", "{tmp}/dir.toml"], 2, "cannot read cluster file"),
    ("cluster a folder", SEARCH + ["--cluster", "{tmp}/folder"], 2, "is a folder"),
    ("sequence past the context (clear already)", ["search", "--model", "gpt2-tiny", "--seq", "99999"], 2,
     "exceeds the model's context of 128"),
    ("--out in a missing folder", SEARCH + ["--out", "{tmp}/nope/plan.json"], 2, "folder .* does not exist"),
    ("--out a folder", SEARCH + ["--out", "{tmp}/folder"], 2, "is a folder"),
    ("--group-plan-out in a missing folder", SEARCH + ["--group-plan-out", "{tmp}/nope/g.json"], 2,
     "does not exist"),
    ("profile --out in a missing folder", ["profile", "--out", "{tmp}/nope/c.toml"], 2, "does not exist"),
    ("profile --devices past JAX's", ["profile", "--devices", "100"], 2, "JAX sees 8 device"),
    ("explain a JSON list", ["explain", "{tmp}/list.json"], 2, "got a list"),
    ("explain a folder", ["explain", "{tmp}/folder"], 2, "cannot read plan file"),
    ("explain text (clear already)", ["explain", "{tmp}/text.json"], 2, "not valid JSON"),
    ("explain schema 99 (clear already)", ["explain", "{tmp}/schema99.json"], 2, "schema 99 is not supported"),
    ("explain --png of a group plan", ["explain", "{tmp}/groups.json", "--png", "{tmp}/p.png"], 2,
     "is a group plan"),
    ("explain --png in a missing folder", ["explain", "{tmp}/schema99.json", "--png", "{tmp}/nope/p.png"], 2,
     "does not exist"),
    ("no command (clear already)", [], 2, "required: COMMAND"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv,status,message", [c[1:] for c in CLI], ids=[c[0] for c in CLI])
def test_cli_bad_inputs_say_what_would_be_right(files, capsys, argv, status, message):
  require_devices(8)
  argv = [a.replace("{tmp}", str(files)) for a in argv]
  try:
    code = main(argv)
  except SystemExit as e:  # argparse's usage errors
    code = e.code
  err = capsys.readouterr().err
  assert code == status
  assert "Traceback" not in err
  assert len([l for l in err.splitlines() if "error:" in l]) == 1, err
  assert re.search(message, err, re.S), err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("option", ["--out", "--group-plan-out"])
def test_a_failed_write_comes_after_the_results(tmp_path, capsys, monkeypatch, option):
  """A write that fails after the search (the disk full, the file taken away) is reported after the printed
  results, with a non-zero exit: nothing of the search is lost."""
  def refuse(self, path):
    raise PermissionError(13, "Permission denied", str(path))

  monkeypatch.setattr(hs.Plan, "save", refuse)
  monkeypatch.setattr(hs.GroupPlan, "save", refuse)
  path = tmp_path / "out.json"
  assert main(["search", "--model", "mlp-tiny", "--cluster", "2xV100-32GB+2xP100-16GB", "--global-batch", "8",
               option, str(path)]) == 2
  out, err = capsys.readouterr()
  assert "searched" in out and "dp_even" in out  # the results are printed
  assert f"was not written to {path}: Permission denied (the results are printed above)" in err
  assert not path.exists()


@pytest.mark.timeout(120)
def test_profile_reports_a_failed_write_after_its_table(tmp_path, capsys, monkeypatch):
  def refuse(self, path):
    raise PermissionError(13, "Permission denied", str(path))

  monkeypatch.setattr(hs.Cluster, "save", refuse)
  assert main(["profile", "--devices", "1", "--out", str(tmp_path / "c.toml")]) == 2
  out, err = capsys.readouterr()
  assert "measured 1 cpu device(s)" in out and "the measured cluster was not written" in err


# --- the example's resume --------------------------------------------------------------------------------------


def test_resume_skips_a_checkpoint_whose_save_was_killed(tmp_path):
  """A save killed midway leaves orbax's ``step_N.orbax-checkpoint-tmp-*`` folder: resume takes the latest
  complete step (it raised ValueError on the folder's name)."""
  import orbax.checkpoint as ocp

  from test_example import _example

  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "step_4", {"w": np.ones(3, np.float32)})
  checkpointer.wait_until_finished()
  (tmp_path / "step_8.orbax-checkpoint-tmp-1733").mkdir()
  example = _example()
  assert example._latest(str(tmp_path)) == str(tmp_path / "step_4")
  only_killed = tmp_path / "killed"
  (only_killed / "step_4.orbax-checkpoint-tmp-1").mkdir(parents=True)
  with pytest.raises(SystemExit, match="no checkpoint"):
    example._latest(str(only_killed))
