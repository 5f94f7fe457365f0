"""Splash's backward kernel (interpreted on the CPU) driven by a TilePlan's transposed tables.

Its ``(dq, dk, dv)`` must equal the XLA flash-style backward's
(:func:`maxdiffusion_svg.kernels.backward.sparse_attention_backward`, itself held to a float64
dense reference in ``test_gradients``) for every tile mode on a padded grid, with backward
tiles equal to or dividing the forward's, given the XLA executor's natural-log log-sum-exp;
a log-sum-exp cotangent folded into ``delta`` is checked against float64 dense autodiff.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxdiffusion_svg.kernels import sparse_attention
from maxdiffusion_svg.kernels.backward import sparse_attention_backward
from maxdiffusion_svg.kernels.splash_backward import (backward_blocks, backward_mask_strategy,
                                                      dkv_smem_bytes, dkv_table_entries,
                                                      plan_dkv_mask_info,
                                                      splash_sparse_attention_backward)
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.tiles import EMPTY, FULL, MASKED, _pack_rows, plan_tiles

GRID = VideoGrid(5, 6, 7)  # 210 tokens: 82 real keys in the last 128-token tile
SPARSE = VideoGrid(9, 8, 10)  # 720 tokens: 6 x 6 tiles, 16-21 of them skipped
SHORT_TAIL = VideoGrid(4, 6, 7)  # 168 tokens: the last 64-key backward tile is all padding
MODES = ("naive", "split", "aligned")


def inputs(grid, dim=64, heads=2, seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  shape = (1, heads, grid.tokens, dim)
  return [jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(4)]


def forward(q, k, v, plan):
  return sparse_attention(q, k, v, plan, backend="xla", return_lse=True)


def both(plan, q, k, v, dout, dlse=None, **kw):
  out, lse = forward(q, k, v, plan)
  delta = jnp.einsum("bhsd,bhsd->bhs", dout.astype(jnp.float32), out.astype(jnp.float32))
  if dlse is not None:
    delta = delta - dlse
  scale = q.shape[-1] ** -0.5
  got = splash_sparse_attention_backward(q, k, v, lse, delta, dout, plan, scale, interpret=True,
                                         **kw)
  want = sparse_attention_backward(q, k, v, lse, delta, dout, plan, scale)
  return got, want


def assert_close(got, want, atol):
  for name, a, b in zip("qkv", got, want):
    assert a.dtype == jnp.float32 and a.shape == b.shape, name
    assert float(jnp.abs(b).max()) > 0.1, name  # a gradient that could fail
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=2e-5,
                               err_msg=f"d{name}")


def without_kv_column(plan, col):
  """``plan`` with no tile in kv column ``col``: a kv tile whose dk/dv no query reaches."""
  rows, cols, kinds = plan.visited_tiles()
  keep = cols != col
  kv_index, kind, counts = _pack_rows(rows[keep], cols[keep], kinds[keep], plan.num_q_tiles)
  return dataclasses.replace(plan, kv_index=kv_index, kind=kind, num_visited=counts)


@pytest.mark.parametrize("mode", MODES)
def test_matches_xla_backward_on_padded_grid(mode):
  plan = plan_tiles(GRID, 0.3, 128, 128, mode)
  q, k, v, dout = inputs(GRID)
  got, want = both(plan, q, k, v, dout)
  assert_close(got, want, 2e-5)


SLOW = pytest.mark.full  # slow duplicates, left to the full tier (CI time)


@pytest.mark.parametrize("mode,stored,bwd_blocks", [
    pytest.param("naive", False, None, marks=SLOW), ("naive", False, (64, 64, 64)),
    ("split", False, (128, 64, 32)), pytest.param("aligned", False, None, marks=SLOW),
    ("aligned", False, (128, 64, 32)), pytest.param("aligned", True, None, marks=SLOW),
    ("aligned", True, (64, 64, 64))])
def test_sparse_plan_and_backward_tiles_dividing_forward_tiles(mode, stored, bwd_blocks):
  plan = plan_tiles(SPARSE, 0.1, 128, 128, mode)
  assert (plan.tile_map() == EMPTY).sum() >= 16
  q, k, v, dout = inputs(SPARSE, dim=128, seed=1)
  got, want = both(plan, q, k, v, dout, bwd_blocks=bwd_blocks, stored_mask=stored)
  assert_close(got, want, 2e-5)


@pytest.mark.parametrize("mode", ["split", "aligned"])
def test_unvisited_kv_tile_gets_zero_dk_dv(mode):
  plan = without_kv_column(plan_tiles(SPARSE, 0.1, 128, 128, mode), 2)
  assert not (plan.tile_map()[:, 2] != EMPTY).any()
  q, k, v, dout = inputs(SPARSE, seed=2)
  got, want = both(plan, q, k, v, dout)
  assert_close(got, want, 2e-5)
  for d in got[1:]:
    assert not np.asarray(d[:, :, 256:384]).any()


def test_aligned_backward_tile_of_padding_only():
  plan = plan_tiles(SHORT_TAIL, 0.3, 128, 128, "aligned")
  info, fn = plan_dkv_mask_info(plan, 64, 64, stored=True)
  assert fn is None and info.q_sequence is None
  # Last forward kv column: keys 128..167 real. Sub-column 2 (128..191) keeps 40 keys, sub-column
  # 3 (192..255) none: its sub-tiles compute nothing, but stay in the table to write dk/dv.
  kv, kinds = np.asarray(info.active_rows), np.asarray(info.block_mask)
  assert set(kinds[kv == 3]) == {EMPTY} and set(kinds[kv == 2]) == {MASKED}
  blocks = np.asarray(info.partial_mask_blocks)
  assert blocks.shape == (2, 64, 64) and blocks[0].sum(0).tolist() == [40] * 64
  assert not blocks[1].any()
  assert dkv_table_entries(plan, (64, 64, 64)) == kv.size
  widths = 1 + 1 + 1 + 8 + 1  # kv tile, q tile, kind, two int32 bounds, stored block
  assert dkv_smem_bytes(plan, (64, 64, 64), stored=True) == kv.size * widths + 4
  q, k, v, dout = inputs(SHORT_TAIL, seed=3)
  for stored in (True, False):
    got, want = both(plan, q, k, v, dout, bwd_blocks=(64, 64, 64), stored_mask=stored)
    assert_close(got, want, 2e-5)


def test_mask_strategies():
  aligned = plan_tiles(GRID, 0.3, 128, 128, "aligned")
  split = plan_tiles(GRID, 0.3, 128, 128, "split")
  # The backward computes the aligned padding rule in-kernel unless asked to store it.
  assert backward_mask_strategy(aligned) == "function"
  assert backward_mask_strategy(aligned, stored=True) == "stored"
  assert backward_mask_strategy(split) == "function"
  with pytest.raises(ValueError, match="aligned"):
    backward_mask_strategy(split, stored=True)
  info, fn = plan_dkv_mask_info(aligned, 128, 128)
  assert info.partial_mask_blocks is None and info.mask_next is None
  assert info.q_sequence.shape == (256,)
  q, k = np.arange(256)[:, None], np.arange(256)[None, :]
  np.testing.assert_array_equal(np.broadcast_to(fn(q, k), (256, 256)),
                                np.broadcast_to(k < 210, (256, 256)))


def test_dkv_table_is_the_transposed_plan():
  plan = plan_tiles(SPARSE, 0.1, 128, 128, "split")
  info, fn = plan_dkv_mask_info(plan, 128, 128)
  assert fn == plan.masked_tile_rule and info.partial_mask_blocks is None
  kv, qt, kinds = (np.asarray(x).astype(int) for x in
                   (info.active_rows, info.active_cols, info.block_mask))
  assert np.all(np.diff(kv) >= 0)  # kv-major: each kv tile's q tiles contiguous
  table = np.zeros((plan.num_q_tiles, plan.num_kv_tiles), int)
  table[qt, kv] = kinds
  np.testing.assert_array_equal(table, plan.tile_map())
  assert int(info.num_active_blocks[0]) == kv.size == dkv_table_entries(plan)
  assert set(np.unique(kinds)) <= {MASKED, FULL}


def test_bfloat16():
  plan = plan_tiles(GRID, 0.3, 128, 128, "split")
  q, k, v, dout = inputs(GRID, dtype=jnp.bfloat16, seed=4)
  got, want = both(plan, q, k, v, dout)
  # Splash accumulates dq over kv tiles in the inputs' dtype; both round p and ds to bfloat16.
  assert_close(got, want, 2e-2)


@pytest.mark.parametrize("mode", ["naive", "aligned"])
def test_lse_cotangent_against_float64_dense(mode):
  """``loss = sum(out * w) + sum(lse * u)``: ``u`` enters only through ``delta``."""
  plan = plan_tiles(GRID, 0.3, 128, 128, mode)
  q, k, v, w = inputs(GRID, seed=5)
  u = jnp.asarray(np.random.default_rng(6).standard_normal(q.shape[:3]), jnp.float32)
  got, want = both(plan, q, k, v, w, dlse=u)
  assert_close(got, want, 2e-5)
  mask = plan.dense_mask()

  def loss(q, k, v):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = jnp.where(mask, s, -jnp.inf)
    out = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)
    return (out * w).sum() + (jax.nn.logsumexp(s, axis=-1) * u).sum()

  with jax.enable_x64(True):
    ref = jax.grad(loss, argnums=(0, 1, 2))(*(np.asarray(x, np.float64) for x in (q, k, v)))
    ref = [np.asarray(g) for g in ref]
  for name, a, b in zip("qkv", got, ref):
    np.testing.assert_allclose(np.asarray(a), b, atol=2e-5, rtol=2e-5, err_msg=f"d{name}")


def test_splash_forward_lse_feeds_the_backward():
  """The Splash forward's own residuals (natural-log lse) round-trip through the backward."""
  from maxdiffusion_svg.kernels.splash import splash_sparse_attention
  plan = plan_tiles(GRID, 0.3, 128, 128, "aligned")
  q, k, v, dout = inputs(GRID, seed=7)
  scale = q.shape[-1] ** -0.5
  out, lse = splash_sparse_attention(q, k, v, plan, scale, interpret=True, return_lse=True)
  delta = jnp.einsum("bhsd,bhsd->bhs", dout, out)
  got = splash_sparse_attention_backward(q, k, v, lse, delta, dout, plan, scale, interpret=True)
  want = sparse_attention_backward(q, k, v, lse, delta, dout, plan, scale)
  assert_close(got, want, 2e-5)


