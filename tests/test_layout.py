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


# The tools a user runs (they may drive the plugin, or draw benchmark figures); the rest of
# the package is core.
TOOLS = ("cli.py", "cli_args.py", "cli_bench.py", "cli_bench_tpu.py", "cli_calibrate.py",
         "cli_compare.py",
         "cli_tiles.py", "generate.py",
         "train.py", "train_vace.py",
         "__main__.py", "plot.py")


def test_core_modules_import_neither_the_plugin_nor_benchmarks_nor_fixtures():
  """The data path (and kernels) stand alone; plugin/ builds on them, never the reverse."""
  package = ROOT / "maxdiffusion_svg"
  core = [p for p in list(package.glob("*.py")) + list((package / "kernels").glob("*.py"))
          if p.name not in TOOLS]
  assert len(core) >= 15, sorted(p.name for p in core)
  offending = {path.name: sorted(m for m in _imported_modules(path) if m.startswith(
      ("maxdiffusion_svg.plugin", "maxdiffusion_svg.bench", "maxdiffusion_svg.testing")))
               for path in core}
  assert not {name: found for name, found in offending.items() if found}


def test_nothing_under_tests_shadows_the_maxdiffusion_package():
  """pytest puts test folders on sys.path; a folder named maxdiffusion there would be imported
  as MaxDiffusion (a namespace package) instead of the real one."""
  tests = ROOT / "tests"
  folders = [tests] + [p for p in tests.rglob("*") if p.is_dir() and p.name != "__pycache__"]
  shadows = [str(f) for f in folders
             if importlib.machinery.PathFinder.find_spec("maxdiffusion", [str(f)]) is not None]
  assert not shadows
