"""The patch's additions to MaxDiffusion on their own: base_config merging in pyconfig, and
plugin entry points loaded after jax.distributed starts, their errors named."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg.plugin import overlay
from tiny_runs import ROOT


def test_patched_pyconfig_merges_as_the_launcher_does(patched_maxdiffusion, tmp_path):
  """Both merge as MaxText's base_config does: top-level keys override (a nested mapping is
  replaced whole); a base is looked up beside the file, then among MaxDiffusion's configs."""
  code = ("import json, sys, yaml\nfrom maxdiffusion import pyconfig\n"
          "for path in sys.argv[1:]:\n  with open(path) as f:\n    raw = yaml.safe_load(f)\n"
          "  print('MERGED ' + json.dumps(pyconfig._with_base_configs(path, raw)))")
  configs = patched_maxdiffusion / "src" / "maxdiffusion" / "configs"
  nested = tmp_path / "nested.yml"
  nested.write_text(yaml.safe_dump({"base_config": "base_wan_14b.yml", "attention": "svg",
                                    "flash_block_sizes": {"block_q": 1024}}))
  cases = [(ROOT / "configs" / "wan_svg.yml", 2), (ROOT / "configs" / "wan_svg_1_3b.yml", 2),
           (ROOT / "configs" / "wan22_svg.yml", 2), (ROOT / "configs" / "wan_i2v_svg.yml", 2),
           (ROOT / "configs" / "wan_svg_v6e16.yml", 3), (ROOT / "configs" / "wan_svg_v6e32.yml", 3),
           (ROOT / "configs" / "wan_svg_v6e64.yml", 3), (nested, 2)]
  result = subprocess.run(  # one process: importing MaxDiffusion is what takes the time
      [sys.executable, "-c", code, *(str(path) for path, _ in cases)], capture_output=True,
      text=True, check=True, env={**os.environ, "PYTHONPATH": str(patched_maxdiffusion / "src")})
  merges = [json.loads(line[len("MERGED "):]) for line in result.stdout.splitlines()
            if line.startswith("MERGED ")]
  assert len(merges) == len(cases)
  for (path, links), merged in zip(cases, merges):
    ours, chain = overlay.load_config(path, search_dirs=[configs])
    assert merged == json.loads(json.dumps(ours)) and len(chain) == links, path
    assert merged["attention"] == "svg" and "logical_axis_rules" in merged
  assert merged["flash_block_sizes"] == {"block_q": 1024}  # not merged into the base's mapping
  assert len(yaml.safe_load((configs / "base_wan_14b.yml").read_text())["flash_block_sizes"]) > 1


PLUGIN_ORDER_SCRIPT = """
import json, sys
from maxdiffusion import max_utils, pyconfig
order = []
real = max_utils.maybe_initialize_jax_distributed_system
def distributed(raw_keys):
  order.append("distributed")
max_utils.maybe_initialize_jax_distributed_system = distributed
import fake_plugin
fake_plugin.ORDER = order
try:
  pyconfig.initialize([None, sys.argv[1], "run_name=order"])
except RuntimeError as e:
  order.append("error: " + str(e))
print(json.dumps(order))
"""


def fake_plugin_dist(folder, behaviour):
  """A package with a ``maxdiffusion.plugins`` entry point, importable from ``folder``."""
  (folder / "fake_plugin.py").write_text(
      "ORDER = []\n"
      "def register():\n"
      f"  {behaviour}\n"
      "  import jax\n"
      "  ORDER.append('plugin: ' + jax.devices()[0].platform)\n", encoding="utf-8")
  info = folder / "fake_plugin-0.1.dist-info"
  info.mkdir()
  (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-plugin\nVersion: 0.1\n",
                                 encoding="utf-8")
  (info / "entry_points.txt").write_text(
      "[maxdiffusion.plugins]\nfake = fake_plugin:register\n", encoding="utf-8")


@pytest.mark.parametrize("behaviour, want", [
    ("pass", ["distributed", "plugin: cpu"]),
    ("raise KeyError('boom')", ["distributed", "error: maxdiffusion plugin 'fake' "
                                "(fake_plugin:register, entry point group "
                                "'maxdiffusion.plugins') failed to load: KeyError: 'boom'"]),
])
def test_plugins_load_after_distributed_init_and_errors_name_the_entry_point(
    patched_maxdiffusion, tmp_path, behaviour, want):
  """A plugin that touches a device at load must not start JAX's backends before
  jax.distributed.initialize: in a multi-host job every host would then run alone."""
  fake_plugin_dist(tmp_path, behaviour)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path),
                                                      str(patched_maxdiffusion / "src")])}
  config = patched_maxdiffusion / "src" / "maxdiffusion" / "configs" / "base_wan_14b.yml"
  result = subprocess.run([sys.executable, "-c", PLUGIN_ORDER_SCRIPT, str(config)], env=env,
                          capture_output=True, text=True, check=False, cwd=tmp_path)
  assert result.returncode == 0, result.stderr[-3000:]
  order = json.loads(result.stdout.strip().splitlines()[-1])
  assert order == want
