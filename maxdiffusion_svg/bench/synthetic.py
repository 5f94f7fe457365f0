"""Synthetic video attention with known structure, for the quality benchmark and tests.

Heads are planted through random Fourier features of token coordinates: ``q . k`` then
approximates a Gaussian kernel of the coordinate difference, so attention concentrates
where the coordinates are close.

* ``spatial``: features of the frame index, so a token attends to its own and nearby frames;
* ``temporal``: features of the (row, column) position, so it attends to the same place in
  every frame;
* ``drifting``: spatial in the first quarter of the frames, temporal after it, as when a
  video's content changes; most rows are temporal, so the right route is temporal, but a
  router that samples only the first frames sees a spatial head;
* ``unstructured``: plain Gaussian queries and keys.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from maxdiffusion_svg.geometry import VideoGrid

HEAD_TYPES = ("spatial", "temporal", "drifting", "unstructured")
# The route a planted head should get (True = temporal); unstructured heads have none.
EXPECTED_TEMPORAL = {"spatial": False, "temporal": True, "drifting": True}


def _fourier_features(coords: np.ndarray, dim: int, bandwidth: float,
                      rng: np.random.Generator) -> np.ndarray:
  """``[S, c]`` coordinates -> ``[S, dim]`` features with ``phi(a).phi(b) ~ exp(-|a-b|^2 / 2 bw^2)``."""
  freqs = rng.normal(0.0, 1.0 / bandwidth, size=(coords.shape[1], dim // 2))
  phase = coords @ freqs
  return np.concatenate([np.cos(phase), np.sin(phase)], axis=1) / np.sqrt(dim // 2)


def planted_qkv(grid: VideoGrid, head_types: Sequence[str], head_dim: int = 64, *,
                strength: float = 14.0, noise: float = 0.3, seed: int = 0,
                batch: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Float32 ``q, k, v`` of shape ``[batch, len(head_types), S, head_dim]``, frame-major.

  ``strength`` sets how sharp planted heads are: logits reach about
  ``strength^2 / sqrt(head_dim)`` between tokens with equal coordinates.
  """
  unknown = sorted(set(head_types) - set(HEAD_TYPES))
  if unknown:
    raise ValueError(f"head types must be among {', '.join(HEAD_TYPES)}, got {unknown}")
  rng = np.random.default_rng(seed)
  s = grid.tokens
  frame, pos = np.divmod(np.arange(s), grid.frame_size)
  row, col = np.divmod(pos, grid.width)
  coords = {"spatial": frame[:, None].astype(np.float64),
            "temporal": np.stack([row, col], axis=1).astype(np.float64)}
  shape = (batch, len(head_types), s, head_dim)
  q = rng.standard_normal(shape)
  k = rng.standard_normal(shape)
  v = rng.standard_normal(shape)
  early = (frame < max(1, grid.frames // 4))[:, None]
  for h, kind in enumerate(head_types):
    if kind == "unstructured":
      continue
    if kind == "drifting":
      phi = np.where(early, _fourier_features(coords["spatial"], head_dim, 1.0, rng),
                     _fourier_features(coords["temporal"], head_dim, 1.0, rng))
    else:
      phi = _fourier_features(coords[kind], head_dim, bandwidth=1.0, rng=rng)
    q[:, h] = strength * phi + noise * q[:, h]
    k[:, h] = strength * phi + noise * k[:, h]
  return q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)
