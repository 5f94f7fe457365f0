"""sparse_attention beyond the executor battery (test_executors.py): executors agreeing with
each other, their work lists and tables, compilations, refusals, inner steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxdiffusion_svg.kernels import plan_reference, sparse_attention
from maxdiffusion_svg.kernels.splash import plan_mask_info
from maxdiffusion_svg.kernels.xla import _work_steps
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.tiles import MASKED, plan_tiles

# S = 210 and 1000 leave padding with 128-token tiles.
GRIDS = {"s210": VideoGrid(5, 6, 7), "s1000": VideoGrid(10, 10, 10)}


def qkv(grid, dtype=jnp.float32, batch=2, heads=3, dim=64, seed=0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal((batch, heads, grid.tokens, dim)), dtype) for _ in range(3)]


@pytest.mark.parametrize("mode", ["split", "aligned"])
def test_backends_agree_with_rectangular_tiles_and_scale(mode):
  grid = GRIDS["s1000"]
  plan = plan_tiles(grid, 0.2, 256, 128, mode)
  q, k, v = qkv(grid, heads=2, dim=32, seed=3)
  a = sparse_attention(q, k, v, plan, backend="xla", scale=0.3)
  b = sparse_attention(q, k, v, plan, backend="splash", scale=0.3)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
  np.testing.assert_allclose(np.asarray(a), np.asarray(plan_reference(q, k, v, plan, scale=0.3)),
                             atol=2e-5)


def test_xla_work_list_covers_each_visited_tile_once_with_distinct_rows_per_step():
  plan = plan_tiles(VideoGrid(10, 10, 10), 0.3, 128, 128, "split")
  rows, cols, kinds = plan.visited_tiles()
  pick = kinds == MASKED
  step_rows, step_cols, slots, tile_rows = map(np.asarray, _work_steps(rows[pick], cols[pick], 5,
                                                                       plan.num_q_tiles))
  real = tile_rows < plan.num_q_tiles
  assert real.sum() == pick.sum()  # the scan computes visited tiles only (plus < 1 step padding)
  assert step_cols.size - real.sum() < step_cols.shape[1]
  got = sorted(zip(tile_rows[real], step_cols[real]))
  assert got == sorted(zip(rows[pick], cols[pick]))
  for i in range(step_rows.shape[0]):
    used = step_rows[i][step_rows[i] < plan.num_q_tiles]
    assert len(set(used)) == used.size
    np.testing.assert_array_equal(step_rows[i][slots[i]], tile_rows[i])


def test_splash_mask_info_is_the_plans_tile_list():
  plan = plan_tiles(GRIDS["s1000"], 0.3, 128, 128, "split")
  info, mask_fn = plan_mask_info(plan)
  rows, cols, kinds = plan.visited_tiles()
  np.testing.assert_array_equal(info.active_rows, rows)
  np.testing.assert_array_equal(info.active_cols, cols)
  np.testing.assert_array_equal(info.block_mask, kinds)
  assert info.num_active_blocks.tolist() == [rows.size]
  assert info.partial_mask_blocks is None and mask_fn is not None
  # An aligned plan whose length is a multiple of the tiles masks nothing: no mask function.
  aligned = plan_tiles(VideoGrid(8, 8, 16), 0.3, 128, 128, "aligned")
  assert plan_mask_info(aligned)[1] is None


def test_one_compilation_per_shape_and_plan():
  grid = GRIDS["s210"]
  plan = plan_tiles(grid, 0.3, 128, 128, "split")
  traces = []

  @jax.jit
  def run(q, k, v):
    traces.append(1)
    return sparse_attention(q, k, v, plan, backend="xla")

  q, k, v = qkv(grid)
  for args in ((q, k, v), (q + 1, k, v * 2)):  # new values, one executable, right answers
    np.testing.assert_allclose(np.asarray(run(*args)), np.asarray(plan_reference(*args, plan)),
                               atol=2e-5)
  assert len(traces) == 1


def test_bad_input_names_expected_and_actual():
  grid = GRIDS["s210"]
  plan = plan_tiles(grid, 0.3, 128, 128, "split")
  q, k, v = qkv(grid)
  with pytest.raises(ValueError, match="q, k, v must share"):
    sparse_attention(q, k[:, :2], v, plan)
  with pytest.raises(ValueError, match="dtypes differ"):
    sparse_attention(q, k.astype(jnp.bfloat16), v, plan)
  with pytest.raises(ValueError, match="head dims differ: expected 64, got 32"):
    sparse_attention(q, k[..., :32], v, plan)
  with pytest.raises(ValueError, match="seq_len 1000, but inputs have S = 210"):
    sparse_attention(q, k, v, plan_tiles(GRIDS["s1000"], 0.3, 128, 128, "split"))
  with pytest.raises(ValueError, match="backend must be one of auto, pallas, splash, xla"):
    sparse_attention(q, k, v, plan, backend="cuda")
  with pytest.raises(ValueError, match="must be \\[B, H, S, D\\]"):
    sparse_attention(q[0], k[0], v[0], plan)
  with pytest.raises(ValueError, match="plan must be a TilePlan"):
    sparse_attention(q, k, v, "split")


def test_splash_inner_kv_step_does_not_change_results():
  grid = GRIDS["s1000"]
  plan = plan_tiles(grid, 0.3, 128, 256, "split")
  q, k, v = qkv(grid, heads=2, dim=32, seed=4)
  out = sparse_attention(q, k, v, plan, backend="splash", block_kv_compute=128)
  np.testing.assert_allclose(np.asarray(out), np.asarray(plan_reference(q, k, v, plan)), atol=2e-5)


def test_xla_step_size_does_not_change_results():
  grid = GRIDS["s1000"]
  plan = plan_tiles(grid, 0.3, 128, 128, "aligned")
  q, k, v = qkv(grid, heads=2, dim=32, seed=5)
  want = np.asarray(plan_reference(q, k, v, plan))
  for tiles_per_step in (1, 3, 1000):
    out = sparse_attention(q, k, v, plan, backend="xla", tiles_per_step=tiles_per_step)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)
