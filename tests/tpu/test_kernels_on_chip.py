"""Our kernel on a real TPU at Wan 720p's per-chip shape (``make test-tpu``, one process):
every mode, fixed and online heads, density 1 and compensated, against the XLA executor and a
float32 reference on sampled rows. Skipped, with the reason, where no TPU is attached (CI)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxdiffusion_svg.kernels import masked_attention, sparse_attention
from maxdiffusion_svg.plan.geometry import grid_for_resolution
from maxdiffusion_svg.plan.target import target_of
from maxdiffusion_svg.plan.tiles import plan_tiles
from maxdiffusion_svg.plan.tiling import choose_tiles

pytestmark = [
    pytest.mark.chip,
    pytest.mark.skipif(jax.devices()[0].platform != "tpu",
                       reason="needs a TPU (make test-tpu on a TPU VM); CI has none"),
]

GRID = grid_for_resolution("720p")  # 75,600 tokens
ROWS = 96  # sampled query rows per head


@pytest.fixture(scope="module")
def qkv():
  """Two heads of bf16 normals: the first passes the fixed-offset gate, the second (q x 12)
  runs online softmax."""
  shape = (1, 2, GRID.tokens, 128)
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  gain = jnp.asarray([1.0, 12.0])[None, :, None, None]
  q = (jax.random.normal(kq, shape, jnp.float32) * gain).astype(jnp.bfloat16)
  return q, jax.random.normal(kk, shape, jnp.bfloat16), jax.random.normal(kv, shape, jnp.bfloat16)


def _rows(seed=0):
  """Sampled rows: the first and last tokens (the sink, the padding tile) and random ones."""
  rng = np.random.default_rng(seed)
  return np.unique(np.concatenate([[0, 1, GRID.tokens - 1],
                                   rng.integers(0, GRID.tokens, ROWS - 3)]))


def _reference(q, k, v, plan, rows):
  """Float32 softmax over the pairs ``plan`` computes, for ``rows`` (an ``[R, S]`` mask built
  by index arithmetic from the plan's tile table)."""
  mask = plan.computed_mask.contains(rows[:, None], np.arange(GRID.tokens)[None, :])
  with jax.default_matmul_precision("highest"):
    out = masked_attention(q[:, :, rows].astype(jnp.float32), k.astype(jnp.float32),
                           v.astype(jnp.float32), jnp.asarray(mask))
  return np.asarray(out, np.float32)


def _ours(q, k, v, plan, backend="pallas", **kwargs):
  tiles = choose_tiles(target_of(), "pallas", plan.block_q, plan.block_kv)
  fn = jax.jit(lambda q, k, v: sparse_attention(
      q, k, v, plan, backend=backend, block_kv_compute=tiles.block_kv_compute, **kwargs))
  return np.asarray(fn(q, k, v), np.float32)


def _check(got, want, head_tol):
  """Per head: the largest error within its bar (bf16 inputs and output), relative to the
  output's scale."""
  for h, tol in enumerate(head_tol):
    err = np.abs(got[0, h] - want[0, h])
    scale = np.abs(want[0, h]).max()
    assert err.max() <= tol * scale, (h, float(err.max()), float(scale))


def _default_plan(density, mode):
  tiles = choose_tiles(target_of(), "pallas")
  return plan_tiles(GRID, density, tiles.block_q, tiles.block_kv, mode)


@pytest.mark.parametrize("mode", ["naive", "split", "aligned"])
def test_every_mode_matches_the_float32_reference_on_sampled_rows(qkv, mode):
  q, k, v = qkv
  plan = _default_plan(0.3, mode)
  rows = _rows()
  got = _ours(q, k, v, plan)[:, :, rows]
  # The online head's logits reach the hundreds: q's bf16 rounding in base 2 moves them.
  _check(got, _reference(q, k, v, plan, rows), (2e-2, 0.25))


@pytest.mark.parametrize("mode", ["split", "aligned"])
def test_our_kernel_equals_the_xla_executor(qkv, mode):
  q, k, v = qkv
  plan = _default_plan(0.3, mode)
  rows = _rows(1)
  _check(_ours(q, k, v, plan)[:, :, rows], _ours(q, k, v, plan, backend="xla")[:, :, rows],
         (2e-2, 0.25))


def test_density_one_matches_dense_attention(qkv):
  q, k, v = qkv
  plan = _default_plan(1.0, "aligned")
  rows = _rows(2)
  _check(_ours(q, k, v, plan)[:, :, rows], _reference(q, k, v, plan, rows), (2e-2, 0.25))


def test_rolled_big_tiles_match_the_reference(qkv):
  """A tile whose scores reach UNROLL_SCORE_BYTES walks its kv steps in a loop (2048x2048/512:
  three steps a turn, one left over)."""
  from maxdiffusion_svg.kernels.pallas import kv_unroll  # pylint: disable=import-outside-toplevel
  q, k, v = qkv
  plan = plan_tiles(GRID, 0.3, 2048, 2048, "aligned")
  assert kv_unroll(plan, choose_tiles(target_of(), "pallas", 2048, 2048).block_kv_compute) == 3
  rows = _rows(3)
  _check(_ours(q, k, v, plan)[:, :, rows], _reference(q, k, v, plan, rows), (2e-2, 0.25))


def test_compensated_call_matches_its_xla_twin(qkv):
  from maxdiffusion_svg.routing.compensation import compensated_attention  # pylint: disable=import-outside-toplevel
  q, k, v = qkv
  plan = _default_plan(0.3, "aligned")
  rows = _rows(4)
  run = lambda backend: np.asarray(jax.jit(lambda q, k, v: compensated_attention(
      q, k, v, plan, blocks=8, backend=backend))(q, k, v), np.float32)[:, :, rows]
  _check(run("pallas"), run("xla"), (2e-2, 0.25))


def test_the_routers_sampled_rows_match_float32(qkv):
  """The router's one pass over the keys (every mask at once) against XLA's float32 softmax."""
  from maxdiffusion_svg.kernels.sampled_rows import sampled_rows, sampled_rows_xla  # pylint: disable=import-outside-toplevel
  q, k, v = qkv
  rows = jnp.asarray(_rows(1)[:64])
  plan = plan_tiles(GRID, 0.3, 2048, 3072, "aligned")
  keys = np.arange(GRID.tokens)[None, :]
  keeps = jnp.asarray(np.stack([plan.computed_mask.contains(np.asarray(rows)[:, None], keys),
                                np.asarray(rows)[:, None] >= keys]))
  q_rows = jnp.take(q, rows, axis=2)
  got = jax.jit(lambda *xs: sampled_rows(*xs, 0.088))(q_rows, k, v, keeps)
  with jax.default_matmul_precision("highest"):
    want = jax.jit(lambda *xs: sampled_rows_xla(*xs, 0.088))(q_rows, k, v, keeps)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)


