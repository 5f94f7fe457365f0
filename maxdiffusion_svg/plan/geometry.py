"""Wan's latent token grid and SVG's two layouts: frame-major ``t = f * (H*W) + p`` (``p`` the
raster position) and temporal-major ``u = p * F + f``, where nearby frames form a band.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Mapping

import numpy as np


class TokenOrder(enum.Enum):
  """Token order of a head's sequence."""

  FRAME_MAJOR = "frame_major"  # (F, H, W): spatial heads keep it
  TEMPORAL_MAJOR = "temporal_major"  # (H, W, F): temporal heads are placed in it


def _positive_int(name: str, value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
    raise ValueError(f"{name} must be a positive integer, got {value!r}")
  return int(value)


@dataclasses.dataclass(frozen=True)
class VideoGrid:
  """The latent token grid after patchify: ``frames x height x width`` tokens."""

  frames: int
  height: int
  width: int

  def __post_init__(self) -> None:
    for name in ("frames", "height", "width"):
      object.__setattr__(self, name, _positive_int(name, getattr(self, name)))

  @property
  def frame_size(self) -> int:
    return self.height * self.width

  @property
  def tokens(self) -> int:
    return self.frames * self.frame_size

  @property
  def shape(self) -> tuple[int, int, int]:
    return (self.frames, self.height, self.width)

  def __str__(self) -> str:
    return f"{self.frames}x{self.height}x{self.width}"

  @classmethod
  def for_video(
      cls,
      num_frames: int,
      height: int,
      width: int,
      vae_temporal: int = 4,
      vae_spatial: int = 8,
      patch: tuple[int, int, int] = (1, 2, 2),
  ) -> "VideoGrid":
    """Wan's grid for a pixel video (81x720x1280 gives 21x45x80); sizes the VAE or patch do not
    divide raise rather than crop."""
    num_frames = _positive_int("num_frames", num_frames)
    height = _positive_int("height", height)
    width = _positive_int("width", width)
    vae_temporal = _positive_int("vae_temporal", vae_temporal)
    vae_spatial = _positive_int("vae_spatial", vae_spatial)
    if len(patch) != 3:
      raise ValueError(f"patch must have 3 entries (t, h, w), got {patch!r}")
    pt, ph, pw = (_positive_int(f"patch[{i}]", p) for i, p in enumerate(patch))
    if (num_frames - 1) % vae_temporal:
      raise ValueError(
          f"num_frames must be 1 + a multiple of vae_temporal={vae_temporal} "
          f"(e.g. 81), got {num_frames}")
    latent_frames = (num_frames - 1) // vae_temporal + 1
    if latent_frames % pt:
      raise ValueError(
          f"latent frames {latent_frames} are not divisible by patch[0]={pt}")
    for name, size, p in (("height", height, ph), ("width", width, pw)):
      step = vae_spatial * p
      if size % step:
        raise ValueError(
            f"{name} must be a multiple of vae_spatial*patch = {step}, got {size}")
    return cls(latent_frames // pt, height // (vae_spatial * ph), width // (vae_spatial * pw))


# Pixel sizes (frames, height, width) of the named presets. 1080 is not a
# multiple of 16, so the 1080p preset uses 1088 rows as Wan pipelines do.
RESOLUTIONS: Mapping[str, tuple[int, int, int]] = {
    "480p": (81, 480, 832),
    "720p": (81, 720, 1280),
    "1080p": (81, 1088, 1920),
    "1440p": (81, 1440, 2560),
}


def grid_for_resolution(name: str) -> VideoGrid:
  """The Wan grid of a named preset (81 frames)."""
  if name not in RESOLUTIONS:
    raise ValueError(
        f"resolution must be one of {', '.join(RESOLUTIONS)}, got {name!r}")
  return VideoGrid.for_video(*RESOLUTIONS[name])


def temporal_major_order(grid: VideoGrid) -> np.ndarray:
  """``order[u]``: the frame-major token at temporal-major ``u``; ``x_tm = x_fm[order]``."""
  return np.arange(grid.tokens, dtype=np.int32).reshape(grid.frames, grid.frame_size).T.reshape(-1)


def frame_major_order(grid: VideoGrid) -> np.ndarray:
  """Inverse of :func:`temporal_major_order`: ``x_fm = x_tm[order]``."""
  return np.arange(grid.tokens, dtype=np.int32).reshape(grid.frame_size, grid.frames).T.reshape(-1)


def layout_positions(grid: VideoGrid, layout: TokenOrder, tokens: Any) -> Any:
  """Position in ``layout`` of frame-major token indices (numpy or jax integer arrays)."""
  if layout is TokenOrder.FRAME_MAJOR:
    return tokens
  return (tokens % grid.frame_size) * grid.frames + tokens // grid.frame_size


def _check_sequence(x: Any, grid: VideoGrid) -> None:
  if x.ndim < 2 or x.shape[-2] != grid.tokens:
    raise ValueError(
        f"expected an array [..., S, D] with S = grid.tokens = {grid.tokens} "
        f"for grid {grid}, got shape {tuple(x.shape)}")


def to_temporal_major(x: Any, grid: VideoGrid) -> Any:
  """Reorders ``[..., S, D]`` (numpy or jax) frame-major to temporal-major: a copy, no gather."""
  _check_sequence(x, grid)
  lead, d = x.shape[:-2], x.shape[-1]
  y = x.reshape(*lead, grid.frames, grid.frame_size, d).swapaxes(-3, -2)
  return y.reshape(*lead, grid.tokens, d)


def to_frame_major(x: Any, grid: VideoGrid) -> Any:
  """Inverse of :func:`to_temporal_major`."""
  _check_sequence(x, grid)
  lead, d = x.shape[:-2], x.shape[-1]
  y = x.reshape(*lead, grid.frame_size, grid.frames, d).swapaxes(-3, -2)
  return y.reshape(*lead, grid.tokens, d)
