"""SVG masks as index arithmetic on a head's placed layout: no ``S x S`` array but the slice
:meth:`Mask.block` is asked for. Positions ``>= seq_len`` are padding, never kept.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any

import numpy as np

from maxdiffusion_svg.plan.geometry import TokenOrder, VideoGrid, layout_positions

# Band widths are rounded up to this many tokens, as the reference SVG code does.
BAND_QUANTUM = 128
# The router's probe masks work on 128-token blocks.
PROBE_BLOCK = 128


def check_density(density: Any, name: str = "density") -> float:
  """Validates a retained-pair density in (0, 1]."""
  if isinstance(density, bool) or not isinstance(density, (int, float, np.integer, np.floating)):
    raise ValueError(f"{name} must be a number in (0, 1], got {density!r}")
  density = float(density)
  if not 0.0 < density <= 1.0:  # also rejects NaN
    raise ValueError(f"{name} must be in (0, 1], got {density!r}")
  return density


def band_half_width(seq_len: int, density: float) -> int:
  """Half-width ``w`` (tokens) of the band keeping about ``density`` of all pairs:
  ``S (1 - sqrt(1 - density))`` rounded up to a multiple of 128 (density 1: all kept)."""
  density = check_density(density)
  raw = seq_len * (1.0 - math.sqrt(1.0 - density))
  return int(math.ceil(raw / BAND_QUANTUM)) * BAND_QUANTUM


class Mask(abc.ABC):
  """A boolean mask over (query, key) positions of a sequence of ``seq_len`` tokens."""

  seq_len: int

  @abc.abstractmethod
  def _rule(self, q: Any, k: Any) -> Any:
    """Membership for in-range positions; broadcasts numpy or jax integer arrays."""

  def contains(self, q: Any, k: Any) -> Any:
    """Whether key ``k`` is kept for query ``q`` (broadcasting, numpy or jax)."""
    return (q < self.seq_len) & (k < self.seq_len) & self._rule(q, k)

  def block(self, q_start: int, q_stop: int, k_start: int, k_stop: int) -> np.ndarray:
    """The mask on ``[q_start, q_stop) x [k_start, k_stop)`` as a bool array."""
    q = np.arange(q_start, q_stop, dtype=np.int64)[:, None]
    k = np.arange(k_start, k_stop, dtype=np.int64)[None, :]
    return np.asarray(self.contains(q, k), dtype=bool)

  def dense(self, max_tokens: int = 16384) -> np.ndarray:
    """The whole ``S x S`` mask, for tests and plots on small sequences only."""
    if self.seq_len > max_tokens:
      raise ValueError(
          f"refusing to build a dense {self.seq_len}x{self.seq_len} mask "
          f"(max_tokens={max_tokens}); use block() or the tile planner")
    return self.block(0, self.seq_len, 0, self.seq_len)


@dataclasses.dataclass(frozen=True)
class SvgMask(Mask):
  """The SVG execution mask: a token band ``|q - k| <= half_width`` plus a key sink ``k < sink``."""

  seq_len: int
  half_width: int
  sink: int = 0

  def __post_init__(self) -> None:
    if self.seq_len <= 0 or self.half_width < 0 or self.sink < 0:
      raise ValueError(f"invalid SvgMask {self}")

  def _rule(self, q: Any, k: Any) -> Any:
    d = q - k
    band = (d <= self.half_width) & (d >= -self.half_width)
    return band | (k < self.sink) if self.sink else band

  def band_keys(self, q_start: Any, q_stop: Any) -> tuple[Any, Any]:
    """Half-open key range ``[lo, hi)`` reached by the band from rows ``[q_start, q_stop)``."""
    lo = np.maximum(np.asarray(q_start) - self.half_width, 0)
    hi = np.minimum(np.asarray(q_stop) + self.half_width, self.seq_len)
    return lo, hi

  def kept_pairs(self, q0: Any, q1: Any, k0: Any, k1: Any) -> np.ndarray:
    """Exact number of kept pairs in rectangles ``[q0, q1) x [k0, k1)`` (vectorised, O(1) each)."""
    s = self.seq_len
    q0, k0 = np.minimum(np.asarray(q0, np.int64), s), np.minimum(np.asarray(k0, np.int64), s)
    q1 = np.clip(np.asarray(q1, np.int64), q0, s)
    k1 = np.clip(np.asarray(k1, np.int64), k0, s)
    w = self.half_width
    band = _pairs_in_diagonals(q0, q1, k0, k1, -w, w)
    if not self.sink:
      return band
    ks1 = np.clip(np.minimum(k1, self.sink), k0, None)  # sink columns of the rectangle
    sink = (q1 - q0) * (ks1 - k0)
    return band + sink - _pairs_in_diagonals(q0, q1, k0, ks1, -w, w)


def _pairs_in_diagonals(q0, q1, k0, k1, lo: Any, hi: Any) -> np.ndarray:
  """Number of pairs with ``lo <= k - q <= hi`` in rectangles ``[q0, q1) x [k0, k1)``."""
  return _pairs_below(q0, q1, k0, k1, hi) - _pairs_below(q0, q1, k0, k1, np.asarray(lo) - 1)


def _pairs_below(q0, q1, k0, k1, d) -> np.ndarray:
  """Pairs with ``k - q <= d``: row ``q`` holds ``clamp(q + d + 1 - k0, 0, k1 - k0)``."""
  width = np.maximum(k1 - k0, 0)

  def ramp_sum(x):  # sum_{t=0..x} clamp(t, 0, width), zero for x < 0
    x = np.asarray(x, np.int64)
    inside = np.minimum(np.maximum(x, 0), width)
    return inside * (inside + 1) // 2 + np.maximum(x - width, 0) * width

  first = q0 + d + 1 - k0
  last = q1 + d - k0
  return np.where(q1 > q0, ramp_sum(last) - ramp_sum(first - 1), 0)


@dataclasses.dataclass(frozen=True)
class ProbeMask(Mask):
  """The router's probe mask: ``|q // block - k // block| < radius_blocks`` or ``k < sink``."""

  seq_len: int
  radius_blocks: int
  sink: int = 0
  block_size: int = PROBE_BLOCK

  def _rule(self, q: Any, k: Any) -> Any:
    d = q // self.block_size - k // self.block_size
    band = (d < self.radius_blocks) & (d > -self.radius_blocks)
    return band | (k < self.sink) if self.sink else band


