"""``tiny-checkpoint --head-dim 128``: the same tiny model in two heads of 128, the width our TPU
kernel runs, with a config that lets ``svg_backend`` pick it on a TPU; ``generate`` runs on it
(here on the CPU's XLA executor; on a TPU the same config runs our kernel)."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from md_required import require_maxdiffusion

require_maxdiffusion()

ROOT = pathlib.Path(__file__).parent.parent.parent


def _run(args, cwd):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device
  env.update(JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
  result = subprocess.run([sys.executable, "-m", "maxdiffusion_svg", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, check=False)
  assert result.returncode == 0, (args, result.stdout[-3000:], result.stderr[-3000:])
  return result


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
  work = tmp_path_factory.mktemp("wide")
  _run(["tiny-checkpoint", "tiny128", "--head-dim", "128"], work)
  return work


def test_two_heads_of_128_and_the_backend_left_to_the_chip(wide):
  transformer = json.loads((wide / "tiny128" / "transformer" / "config.json").read_text())
  assert (transformer["num_attention_heads"], transformer["attention_head_dim"]) == (2, 128)
  keys = (wide / "tiny128" / "tiny_wan_svg.yml").read_text()
  assert "\nsvg_backend: auto" in keys and "svg_backend: xla" not in keys


@pytest.mark.full
def test_generate_runs_sparse_on_it(wide):
  result = _run(["generate", "tiny128/tiny_wan_svg.yml", "output_dir=out"], wide)
  # 10 steps x 3 layers; sparse from step 1 in layers 1 and 2 (the config's schedule), as counted
  assert re.search(r"30 self-attention calls, 18 sparse and 12 dense \(counted\)",
                   result.stdout + result.stderr), result.stdout[-2000:]
