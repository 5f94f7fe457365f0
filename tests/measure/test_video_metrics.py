"""Video metrics against independent float64 computations on known frames."""

import math

import numpy as np
import pytest

from maxdiffusion_svg.measure import video_metrics


def _frames(seed: int, t: int = 3, h: int = 32, w: int = 40) -> np.ndarray:
  """Smooth gradients with noise: structure for SSIM to see, every value in use."""
  rng = np.random.default_rng(seed)
  y, x = np.mgrid[0:h, 0:w]
  base = np.stack([x / w, y / h, (x + y) / (w + h)], axis=-1)
  frames = np.stack([base * (0.5 + 0.2 * i) for i in range(t)])
  return np.clip(np.round((frames + rng.normal(0, 0.05, frames.shape)) * 255), 0, 255).astype(
      np.uint8)


def _ssim_reference(a: np.ndarray, b: np.ndarray) -> float:
  """SSIM of two [H, W, C] images in [0, 1] (Wang et al. 2004): 11-tap Gaussian window,
  sigma 1.5, valid positions only, K1 = 0.01, K2 = 0.03; mean over positions and channels."""
  taps = np.exp(-((np.arange(11) - 5.0) ** 2) / (2 * 1.5**2))
  taps /= taps.sum()

  def blur(x):
    x = np.apply_along_axis(lambda r: np.convolve(r, taps, mode="valid"), 0, x)
    return np.apply_along_axis(lambda r: np.convolve(r, taps, mode="valid"), 1, x)

  mu_a, mu_b = blur(a), blur(b)
  var_a = blur(a * a) - mu_a**2
  var_b = blur(b * b) - mu_b**2
  cov = blur(a * b) - mu_a * mu_b
  c1, c2 = 0.01**2, 0.03**2
  ssim = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
  return float(ssim.mean())


def test_psnr_and_ssim_match_independent_float64_computations():
  video, reference = _frames(1), _frames(2)
  a, b = video.astype(np.float64) / 255, reference.astype(np.float64) / 255
  psnr = video_metrics.frame_psnr(video, reference)
  expected_psnr = [10 * math.log10(1.0 / np.mean((x - y) ** 2)) for x, y in zip(a, b)]
  np.testing.assert_allclose(psnr, expected_psnr, rtol=0, atol=1e-3)
  ssim = video_metrics.frame_ssim(video, reference)
  np.testing.assert_allclose(ssim, [_ssim_reference(x, y) for x, y in zip(a, b)], atol=1e-4)
  assert 0.05 < ssim.min() and ssim.max() < 0.99  # neither trivial end of the scale
  scores = video_metrics.compare_videos(video, reference)
  assert scores.psnr_db == pytest.approx(np.mean(expected_psnr), abs=1e-3)
  assert scores.ssim == pytest.approx(np.mean(ssim))
  assert scores.lpips is None


def test_a_video_against_itself_and_float_frames():
  video = _frames(3)
  same = video_metrics.compare_videos(video, video.astype(np.float32) / 255.0)
  assert same.psnr_db == math.inf and same.ssim == pytest.approx(1.0, abs=1e-6)
  with pytest.raises(ValueError, match="one shape"):
    video_metrics.compare_videos(video, video[:2])
  with pytest.raises(ValueError, match="RGB"):
    video_metrics.as_frames(np.zeros((2, 4, 4)))


def test_side_by_side_keeps_each_video_in_its_columns():
  a, b = _frames(4, w=16), _frames(5, w=24)
  both = video_metrics.side_by_side([a, b], gap=4)
  assert both.shape == (3, 32, 16 + 4 + 24, 3)
  np.testing.assert_array_equal(both[:, :, :16], a)
  np.testing.assert_array_equal(both[:, :, 20:], b)
  assert not both[:, :, 16:20].any()


def test_missing_lpips_is_one_line_naming_the_flag(monkeypatch):
  video_metrics.check_metrics(lpips=False)  # dm_pix is a test dependency
  real = video_metrics.importlib.util.find_spec
  monkeypatch.setattr(video_metrics.importlib.util, "find_spec",
                      lambda name: None if name == "lpips" else real(name))
  with pytest.raises(ValueError, match=r"--lpips needs the lpips package") as err:
    video_metrics.check_metrics(lpips=True)
  assert "\n" not in str(err.value)
  monkeypatch.setattr(video_metrics.importlib.util, "find_spec",
                      lambda name: None if name == "dm_pix" else real(name))
  with pytest.raises(ValueError, match="pip install dm-pix"):
    video_metrics.check_metrics(lpips=False)
