"""Tile plans against brute-force tile classification of the dense mask on small grids."""

import jax.numpy as jnp
import numpy as np
import pytest

from maxdiffusion_svg.plan.geometry import TokenOrder, VideoGrid, grid_for_resolution
from maxdiffusion_svg.plan.masks import PlacedMask, SvgMask, svg_mask
from maxdiffusion_svg.plan.tiles import (EMPTY, FULL, MASKED, TileMode, lookup, plan_mask_tiles,
                                          plan_tiles)

# (grid, density, block_q, block_kv, include_sink): odd sizes leave padding in both dims.
CASES = [
    ((5, 6, 7), 0.3, 128, 128, True),  # 210 tokens
    ((5, 6, 7), 0.1, 128, 128, False),
    ((3, 10, 11), 0.35, 128, 256, True),  # 330 tokens
    ((7, 9, 16), 0.25, 256, 128, True),  # 1008 tokens, frame of 144
    ((8, 8, 16), 0.2, 128, 128, True),  # 1024 tokens: no padding
    ((9, 10, 12), 0.5, 384, 128, True),
]


def brute_tiles(exact, block_q, block_kv):
  """Per tile: any kept pair, and 'every real query row keeps every key column of the tile'."""
  s = exact.shape[0]
  nq, nkv = -(-s // block_q), -(-s // block_kv)
  padded = np.zeros((s, nkv * block_kv), bool)  # padding keys are never kept
  padded[:, :s] = exact
  any_kept = np.zeros((nq, nkv), bool)
  all_kept = np.zeros((nq, nkv), bool)
  for i in range(nq):
    for j in range(nkv):
      tile = padded[i * block_q:(i + 1) * block_q, j * block_kv:(j + 1) * block_kv]
      any_kept[i, j], all_kept[i, j] = tile.any(), tile.all()
  return any_kept, all_kept


def _plan(case, mode, placed=True):
  """A plan of the SVG mask, or of a temporal head's mask left in frame-major order."""
  shape, density, bq, bkv, sink = case
  grid = VideoGrid(*shape)
  if placed:
    return grid, plan_tiles(grid, density, bq, bkv, mode, include_sink=sink), \
        svg_mask(grid, density, sink).dense()
  mask = PlacedMask(svg_mask(grid, density, sink), grid, TokenOrder.TEMPORAL_MAJOR)
  return grid, plan_mask_tiles(mask, bq, bkv, mode), mask.dense()


@pytest.mark.parametrize("placed", [True, False], ids=["placed", "unplaced_temporal"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ["naive", "split"])
def test_naive_and_split_compute_exactly_the_svg_mask(case, mode, placed):
  _, plan, exact = _plan(case, mode, placed)
  np.testing.assert_array_equal(plan.dense_mask(), exact)
  any_kept, all_kept = brute_tiles(exact, plan.block_q, plan.block_kv)
  tile_map = plan.tile_map()
  np.testing.assert_array_equal(tile_map != EMPTY, any_kept)  # visited iff it holds a kept pair
  if mode == "naive":
    assert set(np.unique(tile_map[any_kept])) == {MASKED}
  else:
    np.testing.assert_array_equal(tile_map == FULL, all_kept)  # full only when every pair is kept
  s = plan.stats
  assert s.kept_pairs == s.exact_pairs == exact.sum()
  assert s.real_pairs == exact.size
  assert s.visited_tiles == any_kept.sum() and s.total_tiles == any_kept.size
  assert s.masked_tiles == (tile_map == MASKED).sum() and s.full_tiles == (tile_map == FULL).sum()
  assert s.budget_error == 0 and s.recall == 1 and s.precision == 1
  assert s.retained_pair_fraction == pytest.approx(exact.mean())
  assert s.masked_visited_fraction == pytest.approx(s.masked_tiles / s.visited_tiles)


@pytest.mark.parametrize("placed", [True, False], ids=["placed", "unplaced_temporal"])
@pytest.mark.parametrize("case", CASES)
def test_aligned_rounds_whole_tiles_and_masks_only_padding(case, placed):
  grid, plan, exact = _plan(case, "aligned", placed)
  s_len = grid.tokens
  effective = plan.dense_mask()
  tile_map = plan.tile_map()
  bq, bkv = plan.block_q, plan.block_kv
  for i, j in np.ndindex(*tile_map.shape):
    q0, k0 = i * bq, j * bkv
    tile = effective[q0:q0 + bq, k0:k0 + bkv]
    assert tile.all() if tile_map[i, j] else not tile.any()  # whole tiles in or out
    touches_kv_padding = k0 + bkv > s_len
    if tile_map[i, j]:
      assert (tile_map[i, j] == MASKED) == touches_kv_padding
      assert exact[q0:q0 + bq, k0:k0 + bkv].any()  # rounding never adds a tile with no kept pair
  assert effective.any(axis=1).all()  # every query keeps at least one key
  any_kept, all_kept = brute_tiles(exact, bq, bkv)
  assert (tile_map[all_kept] != EMPTY).all()  # wholly kept tiles are never rounded out
  s = plan.stats
  assert s.kept_pairs == effective.sum()
  assert s.exact_pairs == exact.sum()
  assert s.recall == pytest.approx((effective & exact).sum() / exact.sum())
  assert s.precision == pytest.approx((effective & exact).sum() / effective.sum())
  assert s.budget_error == pytest.approx(effective.sum() / exact.sum() - 1)
  # The greedy prefix is within half a tile of the budget, plus what the diagonal forces in.
  assert abs(s.kept_pairs - s.exact_pairs) <= max(bq * bkv, 0.02 * s.exact_pairs)


@pytest.mark.parametrize("placed", [True, False], ids=["placed", "unplaced_temporal"])
@pytest.mark.parametrize("case", CASES)
def test_aligned_keeps_the_rounding_prefix_closest_to_the_budget(case, placed):
  """Enumerated from the dense mask: tiles wholly kept or on the diagonal stay; the other
  tiles holding kept pairs, most-kept share first, form prefixes; the plan must keep exactly
  the prefix whose pair count is closest to the exact mask's (a tighter check than a bound of
  one tile, which is 39-44% of the pairs on these grids)."""
  grid, plan, exact = _plan(case, "aligned", placed)
  s, bq, bkv = grid.tokens, plan.block_q, plan.block_kv
  tiles = []  # (row, col, kept pairs, real pairs, stays)
  for i, j in np.ndindex(-(-s // bq), -(-s // bkv)):
    q0, q1, k0, k1 = i * bq, min((i + 1) * bq, s), j * bkv, min((j + 1) * bkv, s)
    kept = int(exact[q0:q1, k0:k1].sum())
    if kept:
      real = (q1 - q0) * (k1 - k0)
      tiles.append((i, j, kept, real, kept == real or max(q0, k0) < min(q1, k1)))
  stay = {(i, j) for i, j, _, _, st in tiles if st}
  free = sorted((t for t in tiles if not t[4]), key=lambda t: (-t[2] / t[3], -t[2], t[0], t[1]))
  budget = int(exact.sum()) - sum(t[3] for t in tiles if t[4])
  totals = np.cumsum([0] + [t[3] for t in free])
  best = int(np.argmin(np.abs(totals - budget)))
  want = stay | {(t[0], t[1]) for t in free[:best]}
  got = {tuple(ij) for ij in np.argwhere(plan.tile_map() != EMPTY)}
  assert got == want
  assert plan.stats.kept_pairs == sum(t[3] for t in tiles if (t[0], t[1]) in want)
  # No other prefix is closer to the budget, and the miss is under half the largest free tile.
  assert abs(totals[best] - budget) == np.abs(totals - budget).min()
  assert abs(plan.stats.kept_pairs - exact.sum()) <= max([t[3] for t in free], default=0) / 2


@pytest.mark.parametrize("resolution", ["480p", "720p", "1080p", "1440p"])
@pytest.mark.parametrize("density", [0.2, 0.3, 0.35, 0.5])
def test_aligned_budget_within_two_percent_at_real_sizes(resolution, density):
  plan = plan_tiles(grid_for_resolution(resolution), density, 3328, 1536, "aligned")
  s = plan.stats
  assert abs(s.budget_error) <= 0.02
  assert s.recall > 0.85  # coarse tiles at 480p (a 3328-row tile spans two frames) cost recall
  # Only the last kv-tile column holds padding keys, so at most one masked tile per row.
  assert s.masked_tiles <= plan.num_q_tiles
  assert s.visited_tiles < plan_tiles(grid_for_resolution(resolution), density, 3328, 1536,
                                      "split").stats.visited_tiles


@pytest.mark.parametrize("case", CASES[:3])
@pytest.mark.parametrize("mode", list(TileMode))
def test_plan_arrays_are_compact_ascending_and_padded_with_the_last_tile(case, mode):
  _, plan, _ = _plan(case, mode)
  assert plan.kv_index.dtype == np.int32 and plan.kind.dtype == np.int8
  assert plan.kv_index.shape == plan.kind.shape == (plan.num_q_tiles, plan.width)
  assert plan.width == plan.num_visited.max()
  for i, n in enumerate(plan.num_visited):
    row = plan.kv_index[i]
    assert n >= 1
    assert (np.diff(row[:n]) > 0).all()
    assert (row[n:] == row[n - 1]).all()
    assert (plan.kind[i, :n] != EMPTY).all() and (plan.kind[i, n:] == EMPTY).all()


def test_density_one_visits_every_tile_and_masks_only_kv_padding():
  grid = VideoGrid(5, 6, 7)
  for mode in ("split", "aligned"):
    plan = plan_tiles(grid, 1.0, 128, 128, mode)
    tile_map = plan.tile_map()
    assert (tile_map != EMPTY).all()
    np.testing.assert_array_equal(tile_map[:, 1], MASKED)  # keys 128..255 hold padding
    np.testing.assert_array_equal(tile_map[:, 0], FULL)
    assert plan.stats.retained_pair_fraction == 1


def test_placement_is_what_makes_temporal_heads_sparse_at_720p():
  grid = grid_for_resolution("720p")
  mask = svg_mask(grid, 0.35)
  placed = plan_mask_tiles(mask, 3328, 1536, "split").stats
  unplaced = plan_mask_tiles(PlacedMask(mask, grid, TokenOrder.TEMPORAL_MAJOR), 3328, 1536, "split").stats
  assert unplaced.exact_pairs == placed.exact_pairs  # same pairs, scattered into stripes
  assert unplaced.visited_tile_fraction == 1.0 and placed.visited_tile_fraction < 0.45


def test_seed_geometry_at_720p():
  # The seed reports 39% of pairs kept and 44% of tiles visited at 720p, 3328x1536 tiles.
  naive = plan_tiles(grid_for_resolution("720p"), 0.35, 3328, 1536, "naive").stats
  assert naive.retained_pair_fraction == pytest.approx(0.39, abs=0.01)
  assert naive.visited_tile_fraction == pytest.approx(0.44, abs=0.01)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(block_q=100), "block_q must be a positive multiple of 128"),
    (dict(block_kv=0), "block_kv must be a positive multiple of 128"),
    (dict(block_kv=-128), "block_kv"),
    (dict(block_q=256.0), "block_q"),
    (dict(mode="fast"), "mode must be one of naive, split, aligned"),
    (dict(density=0.0), "density"),
    (dict(density=1.5), "density"),
])
def test_bad_arguments_name_the_argument(kwargs, needle):
  args = dict(grid=VideoGrid(5, 6, 7), density=0.3, block_q=128, block_kv=128, mode="split")
  args.update(kwargs)
  with pytest.raises(ValueError, match=needle):
    plan_tiles(**args)


def test_plans_are_cached_per_static_arguments():
  grid = VideoGrid(5, 6, 7)
  assert plan_tiles(grid, 0.3, 128, 128, "split") is plan_tiles(grid, 0.3, 128, 128, TileMode.SPLIT)
  assert plan_tiles(grid, 0.3, 128, 128, "split") is not plan_tiles(grid, 0.3, 128, 256, "split")
  with pytest.raises(ValueError):  # cached arrays are read-only
    plan_tiles(grid, 0.3, 128, 128, "split").kv_index[0, 0] = 1


def test_plan_for_a_bare_mask_without_sink_or_band():
  # Half-width 0 keeps only the diagonal: every diagonal tile is visited and masked.
  plan = plan_mask_tiles(SvgMask(300, 0), 128, 128, "split")
  np.testing.assert_array_equal(plan.tile_map(), np.diag([MASKED] * 3))
  aligned = plan_mask_tiles(SvgMask(300, 0), 128, 128, "aligned")
  assert aligned.dense_mask().any(axis=1).all()


@pytest.mark.parametrize("rows_shape,cols_shape", [((5, 1), (1, 13)), ((2, 5, 1), (2, 1, 13)),
                                                   ((2, 5, 1), (1, 13)), ((6,), (6,)),
                                                   ((3, 4), (1, 4))])
def test_lookup_is_the_tables_entries(rows_shape, cols_shape):
  rng = np.random.default_rng(0)
  table = rng.random((7, 11)) < 0.4
  rows, cols = rng.integers(0, 7, rows_shape), rng.integers(0, 11, cols_shape)
  got = np.asarray(lookup(jnp.asarray(table), jnp.asarray(rows), jnp.asarray(cols)))
  np.testing.assert_array_equal(got, table[rows, cols])


def test_computed_mask_on_device_is_the_numpy_one():
  plan = plan_tiles(VideoGrid(5, 8, 16), 0.3, 128, 256, "aligned")
  q, k = np.arange(plan.seq_len)[:, None], np.arange(plan.seq_len)[None, :]
  np.testing.assert_array_equal(np.asarray(plan.computed_mask.contains(jnp.asarray(q), jnp.asarray(k))),
                                plan.computed_mask.contains(q, k))
