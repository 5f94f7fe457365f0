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
* ``unstructured``: plain Gaussian queries and keys;
* ``mixed25``/``mixed50``/``mixed75``: a spatial and a temporal component at once, the
  number being the temporal share of the logits (half the features for each component);
  which layout serves such a head best depends on the density;
* ``weak_spatial``/``weak_temporal``: planted at a third of the strength, so attention is
  diffuse and the structure barely stands out of the noise;
* ``moving``: moving content, neither spatial nor temporal. A few objects (discs) travel
  across the frame at their own constant velocities (wrapping at the edges) while the camera
  pans over the background; a token's features are those of its segment (an object or the
  background) and of its coordinates in that segment's own moving frame, so a token attends
  to the same point of the same object in every frame, wherever it has moved to: not the
  same place (temporal) and not only nearby frames (spatial). Each head draws its own
  objects and pan from ``seed``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from maxdiffusion_svg.plan.geometry import VideoGrid

MIXED = {"mixed25": 0.25, "mixed50": 0.5, "mixed75": 0.75}  # temporal share of the logits
WEAK = {"weak_spatial": "spatial", "weak_temporal": "temporal"}
WEAK_STRENGTH = 1 / 3  # of ``strength``
PLANTED_STRENGTH = 14.0  # ``planted_qkv``'s default ``strength``
HEAD_TYPES = ("spatial", "temporal", "drifting", "unstructured", *MIXED, *WEAK, "moving")
MOVING_OBJECTS = 4  # objects per moving head
MOVING_RADIUS = (0.15, 0.3)  # object radius, as a share of the frame's shorter side
MOVING_SPEED = (0.5, 1.5)  # object speed, tokens per frame
MOVING_PAN = 0.3  # camera pan speed over the background, tokens per frame
MOVING_BANDWIDTH = 1.0  # of the attention kernel in a segment's moving frame, tokens
_SEGMENT_GAP = 1e3  # segment ids this far apart in feature coordinates: no attention between
# The route a planted head should get (True = temporal); unstructured and mixed heads have none.
EXPECTED_TEMPORAL = {"spatial": False, "temporal": True, "drifting": True,
                     "weak_spatial": False, "weak_temporal": True}


@dataclasses.dataclass(frozen=True)
class MovingScene:
  """What a ``moving`` head's video holds: the bench's scene by default; the router's tests
  draw others (object counts, sizes, speeds, pans, sharpness) to hold the router to families
  it was not tuned on."""

  objects: int = MOVING_OBJECTS
  radius: tuple[float, float] = MOVING_RADIUS
  speed: tuple[float, float] = MOVING_SPEED
  pan: float = MOVING_PAN
  bandwidth: float = MOVING_BANDWIDTH


def _fourier_features(coords: np.ndarray, dim: int, bandwidth: float,
                      rng: np.random.Generator) -> np.ndarray:
  """``[S, c]`` coordinates -> ``[S, dim]`` features with ``phi(a).phi(b) ~ exp(-|a-b|^2 / 2 bw^2)``."""
  freqs = rng.normal(0.0, 1.0 / bandwidth, size=(coords.shape[1], dim // 2))
  phase = coords @ freqs
  return np.concatenate([np.cos(phase), np.sin(phase)], axis=1) / np.sqrt(dim // 2)


def _wrap(x: np.ndarray, period: float) -> np.ndarray:
  """Offsets on a circle of ``period``, in ``[-period / 2, period / 2)``."""
  return (x + period / 2) % period - period / 2


def moving_coords(grid: VideoGrid, rng: np.random.Generator,
                  scene: MovingScene = MovingScene()) -> np.ndarray:
  """``[S, 3]`` coordinates of each token in its segment's moving frame: ``(segment * gap,
  row, col)``, segment 0 the panning background (scene coordinates), segment ``j >= 1`` object
  ``j`` (offset from its centre). Tokens under two objects belong to the nearer one."""
  frame, pos = np.divmod(np.arange(grid.tokens), grid.frame_size)
  row, col = (x.astype(np.float64) for x in np.divmod(pos, grid.width))
  h, w = grid.height, grid.width
  heading = rng.uniform(0, 2 * np.pi)
  pan = scene.pan * np.array([np.sin(heading), np.cos(heading)])
  coords = np.stack([np.zeros_like(row), row + pan[0] * frame, col + pan[1] * frame], axis=1)
  nearest = np.full(grid.tokens, np.inf)  # distance / radius of the object a token is under
  for j in range(1, scene.objects + 1):
    radius = rng.uniform(*scene.radius) * min(h, w)
    angle, speed = rng.uniform(0, 2 * np.pi), rng.uniform(*scene.speed)
    start = rng.uniform(0, 1, size=2) * (h, w)
    dr = _wrap(row - (start[0] + speed * np.sin(angle) * frame), h)
    dc = _wrap(col - (start[1] + speed * np.cos(angle) * frame), w)
    reach = np.hypot(dr, dc) / radius
    inside = (reach <= 1) & (reach < nearest)
    nearest[inside] = reach[inside]
    coords[inside] = np.stack([np.full_like(dr, j * _SEGMENT_GAP), dr, dc], axis=1)[inside]
  return coords


def planted_qkv(grid: VideoGrid, head_types: Sequence[str], head_dim: int = 64, *,
                strength: float = PLANTED_STRENGTH, noise: float = 0.3, seed: int = 0,
                batch: int = 1,
                scene: MovingScene = MovingScene()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Float32 ``q, k, v`` of shape ``[batch, len(head_types), S, head_dim]``, frame-major.

  ``strength`` sets how sharp planted heads are: logits reach about
  ``strength^2 / sqrt(head_dim)`` between tokens with equal coordinates. ``scene``: what
  ``moving`` heads show.
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
    scale = strength
    if kind == "unstructured":
      continue
    if kind == "drifting":
      phi = np.where(early, _fourier_features(coords["spatial"], head_dim, 1.0, rng),
                     _fourier_features(coords["temporal"], head_dim, 1.0, rng))
    elif kind in MIXED:
      share, half = MIXED[kind], head_dim // 2
      phi = np.concatenate(
          [np.sqrt(1 - share) * _fourier_features(coords["spatial"], half, 1.0, rng),
           np.sqrt(share) * _fourier_features(coords["temporal"], head_dim - half, 1.0, rng)],
          axis=1)
    elif kind == "moving":
      phi = _fourier_features(moving_coords(grid, rng, scene), head_dim, scene.bandwidth, rng)
    elif kind in WEAK:
      phi = _fourier_features(coords[WEAK[kind]], head_dim, bandwidth=1.0, rng=rng)
      scale = strength * WEAK_STRENGTH
    else:
      phi = _fourier_features(coords[kind], head_dim, bandwidth=1.0, rng=rng)
    q[:, h] = scale * phi + noise * q[:, h]
    k[:, h] = scale * phi + noise * k[:, h]
  return q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)
