"""The plugin's settings and import hygiene (no MaxDiffusion needed)."""

import ast
import json
import subprocess
import sys

import pytest
import yaml

from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.budgets.config_keys import KEYS
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
  code = ("import sys; import maxdiffusion_svg, maxdiffusion_svg.plugin\n"
          "import maxdiffusion_svg.parallel.sharding\n"
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
  if isinstance(default, dict):
    return json.loads(text)
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


# ------------------------------------------------ compensation in the settings and the logs


def test_compensation_defaults_come_from_svg_config_alone():
  """The YAML defaults are SvgConfig's, so flipping its default flips every merged config."""
  defaults, svg = config_defaults(), SvgConfig()
  assert (defaults["svg_compensation"], defaults["svg_compensation_blocks"]) == (
      svg.compensation, svg.compensation_blocks)


@pytest.mark.parametrize("mapping, message", [
    ({"svg_compensation": "yes"}, "svg_compensation must be true or false, got 'yes'"),
    ({"svg_compensation_blocks": 0}, "svg_compensation_blocks must be an integer >= 1"),
    ({"svg_compensation_blocks": True}, "svg_compensation_blocks must be an integer >= 1"),
    ({"svg_compensation": True, "svg_compensation_blocks": 3, "svg_block_kv": 1024},
     r"svg_compensation_blocks must divide the key tile svg_block_kv \(1024\), got 3"),
])
def test_bad_compensation_keys_name_the_key(mapping, message):
  with pytest.raises(ValueError, match=message):
    PluginSettings.from_mapping(mapping)


def test_the_settings_line_says_the_compensation():
  from maxdiffusion_svg.plan.target import tpu_target  # pylint: disable=import-outside-toplevel
  off = PluginSettings.from_mapping({})
  on = PluginSettings.from_mapping({"svg_compensation": True, "svg_compensation_blocks": 4})
  assert ", compensation off, " in off.summary() and ", compensation off, " in off.summary(
      tpu_target("v6e", flags=""))
  v6e = tpu_target("v6e", flags="")
  assert ", compensation 4 centroids per key tile, " in on.summary()
  assert (", compensation 4 centroids per key tile, layouts spatial, temporal, dense kernel flash"
          in on.summary(v6e))
  # 7 does not divide our kernel's 1536 key tile on a v6e: refused on the target (the
  # create-transformer hook calls this before weights load).
  bad = PluginSettings.from_mapping({"svg_compensation": True, "svg_compensation_blocks": 7})
  assert "compensation 7 centroids" in bad.summary()  # the tile is not known without a target
  with pytest.raises(ValueError, match=r"svg_compensation_blocks must divide the key tile "
                                       r"svg_block_kv \(1536\), got 7"):
    bad.summary(v6e)


def test_the_aot_cache_key_holds_the_compensation(monkeypatch):
  """MaxDiffusion's AOT cache keys executables by ``meta``; the hook adds the settings, and a
  compensated run's executable must not be taken for an uncompensated one's."""
  import types  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.plugin import hooks_entry  # pylint: disable=import-outside-toplevel
  keys = {"attention": "svg"}
  pyconfig = types.SimpleNamespace(config=types.SimpleNamespace(get_keys=lambda: keys))
  monkeypatch.setitem(sys.modules, "maxdiffusion", types.SimpleNamespace(pyconfig=pyconfig))
  install = hooks_entry.aot_install(lambda cache_dir, meta, mesh: meta)
  metas = []
  for value in (False, True):
    keys["svg_compensation"] = value
    metas.append(install("dir", {"attention": "svg"}, None)["svg"])
  keys["svg_compensation_blocks"] = 4
  metas.append(install("dir", {"attention": "svg"}, None)["svg"])
  assert len(set(metas)) == 3 and "compensation=True" in metas[1]
  # ... nor a run with other layouts, or another clustering, for today's
  for key, value in (("svg_layouts", "[spatial, temporal, semantic]"),
                     ("svg_semantic_clusters", 16), ("svg_semantic_warm_iterations", 2)):
    keys[key] = value
    metas.append(install("dir", {"attention": "svg"}, None)["svg"])
  assert len(set(metas)) == 6 and "'semantic')" in metas[-1]


@pytest.mark.parametrize("spec, name, overrides", [
    ("config+compensation", "svg +compensation", ("svg_compensation=true",)),
    ("0.3+compensation=4", "svg density 0.3 +compensation=4",
     ("svg_density=0.3", "svg_compensation=true", "svg_compensation_blocks=4")),
    ("aggressive+compensation=off", "svg aggressive +compensation=off",
     ("svg_schedule=aggressive", "svg_compensation=false")),
    ("0.25+semantic", "svg density 0.25 +semantic",
     ("svg_density=0.25", "svg_layouts=[spatial, temporal, semantic]")),
    ("config+layouts=semantic+compensation", "svg +layouts=semantic+compensation",
     ("svg_layouts=[semantic]", "svg_compensation=true")),
    ("0.3+sink=off", "svg density 0.3 +sink=off", ("svg_density=0.3", "svg_include_sink=false")),
    ("config+sink=on", "svg +sink=on", ("svg_include_sink=true",)),
    ("config+dense_frames=1", "svg +dense_frames=1", ("svg_dense_frames=1",)),
    ("config+sink_frames=2", "svg +sink_frames=2", ("svg_sink_frames=2",)),
])
def test_compare_runs_can_set_the_compensation_and_layouts(spec, name, overrides):
  from maxdiffusion_svg.plugin.compare import svg_run  # pylint: disable=import-outside-toplevel
  run = svg_run(spec)
  assert (run.name, run.overrides) == (name, overrides)


def test_the_settings_line_says_the_dense_frames_and_compare_refuses_a_bad_count():
  from maxdiffusion_svg.plugin.compare import svg_run  # pylint: disable=import-outside-toplevel
  assert "dense_frames" not in PluginSettings.from_mapping({}).summary()
  assert "sink" not in PluginSettings.from_mapping({}).summary()
  assert ", no sink (svg_include_sink)," in PluginSettings.from_mapping(
      {"svg_include_sink": False}).summary()
  assert ", the first 2 frames a sink (svg_sink_frames), the first frame's queries dense" in \
      PluginSettings.from_mapping({"svg_sink_frames": 2, "svg_dense_frames": 1}).summary()
  for n, said in ((1, "the first frame's"), (2, "the first 2 frames'")):
    line = PluginSettings.from_mapping({"svg_dense_frames": n}).summary()
    assert f"layouts spatial, temporal, {said} queries dense (svg_dense_frames), dense kernel" \
        in line
  with pytest.raises(ValueError, match=r"sink_frames=N \(N >= 1\) or dense_frames=N \(N >= 0\), "
                                       r"got 'dense_frames=x'"):
    svg_run("config+dense_frames=x")


def test_compare_refuses_an_unknown_layout_naming_the_allowed_ones():
  from maxdiffusion_svg.plugin.compare import svg_run  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match=r"svg_layouts: unknown layout\(s\) 'moving'; allowed: "
                                       r"spatial, temporal, semantic"):
    svg_run("0.3+layouts=spatial/moving")
