"""The built wheel carries the shipped configs: installed in a fresh venv (no checkout on its
path), ``python -m maxdiffusion_svg tiles wan_svg.yml`` finds the config by name from an empty
folder (its base, ``base_wan_14b.yml``, among MaxDiffusion's configs)."""

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from tiny_runs import ROOT

# What the build reads (a copy: setuptools' build/ folder in a checkout may hold stale files).
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "maxdiffusion_svg", "configs")


def run(*command, **kwargs):
  done = subprocess.run([str(c) for c in command], capture_output=True, text=True, check=False,
                        **kwargs)
  assert done.returncode == 0, done.stderr
  return done.stdout


def test_the_installed_wheel_finds_a_shipped_config_by_name_from_an_empty_folder(tmp_path):
  source = tmp_path / "source"
  source.mkdir()
  for name in BUILD_INPUTS:
    if (ROOT / name).is_dir():
      shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    else:
      shutil.copy(ROOT / name, source / name)
  run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", source,
      "-w", tmp_path / "wheels")
  (wheel,) = (tmp_path / "wheels").glob("maxdiffusion_svg-*.whl")
  shipped = {f"maxdiffusion_svg/configs/{p.name}" for p in (ROOT / "configs").glob("*.yml")}
  assert len(shipped) > 5 and shipped <= set(zipfile.ZipFile(wheel).namelist())

  venv = tmp_path / "venv"
  run(sys.executable, "-m", "venv", "--without-pip", venv)
  python = venv / "bin" / "python"
  site = pathlib.Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
                      .strip())
  # The dependencies: this venv's packages (the .pth files there, such as an editable install of
  # the checkout, are not read from a path a .pth adds).
  (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
  run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index",
      wheel)

  empty = tmp_path / "empty"
  empty.mkdir()
  (maxdiffusion,) = importlib.util.find_spec("maxdiffusion").submodule_search_locations
  env = {**os.environ, "PYTHONPATH": str(pathlib.Path(maxdiffusion).parent),
         "JAX_PLATFORMS": "cpu"}
  env.pop("LIBTPU_INIT_ARGS", None)
  where = run(python, "-c", "import maxdiffusion_svg; print(maxdiffusion_svg.__file__)", cwd=empty,
              env=env)
  assert pathlib.Path(where).is_relative_to(site), where  # the wheel's, not the checkout's
  out = run(python, "-m", "maxdiffusion_svg", "tiles", "wan_svg.yml", "--slice", "v6e-8",
            cwd=empty, env=env)
  assert out.startswith("Estimate, computed from the tile plan (not measured): TPU v6e"), out
  assert "mesh on a v6e-8" in out and "video 81x720x1280" in out
