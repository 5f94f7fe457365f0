"""TPU backward through tokamax's Splash dkv kernel, driven by tables built from a TilePlan.

Its MaskInfo is the forward's table transposed (kv-major, built in O(tiles) with numpy); a kv
tile no query visits still gets one kind-0 step so its ``dk``/``dv`` are written. Backward tiles
divide the forward's. The kernel takes lse and ``di`` as arguments, so any executor's forward
works: ``lse * log2(e)`` (q prescaled as forward) and ``di = rowsum(dout * out) - dlse``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg.kernels.splash import RING_REFUSAL, _smallest_int
from maxdiffusion_svg.kernels.tokamax_splash import load as load_tokamax
from maxdiffusion_svg.kernels.tpu_memory import mask_strategy
from maxdiffusion_svg.plan.target import VMEM_FLAG, VMEM_KEY, Target
from maxdiffusion_svg.plan.tiles import EMPTY, FULL, MASKED, TilePlan
from maxdiffusion_svg.plan.tiling import default_kv_compute

LOG2E = math.log2(math.e)
# What asks for tokamax when a TPU call is differentiated (the forward may be ours).
BACKWARD = "the TPU backward (a gradient of svg attention)"
# A log-sum-exp at or below this (natural log) marks a row that kept no key (Splash's is about
# its mask value, -0.7 * float32 max; others give -inf): it gets +inf, so its p is 0.
_EMPTY_ROW_LSE = -1e30


def backward_blocks(plan: TilePlan, block_kv_compute: int | None = None,
                    bwd_blocks: tuple[int, int, int] | None = None) -> tuple[int, int, int]:
  """``(block_q_dkv, block_kv_dkv, block_kv_dkv_compute)``: ``bwd_blocks`` checked to divide the
  forward's tiles, or (None) the forward's."""
  if bwd_blocks is None:
    bkv_compute = block_kv_compute or default_kv_compute(plan.block_kv)
    return plan.block_q, plan.block_kv, bkv_compute
  bq, bkv, bkv_compute = (int(b) for b in bwd_blocks)
  if bq <= 0 or plan.block_q % bq:
    raise ValueError(f"backward block_q {bq} must divide the plan's block_q {plan.block_q}")
  if bkv <= 0 or plan.block_kv % bkv:
    raise ValueError(f"backward block_kv {bkv} must divide the plan's block_kv {plan.block_kv}")
  if bkv_compute <= 0 or bkv % bkv_compute:
    raise ValueError(f"backward block_kv_compute {bkv_compute} must divide block_kv {bkv}")
  return bq, bkv, bkv_compute


def _sub_tiles(rows: np.ndarray, cols: np.ndarray, kinds: np.ndarray, a: int, b: int):
  """Each ``(row, col, kind)`` tile as its ``a x b`` sub-tiles (row-major within a tile)."""
  i, j = np.divmod(np.arange(a * b, dtype=np.int64), b)
  rows = (rows.astype(np.int64)[:, None] * a + i).reshape(-1)
  cols = (cols.astype(np.int64)[:, None] * b + j).reshape(-1)
  return rows, cols, np.repeat(kinds, a * b)


def backward_mask_strategy(plan: TilePlan, stored: bool = False) -> str | None:
  """``function`` (the masked-tile rule in-kernel, little HBM traffic), or with ``stored`` and an
  aligned plan stored int8 ``[block_kv, block_q]`` blocks (more VMEM: 17 to 28 MB on v6e at
  720p). None: no masked tile."""
  strategy = mask_strategy(plan)
  if stored and strategy == "function":
    raise ValueError("stored backward masks need an aligned plan (one padding pattern)")
  return "function" if strategy == "stored" and not stored else strategy


def plan_dkv_mask_info(plan: TilePlan, bq: int, bkv: int, stored: bool = False
                       ) -> tuple[Any, Callable[..., Any] | None]:
  """Splash's kv-major backward MaskInfo and mask function for backward tiles ``bq x bkv``."""
  a, b = plan.block_q // bq, plan.block_kv // bkv
  rows, cols, kinds = plan.visited_tiles()
  rows, cols, kinds = _sub_tiles(rows, cols, kinds.astype(np.int8), a, b)
  nkv = plan.num_kv_tiles * b
  strategy = backward_mask_strategy(plan, stored)
  blocks = mask_next = q_sequence = mask_fn = None
  if strategy == "stored":
    # Aligned: a masked tile drops only padding keys, which lie in the last forward kv column;
    # its sub-column j keeps keys below seq_len - k0_j: one stored block per sub-column, a
    # sub-tile of only real keys is full, one of only padding keys computes nothing.
    first = (plan.num_kv_tiles - 1) * b
    if ((cols[kinds == MASKED] < first)).any():
      raise ValueError("an aligned plan's masked tiles must lie in its last kv column")
    k0 = (first + np.arange(b)) * bkv
    real = np.clip(plan.seq_len - k0, 0, bkv)
    masked = kinds == MASKED
    sub = np.where(masked, cols - first, 0)
    kinds = np.where(masked & (real[sub] == bkv), FULL, kinds)
    kinds = np.where(masked & (real[sub] == 0), EMPTY, kinds).astype(np.int8)
    mask_next = sub
    # [b, bkv, bq] (kv-major: the dkv kernel's tile is [kv, q]); built with jnp so that, under
    # jit, it is computed per call rather than embedded as a constant.
    keep = jnp.arange(bkv)[None, :] < jnp.asarray(real)[:, None]
    blocks = jnp.broadcast_to(keep[:, :, None], (b, bkv, bq)).astype(jnp.int8)
  elif strategy == "function":
    q_sequence = jnp.arange(plan.num_q_tiles * plan.block_q, dtype=jnp.int32)
    # naive/split: the SVG rule (the forward's ``plan.mask.contains``); aligned: padding keys.
    mask_fn = plan.masked_tile_rule
  # kv-major; a kv tile no query visits still takes one step (kind 0) so its dk/dv are written.
  unvisited = np.setdiff1d(np.arange(nkv), cols)
  rows = np.concatenate([rows, np.zeros(unvisited.size, np.int64)])
  kinds = np.concatenate([kinds, np.full(unvisited.size, EMPTY, np.int8)])
  if mask_next is not None:
    mask_next = np.concatenate([mask_next, np.zeros(unvisited.size, np.int64)])
  cols = np.concatenate([cols, unvisited])
  order = np.lexsort((rows, cols))
  info = load_tokamax(BACKWARD).MaskInfo(
      mask_next=None if mask_next is None else _smallest_int(mask_next[order]),
      active_rows=_smallest_int(cols[order]),  # kv tiles
      active_cols=_smallest_int(rows[order]),  # q tiles
      block_mask=kinds[order].astype(np.int8),
      num_active_blocks=np.array([order.size], np.int32),
      partial_mask_blocks=blocks,
      q_sequence=q_sequence,
  )
  return info, mask_fn