def test_empty_row_lse_weighs_nothing():
  """A row whose lse says it kept nothing (Splash's large negative value, or -inf) gets no
  gradient, as in the XLA backward, whatever its delta."""
  plan = plan_tiles(GRID, 0.3, 128, 128, "naive")
  q, k, v, dout = inputs(GRID, seed=8)
  out, lse = forward(q, k, v, plan)
  lse = lse.at[:, 0, 5].set(-jnp.inf).at[:, 1, 7].set(-2.3e38)
  delta = jnp.einsum("bhsd,bhsd->bhs", dout, out)
  scale = q.shape[-1] ** -0.5
  dq, dk, dv = splash_sparse_attention_backward(q, k, v, lse, delta, dout, plan, scale,
                                                interpret=True)
  assert np.isfinite(np.asarray(dk)).all() and np.isfinite(np.asarray(dv)).all()
  assert not np.asarray(dq[:, 0, 5]).any() and not np.asarray(dq[:, 1, 7]).any()


def test_backward_blocks_must_divide_forward_tiles():
  plan = plan_tiles(GRID, 0.3, 128, 128, "split")
  assert backward_blocks(plan, 64) == (128, 128, 64)
  assert backward_blocks(plan, None, (64, 128, 64)) == (64, 128, 64)
  for bad in [(96, 128, 128), (128, 96, 96), (128, 128, 96), (256, 128, 128)]:
    with pytest.raises(ValueError, match="must divide"):
      backward_blocks(plan, None, bad)