@dataclasses.dataclass(frozen=True)
class PlacedMask(Mask):
  """A layout's mask seen from frame-major token indices (for plots and brute-force checks)."""

  mask: Mask
  grid: VideoGrid
  layout: TokenOrder

  @property
  def seq_len(self) -> int:  # type: ignore[override]
    return self.mask.seq_len

  def _rule(self, q: Any, k: Any) -> Any:
    return self.mask.contains(layout_positions(self.grid, self.layout, q),
                              layout_positions(self.grid, self.layout, k))

  def kept_pairs(self, q0: Any, q1: Any, k0: Any, k1: Any) -> np.ndarray:
    """Exact kept pairs in frame-major rectangles ``[q0, q1) x [k0, k1)``, in O(1) per
    (query frame, key frame) piece: cost rectangles x frames spanned^2."""
    if not isinstance(self.mask, SvgMask):
      raise TypeError(f"kept_pairs needs an SvgMask inside, got {type(self.mask).__name__}")
    if self.layout is TokenOrder.FRAME_MAJOR:
      return self.mask.kept_pairs(q0, q1, k0, k1)
    frames, p = self.grid.frames, self.grid.frame_size
    w, sink, s = self.mask.half_width, self.mask.sink, self.seq_len
    q0, k0 = np.minimum(np.asarray(q0, np.int64), s), np.minimum(np.asarray(k0, np.int64), s)
    q1 = np.clip(np.asarray(q1, np.int64), q0, s)
    k1 = np.clip(np.asarray(k1, np.int64), k0, s)
    total = np.zeros(np.broadcast(q0, q1, k0, k1).shape, np.int64)

    def pieces(lo, hi):  # per frame offset: (frame, first, stop) raster positions inside it
      span = int(np.max((np.maximum(hi, lo + 1) - 1) // p - lo // p, initial=0)) + 1
      for r in range(span):
        frame = lo // p + r
        yield frame, np.clip(lo - frame * p, 0, p), np.clip(hi - frame * p, 0, p)

    for fq, a, b in pieces(q0, q1):
      b = np.maximum(a, b)
      for fk, c, d in pieces(k0, k1):
        d = np.maximum(c, d)
        delta = fq - fk
        lo, hi = -((w - delta) // frames), (w + delta) // frames  # k_pos - q_pos range
        sink_cols = np.clip(-((fk - sink) // frames), c, d)  # positions with p*F + fk < sink
        total += (_pairs_in_diagonals(a, b, c, d, lo, hi) + (b - a) * (sink_cols - c)
                  - _pairs_in_diagonals(a, b, c, sink_cols, lo, hi))
    return total


def svg_mask(grid: VideoGrid, density: float, include_sink: bool = True,
             sink_frames: int = 1) -> SvgMask:
  """A head's execution mask at ``density`` in its placed layout; the sink is the first
  ``sink_frames`` frames (VACE's reference images lead the grid)."""
  sink = sink_frames * grid.frame_size if include_sink else 0
  return SvgMask(grid.tokens, band_half_width(grid.tokens, density), sink)


def probe_mask(grid: VideoGrid, include_sink: bool = True, sink_frames: int = 1) -> ProbeMask:
  """The router's probe mask in the placed layout, for both head types: about two frames
  either side whatever the density (at least a query's own block on tiny grids)."""
  radius = max(1, 2 * grid.frame_size // PROBE_BLOCK)
  return ProbeMask(grid.tokens, radius, sink_frames * grid.frame_size if include_sink else 0)
