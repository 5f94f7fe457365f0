"""How close a video is to a reference video: PSNR, SSIM and (optionally) LPIPS per frame.

The field compares a sparse-attention video with the dense one of the same prompt and seed
by these three (SVG2 reports 25.8 dB / 0.854 / 0.138 on Wan 2.1 T2V 720p at ~30% density).
Each is the mean over frames of the per-frame figure, on RGB frames in [0, 1]. PSNR and SSIM
come from DeepMind's PIX (``dm_pix``: SSIM with an 11-tap Gaussian window, sigma 1.5, the
constants of Wang et al. 2004); LPIPS from its authors' ``lpips`` package (AlexNet), which
needs PyTorch, torchvision and AlexNet's ImageNet weights: none ship with this project.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any, Callable

import numpy as np

# Frames per metric call: bounds the float32 copies held at once (81 frames of 720p RGB are
# 0.9 GB each).
_CHUNK = 8


@dataclasses.dataclass(frozen=True)
class VideoScores:
  """A video against its reference, each the mean over frames."""

  psnr_db: float
  ssim: float
  lpips: float | None = None  # None: not asked for


def as_frames(video: Any) -> np.ndarray:
  """``[T, H, W, C]`` uint8 frames from what a pipeline returns (uint8, or floats in [0, 1])."""
  frames = np.asarray(video)
  if frames.ndim != 4 or frames.shape[-1] != 3:
    raise ValueError(f"a video must be [frames, height, width, 3] RGB, got shape {frames.shape}")
  if frames.dtype == np.uint8:
    return frames
  return np.clip(np.round(frames.astype(np.float64) * 255.0), 0, 255).astype(np.uint8)


def _chunks(video: np.ndarray, reference: np.ndarray):
  for start in range(0, len(video), _CHUNK):
    yield (video[start:start + _CHUNK].astype(np.float32) / 255.0,
           reference[start:start + _CHUNK].astype(np.float32) / 255.0)


def frame_psnr(video: np.ndarray, reference: np.ndarray) -> np.ndarray:
  """Per-frame PSNR (dB, peak 1.0 on [0, 1] frames); ``inf`` for an identical frame."""
  import dm_pix  # pylint: disable=import-outside-toplevel
  return np.concatenate([np.asarray(dm_pix.psnr(a, b), np.float64)
                         for a, b in _chunks(video, reference)])


def frame_ssim(video: np.ndarray, reference: np.ndarray) -> np.ndarray:
  """Per-frame SSIM, averaged over pixels and the three channels."""
  import dm_pix  # pylint: disable=import-outside-toplevel
  return np.concatenate([np.asarray(dm_pix.ssim(a, b, max_val=1.0), np.float64)
                         for a, b in _chunks(video, reference)])


def alexnet_weights_file() -> str:
  """Where torchvision looks for AlexNet's ImageNet weights (LPIPS's backbone)."""
  import torch  # pylint: disable=import-outside-toplevel
  import torchvision  # pylint: disable=import-outside-toplevel
  url = torchvision.models.AlexNet_Weights.DEFAULT.url
  return os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(url))


def check_metrics(lpips: bool) -> None:
  """Every library and weight file the metrics need is here: one line each, before any
  video is generated."""
  if importlib.util.find_spec("dm_pix") is None:
    raise ValueError("PSNR and SSIM need DeepMind's PIX: pip install dm-pix")
  if not lpips:
    return
  for module, package in (("lpips", "lpips"), ("torch", "torch"),
                          ("torchvision", "torchvision")):
    if importlib.util.find_spec(module) is None:
      raise ValueError(f"--lpips needs the {package} package: pip install lpips torch "
                       f"torchvision (or leave out --lpips)")
  weights = alexnet_weights_file()
  if not os.path.isfile(weights):
    raise ValueError(f"--lpips needs AlexNet's ImageNet weights at {weights} (none ship with "
                     f"maxdiffusion-svg): where there is network, run python -c \"import "
                     f"torchvision; torchvision.models.alexnet(weights='DEFAULT')\" once, or copy "
                     f"the file there (TORCH_HOME moves the folder); or leave out --lpips")


def lpips_scorer() -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
  """Per-frame LPIPS (AlexNet) of uint8 videos; builds the network once."""
  # pylint: disable=import-outside-toplevel
  import lpips
  import torch
  # pylint: enable=import-outside-toplevel
  net = lpips.LPIPS(net="alex", verbose=False).eval()

  def score(video: np.ndarray, reference: np.ndarray) -> np.ndarray:
    out = []
    with torch.no_grad():
      for a, b in _chunks(video, reference):
        ta, tb = (torch.from_numpy(x * 2.0 - 1.0).permute(0, 3, 1, 2) for x in (a, b))
        out.append(net(ta, tb).reshape(-1).numpy().astype(np.float64))
    return np.concatenate(out)

  return score


def compare_videos(video: Any, reference: Any,
                   lpips: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None
                   ) -> VideoScores:
  """``video`` against ``reference`` (same shape): mean per-frame PSNR, SSIM, LPIPS."""
  video, reference = as_frames(video), as_frames(reference)
  if video.shape != reference.shape:
    raise ValueError(f"videos to compare must have one shape, got {video.shape} and "
                     f"{reference.shape}")
  # An identical frame has infinite PSNR, and so has the mean: no cap is invented here.
  return VideoScores(psnr_db=float(np.mean(frame_psnr(video, reference))),
                     ssim=float(np.mean(frame_ssim(video, reference))),
                     lpips=None if lpips is None else float(np.mean(lpips(video, reference))))


def side_by_side(videos: list[np.ndarray], gap: int = 8) -> np.ndarray:
  """One video of several, left to right with ``gap`` black columns between them."""
  frames = [as_frames(v) for v in videos]
  t, h, _, c = frames[0].shape
  if any(f.shape[0] != t or f.shape[1] != h for f in frames):
    raise ValueError(f"side by side needs one frame count and height, got "
                     f"{[f.shape for f in frames]}")
  spacer = np.zeros((t, h, gap, c), np.uint8)
  parts = [frames[0]]
  for f in frames[1:]:
    parts += [spacer, f]
  return np.concatenate(parts, axis=2)
