"""What SVG means in a training step, and the config checks a fine-tuning run gets first.

A training step has no denoising step: MaxDiffusion's Wan trainer samples a noise level per
video (a continuous timestep in [0, 1000)) and runs the transformer once. So the step schedule
cannot pick steps: every training step is sparse, in the layers ``svg_active_layers`` names
(layers are known), and ``svg_active_steps`` must say so ([0, -1]). Semantic warm starts carry
centroids from one denoising step to the next, which a training step does not have: they must be
off (the clustering starts cold in each call, as generation's first step does).
"""

from __future__ import annotations

from typing import Any, Mapping

from maxdiffusion_svg.plugin.settings import KERNEL_NAME, PluginSettings


def check_training(keys: Mapping[str, Any]) -> PluginSettings | None:
  """The plugin settings of a fine-tuning config with ``attention: svg`` (None for another
  kernel: nothing of SVG runs), or one line naming the key to change."""
  if keys.get("attention") != KERNEL_NAME:
    return None
  settings = PluginSettings.from_mapping(keys)
  steps = settings.svg.schedule.active_steps
  if steps.start != 0 or steps.end is not None:
    raise ValueError(f"svg_active_steps={steps.start, -1 if steps.end is None else steps.end}: a "
                     f"training step has no denoising step (it samples a noise level), so every "
                     f"step is sparse; set svg_active_steps: [0, -1] (svg_active_layers still "
                     f"picks the layers)")
  if settings.svg.semantic is not None and settings.svg.semantic_warm_iterations:
    raise ValueError(f"svg_semantic_warm_iterations={settings.svg.semantic_warm_iterations}: "
                     f"warm starts carry centroids across denoising steps, which training does "
                     f"not have; set svg_semantic_warm_iterations: 0")
  return settings
