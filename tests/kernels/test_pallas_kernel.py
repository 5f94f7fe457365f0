"""Our Pallas kernel (interpreted on CPU): work list, fixed offset and gate, both softmax paths."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxdiffusion_svg.kernels import plan_reference, sparse_attention
from maxdiffusion_svg.kernels.fixed_offset import CENTRE_ROWS, OFFSET, fixed_offsets, gate
from maxdiffusion_svg.kernels.worklist import pack_work, unpack_work
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.tiles import EMPTY, plan_tiles

GRID = VideoGrid(5, 6, 7)  # 210 tokens: padding with 128-token tiles
LOG2E = math.log2(math.e)


def normal(shape, seed, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def flags(q, k, v, plan, scale=128 ** -0.5):
  b, h, s, d = q.shape
  fold = lambda x: x.reshape(b * h, s, d)
  return np.asarray(fixed_offsets(fold(q), fold(k), fold(v), scale * LOG2E,
                                  every_key_visited=plan.stats.kept_pairs == s * s).fixed)


def test_work_list_is_the_plans_tiles_plus_one_step_per_empty_row():
  plan = plan_tiles(VideoGrid(10, 10, 10), 0.3, 128, 128, "split")
  kind = np.array(plan.kind)
  kind[2] = EMPTY
  import dataclasses
  plan = dataclasses.replace(plan, kind=kind)
  row, col, kinds, first, last = unpack_work(pack_work(plan))
  rows, cols, visited = plan.visited_tiles()
  real = kinds != EMPTY
  np.testing.assert_array_equal(row[real], rows)
  np.testing.assert_array_equal(col[real], cols)
  np.testing.assert_array_equal(kinds[real], visited)
  assert row[~real].tolist() == [2]  # the empty row still gets its one (do-nothing) step
  i = int(np.flatnonzero(~real)[0])
  assert first[i] == last[i] == 1 and col[i] == col[i - 1]  # reuses the kv block before it
  assert (np.diff(row) >= 0).all() and first.sum() == last.sum() == plan.num_q_tiles


def test_gate_is_the_derived_bound():
  s = 75_600
  assert gate(s, True) == pytest.approx(OFFSET - 1 + 126 - 10 - math.log2(s))
  assert gate(s, False) == pytest.approx(gate(s, True) / 2)
  assert 93 < gate(s, False) < 94 and 186 < gate(s, True) < 187


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mode", ["naive", "aligned"])
def test_heads_take_fixed_or_online_at_run_time_and_both_are_exact(dtype, mode):
  plan = plan_tiles(GRID, 0.3, 128, 128, mode)
  q, k, v = (normal((2, 2, GRID.tokens, 128), seed, dtype) for seed in range(3))
  q = q * jnp.asarray([[1.0, 40.0], [40.0, 1.0]], dtype)[:, :, None, None]  # sharp heads: online
  assert flags(q, k, v, plan).tolist() == [1, 0, 0, 1]
  calls = []

  @jax.jit
  def run(q, k, v):
    calls.append(1)
    return sparse_attention(q, k, v, plan, backend="pallas")

  f32 = lambda x: np.asarray(x, np.float32)
  for qq in (q, q[:, ::-1]):  # the flags flip, the executable stays
    want = plan_reference(*(x.astype(jnp.float32) for x in (qq, k, v)), plan)
    ref_dtype = f32(plan_reference(qq, k, v, plan))  # the same inputs, rounded like ours
    got = f32(run(qq, k, v))
    # Sharp heads (logits in the hundreds) amplify q's rounding once scaled into base 2.
    np.testing.assert_allclose(got, f32(want), atol=2e-4 if dtype == jnp.float32 else 0.4)
    assert np.abs(got - ref_dtype).mean() < (1e-5 if dtype == jnp.float32 else 1e-2)
  assert len(calls) == 1


def _at_the_bound(scale_to, plan, sign_split=False, seed=0):
  """q, k, v whose largest |q||k - mean k| (base-2 logits) is ``scale_to``. With
  ``sign_split``, keys of the first half point one way and the rest the other, so a sparse row
  that visits only first-half keys sees every logit near ``-|q||k|``."""
  s, d = GRID.tokens, 128
  u = np.zeros(d)
  u[0] = 1.0
  noise = np.random.default_rng(seed).standard_normal((s, d)) * 0.01
  if sign_split:
    keys = np.where(np.arange(s)[:, None] < s // 2, -u, u) + noise
  else:
    keys = np.random.default_rng(seed + 1).standard_normal((s, d))
  keys = keys - keys.mean(axis=0)
  k_norm = np.linalg.norm(keys, axis=1).max()
  q = np.tile(u, (s, 1)) + noise
  q_norm = np.linalg.norm(q, axis=1).max()
  scale = 128 ** -0.5
  q = q * scale_to / (q_norm * k_norm * scale * LOG2E)
  v = np.random.default_rng(seed + 2).standard_normal((s, d))
  return [jnp.asarray(x[None, None], jnp.float32) for x in (q, keys, v)]


@pytest.mark.parametrize("where", ["below", "above"])
def test_sparse_rows_far_below_their_bound_at_the_gate(where):
  """Rows that visit only keys scoring about -G (the sparse gate's worst case) stay exact."""
  plan = plan_tiles(GRID, 0.3, 128, 128, "naive")
  bound = gate(GRID.tokens, False) * (0.999 if where == "below" else 1.01)
  q, k, v = _at_the_bound(bound, plan, sign_split=True)
  assert flags(q, k, v, plan).tolist() == [1 if where == "below" else 0]
  out = np.asarray(sparse_attention(q, k, v, plan, backend="pallas"))
  want = np.asarray(plan_reference(q, k, v, plan))
  assert np.isfinite(out).all()
  np.testing.assert_allclose(out, want, atol=1e-4)


def test_dense_plan_uses_the_dense_gate():
  plan = plan_tiles(GRID, 1.0, 128, 128, "aligned", include_sink=False)
  assert plan.stats.kept_pairs == GRID.tokens ** 2
  q, k, v = _at_the_bound(gate(GRID.tokens, True) * 0.999, plan)
  assert flags(q, k, v, plan).tolist() == [1]
  out = np.asarray(sparse_attention(q, k, v, plan, backend="pallas"))
  np.testing.assert_allclose(out, np.asarray(plan_reference(q, k, v, plan)), atol=1e-4)
  sparse = plan_tiles(GRID, 0.3, 128, 128, "naive")
  assert flags(q, k, v, sparse).tolist() == [0]  # over the sparse gate: online there


def test_a_sparse_plans_keys_are_centred_on_a_strided_subsample():
  """Sparse plans centre the keys on every S // CENTRE_ROWS-th key (no pass over every key): each
  row's logits stay within the sparse gate's derivation around its offset (no term over 2**88,
  none under 2**(87 - 2 G_i)), keys far off the origin still pass the gate, the output is the
  reference's; dense plans keep the exact mean."""
  grid = VideoGrid(8, 16, 16)  # 2,048 tokens: every 4th key
  stride = grid.tokens // CENTRE_ROWS
  assert stride == 4
  q, k, v = (normal((1, 1, grid.tokens, 128), seed) for seed in range(3))
  k = k + 8.0 * normal((1, 1, 1, 128), 3)  # a common part 8x the keys' spread
  scale = 128 ** -0.5
  fold = lambda x: x.reshape(1, grid.tokens, 128)
  got = fixed_offsets(fold(q), fold(k), fold(v), scale * LOG2E, every_key_visited=False)
  exact = fixed_offsets(fold(q), fold(k), fold(v), scale * LOG2E, every_key_visited=True)
  qs, k64 = np.asarray(got.q[0], np.float64), np.asarray(k[0, 0], np.float64)
  logits, m = qs @ k64.T, np.asarray(got.m[0, 0], np.float64)
  centre = k64[::stride].mean(0)
  g = np.linalg.norm(qs, axis=1) * np.linalg.norm(k64 - centre, axis=1).max()
  assert np.all(logits.max(1) - m <= OFFSET)
  assert np.all(logits.min(1) - m >= OFFSET - 1 - 2 * g - 1e-3)
  # the subsample's centre, not the mean: a different shift, the same gate decision
  assert np.abs(np.asarray(got.m) - np.asarray(exact.m)).max() > 1e-3
  uncentred = np.linalg.norm(qs, axis=1).max() * np.linalg.norm(k64, axis=1).max()
  assert uncentred > gate(grid.tokens, False) > g.max()
  assert got.fixed.tolist() == [1]
  plan = plan_tiles(grid, 0.3, 128, 256, "split")
  out = np.asarray(sparse_attention(q, k, v, plan, backend="pallas"))
  np.testing.assert_allclose(out, np.asarray(plan_reference(q, k, v, plan)), atol=2e-5)


def test_values_too_large_for_the_offset_run_online():
  plan = plan_tiles(GRID, 0.3, 128, 128, "split")
  q, k, v = (normal((1, 1, GRID.tokens, 128), seed) for seed in range(3))
  big = v * 2.0 ** 30
  assert flags(q, k, v, plan).tolist() == [1] and flags(q, k, big, plan).tolist() == [0]
  out = np.asarray(sparse_attention(q, k, big, plan, backend="pallas"))
  np.testing.assert_allclose(out / 2.0 ** 30, np.asarray(plan_reference(q, k, v, plan)), atol=2e-5)


def _growing_rows(slopes, tokens: int, seed: int = 0):
  """One head whose q tile ``i``'s base-2 logits grow by ``slopes[i]`` per 128 keys along the
  sequence (negative: fall), with noise of a few units: online softmax rows whose maximum
  keeps growing, gently (the lazy pass holds) or past any headroom (the tile reruns)."""
  rng = np.random.default_rng(seed)
  d, scale = 128, 128 ** -0.5
  u = np.zeros(d)
  u[0] = 1.0
  per_key = np.repeat(np.asarray(slopes, np.float64) / 128, 128)[:tokens]
  q = rng.standard_normal((tokens, d)) * 0.3
  q[:, 0] = per_key / (scale * LOG2E)  # q . k = slope x position (base 2, after the scale)
  k = rng.standard_normal((tokens, d)) * 0.3
  k[:, 0] = np.arange(tokens)
  v = rng.standard_normal((tokens, d))
  return [jnp.asarray(x[None, None], jnp.float32) for x in (q, k, v)]


def _float64_attention(q, k, v, mask, scale=128 ** -0.5):
  q, k, v = (np.asarray(x, np.float64)[0, 0] for x in (q, k, v))
  logits = np.where(mask, q @ k.T * scale, -np.inf)
  weights = np.exp(logits - logits.max(axis=1, keepdims=True))
  return (weights / weights.sum(axis=1, keepdims=True)) @ v


@pytest.mark.parametrize("density", [1.0, 0.5], ids=["dense", "sparse"])
def test_online_rows_whose_maximum_keeps_growing_are_exact(density):
  """The online path's lazy pass (offset kept, no rescale) against float64: gentle growth, a
  tile's maximum past the headroom (2**64: rerun rescaling), past float32 (inf: rerun), falling."""
  grid = VideoGrid(4, 8, 16)  # 512 tokens: 4 x 4 tiles of 128
  plan = plan_tiles(grid, density, 128, 128, "aligned", include_sink=False)
  slopes = [6.0, 90.0, 300.0, -40.0]  # per q tile, base-2 logit growth per key tile
  q, k, v = _growing_rows(slopes, grid.tokens)
  assert flags(q, k, v, plan).tolist() == [0]  # logits in the hundreds: online softmax
  out = np.asarray(sparse_attention(q, k, v, plan, backend="pallas"), np.float64)[0, 0]
  want = _float64_attention(q, k, v, np.asarray(plan.dense_mask()))
  # Logits in the thousands lose digits in float32 whoever computes them: the bar per q tile
  # is a float32 dense softmax's own error (a tile lost or counted twice errs by ~1e-2).
  f32 = np.asarray(plan_reference(q, k, v, plan), np.float64)[0, 0]
  assert np.isfinite(out).all()
  for tile in range(plan.num_q_tiles):
    rows = slice(tile * 128, (tile + 1) * 128)
    bar = np.abs(f32 - want)[rows].max()
    assert np.abs(out - want)[rows].max() <= 1.5 * bar + 1e-6, (tile, slopes[tile], bar)
  # The gentle rows weigh every tile they visit: their first tile is 2**-18 of the last.
  assert 2.0 ** (-slopes[0] * (plan.num_kv_tiles - 1)) > 1e-6


def test_online_headroom_leaves_sums_finite():
  """The most a lazy tile's terms may reach: 4,096 terms of 2**room times max |v| stay below
  float32's 2**127 with a term to spare, capped at 2**64, and 0 (plain online) for huge values."""
  q, k, v = (normal((1, 4096, 128), seed) for seed in range(3))
  for scale in (1.0, 2.0 ** 60, 2.0 ** 120):
    got = fixed_offsets(q * 40, k, v * scale, 128 ** -0.5 * LOG2E, every_key_visited=True)
    room = got.headroom.tolist()[0]
    sums = math.log2(4096 * float(jnp.abs(v).max()) * scale)
    assert got.fixed.tolist() == [0]
    assert room == (64 if scale == 1 else 0 if scale == 2.0 ** 120 else room)
    assert room == 0 or sums + room <= 126 < sums + room + 1 or room == 64
  half = fixed_offsets(*(x.astype(jnp.float16) for x in (q, k, v)), 128 ** -0.5 * LOG2E,
                       every_key_visited=True)
  assert half.fixed.tolist() == [0] and half.headroom.tolist() == [14]  # terms cast to float16


def test_inner_kv_step_does_not_change_results():
  plan = plan_tiles(VideoGrid(10, 10, 10), 0.3, 128, 512, "split")
  q, k, v = (normal((1, 2, 1000, 128), seed) for seed in range(3))
  want = np.asarray(plan_reference(q, k, v, plan))
  for step in (128, 256, 512):
    out = sparse_attention(q, k, v, plan, backend="pallas", block_kv_compute=step)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)


