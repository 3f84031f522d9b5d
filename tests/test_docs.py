"""Every ``python`` block of README.md and docs/*.md runs, top to bottom per file, as a reader would paste it.

A block may use what an earlier block of the same file defined, and nothing else. A block that cannot run on
a CPU-only machine says so: ``<!-- no-run: reason -->`` on the line before its fence (the page says why).
"""

import math
import pathlib
import re

import pytest

from conftest import require_devices

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TUTORIALS = sorted(DOCS.glob("tutorial-*.md"))
PAGES = [ROOT / "README.md"] + sorted(DOCS.glob("*.md"))
NO_RUN = re.compile(r"<!--\s*no-run:\s*(.+?)\s*-->\s*\n$")
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```", flags=re.S | re.M)


def python_blocks(text: str) -> list[str]:
  """The ``python`` blocks that run: not after a ``<!-- no-run: reason -->`` line."""
  out = []
  for m in FENCE.finditer(text):
    if m.group(1) != "python":
      continue
    if NO_RUN.search(text[:m.start()]) is None:
      out.append(m.group(3))
  return out


def _with_python(pages: list[pathlib.Path]) -> list[pathlib.Path]:
  return [p for p in pages if re.search(r"^```python", p.read_text(), flags=re.M)]


def run_page(path: pathlib.Path) -> dict:
  namespace = {"__name__": f"docs_{path.stem}"}
  blocks = python_blocks(path.read_text())
  assert blocks, f"{path.name}: no python block runs"
  for i, block in enumerate(blocks):
    exec(compile(block, f"{path.name} block {i + 1}", "exec"), namespace)
  return namespace


def kinds_at_work(step) -> dict[str, set[int]]:
  """{device kind: the microbatch counts its devices run} under a single program's plan."""
  plan = step.plan
  per = len(plan.device_ids) // plan.data_size
  out: dict[str, set[int]] = {}
  for i, count in enumerate(plan.microbatch_counts):
    for kind in plan.device_kinds[i * per:(i + 1) * per]:
      out.setdefault(kind, set()).add(count)
  return out


def assert_mixed_split(step, kinds: set[str]) -> None:
  """Both kinds run microbatches, and the counts differ by kind: weighted work, no idle kind."""
  assert not step.grouped
  work = kinds_at_work(step)
  assert set(work) == kinds, work
  assert all(max(counts) > 0 for counts in work.values()), work
  first, second = work.values()
  assert not first & second, f"the counts do not differ by kind: {work}"


def test_every_page_with_python_runs_here():
  ran = {p.name for p in _with_python(PAGES)}
  assert {"README.md", "tutorial-nnx.md", "tutorial-linen.md", "group-programs.md", "pipeline.md",
          "how-it-works.md"} <= ran
  assert {p.name for p in TUTORIALS} >= {"tutorial-nnx.md", "tutorial-linen.md"}