def test_head_order_is_the_geometrys_bitwise(qkv):
  """Placement by the Pallas pass: each swapped head the geometry's temporal-major copy, the
  rest untouched, and back."""
  from maxdiffusion_svg.kernels.head_order import reorder_heads  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.plan.geometry import to_frame_major, to_temporal_major  # pylint: disable=import-outside-toplevel
  x = qkv[0].reshape(2, GRID.tokens, 128)
  swap = jnp.asarray([1, 0])
  placed = jax.jit(lambda x: reorder_heads(x, swap, GRID.frames, to_temporal=True))(x)
  np.testing.assert_array_equal(np.asarray(placed[0]), np.asarray(to_temporal_major(x[:1], GRID)[0]))
  np.testing.assert_array_equal(np.asarray(placed[1]), np.asarray(x[1]))
  back = jax.jit(lambda x: reorder_heads(x, swap, GRID.frames, to_temporal=False))(placed)
  np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
  np.testing.assert_array_equal(np.asarray(to_frame_major(placed[:1], GRID)), np.asarray(x[:1]))
  # placing q with its scale on the way: XLA's float32 product in bfloat16, bitwise
  scale = 128 ** -0.5 * 1.4426950408889634
  placed = jax.jit(lambda x: reorder_heads(x, swap, GRID.frames, to_temporal=True,
                                           scale=scale))(x)
  scaled = jax.jit(lambda x: (x.astype(jnp.float32) * scale).astype(x.dtype))(x)
  np.testing.assert_array_equal(np.asarray(placed[0]),
                                np.asarray(to_temporal_major(scaled[:1], GRID)[0]))
  np.testing.assert_array_equal(np.asarray(placed[1]), np.asarray(scaled[1]))
