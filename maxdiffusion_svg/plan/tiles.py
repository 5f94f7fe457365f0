"""Tile planning: which ``block_q x block_kv`` tiles a sparse kernel visits, and which it masks.

``naive`` masks every visited tile, ``split`` only boundary tiles; ``aligned`` rounds boundary
tiles in or out to keep about the exact pair count and masks only padding keys. Cost is
O(visited tiles). Padded keys are never kept; padded query rows are computed and sliced off."""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any

import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.masks import Mask, SvgMask, svg_mask

# Tile kinds, in the Splash kernel's convention (0 = skip, 1 = partial, 2 = full).
EMPTY, MASKED, FULL = 0, 1, 2
TILE_QUANTUM = 128


class TileMode(enum.Enum):
  """How boundary tiles are traversed."""

  NAIVE = "naive"
  SPLIT = "split"
  ALIGNED = "aligned"

  @classmethod
  def parse(cls, mode: "TileMode | str", name: str = "mode") -> "TileMode":
    if isinstance(mode, cls):
      return mode
    try:
      return cls(mode)
    except ValueError:
      allowed = ", ".join(m.value for m in cls)
      raise ValueError(f"{name} must be one of {allowed}, got {mode!r}") from None


MODES: tuple[str, ...] = tuple(m.value for m in TileMode)  # naive, split, aligned


def check_block_size(value: Any, name: str) -> int:
  """Tile sides must be positive multiples of 128 (the TPU lane width)."""
  if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
      or value <= 0 or value % TILE_QUANTUM):
    raise ValueError(f"{name} must be a positive multiple of {TILE_QUANTUM}, got {value!r}")
  return int(value)