def dkv_table_entries(plan: TilePlan, bwd_blocks: tuple[int, int, int] | None = None) -> int:
  """Backward grid steps per head: visited sub-tiles plus one per unvisited kv sub-tile."""
  bq, bkv, _ = backward_blocks(plan, None, bwd_blocks)
  a, b = plan.block_q // bq, plan.block_kv // bkv
  rows, cols, _ = plan.visited_tiles()
  visited_cols = np.unique((cols.astype(np.int64)[:, None] * b + np.arange(b)).reshape(-1))
  return rows.size * a * b + plan.num_kv_tiles * b - visited_cols.size


def dkv_smem_bytes(plan: TilePlan, bwd_blocks: tuple[int, int, int] | None = None,
                   stored: bool = False) -> int:
  """SMEM bytes of the backward kernel's tables: per entry kv and q tile (narrowest int), kind,
  two int32 row bounds and, for a stored mask, its block."""
  bq, bkv, _ = backward_blocks(plan, None, bwd_blocks)
  width = lambda n: 1 if n <= 127 else 2 if n <= 32767 else 4
  per_entry = (width(plan.num_kv_tiles * (plan.block_kv // bkv))
               + width(plan.num_q_tiles * (plan.block_q // bq)) + 1 + 8
               + (1 if backward_mask_strategy(plan, stored) == "stored" else 0))
  return dkv_table_entries(plan, bwd_blocks) * per_entry + 4


# tokamax's backward kernel in scoped VMEM: its pipelined blocks (q and dout by the query tile, k
# and v by the kv tile, in the inputs' type; dq's float32 block; dk and dv out), double-buffered,
# its float32 dk/dv accumulators, and the per-step temporaries of a query tile against a kv
# compute chunk (float32 logits and their copies in the inputs' type: ``4 + 2 * itemsize`` bytes
# per ``block_q x block_kv_compute`` pair), plus a constant. Set above libtpu's own figures on every
# generation (``bench backward --vmem``, docs/measurements/backward_vmem.json: at most 1.4x them).
BACKWARD_VMEM_BASE = 2 * 2**20
BACKWARD_VMEM_PER_SCORE = {"v4": 1.2, "v5e": 1.0, "v5p": 1.0, "v6e": 1.0, "tpu7x": 1.0}


def dkv_vmem_bound(bwd_blocks: tuple[int, int, int], head_dim: int, dtype: Any,
                   target: Target) -> int:
  """Scoped-VMEM bytes tokamax's backward kernel needs at most at ``bwd_blocks`` on ``target``'s
  generation (an unknown one: the largest)."""
  bq, bkv, bkc = bwd_blocks
  itemsize = jnp.dtype(dtype).itemsize
  d = -(-head_dim // 128) * 128
  blocks = 2 * (2 * bq * d * itemsize + 4 * bkv * d * itemsize + bq * d * 4) + 2 * bkv * d * 4
  known = target.generation.name if target.known else None
  factor = (BACKWARD_VMEM_PER_SCORE[known] if known in BACKWARD_VMEM_PER_SCORE
            else max(BACKWARD_VMEM_PER_SCORE.values()))
  return int(BACKWARD_VMEM_BASE + blocks + factor * bq * bkc * (4 + 2 * itemsize))


def backward_tiles(plan: TilePlan, block_kv_compute: int, head_dim: int, dtype: Any,
                   target: Target) -> tuple[int, int, int]:
  """The forward's tiles, or the largest query tile dividing them whose :func:`dkv_vmem_bound`
  fits ``target``; the forward's if none does (:func:`check_backward_fits` refuses)."""
  candidates = [bq for bq in range(plan.block_q, 127, -128) if plan.block_q % bq == 0]
  for bq in candidates:
    blocks = (bq, plan.block_kv, block_kv_compute)
    if not target.is_tpu or dkv_vmem_bound(blocks, head_dim, dtype, target) <= target.vmem_limit:
      return blocks
  return plan.block_q, plan.block_kv, block_kv_compute


def check_backward_fits(plan: TilePlan, bwd_blocks: tuple[int, int, int], head_dim: int,
                        dtype: Any, target: Target) -> None:
  """Refuses, before compiling, a backward over ``target``'s scoped VMEM or SMEM."""
  if not target.is_tpu:
    return
  load_tokamax(BACKWARD)
  bq, bkv, bkc = bwd_blocks
  where = (f"the backward kernel's (tokamax's Splash dkv) tiles {bq}x{bkv}/{bkc} for forward "
           f"tiles {plan.block_q}x{plan.block_kv}")
  vmem = dkv_vmem_bound(bwd_blocks, head_dim, dtype, target)
  if vmem > target.vmem_limit:
    raise ValueError(
        f"{where} need about {vmem / 2**20:.1f} MiB of VMEM on {target.chip}, over its "
        f"{target.vmem_limit / 2**20:g} MiB scoped-VMEM limit ({target.vmem_source}), even with "
        f"the smallest query tile dividing svg_block_q: lower svg_block_kv or "
        f"svg_block_kv_compute, or raise the limit ({VMEM_KEY} and --{VMEM_FLAG}, to the same KiB)")
  smem = dkv_smem_bytes(plan, bwd_blocks)
  if smem > target.smem:
    raise ValueError(
        f"{where} walk {plan.num_q_tiles}x{plan.num_kv_tiles} tiles whose tables need about "
        f"{smem / 1024:.0f} KiB of SMEM, over {target.chip}'s {target.smem // 1024} KiB: raise "
        f"svg_block_q or svg_block_kv (fewer, larger tiles)")


def splash_sparse_attention_backward(q: jax.Array, k: jax.Array, v: jax.Array, lse: jax.Array,
                                     delta: jax.Array, dout: jax.Array, plan: TilePlan,
                                     scale: float, *, interpret: bool,
                                     block_kv_compute: int | None = None,
                                     bwd_blocks: tuple[int, int, int] | None = None,
                                     stored_mask: bool = False
                                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Float32 ``(dq, dk, dv)`` over ``plan``'s visited tiles by Splash's backward kernel, from any
  forward's natural-log ``lse [B, H, S]`` and ``delta`` (:func:`row_delta`); one table, no
  ``head_tiles``. ``bwd_blocks``: ``(block_q, block_kv, block_kv_compute)`` dividing the plan's
  (None: the forward's). ``stored_mask``: :func:`backward_mask_strategy`. Unchecked, like Splash."""
  if plan.q_len is not None:
    raise ValueError(RING_REFUSAL)
  tk = load_tokamax(BACKWARD)
  s = q.shape[2]
  bq, bkv, bkv_compute = backward_blocks(plan, block_kv_compute, bwd_blocks)
  info, mask_fn = plan_dkv_mask_info(plan, bq, bkv, stored_mask)
  config = tk.kernel.SplashConfig(
      block_q=plan.block_q, block_kv=plan.block_kv,
      block_kv_compute=block_kv_compute or default_kv_compute(plan.block_kv),
      block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv_compute,
      interpret=interpret, q_prescaled_log2e=True)
  pad_q = plan.num_q_tiles * plan.block_q - s
  pad_kv = plan.num_kv_tiles * plan.block_kv - s
  seq = lambda x, n, value=0.0: jnp.pad(x, [(0, 0), (0, 0), (0, n)] + [(0, 0)] * (x.ndim - 3),
                                        constant_values=value)
  # As the forward: q in base 2, rounded once. Padding queries and rows that kept no key get
  # an infinite log-sum-exp, so their p = exp2(qk - inf) = 0 (their dout and delta are 0 too).
  qs = seq((q.astype(jnp.float32) * (scale * LOG2E)).astype(q.dtype), pad_q)
  lse2 = jnp.where(lse > _EMPTY_ROW_LSE, lse.astype(jnp.float32) * LOG2E, jnp.inf)
  lse2 = seq(lse2, pad_q, jnp.inf)
  di = seq(delta.astype(jnp.float32), pad_q)
  do = seq(dout.astype(q.dtype), pad_q)
  ks, vs = seq(k, pad_kv), seq(v, pad_kv)
  info = jax.tree.map(jnp.asarray, info)

  def one(q1, k1, v1, lse1, do1, di1):
    return tk.kernel._splash_attention_bwd_dkv(  # pylint: disable=protected-access
        q1, k1, v1, None, lse1, do1, di1, bq=bq, bkv=bkv, bkv_compute=bkv_compute,
        is_mqa=False, mask_info=info, mask_value=tk.base.DEFAULT_MASK_VALUE,
        mask_function=mask_fn, config=config,
        dkv_mask_sparsity=plan.stats.visited_tile_fraction)

  dqs, dk, dv = jax.vmap(one)(qs, ks, vs, lse2, do, di)
  # The kernel's dq is the derivative by the prescaled q (divided by log2(e)), its dk by k.
  dq = dqs[:, :, :s].astype(jnp.float32) * (scale * LOG2E)
  return dq, dk[:, :, :s].astype(jnp.float32), dv[:, :, :s].astype(jnp.float32)
