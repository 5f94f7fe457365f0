"""Every executor through one battery: its forward against a float32 dense masked softmax of the
plan's own mask, its gradients against autodiff of a float64 one. Each executor is a subclass
naming its backend (and what it takes: our Pallas kernel whole 128-lane heads; Splash no
log-sum-exp output)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxdiffusion_svg.kernels import (dense_attention, masked_attention, plan_reference,
                                      sparse_attention)
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.masks import svg_mask
from maxdiffusion_svg.plan.tiles import EMPTY, plan_tiles
from references import assert_grads_close, masked_loss64, reference_grads

# S = 210 and 1000 leave padding with 128-token tiles; the sink is frame 0.
GRIDS = {"s210": VideoGrid(5, 6, 7), "s1000": VideoGrid(10, 10, 10)}
GRID = GRIDS["s210"]
FORWARD_TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
GRADIENT_TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 6e-2}


def normal(shape, count, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(count)]


class ExecutorBattery:
  """The tests every executor passes; a subclass sets ``backend`` and ``head_dim``."""

  backend: str = ""
  head_dim: int = 64

  def qkv(self, grid, dtype=jnp.float32):
    return normal((2, 3, grid.tokens, self.head_dim), 3, dtype)

  def qkvw(self, dtype=jnp.float32):
    return normal((2, 3, GRID.tokens, self.head_dim), 4, dtype)

  @pytest.mark.parametrize("mode", ["naive", "split", "aligned"])
  @pytest.mark.parametrize("grid_name", list(GRIDS))
  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
  def test_matches_dense_reference_of_the_plans_mask(self, mode, grid_name, dtype):
    grid = GRIDS[grid_name]
    plan = plan_tiles(grid, 0.3, 128, 128, mode)
    q, k, v = self.qkv(grid, dtype)
    out = sparse_attention(q, k, v, plan, backend=self.backend)
    assert out.shape == q.shape and out.dtype == dtype
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = plan_reference(*f32, plan)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want),
                               atol=FORWARD_TOLERANCE[dtype])
    if mode != "aligned":  # naive and split compute exactly the SVG rule
      exact = jnp.asarray(svg_mask(grid, 0.3).dense())
      np.testing.assert_allclose(np.asarray(want), np.asarray(masked_attention(*f32, exact)),
                                 atol=1e-6)

  def test_density_one_equals_full_dense_attention(self):
    q, k, v = self.qkv(GRID)
    for mode in ("split", "aligned"):
      out = sparse_attention(q, k, v, plan_tiles(GRID, 1.0, 128, 128, mode), backend=self.backend)
      np.testing.assert_allclose(np.asarray(out), np.asarray(dense_attention(q, k, v)), atol=2e-5)

  def test_rows_with_no_kept_key_give_zeros_not_nan(self):
    plan = plan_tiles(GRID, 0.3, 128, 128, "split")
    kind = np.array(plan.kind)
    kind[0] = EMPTY  # drop every tile of q-tile row 0
    stripped = dataclasses.replace(plan, kind=kind)
    q, k, v = self.qkv(GRID)
    out = np.asarray(sparse_attention(q, k, v, stripped, backend=self.backend))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[:, :, :128], 0)
    np.testing.assert_allclose(out[:, :, 128:],
                               np.asarray(plan_reference(q, k, v, plan))[:, :, 128:], atol=2e-5)

  @pytest.mark.parametrize("mode", ["naive", "split", "aligned"])
  def test_gradients_match_the_float64_reference(self, mode):
    plan = plan_tiles(GRID, 0.3, 128, 128, mode)  # sink on, padded last tiles
    q, k, v, w = self.qkvw()
    got = jax.grad(lambda q, k, v: (sparse_attention(q, k, v, plan, backend=self.backend)
                                    * w).sum(), argnums=(0, 1, 2))(q, k, v)
    assert_grads_close(got, reference_grads(masked_loss64(np.asarray(plan.dense_mask()), w),
                                            q, k, v), GRADIENT_TOLERANCE[jnp.float32])

  def test_bfloat16_inputs_give_bfloat16_gradients_near_the_reference(self):
    plan = plan_tiles(GRID, 0.3, 128, 128, "aligned")
    q, k, v, w = self.qkvw(jnp.bfloat16)
    got = jax.grad(lambda q, k, v: (sparse_attention(q, k, v, plan, backend=self.backend)
                                    .astype(jnp.float32) * w.astype(jnp.float32)).sum(),
                   argnums=(0, 1, 2))(q, k, v)
    assert all(g.dtype == jnp.bfloat16 for g in got)
    assert_grads_close(got, reference_grads(masked_loss64(np.asarray(plan.dense_mask()), w),
                                            q, k, v), GRADIENT_TOLERANCE[jnp.bfloat16])

  def test_the_returned_log_sum_exp_differentiates_too(self):
    # What a ring's merge of shards differentiates through.
    plan = plan_tiles(GRID, 0.3, 128, 128, "split")
    q, k, v, w = self.qkvw()
    u = jnp.asarray(np.random.default_rng(5).standard_normal(q.shape[:3]), jnp.float32)

    def loss(q, k, v):
      out, lse = sparse_attention(q, k, v, plan, backend=self.backend, return_lse=True)
      return (out * w).sum() + (lse * u).sum()

    got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert_grads_close(got, reference_grads(masked_loss64(np.asarray(plan.dense_mask()), w, u),
                                            q, k, v), GRADIENT_TOLERANCE[jnp.float32])


class TestXla(ExecutorBattery):
  backend = "xla"


class TestSplash(ExecutorBattery):
  backend = "splash"
  test_the_returned_log_sum_exp_differentiates_too = None  # tokamax's kernel returns none


class TestPallas(ExecutorBattery):
  backend = "pallas"
  head_dim = 128  # our kernel takes head_dim in whole lanes
