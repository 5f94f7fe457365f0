"""The plugin's settings and import hygiene (no MaxDiffusion needed)."""

import subprocess
import sys

import pytest

from maxdiffusion_svg.config import SvgConfig
from maxdiffusion_svg.plugin.settings import PluginSettings


def test_reads_svg_and_plugin_keys_and_ignores_the_rest():
  settings = PluginSettings.from_mapping({
      "attention": "svg", "num_inference_steps": 40, "svg_schedule": "aggressive",
      "svg_dense_kernel": "tokamax_flash", "svg_min_seq_length": 1024, "svg_block_q": 1024})
  assert settings.dense_kernel == "tokamax_flash" and settings.min_seq_length == 1024
  assert settings.svg == SvgConfig.from_mapping({"num_inference_steps": 40,
                                                 "svg_schedule": "aggressive",
                                                 "svg_block_q": 1024})
  assert settings.svg.schedule.active_steps.start == 4  # aggressive: first 10% of 40 dense


def test_defaults_and_the_dense_kernel_per_platform():
  settings = PluginSettings.from_mapping({"svg_dense_kernel": ""})  # YAML '' = default
  assert settings.dense_kernel is None and settings.min_seq_length == 4096
  assert settings.resolved_dense_kernel("tpu") == "flash"
  assert settings.resolved_dense_kernel("cpu") == "dot_product"
  assert PluginSettings(dense_kernel="dot_product").resolved_dense_kernel("tpu") == "dot_product"


@pytest.mark.parametrize("mapping, message", [
    ({"svg_min_seq_lenght": 5}, r"unknown SVG config key\(s\) svg_min_seq_lenght; allowed: .*"
                                r"svg_dense_kernel.*svg_min_seq_length"),
    ({"svg_min_seq_length": -1}, "svg_min_seq_length must be an integer >= 0"),
    ({"svg_min_seq_length": True}, "svg_min_seq_length must be an integer >= 0"),
    ({"svg_dense_kernel": "svg"}, "svg_dense_kernel must name a dense MaxDiffusion"),
    ({"svg_density": 0}, "svg_density"),
])
def test_bad_keys_name_the_key(mapping, message):
  with pytest.raises(ValueError, match=message):
    PluginSettings.from_mapping(mapping)


def test_importing_the_package_touches_neither_maxdiffusion_nor_devices():
  code = ("import sys; import maxdiffusion_svg, maxdiffusion_svg.plugin, maxdiffusion_svg.sharding\n"
          "from jax._src import xla_bridge\n"
          "assert not [m for m in sys.modules if m.split('.')[0] == 'maxdiffusion'], 'maxdiffusion'\n"
          "assert not xla_bridge.backends_are_initialized(), 'devices'\n")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stderr
