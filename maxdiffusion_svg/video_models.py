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
  frames_key: str = "num_frames"  # the config key of the frames one transformer call sees
  extra_frames: int = 0  # latent frames in front of the video's (Animate's reference slot)

  def grid(self, frames: int, height: int, width: int) -> VideoGrid:
    """The token grid of a ``frames x height x width`` pixel video."""
    grid = VideoGrid.for_video(frames, height, width, vae_temporal=self.vae_temporal,
                               vae_spatial=self.vae_spatial, patch=self.patch)
    return VideoGrid(grid.frames + self.extra_frames, grid.height, grid.width)


# Wan 2.1 / 2.2: 14B (40 layers x 40 heads) unless the checkpoint's name says 1.3B.
WAN = VideoModel("Wan", ("wan2.1", "wan2.2"), "generate_wan", 4, 8, (1, 2, 2), 40, 40)
# LTX-2 (19B) and LTX-2.3: one latent token per 32x32 pixels of every 8th frame; 48 layers,
# video self-attention 32 heads x 128. Audio self-attention, text and audio<->video
# cross-attention run dense.
LTX2 = VideoModel("LTX-2", ("ltx2_video", "ltx2.3"), "generate_ltx2", 8, 32, (1, 1, 1), 48, 32,
                  dense_by_design="audio self-attention, text and audio-video cross-attention")
# Wan VACE (Wan 2.1 blocks plus control blocks; MaxDiffusion trains it with train_wan_vace and
# runs it in VaceWanPipeline2_1): reference images are extra latent frames in front of the
# video, so the grid's frame 0 (the first-frame sink) is the first reference. The control
# blocks' self-attention runs dense, counted as `vace` calls.
VACE_BLOCKS = "vace"
WAN_VACE = dataclasses.replace(
    WAN, name="Wan VACE", model_names=(), generate_main="train_wan_vace",
    dense_by_design="cross-attention and the VACE control blocks' self-attention")
# Wan Animate (Wan 2.2 Animate 14B, generate_wan_animate): each segment of
# segment_frame_length frames is one call on its latent frames plus a reference slot in front
# (frame 0, the first-frame sink). Its face adapter's attention runs its own kernel.
WAN_ANIMATE = dataclasses.replace(
    WAN, name="Wan Animate", model_names=(), generate_main="generate_wan_animate",
    frames_key="segment_frame_length", extra_frames=1)
# Keys only an Animate config holds (MaxDiffusion's base_wan_animate.yml; model_name wan2.2).
ANIMATE_KEYS = ("pose_video_path", "face_video_path")
FAMILIES = (WAN, LTX2)


def video_model(config: Mapping[str, Any]) -> VideoModel:
  """The family of a MaxDiffusion config, by its ``model_name`` (Wan when it has none, as
  ``generate_wan`` assumes); a Wan config with Animate's inputs is Wan Animate."""
  name = config.get("model_name")
  if name in WAN.model_names and any(key in config for key in ANIMATE_KEYS):
    return WAN_ANIMATE
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
  family = video_model(config)
  return family.grid(config[family.frames_key], config["height"], config["width"])
