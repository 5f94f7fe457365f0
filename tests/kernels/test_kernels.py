"""sparse_attention against a float32 dense masked softmax of the plan's own mask."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxdiffusion_svg.kernels import (dense_attention, masked_attention, plan_reference,
                                      sparse_attention)
from maxdiffusion_svg.kernels.splash import plan_mask_info
from maxdiffusion_svg.kernels.xla import _work_steps
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.masks import svg_mask
from maxdiffusion_svg.plan.tiles import EMPTY, MASKED, plan_tiles

# S = 210 and 1000 leave padding with 128-token tiles.
GRIDS = {"s210": VideoGrid(5, 6, 7), "s1000": VideoGrid(10, 10, 10)}
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def qkv(grid, dtype=jnp.float32, batch=2, heads=3, dim=64, seed=0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal((batch, heads, grid.tokens, dim)), dtype) for _ in range(3)]


def dim_for(backend):
  """Our Pallas kernel takes head_dim in whole lanes (128); the others any."""
  return 128 if backend == "pallas" else 64


@pytest.mark.parametrize("backend", ["xla", "splash", "pallas"])
@pytest.mark.parametrize("mode", ["naive", "split", "aligned"])
@pytest.mark.parametrize("grid_name", list(GRIDS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_matches_dense_reference_of_the_plans_mask(backend, mode, grid_name, dtype):
  grid = GRIDS[grid_name]
  plan = plan_tiles(grid, 0.3, 128, 128, mode)
  q, k, v = qkv(grid, dtype, dim=dim_for(backend))
  out = sparse_attention(q, k, v, plan, backend=backend)
  assert out.shape == q.shape and out.dtype == dtype
  want = plan_reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), plan)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=TOLERANCE[dtype])
  if mode != "aligned":  # naive and split compute exactly the SVG rule
    exact = jnp.asarray(svg_mask(grid, 0.3).dense())
    np.testing.assert_allclose(np.asarray(want), np.asarray(masked_attention(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), exact)), atol=1e-6)


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


@pytest.mark.parametrize("backend", ["xla", "splash", "pallas"])
def test_density_one_equals_full_dense_attention(backend):
  grid = GRIDS["s210"]
  q, k, v = qkv(grid, dim=dim_for(backend))
  for mode in ("split", "aligned"):
    out = sparse_attention(q, k, v, plan_tiles(grid, 1.0, 128, 128, mode), backend=backend)
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense_attention(q, k, v)), atol=2e-5)


@pytest.mark.parametrize("backend", ["xla", "splash", "pallas"])
def test_rows_with_no_kept_key_give_zeros_not_nan(backend):
  grid = GRIDS["s210"]
  plan = plan_tiles(grid, 0.3, 128, 128, "split")
  kind = np.array(plan.kind)
  kind[0] = EMPTY  # drop every tile of q-tile row 0
  stripped = dataclasses.replace(plan, kind=kind)
  q, k, v = qkv(grid, dim=dim_for(backend))
  out = np.asarray(sparse_attention(q, k, v, stripped, backend=backend))
  assert np.isfinite(out).all()
  np.testing.assert_array_equal(out[:, :, :128], 0)
  np.testing.assert_allclose(out[:, :, 128:], np.asarray(plan_reference(q, k, v, plan))[:, :, 128:],
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
