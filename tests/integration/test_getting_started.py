"""Getting started's "Try it on a CPU" runs as written: each fenced command block of the section,
in order, in an empty folder, with ``python`` this interpreter and MaxDiffusion's source on
``PYTHONPATH`` (what the section asks for), one CPU device; each exits 0."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from md_required import require_maxdiffusion

require_maxdiffusion()

ROOT = pathlib.Path(__file__).parent.parent.parent
PAGE = ROOT / "docs" / "getting-started.md"
HEADING = "## Try it on a CPU"
# The blocks past which a run is over the CI tier's budget (generate, compare, calibrate: 1-3
# min each under the tier's load; the full tier runs them all).
FAST = 2


def blocks() -> list[str]:
  text = PAGE.read_text()
  start = text.index(f"\n{HEADING}\n") + len(HEADING) + 2
  end = text.find("\n## ", start)
  return re.findall(r"```sh\n(.*?)```", text[start:end if end >= 0 else None], re.S)


def run_blocks(tmp_path, commands):
  bin_dir = pathlib.Path(sys.executable).parent  # a venv's bin has its python
  assert (bin_dir / "python").exists(), bin_dir
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device, as a user has
  env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
  work = tmp_path / "work"
  work.mkdir()
  for command in commands:
    result = subprocess.run(["bash", "-e", "-c", command], cwd=work, env=env,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, (command, result.stdout[-3000:], result.stderr[-3000:])
  return work


def test_the_section_has_its_commands():
  commands = blocks()
  assert [" ".join(c.split()[2:4]) for c in commands] == [
      "maxdiffusion_svg tiny-checkpoint", "maxdiffusion_svg tiles", "maxdiffusion_svg generate",
      "maxdiffusion_svg compare", "maxdiffusion_svg calibrate"]


def test_checkpoint_and_tiles_run_as_written(tmp_path):
  work = run_blocks(tmp_path, blocks()[:FAST])
  assert (work / "tiny" / "tiny_wan_svg.yml").exists()


@pytest.mark.full
def test_every_block_runs_as_written(tmp_path):
  work = run_blocks(tmp_path, blocks())
  assert (work / "wan_output_0_0.mp4").stat().st_size > 0
  assert (work / "svg_compare" / "compare.json").exists()
  assert "svg_layer_densities" in (work / "tiny_calibrated.yml").read_text()