def test_no_run_marker_is_read():
  text = "a\n<!-- no-run: needs two processes -->\n```python\nboom()\n```\n\n```python\nok = 1\n```\n"
  assert python_blocks(text) == ["ok = 1\n"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", _with_python(PAGES), ids=lambda p: p.stem)
def test_page_runs(path, tmp_path, monkeypatch):
  require_devices(8)
  monkeypatch.chdir(tmp_path)
  namespace = run_page(path)
  check = CHECKS.get(path.name)
  if check:
    check(namespace)


def _tutorial_losses(namespace: dict) -> None:
  losses = namespace["losses"]  # every tutorial trains a few steps on one fixed batch
  assert len(losses) >= 3 and all(map(math.isfinite, losses)) and losses[-1] < losses[0]


def _nnx(namespace: dict) -> None:
  _tutorial_losses(namespace)
  assert_mixed_split(namespace["step"], {"V100-32GB", "P100-16GB"})


def _linen(namespace: dict) -> None:
  _tutorial_losses(namespace)
  assert_mixed_split(namespace["searched"], {"V100-32GB", "T4"})


def _readme(namespace: dict) -> None:
  loss = float(namespace["metrics"]["loss"])
  assert math.isfinite(loss) and loss < 2.4  # from about 2.5 (10 classes) after 5 steps on one batch
  assert namespace["train_step"].plan.predicted  # the plan came from the search
  assert_mixed_split(namespace["train_step"], {"V100-32GB", "P100-16GB"})
  assert namespace["loaded"] == namespace["named"]
  explained = namespace["train_step"].explain()
  assert "predicted efficiency: " in explained and "%" in explained.split("predicted efficiency: ")[1].split("\n")[0]
  assert not re.search(r"\de[+-]\d", explained), explained  # numbers as hetspmd explain prints them


def _group_programs(namespace: dict) -> None:
  import jax

  assert math.isfinite(float(namespace["metrics"]["loss"]))
  held = [s for s in jax.tree.leaves(namespace["step"].state_shardings(namespace["state"]))
          if isinstance(s, jax.sharding.SingleDeviceSharding)]
  assert held  # the second block's plan holds state leaves in shares, each on one device


def _pipeline(namespace: dict) -> None:
  assert namespace["plan"].stages == namespace["layers"] and math.isfinite(float(namespace["metrics"]["loss"]))
  positions = [line for line in namespace["train_step"].explain().splitlines() if line.startswith("  data[")]
  assert len(positions) == 4 and all("(V100-32GB, P100-16GB)" in line for line in positions), positions


CHECKS = {"README.md": _readme, "tutorial-nnx.md": _nnx, "tutorial-linen.md": _linen,
          "group-programs.md": _group_programs, "pipeline.md": _pipeline}


def code_blocks(text: str) -> list[tuple[str, str]]:
  return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_is_short_and_opens_with_the_two_commands():
  readme = (ROOT / "README.md").read_text()
  assert len(readme.splitlines()) <= 300 and len(readme.encode()) <= 20 * 1024
  (lang1, first), (lang2, second) = code_blocks(readme)[:2]
  assert lang1 == lang2 == "bash"
  assert first.strip() == ("python3 -m venv .venv && . .venv/bin/activate && pip install . && "
                           "hetspmd search --model gpt2-small --cluster amp-t4-v100")
  ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
  assert second.strip() == ci[-1]  # CI runs the README's test command, after removing .venv
  assert ci[-2] == "rm -rf .venv"


# --- the README's sample outputs, against the commands they show ------------------------------------------------

SAMPLE = re.compile(r"^```\n\$ (hetspmd [^\n]*)\n(.*?)^```", flags=re.S | re.M)
SAMPLE_ARGS = {"profile": ["--devices", "2"]}  # two devices measure in seconds; the columns are the same


def template(line: str) -> str:
  """A line without what varies from run to run: numbers, SI prefixes, bars; ``...`` where the sample elides. A
  kind given no microbatch (``4xT4:0``) stays told apart from one at work."""
  line = re.sub(r"\s[#~]+\s*$", "", line)
  line = re.sub(r"(x[\w-]+):0\b(?!\.)", r"\1:idle", line)
  line = re.sub(r"\d+(\.\d+)?", "N", line)
  line = re.sub(r"N [kMGTP]?(B/s|FLOP/s|B)\b", r"N \1", line)
  line = re.sub(r"N (s|ms|us|µs)\b", "N s", line)
  return " ".join(line.split())


def readme_samples() -> list[tuple[str, list[str]]]:
  text = (ROOT / "README.md").read_text()
  return [(command, body.splitlines()) for command, body in SAMPLE.findall(text)]


def test_readme_shows_the_three_samples():
  assert [c.split()[1] for c, _ in readme_samples()] == ["search", "explain", "profile"]


@pytest.mark.timeout(300)
def test_readme_samples_match_the_commands(tmp_path, monkeypatch, capsys):
  """Every line of each sample has the columns and row names of a line the command prints now."""
  require_devices(8)
  from hetspmd.cli import main

  monkeypatch.chdir(tmp_path)
  for command, lines in readme_samples():
    argv = command.split()[1:]
    assert main(argv + SAMPLE_ARGS.get(argv[0], [])) == 0, command
    printed = [template(line) for line in capsys.readouterr().out.splitlines()]
    for line in lines:
      want = template(line)
      if want in ("...", ""):
        continue
      if want.endswith(" ..."):
        assert any(p.startswith(want[:-4]) for p in printed), (command, line)
      else:
        assert want in printed, (command, line, printed)


def test_the_readme_headlines_quote_only_figures_results_md_holds():
  """Every number in the README's Results headlines is one benchmarks/RESULTS.md prints (figures live there)."""
  readme = (ROOT / "README.md").read_text()
  headlines = readme[readme.index("## Results"):readme.index("## Limits")]
  headlines = headlines[headlines.index("Headlines:"):]
  results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
  figures = re.findall(r"\d+\.\d+", headlines)
  assert figures
  missing = [f for f in figures if not re.search(rf"(?<![\d.]){re.escape(f)}(?![\d])", results)]
  assert not missing, f"README figures not in RESULTS.md: {missing}"
