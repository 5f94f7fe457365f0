"""The MaxDiffusion video model families the plugin runs, as facts: no MaxDiffusion import.

Each family says which configs are its own (``model_name``), which MaxDiffusion main generates
with it, and how a pixel video becomes its token grid (VAE compression and patch size). The
plugin's hooks (:mod:`maxdiffusion_svg.plugin.hooks`) hold how each family's transformer is
found and called; the CLI tools (``tiles --config``, ``estimate``, ``compare``) and the run
summary take the grid and the default depth from here, so one video maps to one grid
everywhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from maxdiffusion_svg.geometry import VideoGrid


@dataclasses.dataclass(frozen=True)
class VideoModel:
  """One family of MaxDiffusion video transformers."""

  name: str  # for messages and the settings line
  model_names: tuple[str, ...]  # the configs' model_name values
  generate_main: str  # MaxDiffusion's module whose main generates with it
  vae_temporal: int  # latent frames = (frames - 1) // vae_temporal + 1
  vae_spatial: int
  patch: tuple[int, int, int]  # (t, h, w) patchify after the VAE
  layers: int  # the default checkpoint's depth and video self-attention heads
  heads: int
  # what runs dense by design besides cross-attention (for the settings line)
  dense_by_design: str = "cross-attention"

  def grid(self, frames: int, height: int, width: int) -> VideoGrid:
    """The token grid of a ``frames x height x width`` pixel video."""
    return VideoGrid.for_video(frames, height, width, vae_temporal=self.vae_temporal,
                               vae_spatial=self.vae_spatial, patch=self.patch)


# Wan 2.1 / 2.2: 14B (40 layers x 40 heads) unless the checkpoint's name says 1.3B.
WAN = VideoModel("Wan", ("wan2.1", "wan2.2"), "generate_wan", 4, 8, (1, 2, 2), 40, 40)
# LTX-2 (19B) and LTX-2.3: one latent token per 32x32 pixels of every 8th frame; 48 layers,
# video self-attention 32 heads x 128. Audio self-attention, text and audio<->video
# cross-attention run dense.
LTX2 = VideoModel("LTX-2", ("ltx2_video", "ltx2.3"), "generate_ltx2", 8, 32, (1, 1, 1), 48, 32,
                  dense_by_design="audio self-attention, text and audio-video cross-attention")
FAMILIES = (WAN, LTX2)


def video_model(config: Mapping[str, Any]) -> VideoModel:
  """The family of a MaxDiffusion config, by its ``model_name`` (Wan when it has none, as
  ``generate_wan`` assumes)."""
  name = config.get("model_name")
  if name is None:
    return WAN
  for family in FAMILIES:
    if name in family.model_names:
      return family
  known = ", ".join(n for f in FAMILIES for n in f.model_names)
  raise ValueError(f"model_name {name!r} is not a video model the svg kernel runs; it runs "
                   f"{known}")


def grid_of(config: Mapping[str, Any]) -> VideoGrid:
  """The token grid of a config's ``num_frames``, ``height`` and ``width``."""
  return video_model(config).grid(config["num_frames"], config["height"], config["width"])
