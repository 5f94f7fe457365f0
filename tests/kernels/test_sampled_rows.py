"""The router's sampled-rows kernel (interpreted) against a float64 softmax; the router with it
against the router's XLA path and the NumPy oracle."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxdiffusion_svg.bench.synthetic import planted_qkv
from maxdiffusion_svg.kernels.sampled_rows import sampled_rows, sampled_rows_xla
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.tiles import plan_tiles
from maxdiffusion_svg.routing.router import RouterConfig, profile_heads, sample_rows

from tests.routing.test_router import numpy_layout_errors

GRID = VideoGrid(6, 8, 16)  # 768 tokens
ROWS_ON_CPU = functools.partial(sampled_rows, interpret=True)


def float64_rows(q, k, v, keeps, scale):
  """Each mask's softmax output and log-sum-exp, dense first, in float64."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  logits = np.einsum("bhrd,bhkd->bhrk", q, k) * scale
  outs, lses = [], []
  for keep in [None] + [keeps[..., i, :, :] for i in range(keeps.shape[-3])]:
    x = logits if keep is None else np.where(keep, logits, -np.inf)
    with np.errstate(invalid="ignore"):
      m = x.max(-1, keepdims=True)
      w = np.exp(x - m)
      z = w.sum(-1, keepdims=True)
      outs.append(np.einsum("bhrk,bhkd->bhrd", w / z, v))
      lses.append((m + np.log(z))[..., 0])
  return np.stack(outs, 2), np.stack(lses, 2)


@pytest.mark.parametrize("dtype,per_head,rows", [(jnp.bfloat16, False, 64), (jnp.float32, True, 10),
                                                 (jnp.bfloat16, True, 40)])
def test_every_mask_equals_a_float64_softmax(dtype, per_head, rows):
  rng = np.random.default_rng(0)
  b, h, s, d = 1, 2, 2500, 128  # two key blocks, the second ragged
  q = jnp.asarray(rng.standard_normal((b, h, rows, d)), dtype)
  k, v = (jnp.asarray(rng.standard_normal((b, h, s, d)), dtype) for _ in range(2))
  shape = (b, h, 2, rows, s) if per_head else (2, rows, s)
  keeps = rng.random(shape) < 0.3
  keeps[..., 1, :3, :] = False  # rows keeping nothing
  out, lse = sampled_rows(q, k, v, jnp.asarray(keeps), 0.09, interpret=True)
  want_out, want_lse = float64_rows(q, k, v, keeps, 0.09)
  assert out.shape == (b, h, 3, rows, d) and lse.shape == (b, h, 3, rows)
  kept = np.isfinite(want_lse)
  np.testing.assert_allclose(np.asarray(out)[kept], want_out[kept], atol=2e-6)
  np.testing.assert_allclose(np.asarray(lse)[kept], want_lse[kept], atol=2e-6)
  assert np.isnan(np.asarray(out)[~kept]).all() and np.isneginf(np.asarray(lse)[~kept]).all()
  assert (~kept).sum() == b * h * 3  # the three rows of mask 1 in each head, only
  xla_out, xla_lse = sampled_rows_xla(q, k, v, jnp.asarray(keeps), 0.09)
  np.testing.assert_allclose(np.asarray(xla_out)[kept], want_out[kept], atol=2e-6)
  np.testing.assert_allclose(np.asarray(xla_lse)[kept], want_lse[kept], atol=2e-6)


def test_without_masks_the_dense_row_alone():
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.standard_normal((2, 1, n, 128)), jnp.float32)
             for n in (32, 300, 300))
  out, lse = sampled_rows(q, k, v, None, 0.1, interpret=True)
  want_out, want_lse = float64_rows(q, k, v, np.zeros((0, 32, 300), bool), 0.1)
  np.testing.assert_allclose(np.asarray(out), want_out, atol=2e-6)
  np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-6)


@pytest.mark.parametrize("compensation", [0, 2])
def test_the_router_on_the_kernel_decides_as_on_xla(compensation):
  """Routing through the kernel: the same layouts as the XLA path, errors within float32, and
  both against the NumPy oracle."""
  types = ("spatial", "temporal", "mixed50", "weak_temporal", "weak_spatial", "unstructured")
  q, k, v = (jnp.asarray(x, jnp.bfloat16)
             for x in planted_qkv(GRID, types, head_dim=128, seed=3, batch=2))
  plan = plan_tiles(GRID, 0.3, 128, 128, "aligned")
  config = RouterConfig(profile_queries=16, profile_masks="execution")
  key = jax.random.key(4)
  run = lambda rows_kernel: profile_heads(q, k, v, grid=GRID, config=config, key=key, plan=plan,
                                          compensation_blocks=compensation,
                                          rows_kernel=rows_kernel)
  xla, pallas = run(None), run(ROWS_ON_CPU)
  np.testing.assert_array_equal(np.asarray(pallas.layout), np.asarray(xla.layout))
  np.testing.assert_allclose(np.asarray(pallas.errors), np.asarray(xla.errors), rtol=2e-4,
                             atol=1e-9)
  if not compensation:
    rows = np.asarray(sample_rows(key, GRID.tokens, config))
    err_s, err_t = numpy_layout_errors(q, k, v, rows, GRID, plan.dense_mask())
    np.testing.assert_allclose(np.asarray(pallas.spatial_error), err_s, rtol=2e-4, atol=1e-9)
    np.testing.assert_allclose(np.asarray(pallas.temporal_error), err_t, rtol=2e-4, atol=1e-9)
