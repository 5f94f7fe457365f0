"""``--version``: one line per thing a bug report needs, and never a crash for a missing part."""

import os
import pathlib
import platform
import subprocess
import sys
from importlib import metadata

import pytest

from maxdiffusion_svg.cli import about

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHA = "0123456789abcdef0123456789abcdef01234567"
LINES = ("maxdiffusion-svg ", "maxdiffusion: ", "jax: ", "jaxlib: ", "libtpu: ", "tokamax: ",
         "flax: ", "python: ", "devices: ")


def version_lines(*code: str) -> list[str]:
  """stdout of ``python -m maxdiffusion_svg --version`` (or of ``code`` run first), 8 CPUs."""
  argv = ["-c", "\n".join(["import sys", *code, "from maxdiffusion_svg.cli.main import main",
                           "sys.exit(main(['--version']))"])] if code else [
                               "-m", "maxdiffusion_svg", "--version"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, check=False,
                        cwd=ROOT, env=env, timeout=120)
  assert done.returncode == 0, done.stderr
  assert "Traceback" not in done.stderr, done.stderr
  return done.stdout.splitlines()


def test_version_names_the_plugin_maxdiffusion_the_jax_stack_python_and_the_devices():
  lines = version_lines()
  assert [next(l for l in LINES if line.startswith(l)) for line in lines] == list(LINES), lines
  assert lines[0].split()[:2] == ["maxdiffusion-svg", metadata.version("maxdiffusion-svg")]
  assert lines[2] == f"jax: {metadata.version('jax')}"
  assert lines[3] == f"jaxlib: {metadata.version('jaxlib')}"
  assert lines[6] == f"flax: {metadata.version('flax')}"
  assert lines[7] == f"python: {platform.python_version()} ({sys.executable})"
  assert lines[8] == "devices: cpu x8"


def test_version_without_jax_or_maxdiffusion_still_answers():
  lines = version_lines("sys.modules['jax'] = None  # as if not installed",
                        "sys.modules['maxdiffusion'] = None")
  assert [next(l for l in LINES if line.startswith(l)) for line in lines] == list(LINES), lines
  assert lines[1].startswith("maxdiffusion: not importable (install it, or PYTHONPATH=")
  assert lines[-1].startswith("devices: none (jax is not importable: ")


def test_a_package_no_distribution_provides_is_none():
  assert about.package_line("no_such_module_x", ("no-such-dist-x",)) == "no_such_module_x: none"
  assert about.package_line("jax", ("jax",)) == f"jax: {metadata.version('jax')}"
  assert about.distribution_version("no-such-dist-x", "jax") == metadata.version("jax")


def test_device_kinds_count_each_kind_in_order():
  assert about.device_kinds(["TPU v5 lite"] * 8) == "TPU v5 lite x8"
  assert about.device_kinds(["cpu", "TPU v6e", "cpu"]) == "cpu x2, TPU v6e x1"


def test_a_backend_that_fails_is_a_line_not_a_crash(monkeypatch):
  import jax  # pylint: disable=import-outside-toplevel

  def broken():
    raise RuntimeError("Unable to initialize backend 'tpu'\nmore detail")

  monkeypatch.setattr(jax, "devices", broken)
  assert about.devices_line() == "devices: none (RuntimeError: Unable to initialize backend 'tpu')"


def fake_git(tree: pathlib.Path, head: str, refs: dict[str, str] | None = None,
             packed: str = "") -> None:
  """A ``.git`` folder as git writes it: HEAD, loose branches, packed ones."""
  git = tree / ".git"
  (git / "refs" / "heads").mkdir(parents=True)
  (git / "HEAD").write_text(head + "\n")
  for name, sha in (refs or {}).items():
    (git / name).write_text(sha + "\n")
  if packed:
    (git / "packed-refs").write_text(packed)


@pytest.mark.parametrize("head, refs, packed, commit", [
    (SHA, {}, "", SHA),  # detached
    ("ref: refs/heads/main", {"refs/heads/main": SHA}, "", SHA),  # a loose branch
    ("ref: refs/heads/main", {}, f"# pack-refs with: peeled\n{'f' * 40} refs/heads/other\n"
                                 f"{SHA} refs/heads/main\n", SHA),  # a packed one
    ("ref: refs/heads/gone", {}, "", None),  # an unborn branch
    ("garbage", {}, "", None),
])
def test_the_commit_is_read_from_gits_files(tmp_path, head, refs, packed, commit):
  fake_git(tmp_path, head, refs, packed)
  assert about.git_commit(tmp_path) == commit


def test_a_worktree_reads_its_head_and_the_main_repositorys_branches(tmp_path):
  fake_git(tmp_path / "main", "ref: refs/heads/main", {"refs/heads/main": "f" * 40})
  work = tmp_path / "main" / ".git" / "worktrees" / "w"
  work.mkdir(parents=True)
  (work / "HEAD").write_text("ref: refs/heads/feature\n")
  (work / "commondir").write_text("../..\n")
  (tmp_path / "main" / ".git" / "refs" / "heads" / "feature").write_text(SHA + "\n")
  (tmp_path / "w").mkdir()
  (tmp_path / "w" / ".git").write_text(f"gitdir: {work}\n")
  assert about.git_commit(tmp_path / "w") == SHA


def test_this_checkouts_commit_is_gits_own():
  done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                        text=True, check=False)
  if done.returncode != 0:
    pytest.skip("not a git checkout, or no git here")
  assert about.git_commit(ROOT) == done.stdout.strip()


def test_maxdiffusion_in_place_is_named_by_its_commit_and_where_it_is(tmp_path, monkeypatch):
  if "maxdiffusion" in sys.modules:
    pytest.skip("a real MaxDiffusion is imported in this process")
  package = tmp_path / "src" / "maxdiffusion"
  package.mkdir(parents=True)
  (package / "__init__.py").write_text("raise SystemExit('never imported')\n")
  monkeypatch.syspath_prepend(str(tmp_path / "src"))
  monkeypatch.setattr(about, "distribution_version", lambda *names: None)  # not installed
  assert about.maxdiffusion_line("7cfb8801d41d") == (
      f"maxdiffusion: a source tree with no version or git commit at {package} (tested with "
      f"7cfb8801d41d)")
  fake_git(tmp_path, SHA)
  assert about.maxdiffusion_line("7cfb8801d41d") == (
      f"maxdiffusion: commit {SHA[:12]} at {package} (tested with 7cfb8801d41d)")
