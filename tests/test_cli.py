"""The hetspmd command line."""

import json

import pytest

from hetspmd.cli import main


def test_trace_json_has_the_documented_keys(capsys):
  assert main(["trace", "--model", "gpt2-tiny", "--batch", "2", "--seq", "16", "--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  for key in ("model", "params", "flops_per_step", "layers", "unknown_primitives"):
    assert key in report
  assert report["model"] == "gpt2-tiny"
  assert report["batch"] == {"inputs": [2, 16], "targets": [2, 16]}
  layers = {l["name"]: l for l in report["layers"]}
  assert layers["h_1/attn"]["repeat_of"] == "h_0/attn"
  assert sum(l["flops"] for l in report["layers"]) == pytest.approx(report["flops_per_step"])
  assert report["unknown_primitives"] == []


def test_trace_table_for_people(capsys):
  assert main(["trace", "--model", "mlp-tiny"]) == 0
  out = capsys.readouterr().out
  assert "parameters       6,792" in out
  assert "dense_0" in out and "dot_general" in out


def test_list_shows_every_model(capsys):
  assert main(["trace", "--list", "--json"]) == 0
  rows = json.loads(capsys.readouterr().out)
  assert {"gpt2-small", "mlp-tiny"} <= {r["name"] for r in rows}


@pytest.mark.parametrize("argv,message", [
    (["trace", "--model", "nope"], "unknown model 'nope'; known models: mlp-tiny"),
    (["trace", "--model", "gpt2-tiny", "--seq", "999"], "exceeds the model's context"),
    (["trace", "--model", "mlp-tiny", "--seq", "8"], "no sequence axis"),
])
def test_errors_say_what_is_valid(capsys, argv, message):
  assert main(argv) == 2
  assert message in capsys.readouterr().err


def test_non_positive_sizes_are_usage_errors(capsys):
  with pytest.raises(SystemExit) as exit_info:
    main(["trace", "--batch", "0"])
  assert exit_info.value.code == 2
  assert "expected a positive integer, got 0" in capsys.readouterr().err


def _plan(per_position: bool):
  from hetspmd.plan.value import Plan

  extra = {}
  if per_position:
    extra["predicted_per_position"] = (("compute_seconds", (0.30, 0.28, 0.31)),
                                       ("communication_seconds", (0.05, 0.05, 0.05)),
                                       ("memory_bytes", (8e9, 8e9, 12e9)))
  return Plan(axis_names=("data", "model"), mesh_shape=(3, 1), device_ids=(0, 1, 2), global_batch=24, microbatch=2,
              microbatch_counts=(5, 5, 2), device_kinds=("V100-32GB", "V100-32GB", "P100-16GB"),
              state_specs=(("params/w", ()),), predicted=(("step_seconds", 0.36), ("throughput", 66.7)), **extra)


def test_explain_draws_per_position_bars(tmp_path, capsys):
  path = tmp_path / "plan.json"
  _plan(per_position=True).save(path)
  assert main(["explain", str(path)]) == 0
  out = capsys.readouterr().out
  lines = out.splitlines()
  work = [l for l in lines if "mb" in l and "data[" in l]
  assert len(work) == 3 and work[0].count("#") == 30 and work[2].count("#") == 12  # 5 vs 2 microbatches
  memory = [l for l in lines[lines.index("memory per device (predicted / capacity)"):] if "data[" in l]
  assert "8.00 GB /" in memory[0] and "12.00 GB /" in memory[2]
  assert memory[2].count("#") > memory[0].count("#")  # 12 GB of 16 GB vs 8 GB of 32 GB
  assert "time per step" in out and "~" in out


def test_explain_json_and_png(tmp_path, capsys):
  path = tmp_path / "plan.json"
  _plan(per_position=True).save(path)
  assert main(["explain", str(path), "--json", "--png", str(tmp_path / "plan.png")]) == 0
  report = json.loads(capsys.readouterr().out)
  assert [r["microbatches"] for r in report["positions"]] == [5, 5, 2]
  assert report["positions"][2]["memory_capacity_bytes"] == 16 * 2**30
  png = (tmp_path / "plan.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_explain_without_predictions_shows_the_work_split(tmp_path, capsys):
  path = tmp_path / "plan.json"
  _plan(per_position=False).save(path)
  assert main(["explain", str(path)]) == 0
  out = capsys.readouterr().out
  assert "work (share of the global batch)" in out and "time per step" not in out


def test_explain_of_a_missing_file_says_so(tmp_path, capsys):
  assert main(["explain", str(tmp_path / "nope.json")]) == 2
  assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("name", __import__("hetspmd.models").models.names())
def test_trace_works_for_every_zoo_model(name, capsys):
  from hetspmd import models

  assert main(["trace", "--model", name, "--batch", "1", "--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["params"] == models.get(name).param_count()
  assert report["flops_per_step"] > 0 and report["unknown_primitives"] == []


def test_list_names_sizes_and_papers(capsys):
  assert main(["trace", "--list"]) == 0
  out = capsys.readouterr().out
  for needle in ("bert-large", "Devlin et al., 2019", "vit-b16", "Dosovitskiy", "resnet50", "He et al., 2016",
                 "gpt3-13b", "Brown et al., 2020", "bert-moe-base", "linen-lm-350m", "12.85 G"):
    assert needle in out


def test_explain_collapses_runs_of_identical_positions(tmp_path, capsys):
  from hetspmd.plan.value import Plan

  plan = Plan(axis_names=("data", "model"), mesh_shape=(5, 1), device_ids=tuple(range(5)), global_batch=18,
              microbatch=2, microbatch_counts=(2, 2, 2, 2, 1), device_kinds=("V100-32GB",) * 4 + ("P100-16GB",),
              state_specs=(("params/w", ()),))
  plan.save(tmp_path / "plan.json")
  assert main(["explain", str(tmp_path / "plan.json")]) == 0
  work = [l.split() for l in capsys.readouterr().out.splitlines() if l.startswith("  data[")]
  assert [w[:3] for w in work] == [["data[0-3]", "V100-32GB", "2"], ["data[4]", "P100-16GB", "1"]]


def test_search_plan_explains_time_and_memory_per_position(tmp_path, capsys):
  plan_path = tmp_path / "plan.json"
  assert main(["search", "--model", "gpt2-tiny", "--cluster", "2xV100-32GB+2xP100-16GB", "--global-batch", "16",
               "--out", str(plan_path), "--json"]) == 0
  capsys.readouterr()
  assert main(["explain", str(plan_path), "--json"]) == 0
  rows = json.loads(capsys.readouterr().out)["positions"]
  for key in ("compute_seconds", "communication_seconds", "memory_bytes", "memory_capacity_bytes"):
    assert all(row[key] > 0 for row in rows), key
  assert max(r["compute_seconds"] for r in rows) <= json.load(open(plan_path))["predicted"]["compute_seconds"] + 1e-12


def test_search_shows_the_group_plan_where_no_single_program_fits(tmp_path, capsys):
  """GPT-3 2.7B in bfloat16 on Cephalo's workstation: no single program fits, so the search says so and shows
  (and writes) the best group plan, in the table and under --json."""
  argv = ["search", "--model", "gpt3-2.7b", "--cluster", "cephalo-workstation", "--global-batch", "64", "--seq",
          "512", "--dtype", "bfloat16", "--grad-reduce-dtype", "search"]
  out = tmp_path / "groups.json"
  assert main(argv + ["--group-plan-out", str(out)]) == 0
  text = " ".join(capsys.readouterr().out.split())  # the table wraps its words at 100 columns
  assert "no single program fits: no plan fits" in text and "best group plan" in text
  assert "of the parameters and optimizer state per device" in text
  from hetspmd.plan.groups import GroupPlan
  assert GroupPlan.load(out).zero_stage == 3
  assert main(["explain", str(out)]) == 0  # the group plan file, per group and per device
  shown = capsys.readouterr().out
  assert shown.startswith(f"group plan: {len(GroupPlan.load(out).groups)} group program(s), global batch 64")
  work = shown[shown.index("work per device"):].split("\n\n")[0].splitlines()[1:]
  labels = [line.split()[1].split("-") for line in work]
  assert [d for ends in labels for d in range(int(ends[0]), int(ends[-1]) + 1)] == list(GroupPlan.load(out).devices)
  assert "memory per device (predicted / capacity), state share" in shown and "e+0" not in shown
  assert main(argv + ["--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["plans"] == [] and "no plan fits" in report["no_single_program"]
  assert report["group_plan"]["zero_stage"] == 3 and report["devices"] == 4 and report["stage_plans"] == []
  assert main(argv + ["--out", str(tmp_path / "plan.json")]) == 2  # the single program asked for: none fits
  assert "was not written" in capsys.readouterr().err and not (tmp_path / "plan.json").exists()


def test_explain_reads_a_saved_group_plan(tmp_path, capsys):
  from hetspmd.plan.groups import group_plan

  path = tmp_path / "groups.json"
  group_plan([((0, 1), 4, (3, 3)), ((2, 3, 4, 5), 2, (2, 2, 1, 1))], global_batch=42, tail=(1, 1)).save(path)
  assert main(["explain", str(path)]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].startswith("group plan: 2 group program(s), global batch 42, then 1 microbatch(es) of 1")
  assert lines[1].startswith("  group 0: devices [0, 1], 6 microbatches of 4 (24 examples)")
  work = [line.split()[:8] for line in lines if line.startswith("  device")]  # equal neighbours on one line
  assert work == [["devices", "0-1", "group", "0", "3", "x", "4", "13"],
                  ["devices", "2-3", "group", "1", "2", "x", "2", "5"],
                  ["devices", "4-5", "group", "1", "1", "x", "2", "3"]]
  assert main(["explain", str(path), "--json"]) == 0
  rows = json.loads(capsys.readouterr().out)["devices"]
  assert [r["examples"] for r in rows] == [13, 13, 5, 5, 3, 3]
  assert main(["explain", str(path), "--png", str(tmp_path / "g.png")]) == 2
  assert "is a group plan" in capsys.readouterr().err


def test_help_lists_every_link_the_grammar_accepts(capsys):
  from hetspmd.hardware.cluster import Cluster
  from hetspmd.hardware.devices import LINK_PRESETS

  with pytest.raises(SystemExit):
    main(["search", "--help"])
  text = " ".join(capsys.readouterr().out.split())
  listed = text[text.index("LINK is a preset (") + len("LINK is a preset ("):].split(")")[0].split(", ")
  assert listed == list(LINK_PRESETS) and {"pcie3", "pcie5", "nvlink2"} <= set(listed)
  for name in listed:
    assert Cluster.parse(f"2xV100-32GB@{name}").num_devices == 2


def test_calibrate_then_search_on_the_measured_times(tmp_path, capsys):
  """hetspmd calibrate times a zoo model on emulated kinds and writes a calibration; hetspmd search --calibration
  prices those kinds on it and says so; a calibration of another model is refused with what to do."""
  import jax

  from hetspmd.hardware.calibration import Calibration

  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  out = tmp_path / "cal.json"
  assert main(["calibrate", "--model", "mlp", "--devices", "2", "--kinds", "V100-16GB,T4", "--out", str(out)]) == 0
  calibration = Calibration.load(out)
  assert set(calibration.kind_names) == {"V100-16GB", "T4"}
  assert "V100-16GB: per microbatch" in capsys.readouterr().out
  assert main(["search", "--model", "mlp", "--cluster", "amp-t4-v100", "--calibration", str(out), "--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  assert all("the step's measured times" in line for line in report["pricing"])
  assert main(["search", "--model", "gpt2-tiny", "--cluster", "amp-t4-v100", "--calibration", str(out)]) == 2
  assert "measured on another step" in capsys.readouterr().err
  assert main(["calibrate", "--model", "mlp", "--devices", "2", "--kinds", "A,B,C", "--out", str(out)]) == 2
  assert "--kinds names 3 kind(s) for 2 device(s)" in capsys.readouterr().err
  assert main(["calibrate", "--model", "mlp", "--devices", "2", "--remat", "none,sometimes", "--out", str(out)]) == 2
  assert "remats: one or more of ('none', 'all_dots'" in capsys.readouterr().err
