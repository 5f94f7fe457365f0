"""TPU path: tokamax's Splash kernel driven by mask information built from a TilePlan.

Splash's forward kernel runs a compacted grid over a flat list of active tiles
(``active_rows``/``active_cols``), with a mask-free body for full tiles (kind 2) and a
masked body for partial ones (kind 1), whose mask it computes in-kernel from a
``mask_function`` of (query, key) indices. A TilePlan is that list already, so the
MaskInfo is a reshuffle of the plan's arrays in O(tiles): no ``S x S`` mask, no host
pass over tiles. This is the only module that touches tokamax internals (the public
op takes no MaskInfo and refuses to run off TPU).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tokamax._src.ops.experimental.tpu.splash_attention import base as splash_base
from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as splash
from tokamax._src.ops.experimental.tpu.splash_attention.splash_attention_mask_info import MaskInfo

from maxdiffusion_svg.tiles import MASKED, TilePlan


@dataclasses.dataclass(frozen=True)
class _TileMaskFunction:
  """The plan's masked-tile rule as a hashable callable (Splash keys compilation on it)."""

  plan_mask: Any
  exact: bool
  seq_len: int

  def __call__(self, q: jax.Array, k: jax.Array) -> jax.Array:
    if self.exact:
      return self.plan_mask.contains(q, k)
    return k < self.seq_len


def _smallest_int(a: np.ndarray) -> np.ndarray:
  """Tile tables live in TPU scalar memory: store them as narrow as they fit."""
  for dtype in (np.int8, np.int16):
    if a.size == 0 or a.max() <= np.iinfo(dtype).max:
      return a.astype(dtype)
  return a.astype(np.int32)


def plan_mask_info(plan: TilePlan) -> tuple[MaskInfo, _TileMaskFunction | None]:
  """Splash's forward MaskInfo (and in-kernel mask function) for ``plan``."""
  rows, cols, kinds = plan.visited_tiles()
  # A row with no visited tile still needs one (do-nothing) step so its output is written.
  empty_rows = np.setdiff1d(np.arange(plan.num_q_tiles, dtype=np.int32), rows)
  if empty_rows.size:
    order = np.argsort(np.concatenate([rows, empty_rows]), kind="stable")
    rows = np.concatenate([rows, empty_rows])[order]
    cols = np.concatenate([cols, np.zeros_like(empty_rows)])[order]
    kinds = np.concatenate([kinds, np.zeros(empty_rows.size, kinds.dtype)])[order]
  has_masked = bool((kinds == MASKED).any())
  info = MaskInfo(
      mask_next=None,
      active_rows=_smallest_int(rows),
      active_cols=_smallest_int(cols),
      block_mask=kinds.astype(np.int8),
      num_active_blocks=np.array([rows.size], np.int32),
      partial_mask_blocks=None,
      q_sequence=np.arange(plan.num_q_tiles * plan.block_q, dtype=np.int32) if has_masked else None,
  )
  mask_fn = _TileMaskFunction(plan.mask, plan.masks_exact, plan.seq_len) if has_masked else None
  return info, mask_fn


def splash_sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, plan: TilePlan,
                            scale: float, *, interpret: bool,
                            block_kv_compute: int | None = None) -> jax.Array:
  """Attention of ``[B, H, S, D]`` inputs through Splash, visiting only the plan's tiles."""
  b, h, s, _ = q.shape
  info, mask_fn = plan_mask_info(plan)
  config = splash.SplashConfig(block_q=plan.block_q, block_kv=plan.block_kv,
                               block_kv_compute=block_kv_compute or plan.block_kv,
                               interpret=interpret)
  kernel = splash.SplashAttentionKernel(
      jax.tree.map(jnp.asarray, info), None, config=config, is_mqa=False, save_residuals=False,
      mask_value=splash_base.DEFAULT_MASK_VALUE, mask_function=mask_fn,
      fwd_mask_sparsity=plan.stats.visited_tile_fraction, dkv_mask_sparsity=1.0)
  pad_q = plan.num_q_tiles * plan.block_q - s
  pad_kv = plan.num_kv_tiles * plan.block_kv - s
  qs = (q.astype(jnp.float32) * scale).astype(q.dtype)  # Splash does not scale logits
  qs = jnp.pad(qs, ((0, 0), (0, 0), (0, pad_q), (0, 0)))
  ks = jnp.pad(k, ((0, 0), (0, 0), (0, pad_kv), (0, 0)))
  vs = jnp.pad(v, ((0, 0), (0, 0), (0, pad_kv), (0, 0)))
  out = jax.vmap(kernel)(qs, ks, vs)
  return out[:, :, :s].astype(q.dtype)
