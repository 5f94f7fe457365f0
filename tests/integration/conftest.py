"""Fixtures shared by the MaxDiffusion tests."""

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).parent.parent.parent


@pytest.fixture(scope="session")
def patched_maxdiffusion(tmp_path_factory):
  """A copy of the MaxDiffusion source with patches/maxdiffusion-plugins.patch applied."""
  copy = tmp_path_factory.mktemp("patched") / "maxdiffusion"
  shutil.copytree(pathlib.Path(os.environ.get("MAXDIFFUSION_SRC", "")) / "src",
                  copy / "src", ignore=shutil.ignore_patterns("__pycache__", "tests"))
  script = ROOT / "scripts" / "apply_maxdiffusion_patch.sh"
  check = subprocess.run([str(script), "--check", str(copy)], capture_output=True, text=True,
                         check=False)
  assert check.returncode == 0 and "applies cleanly" in check.stdout, check.stderr
  subprocess.run([str(script), str(copy)], check=True, capture_output=True)
  again = subprocess.run([str(script), str(copy)], capture_output=True, text=True, check=True)
  assert "already applied" in again.stdout
  return copy