@SLOW  # tests/kernels/test_gradients.py differentiates Splash calls through sparse_attention itself
def test_under_jit_as_a_custom_vjp_backward():
  """Wired as gradient.py would: Splash forward, this backward, traced under jit and grad."""
  from maxdiffusion_svg.kernels.splash import splash_sparse_attention
  plan = plan_tiles(SPARSE, 0.1, 128, 128, "aligned")
  q, k, v, w = inputs(SPARSE, seed=9)
  scale = q.shape[-1] ** -0.5

  @jax.custom_vjp
  def attend(q, k, v):
    return splash_sparse_attention(q, k, v, plan, scale, interpret=True, return_lse=True)

  def fwd(q, k, v):
    out, lse = attend(q, k, v)
    return (out, lse), (q, k, v, out, lse)

  def bwd(res, ct):
    q, k, v, out, lse = res
    dout, dlse = ct
    delta = jnp.einsum("bhsd,bhsd->bhs", dout.astype(jnp.float32), out.astype(jnp.float32))
    dq, dk, dv = splash_sparse_attention_backward(q, k, v, lse, delta - dlse, dout, plan, scale,
                                                  interpret=True, bwd_blocks=(128, 64, 64))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

  attend.defvjp(fwd, bwd)
  u = jnp.asarray(np.random.default_rng(10).standard_normal(q.shape[:3]), jnp.float32)

  def loss(attention):
    def f(q, k, v):
      out, lse = attention(q, k, v)
      return (out * w).sum() + (lse * u).sum()
    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

  got = loss(attend)(q, k, v)
  want = loss(lambda q, k, v: sparse_attention(q, k, v, plan, backend="xla", return_lse=True))(
      q, k, v)
  assert_close(got, want, 3e-5)


