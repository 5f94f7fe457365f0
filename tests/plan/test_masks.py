"""SVG masks against a brute-force rule written from the definition."""

import itertools
import math

import numpy as np
import pytest

from maxdiffusion_svg.plan.geometry import (TokenOrder, VideoGrid, frame_major_order,
                                            grid_for_resolution, temporal_major_order)
from maxdiffusion_svg.plan.masks import (PlacedMask, SvgMask, band_half_width, check_density,
                                         probe_mask, svg_mask)


def brute_svg(seq_len, half_width, sink, padded=None):
  """Keep k for q iff |q - k| <= w or k < sink; positions past seq_len are never kept."""
  n = padded or seq_len
  out = np.zeros((n, n), bool)
  for q, k in itertools.product(range(seq_len), repeat=2):
    out[q, k] = abs(q - k) <= half_width or k < sink
  return out


def test_band_half_width_formula_and_reference_values():
  # 720p at density 0.25 and 0.30: the widths the reference SVG code produces.
  assert band_half_width(75_600, 0.25) == 10_240
  assert band_half_width(75_600, 0.30) == 12_416
  for s, d in [(210, 0.3), (1000, 0.05), (302_400, 0.35)]:
    w = band_half_width(s, d)
    assert w % 128 == 0
    assert w - 128 < s * (1 - math.sqrt(1 - d)) <= w


def test_band_density_is_close_to_requested():
  s = 75_600
  for density in (0.2, 0.3, 0.5):
    mask = SvgMask(s, band_half_width(s, density))
    kept = mask.kept_pairs(0, s, 0, s) / s**2
    assert density <= kept < density + 0.01  # rounding the width up only adds pairs


@pytest.mark.parametrize("bad", [0, -0.1, 1.0001, float("nan"), True, "0.3", None])
def test_density_outside_range_is_rejected(bad):
  with pytest.raises(ValueError, match=r"density must be .*\(0, 1\]"):
    check_density(bad)
  with pytest.raises(ValueError, match="density"):
    svg_mask(VideoGrid(2, 2, 2), bad)


def test_density_one_keeps_everything():
  grid = VideoGrid(5, 6, 7)
  assert svg_mask(grid, 1.0).dense().all()
  assert svg_mask(grid, 1.0, include_sink=False).dense().all()


@pytest.mark.parametrize("shape, density, include_sink", [
    ((5, 6, 7), 0.3, True), ((5, 6, 7), 0.05, False), ((3, 10, 11), 0.5, True), ((4, 2, 3), 0.2, True),
])
def test_svg_mask_equals_brute_force(shape, density, include_sink):
  grid = VideoGrid(*shape)
  mask = svg_mask(grid, density, include_sink)
  want = brute_svg(grid.tokens, band_half_width(grid.tokens, density),
                   grid.frame_size if include_sink else 0, padded=grid.tokens + 40)
  np.testing.assert_array_equal(mask.block(0, grid.tokens + 40, 0, grid.tokens + 40), want)


def test_kept_pairs_matches_brute_force_on_random_rectangles():
  rng = np.random.default_rng(1)
  for seq_len, w, sink in [(210, 128, 42), (330, 0, 0), (330, 256, 110), (97, 5, 3)]:
    mask = SvgMask(seq_len, w, sink)
    full = brute_svg(seq_len, w, sink, padded=seq_len + 60)
    q = np.sort(rng.integers(0, seq_len + 60, size=(500, 2)), axis=1)
    k = np.sort(rng.integers(0, seq_len + 60, size=(500, 2)), axis=1)
    got = mask.kept_pairs(q[:, 0], q[:, 1], k[:, 0], k[:, 1])
    want = [full[a:b, c:d].sum() for (a, b), (c, d) in zip(q, k)]
    np.testing.assert_array_equal(got, want)


def _temporal_position(grid, t):
  f, p = divmod(t, grid.frame_size)
  return p * grid.frames + f