@dataclasses.dataclass(frozen=True)
class TileStats:
  """What a plan costs and how faithful it is. Fractions of tiles are of the whole padded grid."""

  total_tiles: int
  visited_tiles: int
  masked_tiles: int
  full_tiles: int
  real_pairs: int  # S * S
  exact_pairs: int  # pairs kept by the exact SVG mask
  kept_pairs: int  # pairs the plan keeps (differs from exact only when aligned)
  recall: float  # share of exact pairs the plan keeps
  precision: float  # share of the plan's pairs the exact mask keeps

  @property
  def retained_pair_fraction(self) -> float:
    return self.kept_pairs / self.real_pairs

  @property
  def exact_pair_fraction(self) -> float:
    return self.exact_pairs / self.real_pairs

  @property
  def visited_tile_fraction(self) -> float:
    return self.visited_tiles / self.total_tiles

  @property
  def masked_tile_fraction(self) -> float:
    return self.masked_tiles / self.total_tiles

  @property
  def masked_visited_fraction(self) -> float:
    return self.masked_tiles / self.visited_tiles if self.visited_tiles else 0.0

  @property
  def budget_error(self) -> float:
    """Relative change of the kept-pair count against the exact mask."""
    return self.kept_pairs / self.exact_pairs - 1.0

  def as_dict(self) -> dict[str, float | int]:
    out: dict[str, float | int] = dataclasses.asdict(self)
    for name in ("retained_pair_fraction", "exact_pair_fraction", "visited_tile_fraction",
                 "masked_tile_fraction", "masked_visited_fraction", "budget_error"):
      out[name] = getattr(self, name)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class TilePlan:
  """Per q-tile row, the kv tiles to visit (ascending) and whether each needs a mask. Slots past
  ``num_visited[i]`` repeat the last tile, kind ``EMPTY``. ``MASKED`` applies ``mask`` exactly
  in ``naive``/``split`` plans, and only drops padding keys (``k >= seq_len``) in ``aligned``."""

  mask: Mask  # an SvgMask, or a PlacedMask view of one (to measure unplaced heads)
  mode: TileMode
  block_q: int
  block_kv: int
  kv_index: np.ndarray  # int32 [num_q_tiles, width]
  kind: np.ndarray  # int8 [num_q_tiles, width]: EMPTY / MASKED / FULL
  num_visited: np.ndarray  # int32 [num_q_tiles]
  stats: TileStats
  # Queries, where they differ from the keys: one ring shard's rows of a plan against the key
  # tiles it fetched (:func:`maxdiffusion_svg.parallel.ring_plan.window_plan`); ``seq_len`` is then
  # the
  # real keys of that window.
  q_len: int | None = None

  @property
  def seq_len(self) -> int:
    return self.mask.seq_len

  @property
  def num_q_tiles(self) -> int:
    return -(-(self.q_len or self.seq_len) // self.block_q)

  @property
  def num_kv_tiles(self) -> int:
    return -(-self.seq_len // self.block_kv)

  @property
  def width(self) -> int:
    return self.kv_index.shape[1]

  @property
  def masks_exact(self) -> bool:
    """Whether masked tiles evaluate the SVG rule (else they only drop padding keys)."""
    return self.mode is not TileMode.ALIGNED

  def masked_tile_rule(self, q: Any, k: Any) -> Any:
    """What a ``MASKED`` tile keeps, for kernels (broadcasting numpy or jax indices)."""
    return self.mask.contains(q, k) if self.masks_exact else k < self.seq_len

  def visited_tiles(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat ``(rows, cols, kinds)`` of the visited tiles, row-major: the kernels' work list."""
    rows, slots = np.nonzero(self.kind)
    return rows.astype(np.int32), self.kv_index[rows, slots], self.kind[rows, slots]

  def work_list(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rows, cols, kinds)`` a TPU kernel's grid walks: the visited tiles, plus one ``EMPTY``
    step (repeating the previous kv column) per q-tile row visiting none, to write its output."""
    rows, cols, kinds = self.visited_tiles()
    empty = np.setdiff1d(np.arange(self.num_q_tiles, dtype=np.int32), rows)
    if not empty.size:
      return rows, cols, kinds
    order = np.argsort(np.concatenate([rows, empty]), kind="stable")
    rows = np.concatenate([rows, empty])[order]
    cols = np.concatenate([cols, np.full(empty.size, -1, cols.dtype)])[order]
    kinds = np.concatenate([kinds, np.full(empty.size, EMPTY, kinds.dtype)])[order]
    for i in np.flatnonzero(cols < 0):  # O(empty rows)
      cols[i] = cols[i - 1] if i else 0
    return rows, cols, kinds

  def tile_map(self) -> np.ndarray:
    """``int8 [num_q_tiles, num_kv_tiles]`` of tile kinds, for reports and plots."""
    out = np.zeros((self.num_q_tiles, self.num_kv_tiles), np.int8)
    rows, cols, kinds = self.visited_tiles()
    out[rows, cols] = kinds
    return out

  @functools.cached_property
  def computed_mask(self) -> "ComputedMask":
    """The pairs this plan's kernel computes, as a mask (membership in O(1) per pair)."""
    return ComputedMask(self)

  def dense_mask(self, max_tokens: int = 16384) -> np.ndarray:
    """The ``S x S`` mask this plan computes, for references on small sequences only."""
    return self.computed_mask.dense(max_tokens)


@dataclasses.dataclass(frozen=True, eq=False)
class ComputedMask(Mask):
  """What a plan's kernel computes: the exact rule in ``naive``/``split`` plans; in ``aligned``
  ones every non-padding pair of a visited tile, looked up in a ``[q_tiles, kv_tiles]`` table
  (numpy or jax indices)."""

  plan: TilePlan

  @property
  def seq_len(self) -> int:  # type: ignore[override]
    return self.plan.seq_len

  @functools.cached_property
  def visited(self) -> np.ndarray:
    return self.plan.tile_map() != EMPTY

  def _rule(self, q: Any, k: Any) -> Any:
    plan = self.plan
    if plan.masks_exact:
      return plan.mask.contains(q, k)
    numpy = all(isinstance(x, (np.ndarray, np.integer, int)) for x in (q, k))
    xp, table = (np, self.visited) if numpy else (jnp, jnp.asarray(self.visited))
    rows = xp.minimum(q // plan.block_q, plan.num_q_tiles - 1)
    cols = xp.minimum(k // plan.block_kv, plan.num_kv_tiles - 1)
    return table[rows, cols] if numpy else lookup(table, rows, cols)


def lookup(table: Any, rows: Any, cols: Any) -> Any:
  """``table[rows, cols]`` (broadcasting) for a 0/1 table, by one-hot products instead of a
  gather: libtpu runs a gather one vector of 128 elements at a time, and the router's lookup of
  sampled rows against every key cost more than the sparse kernel it routes
  (docs/benchmarks.md, "A denoising step"). Exact: each product sums one 0/1 term."""
  rows, cols = jnp.asarray(rows), jnp.asarray(cols)
  num_rows, num_cols = table.shape
  one_hot = lambda i, n: (i[..., None] == jnp.arange(n, dtype=i.dtype)).astype(jnp.float32)
  by_row = jnp.matmul(one_hot(rows, num_rows), table.astype(jnp.float32))  # rows.shape + (nkv,)
  hot = one_hot(cols, num_cols)  # cols.shape + (nkv,)
  if rows.ndim >= 2 and cols.ndim >= 2 and rows.shape[-1] == 1 and cols.shape[-2] == 1:
    # an outer product ([..., R, 1] by [..., 1, S]): one matrix product
    hits = jnp.matmul(by_row[..., 0, :], jnp.swapaxes(hot[..., 0, :, :], -1, -2),
                      preferred_element_type=jnp.float32)
  else:
    hits = jnp.sum(by_row * hot, axis=-1, dtype=jnp.float32)
  return hits > 0.5


def plan_tiles(grid: VideoGrid, density: float, block_q: int, block_kv: int,
               mode: TileMode | str, *, include_sink: bool = True,
               sink_frames: int = 1) -> TilePlan:
  """Plans the SVG band+sink mask of ``grid`` at ``density`` (see :func:`plan_mask_tiles`)."""
  return plan_mask_tiles(svg_mask(grid, density, include_sink, sink_frames), block_q, block_kv,
                         mode)


def plan_mask_tiles(mask: Mask, block_q: int, block_kv: int, mode: TileMode | str) -> TilePlan:
  """The tile plan of ``mask`` (cached), which must have ``kept_pairs``; only an
  :class:`SvgMask` skips the tiles its band and sink cannot reach."""
  if not hasattr(mask, "kept_pairs"):
    raise TypeError(f"cannot plan a {type(mask).__name__}: it has no kept_pairs counter")
  return _plan(mask, check_block_size(block_q, "block_q"),
               check_block_size(block_kv, "block_kv"), TileMode.parse(mode))


@functools.lru_cache(maxsize=64)
def _plan(mask: Mask, block_q: int, block_kv: int, mode: TileMode) -> TilePlan:
  s = mask.seq_len
  nq, nkv = -(-s // block_q), -(-s // block_kv)
  rows, cols = _candidate_tiles(mask, block_q, block_kv, nq)
  q0 = rows * block_q
  q1 = np.minimum(q0 + block_q, s)
  k0 = cols * block_kv
  k1 = np.minimum(k0 + block_kv, s)
  exact = mask.kept_pairs(q0, q1, k0, k1)
  real = (q1 - q0) * (k1 - k0)
  nonempty = exact > 0
  rows, cols, exact, real = rows[nonempty], cols[nonempty], exact[nonempty], real[nonempty]
  q0, q1, k0, k1 = q0[nonempty], q1[nonempty], k0[nonempty], k1[nonempty]
  kv_padding = k0 + block_kv > s
  boundary = exact < real

  if mode is TileMode.NAIVE:
    visit = np.ones_like(boundary)
    kind = np.full(rows.shape, MASKED, np.int8)
  elif mode is TileMode.SPLIT:
    visit = np.ones_like(boundary)
    kind = np.where(boundary | kv_padding, MASKED, FULL).astype(np.int8)
  else:
    diagonal = np.maximum(q0, k0) < np.minimum(q1, k1)  # keeps every row non-empty
    visit = _balance_boundary(rows, cols, exact, real, boundary, diagonal)
    kind = np.where(kv_padding, MASKED, FULL).astype(np.int8)

  rows, cols, kind = rows[visit], cols[visit], kind[visit]
  kept = int(real[visit].sum()) if mode is TileMode.ALIGNED else int(exact.sum())
  covered = int(exact[visit].sum())
  stats = TileStats(
      total_tiles=nq * nkv,
      visited_tiles=int(visit.sum()),
      masked_tiles=int((kind == MASKED).sum()),
      full_tiles=int((kind == FULL).sum()),
      real_pairs=s * s,
      exact_pairs=int(exact.sum()),
      kept_pairs=kept,
      recall=covered / int(exact.sum()),
      precision=covered / kept,
  )
  kv_index, kinds, counts = _pack_rows(rows, cols, kind, nq)
  return TilePlan(mask, mode, block_q, block_kv, kv_index, kinds, counts, stats)


def visited_in_tiles_of(plan: TilePlan, other: TilePlan) -> float:
  """``plan``'s visited tiles counted in ``other``'s tile size."""
  return (plan.stats.visited_tiles * plan.block_q * plan.block_kv
          / (other.block_q * other.block_kv))


@functools.lru_cache(maxsize=16)
def dense_rows_plan(seq_len: int, rows: int, block_q: int, block_kv: int) -> TilePlan:
  """The dense rows' plan (``svg_dense_frames``): the first ``rows`` queries against every key
  tile, masking only the padded last one."""
  if not 0 < rows <= seq_len:
    raise ValueError(f"dense rows must be in [1, {seq_len}] (the sequence), got {rows}")
  block_q, block_kv = check_block_size(block_q, "block_q"), check_block_size(block_kv, "block_kv")
  nq, nkv = -(-rows // block_q), -(-seq_len // block_kv)
  kind = np.full((nq, nkv), FULL, np.int8)
  if seq_len % block_kv:
    kind[:, -1] = MASKED  # drops the padding keys (an aligned plan's only mask)
  kv_index = np.broadcast_to(np.arange(nkv, dtype=np.int32), (nq, nkv)).copy()
  counts = np.full(nq, nkv, np.int32)
  for a in (kv_index, kind, counts):
    a.setflags(write=False)
  masked = int((kind == MASKED).sum())
  pairs = rows * seq_len
  stats = TileStats(total_tiles=nq * nkv, visited_tiles=nq * nkv, masked_tiles=masked,
                    full_tiles=nq * nkv - masked, real_pairs=pairs, exact_pairs=pairs,
                    kept_pairs=pairs, recall=1.0, precision=1.0)
  return TilePlan(SvgMask(seq_len, seq_len), TileMode.ALIGNED, block_q, block_kv, kv_index, kind,
                  counts, stats, q_len=rows)


def _candidate_tiles(mask: Mask, block_q: int, block_kv: int, nq: int):
  """(row, col) of every tile that may hold a kept pair, ascending per row."""
  s = mask.seq_len
  if not isinstance(mask, SvgMask):
    nkv = -(-s // block_kv)
    return np.repeat(np.arange(nq), nkv), np.tile(np.arange(nkv), nq)
  i = np.arange(nq, dtype=np.int64)
  lo, hi = mask.band_keys(i * block_q, np.minimum((i + 1) * block_q, s))
  band_first, band_last = lo // block_kv, (hi - 1) // block_kv
  sink_tiles = -(-min(mask.sink, s) // block_kv)  # kv tiles [0, sink_tiles) touch the sink
  band_start = np.maximum(band_first, sink_tiles)
  band_count = np.maximum(band_last - band_start + 1, 0)
  per_row = sink_tiles + band_count
  rows = np.repeat(i, per_row)
  offset = np.arange(rows.size) - np.repeat(np.cumsum(per_row) - per_row, per_row)
  cols = np.where(offset < sink_tiles, offset, band_start[rows] + offset - sink_tiles)
  return rows, cols


def _balance_boundary(rows, cols, exact, real, boundary, required) -> np.ndarray:
  """Rounds boundary tiles in or out so the kept pairs best match the exact count: full and
  ``required`` tiles stay; of the rest, by falling kept share, the best-matching prefix goes in."""
  keep = ~boundary | required
  free = np.flatnonzero(~keep)
  share = exact[free] / real[free]
  order = free[np.lexsort((cols[free], rows[free], -exact[free], -share))]
  deficit = int(exact.sum()) - int(real[keep].sum())
  totals = np.concatenate([[0], np.cumsum(real[order])])
  keep[order[:int(np.argmin(np.abs(totals - deficit)))]] = True
  return keep


def _pack_rows(rows, cols, kind, nq):
  """Packs ascending per-row lists into fixed-width ``[nq, width]`` arrays."""
  counts = np.bincount(rows, minlength=nq).astype(np.int32)
  width = max(int(counts.max(initial=0)), 1)
  starts = np.cumsum(counts) - counts
  slot = np.arange(rows.size) - np.repeat(starts, counts)
  last = np.zeros(nq, np.int64)
  has = counts > 0
  last[has] = cols[starts[has] + counts[has] - 1]
  kv_index = np.repeat(last[:, None], width, axis=1).astype(np.int32)
  kv_index[rows, slot] = cols
  kinds = np.zeros((nq, width), np.int8)
  kinds[rows, slot] = kind
  for a in (kv_index, kinds, counts):
    a.setflags(write=False)  # plans are cached and shared
  return kv_index, kinds, counts
