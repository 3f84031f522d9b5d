"""The package's shape, read from its source with ``ast`` (nothing is imported).

Imports run one way, down the pipeline's layers; there are no circles
between modules or between packages; one adapter module is the only door to
JAX internals; every error raised on purpose is a ``HetSpmdError``; functions
read in one screen and take a handful of positional parameters.
"""

from __future__ import annotations

import ast
import pathlib
import re
from collections import defaultdict

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {"hetspmd": "hetspmd", "passes": "hetspmd.passes", "models": "hetspmd.models"}
ADAPTER = "hetspmd.passes._jax_adapter"

# The layers, lowest first: a module may import its own layer and the layers below it, never one above.
LAYERS = (
    ("leaves", ("hetspmd._version", "hetspmd._pytree", "hetspmd._dtypes", "hetspmd._format", "hetspmd.errors", ADAPTER)),
    ("autodiff", ("hetspmd.autodiff",)),
    ("passes", ("hetspmd.passes",)),
    ("hardware", ("hetspmd.hardware",)),
    ("plan", ("hetspmd.plan",)),
    ("planner", ("hetspmd.planner",)),
    ("lowering", ("hetspmd.lowering",)),
    ("runtime", ("hetspmd.runtime",)),
    ("models", ("hetspmd.models",)),
    ("facade", ("hetspmd", "hetspmd.__main__", "hetspmd.cli", "hetspmd.report", "hetspmd.search_report",
                 "hetspmd.step_search")),
)
MAX_FUNCTION_LINES = 80
MAX_POSITIONAL = 6
BUILTIN_ERRORS = {"ValueError", "TypeError", "KeyError", "RuntimeError", "IndexError", "AssertionError"}
INTERNAL_IMPORT = re.compile(r"^jax\._src\b|^jax\.interpreters\b|^jax\.core$|^jax\.extend\b")
INTERNAL_USE = re.compile(r"\.jaxpr\.jaxpr\b|\bmake_jaxpr\(|\.as_text\(\)")


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for folder, package in PACKAGES.items():
    for path in sorted((ROOT / folder).rglob("*.py")):
      parts = path.relative_to(ROOT / folder).with_suffix("").parts
      name = ".".join((package,) + parts)
      out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
  return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _layer(module: str) -> int:
  best, depth = None, -1
  for index, (_, prefixes) in enumerate(LAYERS):
    for prefix in prefixes:
      if (module == prefix or module.startswith(prefix + ".") and prefix != "hetspmd") and len(prefix) > depth:
        best, depth = index, len(prefix)
  if best is None:
    raise AssertionError(f"{module} belongs to no layer; name it in LAYERS")
  return best


def _imported(module: str, node: ast.AST) -> set[str]:
  """The project modules an import statement brings in."""
  if isinstance(node, ast.Import):
    names = [a.name for a in node.names]
  else:
    base = node.module or ""
    if node.level:
      parts = module.split(".")
      if not str(MODULES[module]).endswith("__init__.py"):
        parts = parts[:-1]
      base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
    names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
  found = set()
  for name in names:
    while name and name not in MODULES:
      name = name.rpartition(".")[0]
    if name and name != module:
      found.add(name)
  return found


def _graph() -> dict[str, set[str]]:
  graph = defaultdict(set)
  for module, tree in TREES.items():
    graph[module]
    for node in ast.walk(tree):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        graph[module] |= _imported(module, node)
  return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one node (Tarjan)."""
  index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in list(graph):
    if v not in index:
      visit(v)
  return out


def test_every_module_has_a_layer():
  for module in MODULES:
    _layer(module)


def test_imports_run_down_the_layers():
  upward = [f"{a} ({LAYERS[_layer(a)][0]}) imports {b} ({LAYERS[_layer(b)][0]})"
            for a, targets in _graph().items() for b in targets if _layer(b) > _layer(a)]
  assert not upward, "imports that run up the layers:\n" + "\n".join(sorted(upward))


def test_no_import_circles_between_modules():
  assert not _circles(_graph())


def test_no_import_circles_between_packages():
  def package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:3]) if module.startswith("hetspmd.passes.") else ".".join(parts[:2])

  packages = defaultdict(set)
  for a, targets in _graph().items():
    for b in targets:
      if package(a) != package(b):
        packages[package(a)].add(package(b))
  assert not _circles(packages)


def test_passes_import_only_leaves_and_themselves():
  leaves = set(LAYERS[0][1])
  outside = [f"{a} imports {b}" for a, targets in _graph().items() if a.startswith("hetspmd.passes")
             for b in targets if not b.startswith("hetspmd.passes") and b not in leaves]
  assert not outside, "\n".join(outside)


def test_the_adapter_imports_only_the_error_family():
  assert _graph()[ADAPTER] <= {"hetspmd.errors"}
  assert not _graph()["hetspmd.errors"]


def test_jax_internals_only_in_the_adapter():
  found = []
  for module, tree in TREES.items():
    if module == ADAPTER:
      continue
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module and INTERNAL_IMPORT.search(node.module):
        found.append(f"{module}:{node.lineno} imports {node.module}")
      if isinstance(node, ast.Import):
        found += [f"{module}:{node.lineno} imports {a.name}" for a in node.names if INTERNAL_IMPORT.search(a.name)]
    for number, line in enumerate(MODULES[module].read_text().splitlines(), 1):
      if INTERNAL_USE.search(line) and not line.lstrip().startswith("#"):
        found.append(f"{module}:{number} {line.strip()}")
  assert not found, "\n".join(found)


def test_errors_raised_on_purpose_are_in_the_family():
  bare = []
  for module, tree in TREES.items():
    for node in ast.walk(tree):
      if isinstance(node, ast.Raise) and node.exc is not None:
        call = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        if isinstance(call, ast.Name) and call.id in BUILTIN_ERRORS:
          bare.append(f"{module}:{node.lineno} raises {call.id}")
  assert not bare, "\n".join(bare)


def _functions():
  for module, tree in TREES.items():
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        yield module, node


def test_functions_read_in_one_screen():
  long = [f"{module}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
          for module, node in _functions() if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
  assert not long, "\n".join(long)


def test_functions_take_few_positional_parameters():
  many = []
  for module, node in _functions():
    names = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
    if len(names) > MAX_POSITIONAL:
      many.append(f"{module}:{node.lineno} {node.name}{tuple(names)}")
  assert not many, "\n".join(many)


def test_no_module_is_shadowed_by_a_name_its_package_exports():
  """``hetspmd.search`` the function once hid ``hetspmd.search`` the module: a package's re-export of a name
  must not be the name of one of its own submodules."""
  shadowed = [f"{package}.{a.asname or a.name} (from {node.module})"
              for package, tree in TREES.items() if str(MODULES[package]).endswith("__init__.py")
              for node in tree.body if isinstance(node, ast.ImportFrom) and node.module != package
              for a in node.names if f"{package}.{a.asname or a.name}" in MODULES]
  assert not shadowed, "re-exports that hide a submodule of the same name: " + ", ".join(shadowed)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not str(MODULES[m]).endswith("__main__.py")))
def test_every_module_says_what_it_is(module):
  assert ast.get_docstring(TREES[module]), f"{module} has no docstring"
