"""Video grid and layout permutations against brute force."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from maxdiffusion_svg.plan.geometry import (TokenOrder, VideoGrid, frame_major_order,
                                            grid_for_resolution, layout_positions,
                                            temporal_major_order, to_frame_major, to_temporal_major)


@pytest.mark.parametrize("name, shape, tokens", [
    ("480p", (21, 30, 52), 32_760),
    ("720p", (21, 45, 80), 75_600),
    ("1080p", (21, 68, 120), 171_360),
    ("1440p", (21, 90, 160), 302_400),
])
def test_presets_match_wan_latent_grids(name, shape, tokens):
  grid = grid_for_resolution(name)
  assert grid.shape == shape
  assert grid.tokens == tokens
  assert grid.frame_size == shape[1] * shape[2]


def test_for_video_custom_vae_and_patch():
  assert VideoGrid.for_video(17, 64, 128, vae_temporal=4, vae_spatial=8, patch=(1, 2, 2)).shape == (5, 4, 8)
  assert VideoGrid.for_video(9, 32, 32, vae_temporal=2, vae_spatial=4, patch=(1, 1, 1)).shape == (5, 8, 8)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(num_frames=80, height=720, width=1280), "num_frames"),
    (dict(num_frames=81, height=1080, width=1920), "height"),
    (dict(num_frames=81, height=720, width=1000), "width"),
    (dict(num_frames=0, height=720, width=1280), "num_frames"),
    (dict(num_frames=81, height=-16, width=1280), "height"),
    (dict(num_frames=81, height=720, width=1280, patch=(2, 2, 2)), "patch"),
])
def test_for_video_rejects_sizes_the_vae_does_not_divide(kwargs, needle):
  with pytest.raises(ValueError, match=needle):
    VideoGrid.for_video(**kwargs)


@pytest.mark.parametrize("bad", [(0, 2, 2), (2, -1, 2), (2, 2, 1.5), (True, 2, 2)])
def test_grid_rejects_non_positive_sides(bad):
  with pytest.raises(ValueError, match="must be a positive integer"):
    VideoGrid(*bad)


def test_unknown_resolution_names_the_choices():
  with pytest.raises(ValueError, match="resolution must be one of 480p, 720p, 1080p, 1440p"):
    grid_for_resolution("4k")


def _brute_temporal_order(grid):
  """Token (f, p) goes to position p * F + f: build it by enumeration."""
  order = np.empty(grid.tokens, np.int64)
  for f, p in itertools.product(range(grid.frames), range(grid.frame_size)):
    order[p * grid.frames + f] = f * grid.frame_size + p
  return order


@pytest.mark.parametrize("shape", [(5, 6, 7), (1, 3, 4), (4, 1, 1), (3, 2, 9)])
def test_index_maps_match_enumeration_and_invert(shape):
  grid = VideoGrid(*shape)
  order = temporal_major_order(grid)
  inverse = frame_major_order(grid)
  np.testing.assert_array_equal(order, _brute_temporal_order(grid))
  np.testing.assert_array_equal(order[inverse], np.arange(grid.tokens))
  np.testing.assert_array_equal(inverse[order], np.arange(grid.tokens))
  # layout_positions answers "where does token t sit" by arithmetic.
  np.testing.assert_array_equal(layout_positions(grid, TokenOrder.TEMPORAL_MAJOR, np.arange(grid.tokens)),
                                inverse)
  np.testing.assert_array_equal(layout_positions(grid, TokenOrder.FRAME_MAJOR, np.arange(5)), np.arange(5))


@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jax"])
def test_apply_permutation_matches_index_arrays_and_round_trips(xp):
  grid = VideoGrid(5, 6, 7)
  x = np.random.default_rng(0).standard_normal((2, 3, grid.tokens, 4)).astype(np.float32)
  tm = to_temporal_major(xp.asarray(x), grid)
  np.testing.assert_array_equal(np.asarray(tm), x[..., temporal_major_order(grid), :])
  back = to_frame_major(tm, grid)
  np.testing.assert_array_equal(np.asarray(back), x)  # exact: a pure reordering
  # Same spatial position, consecutive frames, are neighbours in temporal-major order.
  f, p = 2, 11
  assert np.array_equal(np.asarray(tm)[0, 0, p * grid.frames + f], x[0, 0, f * grid.frame_size + p])


def test_permutation_rejects_wrong_sequence_length():
  grid = VideoGrid(5, 6, 7)
  with pytest.raises(ValueError, match="S = grid.tokens = 210"):
    to_temporal_major(np.zeros((1, 209, 4)), grid)
  with pytest.raises(ValueError, match="S = grid.tokens = 210"):
    to_frame_major(np.zeros((210,)), grid)


def test_the_public_names_resolve_and_the_token_order_keeps_its_old_name():
  """``from maxdiffusion_svg import ...`` for every public name; ``Layout`` (the token order's
  name before head layouts took the word) is ``TokenOrder``."""
  import maxdiffusion_svg  # pylint: disable=import-outside-toplevel
  for name in maxdiffusion_svg.__all__:
    assert getattr(maxdiffusion_svg, name) is not None
  assert maxdiffusion_svg.Layout is maxdiffusion_svg.TokenOrder is TokenOrder
  assert set(TokenOrder) == {TokenOrder.FRAME_MAJOR, TokenOrder.TEMPORAL_MAJOR}
