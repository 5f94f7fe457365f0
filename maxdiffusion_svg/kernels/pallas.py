"""Our Pallas TPU kernel: a TilePlan's work list, queries on lanes, a fixed softmax offset.

Faster than Splash's tile body (docs/benchmarks.md): scores are ``K·Qᵀ`` so a query's softmax
statistics are one lane; ``log2(e)`` and the scale are folded into q once; heads passing the
gate (:mod:`maxdiffusion_svg.kernels.fixed_offset`) use a fixed offset, other heads and all
masked tiles online softmax. An online head's mask-free tile first runs with the row's offset
as it stands, no rescale, into a spare accumulator, and keeps it if no query's tile sum passed
``2**headroom``; else (and on a row's first tile) it reruns the tile rescaling. The grid walks
the packed work list
(:mod:`maxdiffusion_svg.kernels.worklist`), one output block per row, written when the row
closes (zeros if it keeps no key); a per-head budget's grid is ragged, ``(cores, steps)``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from maxdiffusion_svg.kernels.fixed_offset import FixedOffsets, fixed_offsets
from maxdiffusion_svg.kernels.row_keys import RowKeys, pad_row_keys
from maxdiffusion_svg.kernels.worklist import (pack_head_work, pack_ragged_work, pack_work,
                                               ragged_cores, unpack_work)
from maxdiffusion_svg.plan.masks import SvgMask
from maxdiffusion_svg.plan.tiles import FULL, MASKED, TilePlan

# A masked logit, and the offset an online row starts from: both finite, so no inf - inf, and
# the start above every masked logit, so a row whose keys are all masked so far adds
# exp2(masked - start) = 0 and keeps l = 0.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_ROW_START = -1e30
# Softmax statistics are (8, block_q): one full vreg row per 128 queries, every sublane the same
# (libtpu schedules the online body shorter than with (1, block_q) rows: docs/benchmarks.md,
# "Figures behind choices in the code").
_STAT_ROWS = 8
# A tile's kv steps are unrolled in groups whose float32 scores (block_q x the group's keys)
# stay under this, the groups in a loop: on a v5e, fully unrolled tiles at or over 16 MiB ran
# 2.3x to 2.8x slower, rolled ones at full speed, groups of three 4 MiB steps 3% faster than
# rolled (docs/benchmarks.md, "Timed on a TPU"); libtpu's static schedule does not see it.
UNROLL_SCORE_BYTES = 16 * 2**20
_NT = (((1,), (1,)), ((), ()))  # k (kv, d) x q (q, d) -> (kv, q)
_TN = (((0,), (0,)), ((), ()))  # v (kv, dv) x p (kv, q) -> (dv, q)


def check_shapes(head_dim: int, dtype, plan: TilePlan, block_kv_compute: int,
                 value_dim: int | None = None) -> None:
  """Refuses what the kernel cannot take, naming the constraint and the key to change."""
  for name, dim in (("head_dim", head_dim), ("the value head_dim", value_dim or head_dim)):
    if dim % 128:
      raise ValueError(f"svg_backend pallas needs {name} a multiple of 128 (lanes), got "
                       f"{dim}: use svg_backend: splash or xla")
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"svg_backend pallas needs floating-point q, k, v, got {dtype}")
  if block_kv_compute % 128 or plan.block_kv % block_kv_compute:
    raise ValueError(f"svg_block_kv_compute must be a multiple of 128 dividing svg_block_kv "
                     f"({plan.block_kv}), got {block_kv_compute}")


# Scalar-prefetched arrays, in order: the work list, each head's fixed-offset flag and its
# online tiles' largest lazy sum (2**headroom), then (ragged calls only) each step's head.
_WORK, _FIXED, _HEADROOM, _HEADS = range(4)


def _locator(per_head: int, ragged: int):
  """``locate(i, t, *scalar_refs) -> (bh, word)`` of grid step ``(i, t)``: shared list, per-head
  lists (``per_head`` steps each) or ragged (``ragged`` steps per core, each naming its head)."""
  if ragged:
    return lambda i, t, *refs: (refs[_HEADS][i * ragged + t], refs[_WORK][i * ragged + t])
  if per_head:
    return lambda i, t, *refs: (i, refs[_WORK][i * per_head + t])
  return lambda i, t, *refs: (i, refs[_WORK][t])


def _kernel(*refs, plan: TilePlan, bkc: int, row_keys: bool, lse: bool, locate, scalars: int,
            unpadded: bool):
  # ``scalars`` prefetched arrays lead (``_WORK`` ...). With ``row_keys`` three inputs follow q,
  # k, v and the fixed offsets: the row's extra keys, values and base-2 logit bias
  # (lane-replicated); with ``lse`` an output follows o: the row's log-sum-exp, lane-major.
  # ``unpadded``: q, k and v are not padded to whole tiles, so the last blocks read past the
  # arrays (undefined values): padding keys are masked and their values zeroed (0 * NaN is NaN),
  # padding queries' lanes are left out of the lazy pass's test; their outputs are not written.
  scalar_refs, (q_ref, k_ref, v_ref, mfix_ref, *refs) = refs[:scalars], refs[scalars:]
  rk_ref = rv_ref = rb_ref = lse_ref = None
  if row_keys:
    rk_ref, rv_ref, rb_ref, *refs = refs
  o_ref, *refs = refs
  if lse:
    lse_ref, *refs = refs
  m_ref, l_ref, tile_l_ref, accs_ref, slot_ref, kept_ref = refs
  bq, bkv = plan.block_q, plan.block_kv
  q_len = plan.q_len or plan.seq_len
  chunks = bkv // bkc
  unroll = kv_unroll(plan, bkc)
  loop_unroll = True if unroll == chunks else unroll  # True: no loop at all
  bh, word = locate(pl.program_id(0), pl.program_id(1), *scalar_refs)
  row, col, kind, first, last = unpack_work(word)
  fixed = scalar_refs[_FIXED][bh] > 0

  rows = m_ref.shape[0]
  wide = lambda x: jnp.broadcast_to(x, (rows, bq))
  live_acc = lambda: accs_ref.at[slot_ref[0]]  # the row's accumulator (the other is the spare)

  @pl.when(first == 1)
  def _open_row():
    slot_ref[0] = 0
    accs_ref[0] = jnp.zeros(accs_ref.shape[1:], accs_ref.dtype)
    l_ref[...] = jnp.zeros_like(l_ref)
    m_ref[...] = wide(jnp.where(fixed, mfix_ref[...], _ROW_START))

  def scores(c):
    k = k_ref[pl.ds(c * bkc, bkc), :]
    return lax.dot_general(k, q_ref[...], _NT, preferred_element_type=jnp.float32)

  def accumulate(c, p, alpha=None, v=None):
    v = v_ref[pl.ds(c * bkc, bkc), :] if v is None else v
    pv = lax.dot_general(v, p.astype(v_ref.dtype), _TN, preferred_element_type=jnp.float32)
    if alpha is None:
      l_ref[...] += wide(p.sum(axis=0, keepdims=True))
      acc_ref = live_acc()
      acc_ref[...] += pv
    else:
      l_ref[...] = alpha * l_ref[...] + wide(p.sum(axis=0, keepdims=True))
      acc_ref = live_acc()
      acc_ref[...] = alpha[0:1] * acc_ref[...] + pv

  def fixed_chunk(c, carry):
    accumulate(c, jnp.exp2(scores(c) - m_ref[0:1]))
    return carry

  def online_chunk(c, carry, keep=None, v=None):
    s = scores(c)
    if keep is not None:
      s = jnp.where(keep, s, _MASK_VALUE)
    m_prev = m_ref[...]
    m_next = jnp.maximum(m_prev, s.max(axis=0, keepdims=True))
    m_ref[...] = m_next
    accumulate(c, jnp.exp2(s - m_next[0:1]), jnp.exp2(m_prev - m_next), v)
    return carry

  def masked_chunk(c, carry):
    q_pos = row * bq + lax.broadcasted_iota(jnp.int32, (1, bq), 1)
    k_pos = col * bkv + c * bkc + lax.broadcasted_iota(jnp.int32, (bkc, 1), 0)
    if unpadded and plan.seq_len % bkv:
      # Only a chunk reading past the keys needs it; a select of (bkc, dv) per masked chunk.
      v = jnp.where(k_pos < plan.seq_len, v_ref[pl.ds(c * bkc, bkc), :], 0)
    else:
      v = None
    if isinstance(plan.mask, SvgMask) and plan.masks_exact:
      # The band |q - k| <= w as one unsigned compare of (k + w) - q <= 2w, with padding keys
      # moved out of every band and the sink as a per-key flag: three operations per logit.
      # (Padding queries need no mask: their rows are sliced off.)
      w = plan.mask.half_width
      k_shift = jnp.where(k_pos < plan.seq_len, k_pos + w, jnp.int32(2**30))
      band = (k_shift - q_pos).astype(jnp.uint32) <= jnp.uint32(2 * w)
      keep = band | (k_pos < plan.mask.sink) if plan.mask.sink else band
    else:
      keep = plan.masked_tile_rule(q_pos, k_pos)
      if unpadded and plan.seq_len % bkv:
        keep = keep & (k_pos < plan.seq_len)
    return online_chunk(c, carry, keep, v)

  @pl.when((kind == FULL) & fixed)
  def _full_fixed():
    lax.fori_loop(0, chunks, fixed_chunk, None, unroll=loop_unroll)

  online_full = (kind == FULL) & jnp.logical_not(fixed)

  @pl.when(online_full & (first == 0))
  def _full_online_lazy():
    # Like the fixed path, with the row's offset as it stands: exact while the tile's terms
    # sum to at most 2**headroom per query (so none exceeds it and the row's sums stay finite),
    # which the sums tell after the fact. The tile adds into the spare accumulator, which
    # becomes the row's only if it held: a tile that broke the headroom leaves the row as it
    # was, one that held cost no copy.
    live = slot_ref[0]
    spare_ref = accs_ref.at[1 - live]

    def lazy_chunk(c, carry):
      p = jnp.exp2(scores(c) - m_ref[0:1])
      pv = lax.dot_general(v_ref[pl.ds(c * bkc, bkc), :], p.astype(v_ref.dtype), _TN,
                           preferred_element_type=jnp.float32)
      part = wide(p.sum(axis=0, keepdims=True))
      if isinstance(c, int) and c == 0:
        spare_ref[...] = accs_ref[live] + pv
        tile_l_ref[...] = part
      else:
        spare_ref[...] += pv
        tile_l_ref[...] += part
      return carry

    if unroll == chunks:
      for c in range(chunks):
        lazy_chunk(c, None)
    else:  # the spare starts as the row's accumulator, then the loop adds every chunk
      spare_ref[...] = accs_ref[live]
      tile_l_ref[...] = jnp.zeros_like(tile_l_ref)
      lax.fori_loop(0, chunks, lazy_chunk, None, unroll=unroll)
    # Compared this way round, NaN sums fail and rerun, as online softmax would run them.
    sums = tile_l_ref[0:1]
    if unpadded and q_len % bq:
      sums = jnp.where(row * bq + lax.broadcasted_iota(jnp.int32, (1, bq), 1) < q_len, sums, 0.0)
    kept_ref[0] = (jnp.max(sums) <= scalar_refs[_HEADROOM][bh]).astype(jnp.int32)

    @pl.when(kept_ref[0] == 1)
    def _commit():
      l_ref[...] += tile_l_ref[...]
      slot_ref[0] = 1 - live

  @pl.when(online_full & ((first == 1) | (kept_ref[0] == 0)))
  def _full_online():
    lax.fori_loop(0, chunks, online_chunk, None, unroll=loop_unroll)

  @pl.when(kind == MASKED)
  def _masked():
    if plan.masks_exact:
      lax.fori_loop(0, chunks, masked_chunk, None, unroll=loop_unroll)
      return
    # Aligned plans mask only the padding keys of the last kv column: whole chunks of real
    # keys run unmasked, the chunk the sequence ends in is masked, padding chunks are skipped.
    real = plan.seq_len - (plan.num_kv_tiles - 1) * bkv
    lax.fori_loop(0, real // bkc, online_chunk, None, unroll=loop_unroll)
    if real % bkc:
      masked_chunk(real // bkc, None)

  @pl.when(last == 1)
  def _close_row():
    if row_keys:  # the row's own keys, in chunks like a tile's, before the row is normalised
      chunk = min(rk_ref.shape[0], bkc)

      def row_key_chunk(c, carry):
        s = lax.dot_general(rk_ref[pl.ds(c * chunk, chunk), :], q_ref[...], _NT,
                            preferred_element_type=jnp.float32)
        s = s + rb_ref[pl.ds(c * chunk, chunk), 0:1]
        m_prev = m_ref[...]
        m_next = jnp.maximum(m_prev, s.max(axis=0, keepdims=True))
        m_ref[...] = m_next
        p = jnp.exp2(s - m_next[0:1])
        alpha = jnp.exp2(m_prev - m_next)
        l_ref[...] = alpha * l_ref[...] + wide(p.sum(axis=0, keepdims=True))
        acc_ref = live_acc()
        acc_ref[...] = alpha[0:1] * acc_ref[...] + lax.dot_general(
            rv_ref[pl.ds(c * chunk, chunk), :], p.astype(rv_ref.dtype), _TN,
            preferred_element_type=jnp.float32)
        return carry

      lax.fori_loop(0, rk_ref.shape[0] // chunk, row_key_chunk, None, unroll=True)
    l = l_ref[0:1]
    out = live_acc()[...] * jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
    o_ref[...] = out.T.astype(o_ref.dtype)
    if lse_ref is not None:
      # Base-2 logits of q prescaled by log2(e): ln sum exp = (m + log2 l) ln 2.
      lse = (m_ref[0:1] + jnp.log2(jnp.where(l > 0, l, 1.0))) * math.log(2.0)
      lse_ref[...] = jnp.where(l > 0, lse, -jnp.inf)


def kv_unroll(plan: TilePlan, block_kv_compute: int) -> int:
  """How many of a tile's kv steps run unrolled together (all of them: no loop; see
  :data:`UNROLL_SCORE_BYTES`)."""
  step_bytes = 4 * plan.block_q * block_kv_compute
  return max(1, min(plan.block_kv // block_kv_compute, -(-UNROLL_SCORE_BYTES // step_bytes) - 1))


def unrolled(plan: TilePlan, block_kv_compute: int) -> bool:
  """Whether a tile's kv steps are all unrolled (no loop in the kernel's body)."""
  return kv_unroll(plan, block_kv_compute) == plan.block_kv // block_kv_compute


def _pad(x: jax.Array, length: int) -> jax.Array:
  return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0)))


def pallas_sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, plan: TilePlan,
                            scale: float, *, interpret: bool, block_kv_compute: int,
                            return_lse: bool = False,
                            row_keys: RowKeys | None = None,
                            head_tiles: jax.Array | None = None,
                            head_steps: int | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Our kernel over ``[B, H, S, D]`` inputs and the plan's visited tiles; ``return_lse`` adds
  float32 ``[B, H, S]`` (``-inf``: row keeps nothing). ``row_keys`` join each row's softmax as it
  closes. ``head_tiles [B, H, num_q_tiles, width]``: each head's own key tiles (aligned plan);
  with ``head_steps`` (a per-head budget) rows may end early (``-1``) and the grid is ragged."""
  b, h, s, d = q.shape
  dv = v.shape[-1]
  check_shapes(d, q.dtype, plan, block_kv_compute, dv)
  bq, bkv = plan.block_q, plan.block_kv
  fold = lambda x: x.reshape(b * h, x.shape[2], x.shape[-1])
  # A ring shard's window holds unused and padding keys: its heads take the sparse gate.
  # (A ragged call's plan holds its widest head's counts, not every head's keys.)
  every_key_visited = (plan.q_len is None and head_steps is None
                       and plan.stats.kept_pairs == s * s)
  offsets: FixedOffsets = fixed_offsets(fold(q), fold(k), fold(v), scale * math.log2(math.e),
                                        every_key_visited=every_key_visited)
  # Where q and k are the plan's own lengths the last blocks read past them (the kernel masks
  # what they read) and write only the real rows: no padded copies of q, k, v and the output.
  unpadded = s == (plan.q_len or plan.seq_len) and k.shape[2] == plan.seq_len
  q_rows = s if unpadded else plan.num_q_tiles * bq
  kv_rows = k.shape[2] if unpadded else plan.num_kv_tiles * bkv
  q_pad = _pad(offsets.q, q_rows)
  k_pad = _pad(fold(k), kv_rows)
  v_pad = _pad(fold(v), kv_rows)
  m_pad = jnp.pad(offsets.m, ((0, 0), (0, 0), (0, q_rows - s)))
  limits = jnp.exp2(offsets.headroom.astype(jnp.float32))  # an online tile's largest sum
  if head_steps is not None:
    cores = ragged_cores(b * h)
    work, heads = pack_ragged_work(plan, head_tiles, head_steps, cores)
    grid, locate = (cores, head_steps), _locator(0, head_steps)
    scalars = (work, offsets.fixed, limits, heads)
  else:
    if head_tiles is None:
      work, per_head = jnp.asarray(pack_work(plan)), 0
    else:
      work = pack_head_work(plan, head_tiles)
      per_head = work.size // (b * h)
    grid, locate = (b * h, per_head or work.size), _locator(per_head, 0)
    scalars = (work, offsets.fixed, limits)

  def located(i, t, refs):
    bh, word = locate(i, t, *refs)
    return bh, unpack_work(word)

  def at_row(i, t, *refs):
    bh, word = located(i, t, refs)
    return bh, word[0], 0

  def at_col(i, t, *refs):
    bh, word = located(i, t, refs)
    return bh, word[1], 0

  def at_row_lanes(i, t, *refs):
    bh, word = located(i, t, refs)
    return bh, 0, word[0]

  extra_specs, extra_args = [], []
  if row_keys is not None:
    row_keys = pad_row_keys(row_keys, block_kv_compute)
    m = row_keys.bias.shape[1]

    def at_row_keys(i, t, *refs):
      bh, word = located(i, t, refs)
      return bh, word[0], 0, 0

    def at_row_bias(i, t, *refs):
      return located(i, t, refs)[1][0], 0, 0

    # Base-2 logits like the kernel's; an unused slot gets the mask value, not -inf.
    bias = np.where(np.isfinite(row_keys.bias), row_keys.bias * math.log2(math.e), _MASK_VALUE)
    extra_specs = [pl.BlockSpec((None, None, m, d), at_row_keys),
                   pl.BlockSpec((None, None, m, dv), at_row_keys),
                   pl.BlockSpec((None, m, 128), at_row_bias)]
    fold_rows = lambda x: x.reshape(b * h, *x.shape[2:])
    extra_args = [fold_rows(row_keys.k).astype(q.dtype), fold_rows(row_keys.v).astype(v.dtype),
                  jnp.asarray(np.broadcast_to(bias.astype(np.float32)[:, :, None],
                                              (*bias.shape, 128)))]

  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(scalars), grid=grid,
      in_specs=[pl.BlockSpec((None, bq, d), at_row), pl.BlockSpec((None, bkv, d), at_col),
                pl.BlockSpec((None, bkv, dv), at_col), pl.BlockSpec((None, 1, bq), at_row_lanes),
                *extra_specs],
      out_specs=[pl.BlockSpec((None, bq, dv), at_row),
                 *([pl.BlockSpec((None, 1, bq), at_row_lanes)] if return_lse else [])],
      scratch_shapes=[pltpu.VMEM((_STAT_ROWS, bq), jnp.float32),  # m: the row's offset
                      pltpu.VMEM((_STAT_ROWS, bq), jnp.float32),  # l: the row's sum
                      pltpu.VMEM((_STAT_ROWS, bq), jnp.float32),  # an online tile's, lazily
                      # the row's accumulator, transposed, and a spare an online tile adds into
                      pltpu.VMEM((2, dv, bq), jnp.float32),
                      pltpu.SMEM((1,), jnp.int32),  # which of the two is the row's
                      pltpu.SMEM((1,), jnp.int32)])  # 1: an online tile's lazy pass held
  out_shape = [jax.ShapeDtypeStruct((b * h, q_rows, dv), q.dtype)]
  if return_lse:
    out_shape.append(jax.ShapeDtypeStruct((b * h, 1, q_rows), jnp.float32))
  outs = pl.pallas_call(
      functools.partial(_kernel, plan=plan, bkc=block_kv_compute, row_keys=row_keys is not None,
                        lse=return_lse, locate=locate, scalars=len(scalars),
                        unpadded=unpadded),
      grid_spec=grid_spec,
      out_shape=out_shape,
      # Every block index comes from the work list and every kv step from the static tile: the
      # checks guard nothing and cost 0.4% on a v5e (docs/benchmarks.md, "Timed on a TPU").
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                           disable_bounds_checks=True),
      interpret=interpret,
      name="svg_pallas_sparse",
  )(*scalars, q_pad, k_pad, v_pad, m_pad, *extra_args)
  out = outs[0][:, :s].reshape(b, h, s, dv)
  if not return_lse:
    return out
  return out, outs[1][:, 0, :s].reshape(b, h, s)
