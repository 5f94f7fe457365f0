"""The repository's layout rules: what a user's job imports, and nothing shadowing MaxDiffusion."""

import ast
import importlib.machinery
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "maxdiffusion_svg" / "plugin"


def _imported_modules(path: pathlib.Path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{alias.name}" for alias in node.names)
  return names


def test_the_plugin_imports_neither_fixtures_nor_benchmarks():
  """plugin/ is what a user's job runs; test fixtures and benchmarks live elsewhere."""
  offending = {
      path.name: sorted(m for m in _imported_modules(path)
                        if m.startswith(("maxdiffusion_svg.testing", "maxdiffusion_svg.bench")))
      for path in PLUGIN.glob("*.py")}
  assert len(offending) >= 8, sorted(offending)  # the glob found the package
  assert not {name: found for name, found in offending.items() if found}


# The package's map, lowest layer first (docs/development.md#the-packages-map): a module imports
# only modules of its own layer or below. The top level's entry points sit above everything.
LAYERS = ("plan", "kernels", "routing", "budgets", "call", "parallel", "tpu", "measure",
          "plugin", "testing", "bench", "cli")
PACKAGE = ROOT / "maxdiffusion_svg"


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
  """Module -> the package's modules it imports, anywhere in its source (lazy imports too)."""
  paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}

  def owner(name: str) -> str | None:
    while name and name not in paths:
      name = name.rpartition(".")[0]
    return name or None

  graph = {}
  for module, path in paths.items():
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        imported.update(owner(alias.name) for alias in node.names)
      elif isinstance(node, ast.ImportFrom) and node.module:
        # from a import b: the module a.b where b is one, else a itself (a name from it)
        imported.update(owner(f"{node.module}.{alias.name}") for alias in node.names)
    graph[module] = {m for m in imported if m and m.startswith("maxdiffusion_svg")} - {module}
  return graph


def _layer(module: str) -> int:
  parts = module.split(".")
  if len(parts) < 3 and (len(parts) == 1 or (PACKAGE / f"{parts[1]}.py").exists()):
    return len(LAYERS)  # the facade and the entry points (generate, train, __main__)
  return LAYERS.index(parts[1])


def test_every_subpackage_has_its_place_on_the_map():
  subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
  assert subpackages == set(LAYERS)


def test_the_tests_mirror_the_package():
  """tests/<subpackage>/ holds a subpackage's tests (tests/integration: MaxDiffusion's); the top
  level only the repository's own rules and what spans the package."""
  folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name != "__pycache__"}
  assert folders - {"integration"} <= set(LAYERS), sorted(folders - set(LAYERS))
  assert len(folders) >= 8


def test_no_module_imports_one_above_it_on_the_map():
  graph = _import_graph()
  assert len(graph) >= 100, len(graph)  # the walk found the package
  upward = {module: sorted(m for m in imported if _layer(m) > _layer(module))
            for module, imported in graph.items()}
  assert not {module: found for module, found in upward.items() if found}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The graph's strongly connected components of more than one module (Tarjan's)."""
  cycles, stack = [], []
  index: dict[str, int] = {}
  low: dict[str, int] = {}

  def visit(module: str) -> None:
    index[module] = low[module] = len(index)
    stack.append(module)
    for other in graph.get(module, ()):
      if other not in index:
        visit(other)
        low[module] = min(low[module], low[other])
      elif other in stack:
        low[module] = min(low[module], index[other])
    if low[module] == index[module]:
      component = []
      while not component or component[-1] != module:
        component.append(stack.pop())
      if len(component) > 1:
        cycles.append(sorted(component))

  for module in sorted(graph):
    if module not in index:
      visit(module)
  return cycles


def test_the_package_has_no_import_cycles():
  assert not _cycles(_import_graph())


def test_the_checks_can_fail():
  """A function-level import is an edge, a planted cycle is found, the map has an order."""
  graph = _import_graph()
  assert "maxdiffusion_svg.plugin.launcher" in graph["maxdiffusion_svg.generate"]  # lazy import
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert _layer("maxdiffusion_svg.plan.tiles") < _layer("maxdiffusion_svg.kernels.api")
  assert _layer("maxdiffusion_svg.cli.main") < _layer("maxdiffusion_svg.generate")


def test_nothing_under_tests_shadows_the_maxdiffusion_package():
  """pytest puts test folders on sys.path; a folder named maxdiffusion there would be imported
  as MaxDiffusion (a namespace package) instead of the real one."""
  tests = ROOT / "tests"
  folders = [tests] + [p for p in tests.rglob("*") if p.is_dir() and p.name != "__pycache__"]
  shadows = [str(f) for f in folders
             if importlib.machinery.PathFinder.find_spec("maxdiffusion", [str(f)]) is not None]
  assert not shadows
