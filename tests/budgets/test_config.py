"""SvgConfig from flat svg_* keys, presets and schedules."""

import jax
import jax.numpy as jnp
import pytest

from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.budgets.schedule import PRESETS, Interval, Schedule
from maxdiffusion_svg.plan.tiles import TileMode
from maxdiffusion_svg.plugin.settings import PluginSettings
from shipped_configs import own_chain

EVERY_KEY = {
    "svg_density": 0.25,
    "svg_high_noise_density": 0.5,
    "svg_low_noise_density": 0.2,
    "svg_schedule": "aggressive",
    "svg_active_steps": [11, 40],
    "svg_active_layers": [1, -1],
    "svg_tile_mode": "split",
    "svg_block_q": 1024,
    "svg_block_kv": 512,
    "svg_block_kv_compute": 256,
    "svg_backend": "xla",
    "svg_include_sink": False,
    "svg_profile_queries": 32,
    "svg_profile_pool": "prefix",
    "svg_sample_max_row": 5000,
    "svg_profile_masks": "probe",
    "svg_profile_seed": 7,
    "svg_vmem_limit_kib": 65536,
}


def test_every_key_is_read():
  cfg = SvgConfig.from_mapping({**EVERY_KEY, "attention": "flash", "num_inference_steps": 40})
  assert cfg.density == 0.25
  assert cfg.density_for("high_noise") == 0.5 and cfg.density_for("low_noise") == 0.2
  assert cfg.schedule == Schedule(Interval(11, 40), Interval(1, None))
  assert cfg.tile_mode is TileMode.SPLIT
  assert (cfg.block_q, cfg.block_kv, cfg.block_kv_compute) == (1024, 512, 256)
  assert cfg.backend == "xla" and cfg.include_sink is False
  assert cfg.router.profile_queries == 32 and cfg.router.profile_pool == "prefix"
  assert cfg.router.sample_max_row == 5000 and cfg.router.include_sink is False
  assert cfg.router.profile_masks == "probe"
  assert cfg.profile_seed == 7
  assert cfg.vmem_limit_kib == 65536


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_set_density_and_warmup_from_the_step_count(name):
  preset = PRESETS[name]
  cfg = SvgConfig.from_mapping({"svg_schedule": name, "num_inference_steps": 40})
  assert cfg.density == preset.density
  assert cfg.schedule.active_steps == Interval(int(preset.dense_step_fraction * 40), None)
  assert cfg.schedule.active_layers == Interval(preset.dense_layers, None)
  # Key-by-key overrides win over the preset.
  over = SvgConfig.from_mapping({"svg_schedule": name, "svg_density": 0.6,
                                 "svg_active_layers": [0, 10]}, num_steps=40)
  assert over.density == 0.6 and over.schedule.active_layers == Interval(0, 10)
  assert over.schedule.active_steps == cfg.schedule.active_steps


def test_defaults_are_the_moderate_preset():
  assert SvgConfig.from_mapping({}) == SvgConfig()
  assert SvgConfig().density == PRESETS["moderate"].density
  assert SvgConfig().schedule.active_steps == Interval(10, None)  # 20% of 50 steps


@pytest.mark.parametrize("mapping, needle", [
    ({"svg_density": 0}, "svg_density must be in"),
    ({"svg_density": 1.5}, "svg_density must be in"),
    ({"svg_high_noise_density": -0.1}, "svg_high_noise_density must be in"),
    ({"svg_low_noise_density": "x"}, "svg_low_noise_density must be a number"),
    ({"svg_schedule": "fast"}, "svg_schedule must be one of conservative, moderate, aggressive"),
    ({"svg_active_steps": [10, 10]}, "svg_active_steps needs start < end"),
    ({"svg_active_steps": [12, 3]}, "svg_active_steps needs start < end"),
    ({"svg_active_layers": [1]}, "svg_active_layers must be a \\[start, end\\) pair"),
    ({"svg_active_layers": [-2, 5]}, "svg_active_layers must hold integers >= 0"),
    ({"svg_tile_mode": "fast"}, "svg_tile_mode must be one of naive, split, aligned"),
    ({"svg_block_q": 100}, "svg_block_q must be a positive multiple of 128"),
    ({"svg_block_kv_compute": -128}, "svg_block_kv_compute must be a positive multiple of 128"),
    ({"svg_vmem_limit_kib": -1}, "svg_vmem_limit_kib must be an integer >= 0"),
    ({"svg_backend": "cuda"}, "svg_backend must be one of auto, pallas, splash, xla"),
    ({"svg_include_sink": "yes"}, "svg_include_sink must be true or false"),
    ({"svg_profile_queries": 0}, "svg_profile_queries must be an integer >= 1"),
    ({"svg_profile_pool": "all"}, "svg_profile_pool must be one of prefix, stratified"),
    ({"svg_profile_masks": "exact"}, "svg_profile_masks must be one of probe, execution"),
    ({"svg_sample_max_row": 0}, "svg_sample_max_row must be an integer >= 1"),
    ({"svg_profile_seed": 1.5}, "svg_profile_seed must be an integer"),
    ({"svg_densty": 0.3}, "unknown SVG config key\\(s\\) svg_densty \\(did you mean svg_density or .*; allowed: "),
    ({"num_inference_steps": 0}, "num_inference_steps must be a positive integer"),
])
def test_bad_values_and_unknown_keys_name_the_key(mapping, needle):
  with pytest.raises(ValueError, match=needle):
    SvgConfig.from_mapping(mapping)


def test_unknown_expert_is_rejected():
  with pytest.raises(ValueError, match="expert must be one of high_noise, low_noise"):
    SvgConfig().density_for("medium")


def test_is_active_for_ints_and_traced_scalars():
  schedule = Schedule(Interval(2, 5), Interval(1, None))
  expected = {(s, l): 2 <= s < 5 and l >= 1 for s in range(7) for l in range(3)}
  for (s, l), want in expected.items():
    assert schedule.is_active(s, l) is want
  traced = jax.jit(schedule.is_active)
  for (s, l), want in expected.items():
    assert bool(traced(jnp.int32(s), jnp.int32(l))) == want


def test_a_schedule_active_everywhere_is_decided_while_tracing():
  # No dense branch (no cond) even for traced steps and layers: what training relies on to keep
  # one branch's residuals.
  everywhere = Schedule(Interval(0, None), Interval(0, None))
  seen = []
  jax.make_jaxpr(lambda s, l: seen.append(everywhere.is_active(s, l)) or s)(jnp.int32(3),
                                                                          jnp.int32(7))
  assert seen == [True]
  partly = Schedule(Interval(0, None), Interval(1, None))
  jax.make_jaxpr(lambda s, l: seen.append(partly.is_active(s, l)) or s)(jnp.int32(3), jnp.int32(7))
  assert not isinstance(seen[-1], bool)


def test_shipped_yaml_fragments_are_valid():
  import pathlib  # pylint: disable=import-outside-toplevel
  import yaml  # pylint: disable=import-outside-toplevel
  files = sorted((pathlib.Path(__file__).parents[2] / "configs").glob("*.yml"))
  assert files
  for path in files:
    data = own_chain(path)
    assert data["attention"] == "svg"
    settings = PluginSettings.from_mapping({**data, "num_inference_steps": 40})
    assert settings.svg.tile_mode is TileMode.ALIGNED and settings.dense_kernel is None
  wan22 = PluginSettings.from_mapping(yaml.safe_load(
      (files[0].parent / "wan22_svg.yml").read_text())).svg
  assert wan22.density_for("high_noise") == 0.5 and wan22.schedule.active_steps == Interval(11, None)
