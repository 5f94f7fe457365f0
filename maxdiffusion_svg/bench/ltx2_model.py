"""LTX-2 19B as the benchmarks see it: its transformer's checkpoint config, its VAEs' strides,
MaxDiffusion's ``ltx2_video.yml`` defaults and the named video sizes."""

from __future__ import annotations

import pathlib
from typing import Sequence

CONFIG_NAME = "ltx2_video.yml"  # MaxDiffusion's LTX-2 config, the default base

# LTX-2 19B's transformer as its Hugging Face checkpoint (Lightricks/LTX-2, transformer/
# config.json) gives it: the values diffusers' LTX-2 conversion script writes for version
# "2.0". MaxDiffusion's LTX2VideoTransformer3DModel defaults hold the same but for rope_type
# (its default "interleaved"; the checkpoint's "split") and activation_fn (the checkpoint's
# "gelu-approximate", which MaxDiffusion's loader turns into its "gelu").
LTX2_19B = {
    "in_channels": 128, "out_channels": 128, "patch_size": 1, "patch_size_t": 1,
    "num_attention_heads": 32, "attention_head_dim": 128, "cross_attention_dim": 4096,
    "vae_scale_factors": [8, 32, 32], "pos_embed_max_pos": 20, "base_height": 2048,
    "base_width": 2048, "audio_in_channels": 128, "audio_out_channels": 128,
    "audio_patch_size": 1, "audio_patch_size_t": 1, "audio_num_attention_heads": 32,
    "audio_attention_head_dim": 64, "audio_cross_attention_dim": 2048, "audio_scale_factor": 4,
    "audio_pos_embed_max_pos": 20, "audio_sampling_rate": 16000, "audio_hop_length": 160,
    "num_layers": 48, "activation_fn": "gelu-approximate", "qk_norm": "rms_norm_across_heads",
    "norm_elementwise_affine": False, "norm_eps": 1e-06, "caption_channels": 3840,
    "attention_bias": True, "attention_out_bias": True, "rope_theta": 10000.0,
    "rope_double_precision": True, "causal_offset": 1, "timestep_scale_multiplier": 1000,
    "cross_attn_timestep_scale_multiplier": 1000, "rope_type": "split",
}
# LTX-2's video VAE: one latent frame per 8 frames (the first alone), 32x32 pixels per latent.
VAE_TEMPORAL, VAE_SPATIAL = 8, 32
# LTX-2's audio VAE (16 kHz, mel hop 160, 4x temporal compression): 25 audio latents a second,
# 8 channels x 16 mel bins (64 / 4) packed into the transformer's 128 audio channels.
AUDIO_LATENTS_PER_SECOND = 16000 / 160 / 4
TEXT_LEN = 1024  # ltx2_video.yml's max_sequence_length: the connectors' output tokens
FPS = 24.0  # ltx2_video.yml's fps
NUM_STEPS = 40  # ltx2_video.yml's num_inference_steps: the schedule written into svg's model
# Pixel videos by name: 121 frames (ltx2_video.yml's num_frames) at 1280x704 and 1920x1088.
RESOLUTIONS = {"720p": (121, 704, 1280), "1080p": (121, 1088, 1920)}


def default_config() -> pathlib.Path:
  """MaxDiffusion's ``ltx2_video.yml`` (found where the plugin's overlay finds bases)."""
  from maxdiffusion_svg.plugin.overlay import maxdiffusion_config_dirs  # pylint: disable=import-outside-toplevel
  for folder in maxdiffusion_config_dirs():
    if (folder / CONFIG_NAME).is_file():
      return folder / CONFIG_NAME
  raise FileNotFoundError(f"MaxDiffusion's {CONFIG_NAME} was not found: is MaxDiffusion "
                          f"importable?")


def latent_grid(frames: int, height: int, width: int) -> tuple[int, int, int]:
  """``(frames, height, width)`` of LTX-2's latent (patch 1: one video token per cell)."""
  if frames < 1 or (frames - 1) % VAE_TEMPORAL:
    raise ValueError(f"frames must be 1 + a multiple of {VAE_TEMPORAL}, got {frames}")
  if height % VAE_SPATIAL or width % VAE_SPATIAL:
    raise ValueError(f"height and width must be multiples of {VAE_SPATIAL}, got "
                     f"{height}x{width}")
  return (frames - 1) // VAE_TEMPORAL + 1, height // VAE_SPATIAL, width // VAE_SPATIAL


def audio_frames(frames: int, fps: float = FPS) -> int:
  """Audio latent length of a ``frames``-frame video, as LTX2Pipeline derives it."""
  return round(frames / fps * AUDIO_LATENTS_PER_SECOND)


def resolution_video(resolution: str | Sequence[int]) -> tuple[int, int, int]:
  """``(frames, height, width)`` of a named resolution or of a ``(frames, height, width)``."""
  if isinstance(resolution, str):
    if resolution not in RESOLUTIONS:
      raise ValueError(f"resolution must be among {', '.join(RESOLUTIONS)} or (frames, height, "
                       f"width), got {resolution!r}")
    return RESOLUTIONS[resolution]
  frames, height, width = (int(x) for x in resolution)
  return frames, height, width
