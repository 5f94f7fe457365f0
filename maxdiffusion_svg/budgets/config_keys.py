"""The flat ``svg_*`` YAML keys: the ``SvgConfig`` field each sets, the values leaving it unset."""

from __future__ import annotations

import difflib
from typing import Any, Mapping

import yaml

from maxdiffusion_svg.budgets.per_layer import UNIFORM
from maxdiffusion_svg.budgets.schedule import Interval, Schedule, get_preset

# MaxDiffusion's Wan 2.1 14B default; used to place a preset's dense warm-up when the
# config does not say how many steps the run has (``num_inference_steps``).
DEFAULT_NUM_STEPS = 50
DEFAULT_PRESET = "moderate"
# Values that leave a key unset, so that every key can sit in a YAML with a typed value
# (MaxDiffusion overrides only keys its config holds, and cannot override a null).
PRESET = "preset"  # svg_density, svg_active_steps/layers: svg_schedule's preset decides
SHARED = "svg_density"  # svg_high/low_noise_density: the same as svg_density
UNSET_BY = {"svg_density": PRESET, "svg_active_steps": PRESET, "svg_active_layers": PRESET,
            "svg_high_noise_density": SHARED, "svg_low_noise_density": SHARED,
            "svg_layer_densities": UNIFORM, "svg_high_noise_layer_densities": UNIFORM,
            "svg_low_noise_layer_densities": UNIFORM, "svg_layer_compensation": UNIFORM,
            "svg_high_noise_layer_compensation": UNIFORM,
            "svg_low_noise_layer_compensation": UNIFORM, "svg_head_densities": UNIFORM,
            "svg_high_noise_head_densities": UNIFORM, "svg_low_noise_head_densities": UNIFORM}


def config_kwargs(mapping: Mapping[str, Any], num_steps: int | None = None,
                  extra_keys: tuple[str, ...] = ()) -> dict[str, Any]:
  """``SvgConfig``'s arguments from a flat config (:meth:`.SvgConfig.from_mapping`)."""
  allowed = set(KEYS) | {"svg_schedule"} | set(extra_keys)
  unknown = sorted(k for k in mapping if k.startswith("svg_") and k not in allowed)
  if unknown:
    close = list(dict.fromkeys(
        match for key in unknown for match in difflib.get_close_matches(key, allowed, n=2)))
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    raise ValueError(f"unknown SVG config key(s) {', '.join(unknown)}{hint}; allowed: "
                     f"{', '.join(sorted(allowed))}")
  svg = {k: v for k, v in mapping.items() if k in allowed}
  for key, unset in UNSET_BY.items():
    value = _given(svg, key, unset)
    if value is None:
      svg.pop(key, None)
    else:
      svg[key] = value
  steps = num_steps if num_steps is not None else mapping.get("num_inference_steps",
                                                               DEFAULT_NUM_STEPS)
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise ValueError(f"num_inference_steps must be a positive integer, got {steps!r}")
  preset = get_preset(svg.get("svg_schedule", DEFAULT_PRESET))
  base = preset.schedule(steps)
  kwargs: dict[str, Any] = {"density": preset.density}
  for key, field in KEYS.items():
    if key in svg and field not in ("active_steps", "active_layers"):
      kwargs[field] = svg[key]
  kwargs["schedule"] = Schedule(
      Interval.parse(svg["svg_active_steps"], "svg_active_steps")
      if "svg_active_steps" in svg else base.active_steps,
      Interval.parse(svg["svg_active_layers"], "svg_active_layers")
      if "svg_active_layers" in svg else base.active_layers)
  return kwargs


def _given(svg: Mapping[str, Any], key: str, unset: str) -> Any:
  """A key's value, or None where absent or ``unset``; text is read as YAML (a command line's
  ``svg_density=0.3`` arrives as ``"0.3"``)."""
  value = svg.get(key)
  if not isinstance(value, str):
    return value
  if value.strip() == unset:
    return None
  try:
    return yaml.safe_load(value)
  except yaml.YAMLError as e:
    raise ValueError(f"{key}: cannot read {value!r} (give a value, or {unset!r})") from e


# Flat YAML key -> SvgConfig field (svg_schedule is the preset, handled apart).
KEYS = {
    "svg_density": "density",
    "svg_high_noise_density": "high_noise_density",
    "svg_low_noise_density": "low_noise_density",
    "svg_layer_densities": "layer_densities",
    "svg_high_noise_layer_densities": "high_noise_layer_densities",
    "svg_low_noise_layer_densities": "low_noise_layer_densities",
    "svg_active_steps": "active_steps",
    "svg_active_layers": "active_layers",
    "svg_tile_mode": "tile_mode",
    "svg_block_q": "block_q",
    "svg_block_kv": "block_kv",
    "svg_block_kv_compute": "block_kv_compute",
    "svg_backend": "backend",
    "svg_vmem_limit_kib": "vmem_limit_kib",
    "svg_include_sink": "include_sink",
    "svg_sink_frames": "sink_frames",
    "svg_dense_frames": "dense_frames",
    "svg_profile_queries": "profile_queries",
    "svg_profile_pool": "profile_pool",
    "svg_sample_max_row": "sample_max_row",
    "svg_profile_masks": "profile_masks",
    "svg_profile_seed": "profile_seed",
    "svg_compensation": "compensation",
    "svg_compensation_blocks": "compensation_blocks",
    "svg_layer_compensation": "layer_compensation",
    "svg_high_noise_layer_compensation": "high_noise_layer_compensation",
    "svg_low_noise_layer_compensation": "low_noise_layer_compensation",
    "svg_head_densities": "head_densities",
    "svg_high_noise_head_densities": "high_noise_head_densities",
    "svg_low_noise_head_densities": "low_noise_head_densities",
    "svg_layouts": "layouts",
    "svg_semantic_clusters": "semantic_clusters",
    "svg_semantic_iterations": "semantic_iterations",
    "svg_semantic_warm_iterations": "semantic_warm_iterations",
}
