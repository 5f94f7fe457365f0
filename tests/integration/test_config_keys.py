"""Every svg_* key set from the command line on every shipped config, through MaxDiffusion's
own pyconfig: behind the launcher, and in a patched MaxDiffusion (entry-point defaults)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import yaml

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion import pyconfig

from maxdiffusion_svg.plugin import overlay
from maxdiffusion_svg.plugin.launcher import prepare_argv
from maxdiffusion_svg.plugin.settings import PluginSettings, config_defaults
from shipped_configs import CONFIGS, OVERRIDES

SHIPPED = sorted(p.name for p in CONFIGS.glob("*.yml"))


def expected(config: pathlib.Path, key: str) -> PluginSettings:
  """The settings the merged config with ``key`` set to its override value should give."""
  merged, _ = overlay.load_config(config)
  return PluginSettings.from_mapping(
      {**config_defaults(), **merged, key: yaml.safe_load(OVERRIDES[key])})


@pytest.mark.parametrize("name", SHIPPED)
def test_the_launcher_lets_maxdiffusion_override_every_key(name, tmp_path):
  config = CONFIGS / name
  unchanged = None
  for key, text in OVERRIDES.items():
    argv, _ = prepare_argv(["prog", str(config), f"{key}={text}"], str(tmp_path))
    pyconfig.initialize(argv, unittest=True)
    got = PluginSettings.from_mapping(pyconfig.config.get_keys())
    assert got == expected(config, key), key
    if name == "wan_svg.yml":  # it leaves every key but the preset's to the defaults
      if unchanged is None:
        argv, _ = prepare_argv(["prog", str(config)], str(tmp_path))
        pyconfig.initialize(argv, unittest=True)
        unchanged = PluginSettings.from_mapping(pyconfig.config.get_keys())
      assert got != unchanged, key


PATCHED_SCRIPT = """
import json, sys
from maxdiffusion import pyconfig
from maxdiffusion_svg.plugin.settings import PluginSettings
out = {}
for key, text in json.loads(sys.argv[2]).items():
  pyconfig.initialize([None, sys.argv[1], f"{key}={text}"], unittest=True)
  out[key] = repr(PluginSettings.from_mapping(pyconfig.config.get_keys()))
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("name", ["wan_svg.yml",  # the Wan 2.2 config's run: full tier
                                  pytest.param("wan22_svg.yml", marks=pytest.mark.full)])
def test_a_patched_maxdiffusion_takes_every_key_from_the_plugins_defaults(
    name, patched_maxdiffusion):
  config = CONFIGS / name
  done = subprocess.run(
      [sys.executable, "-c", PATCHED_SCRIPT, str(config), json.dumps(OVERRIDES)],
      capture_output=True, text=True, check=False,
      env={**os.environ, "PYTHONPATH": f"{patched_maxdiffusion / 'src'}:{CONFIGS.parent}"})
  assert done.returncode == 0, done.stderr[-3000:]
  got = json.loads(done.stdout.split("RESULT ", 1)[1])
  assert got == {key: repr(expected(config, key)) for key in OVERRIDES}


@pytest.mark.parametrize("name", SHIPPED)
def test_the_estimate_runs_on_every_shipped_config(name):
  """The estimate (`tiles --config`) on each shipped config, its MaxDiffusion base found among
  the installed configs: one row per model (two for Wan 2.2, splitting the run's steps), each
  on the config's schedule."""
  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.plan.target import tpu_target
  from maxdiffusion_svg.plugin.estimate import estimate_config
  from maxdiffusion_svg.plugin.video_models import WAN, video_model
  merged, _ = overlay.load_config(CONFIGS / name)
  svg = PluginSettings.from_mapping({**config_defaults(), **merged}).svg
  result = estimate_config(merged, tpu_target("v6e"))
  rows = result["rows"]
  # The worst case (every head on online softmax) is no slower than MaxDiffusion's fixed-m
  # kernel, wherever the static schedule prices it.
  priced = [row["vs_fixed_m"] for row in rows if row["vs_fixed_m"].get("priced")]
  priced += [result["combined"]["vs_fixed_m"]] if "vs_fixed_m" in result["combined"] else []
  assert all(vs["online"]["bound"] >= 1.0 for vs in priced), [vs["online"] for vs in priced]
  wan22 = merged["model_name"] == "wan2.2" and video_model(merged) is WAN  # not Animate's
  assert [row["expert"] for row in rows] == (["high_noise", "low_noise"] if wan22 else [None])
  steps = merged["num_inference_steps"]
  assert sum(row["steps"] for row in rows) == steps
  for row in rows:
    assert 0 < row["sparse_steps"] <= row["steps"]
    assert 0 < row["work_vs_dense"] < 1
    assert row["density"] == svg.density_for(row["expert"])
