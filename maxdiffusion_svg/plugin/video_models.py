"""The MaxDiffusion video model families the plugin runs, as facts: no MaxDiffusion import.

Each family says which configs are its own (``model_name``), which MaxDiffusion main generates
with it, how a pixel video becomes its token grid (VAE compression and patch size), which
transformer class it is and where its self-attention ops sit (:mod:`families` reads that), and
which plugin module holds its own hooks and generate driver (LTX-2's :mod:`ltx2`, Wan Animate's
:mod:`wan_animate`, Wan VACE's :mod:`wan_vace`; Wan's sit in :mod:`hooks` and
:mod:`generations`). The CLI tools (``tiles --config``,
``estimate``, ``compare``) and the run summary take the grid and the default depth from here,
so one video maps to one grid everywhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from maxdiffusion_svg.plan.geometry import VideoGrid


@dataclasses.dataclass(frozen=True)
class VideoModel:
  """One family of MaxDiffusion video transformers."""

  name: str  # for messages and the settings line
  model_names: tuple[str, ...]  # the configs' model_name values
  generate_main: str  # the module whose main generates with it (MaxDiffusion's, by default)
  vae_temporal: int  # latent frames = (frames - 1) // vae_temporal + 1
  vae_spatial: int
  patch: tuple[int, int, int]  # (t, h, w) patchify after the VAE
  layers: int  # the default checkpoint's depth and video self-attention heads
  heads: int
  head_dim: int = 128  # ... and their width (every Wan size's and LTX-2's video)
  # what runs dense by design besides cross-attention (for the settings line)
  dense_by_design: str = "cross-attention"
  frames_key: str = "num_frames"  # the config key of the frames one transformer call sees
  extra_frames: int = 0  # latent frames in front of the video's (Animate's reference slot)
  # a config key listing inputs that each add a latent frame in front (VACE's reference images)
  extra_frames_key: str = ""
  main_package: str = "maxdiffusion"  # where generate_main lives
  # The transformer class (by name, anywhere in the model's MRO) that is this family; "": told
  # apart otherwise (Wan, and VACE by its control blocks).
  model_class: str = ""
  blocks: str = "blocks"  # the model's attribute holding its blocks
  # The residual checkpoint name of a block's attn1 op, which tells self-attention from
  # cross-attention at the kernel; None: the op is tagged by its place (LTX-2's attn1).
  self_attention_name: str | None = "self_attn"
  control_blocks: str = ""  # blocks whose self-attention runs dense by design (VACE's)
  # The plugin module holding the family's own hooks (install(wrap)) and its generate driver
  # (GENERATION); "": Wan's, in hooks and generations.
  module: str = ""
  # (model width d, dense FLOPs per token and block in d²): a FLOP model of a step's
  # self-attention share where none is measured; None: Wan's measured shares.
  flop_model: tuple[int, int] | None = None

  @property
  def generate_module(self) -> str:
    """The importable module of :attr:`generate_main`."""
    return f"{self.main_package}.{self.generate_main}"

  def grid(self, frames: int, height: int, width: int, extra_frames: int = 0) -> VideoGrid:
    """The token grid of a ``frames x height x width`` pixel video; ``extra_frames``: the
    config's inputs of :attr:`extra_frames_key` (latent frames in front of the video's)."""
    grid = VideoGrid.for_video(frames, height, width, vae_temporal=self.vae_temporal,
                               vae_spatial=self.vae_spatial, patch=self.patch)
    return VideoGrid(grid.frames + self.extra_frames + extra_frames, grid.height, grid.width)


# Wan 2.1 / 2.2: 14B (40 layers x 40 heads) unless the checkpoint's name says 1.3B.
WAN = VideoModel("Wan", ("wan2.1", "wan2.2"), "generate_wan", 4, 8, (1, 2, 2), 40, 40)
# LTX-2 (19B) and LTX-2.3: one latent token per 32x32 pixels of every 8th frame; 48 layers,
# video self-attention 32 heads x 128. Audio self-attention, text and audio<->video
# cross-attention run dense.
# Its video stream: width 4096 (32 heads x 128); per token and block, the projections and
# feed-forward (self-attention q/k/v/o, text and audio cross-attention q/o, a 4x feed-forward)
# cost about 32·d² FLOPs, and self-attention's scores and values 4·N·d.
LTX2 = VideoModel("LTX-2", ("ltx2_video", "ltx2.3"), "generate_ltx2", 8, 32, (1, 1, 1), 48, 32,
                  dense_by_design="audio self-attention, text and audio-video cross-attention",
                  model_class="LTX2VideoTransformer3DModel", blocks="transformer_blocks",
                  self_attention_name=None, module="maxdiffusion_svg.plugin.ltx2",
                  flop_model=(4096, 32))
# Wan VACE (Wan 2.1 blocks plus control blocks; MaxDiffusion trains it with train_wan_vace and
# runs it in VaceWanPipeline2_1, with no generate main: ours, maxdiffusion_svg.plugin.generate_vace,
# drives that pipeline): each reference image is an extra latent frame in front of the video,
# so the grid's frame 0 (the first-frame sink) is the first reference. The control blocks'
# self-attention runs dense, counted as `vace` calls.
VACE_BLOCKS = "vace"
VACE_REFERENCES = "vace_reference_images"  # the generation config's reference images
WAN_VACE = dataclasses.replace(
    WAN, name="Wan VACE", model_names=(), generate_main="generate_vace",
    main_package="maxdiffusion_svg.plugin", extra_frames_key=VACE_REFERENCES,
    dense_by_design="cross-attention and the VACE control blocks' self-attention",
    control_blocks="vace_blocks", module="maxdiffusion_svg.plugin.wan_vace")
# Wan Animate (Wan 2.2 Animate 14B, generate_wan_animate): each segment of
# segment_frame_length frames is one call on its latent frames plus a reference slot in front
# (frame 0, the first-frame sink). Its face adapter's attention runs its own kernel.
WAN_ANIMATE = dataclasses.replace(
    WAN, name="Wan Animate", model_names=(), generate_main="generate_wan_animate",
    frames_key="segment_frame_length", extra_frames=1,
    model_class="WanAnimateTransformer3DModel", module="maxdiffusion_svg.plugin.wan_animate")
# Keys only an Animate config holds (MaxDiffusion's base_wan_animate.yml; model_name wan2.2).
ANIMATE_KEYS = ("pose_video_path", "face_video_path")
FAMILIES = (WAN, LTX2)  # by model_name
EVERY_FAMILY = (*FAMILIES, WAN_ANIMATE, WAN_VACE)  # and the Wan variants, told by their keys


def video_model(config: Mapping[str, Any]) -> VideoModel:
  """The family of a MaxDiffusion config, by its ``model_name`` (Wan when it has none, as
  ``generate_wan`` assumes); a Wan config with Animate's inputs is Wan Animate, one with
  VACE's reference images (our VACE generation config's key) Wan VACE."""
  name = config.get("model_name")
  if name in WAN.model_names and any(key in config for key in ANIMATE_KEYS):
    return WAN_ANIMATE
  if name in WAN.model_names and VACE_REFERENCES in config:
    return WAN_VACE
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
  extra = len(config.get(family.extra_frames_key) or ()) if family.extra_frames_key else 0
  return family.grid(config[family.frames_key], config["height"], config["width"], extra)


@dataclasses.dataclass(frozen=True)
class WanSize:
  """A Wan (or Wan VACE) checkpoint's size, which the YAML does not hold."""

  name: str
  layers: int
  heads: int
  vace_blocks: int  # Wan VACE's control blocks (its checkpoint's vace_layers)