@pytest.mark.parametrize("include_sink", [True, False])
def test_temporal_head_mask_in_original_order_equals_brute_force(include_sink):
  grid = VideoGrid(5, 6, 7)
  mask = svg_mask(grid, 0.2, include_sink)
  w, sink, n = mask.half_width, mask.sink, grid.tokens
  want = np.zeros((n, n), bool)
  for q, k in itertools.product(range(n), repeat=2):
    uq, uk = _temporal_position(grid, q), _temporal_position(grid, k)
    want[q, k] = abs(uq - uk) <= w or uk < sink
  np.testing.assert_array_equal(PlacedMask(mask, grid, TokenOrder.TEMPORAL_MAJOR).dense(), want)
  np.testing.assert_array_equal(PlacedMask(mask, grid, TokenOrder.FRAME_MAJOR).dense(), mask.dense())


@pytest.mark.parametrize("shape, density, include_sink", [
    ((5, 6, 7), 0.3, True), ((5, 6, 7), 0.05, False), ((7, 3, 5), 0.5, True), ((4, 8, 16), 0.2, True),
])
def test_unplaced_temporal_kept_pairs_match_brute_force(shape, density, include_sink):
  grid = VideoGrid(*shape)
  mask = PlacedMask(svg_mask(grid, density, include_sink), grid, TokenOrder.TEMPORAL_MAJOR)
  n = grid.tokens + 50
  full = mask.block(0, n, 0, n)
  rng = np.random.default_rng(2)
  q = np.sort(rng.integers(0, n, size=(300, 2)), axis=1)
  k = np.sort(rng.integers(0, n, size=(300, 2)), axis=1)
  got = mask.kept_pairs(q[:, 0], q[:, 1], k[:, 0], k[:, 1])
  np.testing.assert_array_equal(got, [full[a:b, c:d].sum() for (a, b), (c, d) in zip(q, k)])


def test_temporal_head_keeps_the_same_place_in_every_frame():
  # A temporal band of +-F positions keeps each token's own spatial position in all frames.
  grid = VideoGrid(6, 8, 16)
  mask = PlacedMask(SvgMask(grid.tokens, half_width=grid.frames), grid, TokenOrder.TEMPORAL_MAJOR)
  for f, p in [(0, 0), (3, 77), (5, 127)]:
    q = f * grid.frame_size + p
    same_place = np.arange(grid.frames) * grid.frame_size + p
    assert mask.contains(q, same_place).all()
    # ...but not a far-away position in its own frame.
    assert not mask.contains(q, f * grid.frame_size + (p + 40) % grid.frame_size)


def test_spatial_sink_is_the_first_frame():
  grid = VideoGrid(6, 8, 16)
  mask = svg_mask(grid, 0.1)
  last = grid.tokens - 1
  assert mask.contains(last, np.arange(grid.frame_size)).all()
  assert not mask.contains(last, grid.frame_size)


def _brute_probe(n, frame_size, sink):
  radius = 2 * frame_size // 128
  out = np.zeros((n, n), bool)
  for q, k in itertools.product(range(n), repeat=2):
    out[q, k] = k < sink or abs(q // 128 - k // 128) < radius
  return out


@pytest.mark.parametrize("include_sink", [True, False])
def test_probe_masks_match_reference_rule(include_sink):
  grid = VideoGrid(5, 8, 16)  # frame of 128 tokens: +-1 block of 128 around the query's block
  spatial = probe_mask(grid, include_sink)
  want = _brute_probe(grid.tokens, grid.frame_size, grid.frame_size if include_sink else 0)
  np.testing.assert_array_equal(spatial.dense(), want)
  # Temporal heads: the same matrix re-indexed through the temporal-major permutation.
  pos = frame_major_order(grid)  # pos[t] = temporal-major position of frame-major token t
  np.testing.assert_array_equal(PlacedMask(spatial, grid, TokenOrder.TEMPORAL_MAJOR).dense(),
                                want[np.ix_(pos, pos)])
  assert np.array_equal(temporal_major_order(grid)[pos], np.arange(grid.tokens))


def test_probe_radius_at_720p_is_about_two_frames():
  grid = grid_for_resolution("720p")
  probe = probe_mask(grid)
  assert probe.radius_blocks == 56  # 56 blocks of 128 = 7168 tokens, 1.99 frames
  assert probe.contains(50_000, 50_000 + 7_000) and not probe.contains(50_000, 50_000 + 7_400)


def test_dense_refuses_real_sizes():
  with pytest.raises(ValueError, match="refusing"):
    svg_mask(grid_for_resolution("720p"), 0.3).dense()
