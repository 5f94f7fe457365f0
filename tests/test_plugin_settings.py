"""The plugin's settings and import hygiene (no MaxDiffusion needed)."""

import ast
import subprocess
import sys

import pytest
import yaml

from maxdiffusion_svg.config import KEYS, SvgConfig
from maxdiffusion_svg.plugin.settings import PLUGIN_KEYS, PluginSettings, config_defaults
from shipped_configs import OVERRIDES


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
    ({"svg_min_seq_lenght": 5}, r"unknown SVG config key\(s\) svg_min_seq_lenght \(did you mean svg_min_seq_length\?\); allowed: .*"
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


def typed_like(default, text):
  """A command-line value as MaxDiffusion's pyconfig types it: like the config's value."""
  if isinstance(default, bool):
    return text.lower() == "true"
  if isinstance(default, list):
    return ast.literal_eval(text)
  return type(default)(text)


def test_config_defaults_hold_every_key_with_a_typed_value_meaning_the_default():
  defaults = config_defaults()
  assert set(defaults) == set(OVERRIDES) == {*KEYS, "svg_schedule", *PLUGIN_KEYS}
  assert all(value is not None for value in defaults.values())  # a YAML null cannot be overridden
  assert PluginSettings.from_mapping(defaults) == PluginSettings.from_mapping({})


@pytest.mark.parametrize("key", sorted(OVERRIDES))
def test_every_key_overrides_the_defaults_as_maxdiffusion_types_it(key):
  """The config holds the default (e.g. svg_density: preset, a string), so the command line's
  svg_density=0.2 arrives typed like it; it must still mean 0.2."""
  defaults = config_defaults()
  text = OVERRIDES[key]
  got = PluginSettings.from_mapping({**defaults, key: typed_like(defaults[key], text)})
  assert got == PluginSettings.from_mapping({key: yaml.safe_load(text)})
  assert got != PluginSettings.from_mapping({})


def test_unset_words_and_unreadable_text_name_the_key():
  assert PluginSettings.from_mapping({"svg_schedule": "aggressive", "svg_density": "preset"}) \
      == PluginSettings.from_mapping({"svg_schedule": "aggressive"})
  with pytest.raises(ValueError, match=r"svg_density must be a number in \(0, 1\], got 'dense'"):
    PluginSettings.from_mapping({"svg_density": "dense"})
  with pytest.raises(ValueError, match=r"svg_active_steps: cannot read '\[3, ' \(give a value, "
                                       r"or 'preset'\)"):
    PluginSettings.from_mapping({"svg_active_steps": "[3, "})