# Wan 2.1 1.3B has 30 blocks of 12 heads; the 14B models and each Wan 2.2 A14B expert 40 of 40.
# Diffusers' Wan2.1-VACE checkpoints put a control block at every 2nd of the 1.3B's first 30
# blocks and every 5th of the 14B's 40.
WAN_1_3B, WAN_14B = WanSize("1.3B", 30, 12, 15), WanSize("14B", 40, 40, 8)


def wan_size(config: Mapping[str, Any]) -> WanSize | None:
  """A Wan or Wan VACE config's size by its checkpoint's name (1.3B where the name says so,
  else 14B); None for the other families, one size each (:class:`VideoModel`'s own)."""
  if video_model(config) not in (WAN, WAN_VACE):
    return None
  return WAN_1_3B if "1.3B" in str(config.get("pretrained_model_name_or_path", "")) else WAN_14B


def experts_of(config: Mapping[str, Any]) -> tuple[str | None, ...]:
  """The experts a config's run prepares: Wan 2.2's two (T2V and I2V; Animate, also
  ``model_name: wan2.2``, has one transformer), else one model (``None``)."""
  if config.get("model_name") == "wan2.2" and video_model(config) is WAN:
    from maxdiffusion_svg.budgets.config import EXPERTS  # pylint: disable=import-outside-toplevel
    return EXPERTS
  return (None,)