def test_shapes_it_cannot_take_are_refused_naming_the_key():
  plan = plan_tiles(GRID, 0.3, 128, 256, "split")
  q = normal((1, 1, GRID.tokens, 64), 0)
  with pytest.raises(ValueError, match="head_dim a multiple of 128.*svg_backend: splash"):
    sparse_attention(q, q, q, plan, backend="pallas")
  q = normal((1, 1, GRID.tokens, 128), 0)
  with pytest.raises(ValueError, match="svg_block_kv_compute must be a multiple of 128 dividing"):
    sparse_attention(q, q, q, plan, backend="pallas", block_kv_compute=384)
  ints = jnp.ones((1, 1, GRID.tokens, 128), jnp.int32)
  with pytest.raises(ValueError, match="floating-point"):
    sparse_attention(ints, ints, ints, plan, backend="pallas")




@pytest.mark.parametrize("mode", ["split", "aligned"])
def test_rolled_kv_steps_give_the_unrolled_results(mode, monkeypatch):
  """Tiles whose scores reach UNROLL_SCORE_BYTES walk their kv steps in a loop, one step or a
  group a turn: fixed, online (lazy pass and rescaling) and masked bodies equal the unrolled
  kernel's and the reference."""
  from maxdiffusion_svg.kernels import pallas  # pylint: disable=import-outside-toplevel
  grid = VideoGrid(6, 10, 10)  # 600 tokens: 3 x 2 tiles of 256 x 512, kv steps of 128
  plan = plan_tiles(grid, 0.4, 256, 512, mode)
  q, k, v = (normal((1, 2, grid.tokens, 128), seed) for seed in range(3))
  q = q * jnp.asarray([1.0, 40.0])[None, :, None, None]  # one fixed head, one online
  assert flags(q, k, v, plan).tolist() == [1, 0]
  run = lambda: np.asarray(sparse_attention(q, k, v, plan, backend="pallas",
                                            block_kv_compute=128))
  assert pallas.unrolled(plan, 128)
  unrolled = run()
  step = 4 * 256 * 128  # one kv step's float32 scores
  # rolled; groups of 2 of the 4 steps; groups of 3 (a group of 1 left over)
  for limit, group in ((0, 1), (5 * step // 2, 2), (7 * step // 2, 3)):
    monkeypatch.setattr(pallas, "UNROLL_SCORE_BYTES", limit)
    assert pallas.kv_unroll(plan, 128) == group and not pallas.unrolled(plan, 128)
    rolled = run()
    np.testing.assert_allclose(rolled, unrolled, atol=1e-6)
    np.testing.assert_allclose(rolled, np.asarray(plan_reference(q, k, v, plan)), atol=2e-4)