def test_a_backward_whose_tables_overflow_smem_is_refused_when_differentiated():
  """At 1440p, 512x512 tiles: our kernel's forward tables fit a v6e's 1 MiB of SMEM (474 KB),
  the backward's kv-major list (1.5 MB) does not; the refusal comes when a gradient is traced,
  naming the keys, and inference is unaffected."""
  from maxdiffusion_svg.kernels.splash_backward import check_backward_fits
  from maxdiffusion_svg.plan.geometry import grid_for_resolution
  from maxdiffusion_svg.plan.target import tpu_target
  v6e = tpu_target("v6e")
  plan = plan_tiles(grid_for_resolution("1440p"), 0.3, 512, 512, "aligned")
  assert dkv_smem_bytes(plan) > v6e.smem
  with pytest.raises(ValueError, match="SMEM.*svg_block_q or svg_block_kv"):
    check_backward_fits(plan, (512, 512, 256), 128, jnp.bfloat16, v6e)
  check_backward_fits(plan_tiles(grid_for_resolution("1440p"), 0.3, 3328, 1536, "aligned"),
                      (3328, 1536, 256), 128, jnp.bfloat16, v6e)
  x = jax.ShapeDtypeStruct((1, 1, plan.seq_len, 128), jnp.bfloat16)
  call = lambda q, k, v: sparse_attention(q, k, v, plan, backend="pallas", target=v6e)
  jax.eval_shape(call, x, x, x)  # the forward fits
  with pytest.raises(ValueError, match="backward kernel's .* SMEM"):
    jax.eval_shape(jax.grad(lambda q, k, v: call(q, k, v).astype(jnp.float32).sum()), x, x, x)


def test_the_backward_vmem_bound_holds_libtpus_figures():
  """Every compiled point (``bench backward --vmem``): libtpu's scoped VMEM for tokamax's
  backward kernel is under our bound, and the bound is not loose (at most 1.5x)."""
  import json
  import pathlib
  from maxdiffusion_svg.kernels.splash_backward import dkv_vmem_bound
  from maxdiffusion_svg.plan.target import tpu_target
  path = pathlib.Path(__file__).parents[2] / "docs" / "measurements" / "backward_vmem.json"
  rows = json.loads(path.read_text())["rows"]
  assert {r["chip"] for r in rows} == {"v4", "v5e", "v5p", "v6e", "tpu7x"}
  for r in rows:
    need = r["compiler_bytes"]
    bound = dkv_vmem_bound((r["block_q"], r["block_kv"], r["block_kv_compute"]), 128, r["dtype"],
                           tpu_target(r["chip"]))
    assert need and need <= bound <= 1.5 * need, (r, bound / 2**20)


def test_the_backward_takes_the_largest_query_tile_that_fits():
  from maxdiffusion_svg.kernels.splash_backward import backward_tiles, dkv_vmem_bound
  from maxdiffusion_svg.plan.geometry import grid_for_resolution
  from maxdiffusion_svg.plan.target import tpu_target
  plan = plan_tiles(grid_for_resolution("720p"), 0.3, 3328, 1536, "aligned")
  assert backward_tiles(plan, 256, 128, jnp.bfloat16, tpu_target("v6e")) == (3328, 1536, 256)
  v5e = tpu_target("v5e")  # 16 MiB: the forward's query tile does not fit, half of it does
  assert dkv_vmem_bound((3328, 1536, 256), 128, jnp.bfloat16, v5e) > v5e.vmem_limit
  assert backward_tiles(plan, 256, 128, jnp.bfloat16, v5e) == (1664, 1536, 256)
