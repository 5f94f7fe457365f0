"""Getting started's "Try it on a CPU" runs as written: each fenced command block of the section,
in order, in an empty folder, with ``python`` this interpreter and MaxDiffusion's source on
``PYTHONPATH`` (what the section asks for), one CPU device; each exits 0."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import yaml

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


# What a try-out command may print (stdout and stderr together): the plugin's lines and the result,
# MaxDiffusion's config dump and logs in a log file (issue 71: generate printed 287 lines).
MAX_LINES = 25


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
                            capture_output=True, check=False)
    # bytes, not text=True: that reads a progress bar's redraws (\r) as new lines, which on a
    # terminal they are not
    printed = (result.stdout + result.stderr).decode(errors="replace")
    assert result.returncode == 0, (command, printed[-6000:])
    lines = [line for line in printed.split("\n") if line.strip()]
    assert len(lines) <= MAX_LINES, (command, len(lines), printed[-3000:])
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
  """Each command prints at most MAX_LINES and writes only its outputs: the checkpoint, the
  video and MaxDiffusion's folder (its log in it), compare's folder, the overlay and its log
  (no sdxl-model-finetuned/, MaxDiffusion's default output_dir). The try-out shows what SVG
  does: the presets keep different tiles and lose different PSNR, and calibrate moves tiles."""
  work = run_blocks(tmp_path, blocks())
  assert sorted(p.name for p in work.iterdir()) == [
      "svg_compare", "tiny", "tiny_calibrated.maxdiffusion.log", "tiny_calibrated.yml",
      "tiny_output", "wan_output_0_0.mp4"]
  assert (work / "wan_output_0_0.mp4").stat().st_size > 0
  assert "Config param attention: svg" in (work / "tiny_output/tiny/maxdiffusion.log").read_text()
  assert "Config param" in (work / "svg_compare" / "maxdiffusion.log").read_text()
  assert "Config param" in (work / "tiny_calibrated.maxdiffusion.log").read_text()
  rows = {r["name"]: r for r in
          json.loads((work / "svg_compare" / "compare.json").read_text())["runs"]}
  config, aggressive = rows["svg"], rows["svg aggressive"]
  assert config["visited_tile_share"] > aggressive["visited_tile_share"]
  assert config["psnr_db"] > aggressive["psnr_db"]
  overlay = yaml.safe_load((work / "tiny_calibrated.yml").read_text())
  assert len(set(overlay["svg_layer_densities"][1:])) > 1  # the two sparse layers differ
