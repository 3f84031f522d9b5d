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
