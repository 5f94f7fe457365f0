"""Per-head token order on a TPU (interpreted): bitwise the geometry's reorders, head by head."""

import jax.numpy as jnp
import numpy as np
import pytest

from maxdiffusion_svg.kernels.head_order import block_positions, reorder_heads, supported
from maxdiffusion_svg.plan.geometry import VideoGrid, to_frame_major, to_temporal_major


@pytest.mark.parametrize("grid,dtype", [(VideoGrid(5, 4, 8), jnp.bfloat16),
                                        (VideoGrid(3, 8, 12), jnp.float32),
                                        (VideoGrid(21, 2, 8), jnp.bfloat16)])
def test_swapped_heads_reorder_and_the_rest_are_copied(grid, dtype):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((4, grid.tokens, 128)), dtype)
  swap = jnp.asarray([1, 0, 0, 1])
  placed = reorder_heads(x, swap, grid.frames, to_temporal=True, interpret=True)
  for head in range(4):
    want = to_temporal_major(x[head][None], grid)[0] if swap[head] else x[head]
    np.testing.assert_array_equal(np.asarray(placed[head]), np.asarray(want))
  back = reorder_heads(placed, swap, grid.frames, to_temporal=False, interpret=True)
  np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
  for head in (0, 3):  # the inverse alone, against the geometry's
    np.testing.assert_array_equal(np.asarray(back[head]),
                                  np.asarray(to_frame_major(placed[head][None], grid)[0]))


def test_what_it_takes():
  assert block_positions(3600, 21, 256) == 144  # the largest multiple of 8 dividing 3600 in 1 MiB
  assert block_positions(1560, 21, 256) == 120
  assert supported(21, 3600, 128, jnp.bfloat16)
  assert not supported(21, 3604, 128, jnp.bfloat16)  # positions not in whole sublanes
  assert not supported(21, 3600, 64, jnp.bfloat16)  # rows narrower than the lanes
  with pytest.raises(ValueError, match="as 3 frames of a multiple of 8 positions"):
    reorder_heads(jnp.zeros((1, 30, 128)), jnp.ones(1), 3, to_temporal=True, interpret=True)


def test_its_gradient_is_the_reverse_reorder():
  """Training differentiates placement: the gradient of a reorder is the cotangent reordered
  back, the geometry's own gradient."""
  import jax  # pylint: disable=import-outside-toplevel
  grid = VideoGrid(5, 4, 8)
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((2, grid.tokens, 128)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((2, grid.tokens, 128)), jnp.float32)
  swap = jnp.asarray([1, 0])
  for to_temporal in (True, False):
    ours = jax.grad(lambda x: (reorder_heads(x, swap, grid.frames, to_temporal=to_temporal,
                                             interpret=True) * w).sum())(x)
    move = to_temporal_major if to_temporal else to_frame_major
    want = jax.grad(lambda x: (jnp.stack([move(x[:1], grid)[0], x[1]]) * w).sum())(x)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(want))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_placing_scales_every_head_as_xla_would(dtype):
  """The scale rides the placing pass: each head (swapped or copied) is XLA's float32 product
  rounded to its dtype, bitwise; its gradient is the scaled reverse reorder; restoring takes none."""
  import jax  # pylint: disable=import-outside-toplevel
  grid, scale = VideoGrid(5, 4, 8), 128 ** -0.5 * 1.4426950408889634
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((3, grid.tokens, 128)), dtype)
  swap = jnp.asarray([1, 0, 1])
  placed = reorder_heads(x, swap, grid.frames, to_temporal=True, interpret=True, scale=scale)
  scaled = (x.astype(jnp.float32) * scale).astype(dtype)
  for head in range(3):
    want = to_temporal_major(scaled[head][None], grid)[0] if swap[head] else scaled[head]
    np.testing.assert_array_equal(np.asarray(placed[head]), np.asarray(want))
  assert not np.array_equal(np.asarray(placed[1]), np.asarray(x[1]))  # the copied head scaled
  w = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  loss = lambda f: lambda x: (f(x).astype(jnp.float32) * w).sum()
  ours = jax.grad(loss(lambda x: reorder_heads(x, swap, grid.frames, to_temporal=True,
                                               interpret=True, scale=scale)))(x)
  move = lambda x: jnp.stack([to_temporal_major(x[:1], grid)[0], x[1],
                              to_temporal_major(x[2:], grid)[0]])
  want = jax.grad(loss(lambda x: move((x.astype(jnp.float32) * scale).astype(dtype))))(x)
  np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(want, np.float32),
                             rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6)
  with pytest.raises(ValueError, match="temporal-major order only"):
    reorder_heads(x, swap, grid.frames, to_temporal=False, interpret=True, scale=scale)
