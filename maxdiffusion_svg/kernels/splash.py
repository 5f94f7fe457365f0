"""TPU path: tokamax's Splash kernel driven by mask information built from a TilePlan.

A TilePlan already is Splash's flat active-tile list, so its MaskInfo is built in O(tiles), with
no ``S x S`` mask; masked tiles take the cheaper of tokamax's two masks (:func:`mask_traffic`).
The only module touching tokamax internals (the public op takes no MaskInfo, runs only on TPU).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg.kernels.tokamax_splash import load as load_tokamax
from maxdiffusion_svg.kernels.tpu_memory import LANES, mask_strategy
from maxdiffusion_svg.plan.tiles import MASKED, TilePlan
from maxdiffusion_svg.plan.tiling import default_kv_compute


def mask_traffic(plan: TilePlan, heads: int) -> dict[str, dict[str, float]]:
  """HBM bytes per call over ``heads`` heads of each way to mask masked tiles: ``function`` (an
  int32 ``[S_pad, 128]`` query index every head reads) or ``stored`` (int8 ``[block_q, block_kv]``
  blocks per distinct pattern, an upper bound, refetched when the pattern changes)."""
  rows, cols, kinds = plan.visited_tiles()
  s, bq, bkv = plan.seq_len, plan.block_q, plan.block_kv
  function = {"bytes": float((1 + heads) * plan.num_q_tiles * bq * LANES * 4)}
  masked = kinds == MASKED
  if not masked.any():
    return {"function": function, "stored": {"bytes": 0.0, "blocks": 0}}
  q0, k0 = rows[masked].astype(np.int64) * bq, cols[masked].astype(np.int64) * bkv
  if plan.masks_exact:
    sink = getattr(plan.mask, "sink", 0)
    keys = np.stack([k0 - q0, np.clip(sink - k0, 0, bkv), np.clip(s - k0, 0, bkv),
                     np.clip(s - q0, 0, bq)], axis=1)
  else:  # aligned: only padding keys are masked
    keys = np.clip(s - k0, 0, bkv)[:, None]
  _, ids = np.unique(keys, axis=0, return_inverse=True)
  ids = ids.reshape(-1)
  distinct = int(ids.max()) + 1
  # Per head the prefetched pattern changes at each new pattern and, going round to the next
  # head, once more if the last pattern is not the first; the very first block is one fetch.
  fetches = heads * (int((ids[1:] != ids[:-1]).sum()) + int(ids[0] != ids[-1])) + 1
  return {"function": function,
          "stored": {"bytes": float((distinct + fetches) * bq * bkv), "blocks": distinct}}


def _smallest_int(a: np.ndarray) -> np.ndarray:
  """Tile tables live in TPU scalar memory: store them as narrow as they fit."""
  for dtype in (np.int8, np.int16):
    if a.size == 0 or a.max() <= np.iinfo(dtype).max:
      return a.astype(dtype)
  return a.astype(np.int32)


def plan_mask_info(plan: TilePlan) -> tuple[Any, Callable[..., Any] | None]:
  """Splash's forward MaskInfo (and in-kernel mask function) for ``plan``."""
  rows, cols, kinds = plan.work_list()
  strategy = mask_strategy(plan)
  blocks = mask_next = q_sequence = mask_fn = None
  if strategy == "stored":
    # Every masked tile of an aligned plan is in the last kv column and drops the same
    # padding keys: one block serves them all, fetched once. Built with jnp so that, under
    # jit, it is computed per call rather than embedded as a constant in the executable.
    last_k0 = (plan.num_kv_tiles - 1) * plan.block_kv
    keep = jnp.arange(plan.block_kv) < plan.seq_len - last_k0
    blocks = jnp.broadcast_to(keep, (1, plan.block_q, plan.block_kv)).astype(jnp.int8)
    mask_next = np.zeros(rows.size, np.int8)
  elif strategy == "function":
    q_sequence = jnp.arange(plan.num_q_tiles * plan.block_q, dtype=jnp.int32)
    # A bound method of the frozen mask: hashable, as Splash keys compilation on it.
    mask_fn = plan.mask.contains
  info = load_tokamax().MaskInfo(
      mask_next=mask_next,
      active_rows=_smallest_int(rows),
      active_cols=_smallest_int(cols),
      block_mask=kinds.astype(np.int8),
      num_active_blocks=np.array([rows.size], np.int32),
      partial_mask_blocks=blocks,
      q_sequence=q_sequence,
  )
  return info, mask_fn


# Splash runs whole sequences; a ring shard's rows against its window of keys need ours or XLA.
RING_REFUSAL = ("svg_backend splash cannot run a ring shard's rows (ulysses_shards leaves a ring "
                "on this mesh): use svg_backend pallas (the TPU default) or xla")


def splash_sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, plan: TilePlan,
                            scale: float, *, interpret: bool,
                            block_kv_compute: int | None = None,
                            return_lse: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Splash over ``[B, H, S, D]`` inputs and the plan's tiles; ``return_lse`` adds float32
  ``[B, H, S]`` (natural log; very negative, not ``-inf``, for an empty row). Unchecked:
  :func:`maxdiffusion_svg.kernels.sparse_attention` checks VMEM and SMEM first."""
  if plan.q_len is not None:
    raise ValueError(RING_REFUSAL)
  tk = load_tokamax()
  s = q.shape[2]
  info, mask_fn = plan_mask_info(plan)
  # q_prescaled_log2e: the kernel works in base 2; folding log2(e) into the softmax scale
  # here rounds a bfloat16 q once instead of twice.
  config = tk.kernel.SplashConfig(
      block_q=plan.block_q, block_kv=plan.block_kv,
      block_kv_compute=block_kv_compute or default_kv_compute(plan.block_kv),
      interpret=interpret, q_prescaled_log2e=True)
  kernel = tk.kernel.SplashAttentionKernel(
      jax.tree.map(jnp.asarray, info), None, config=config, is_mqa=False, save_residuals=return_lse,
      mask_value=tk.base.DEFAULT_MASK_VALUE, mask_function=mask_fn,
      fwd_mask_sparsity=plan.stats.visited_tile_fraction, dkv_mask_sparsity=1.0)
  pad_q = plan.num_q_tiles * plan.block_q - s
  pad_kv = plan.num_kv_tiles * plan.block_kv - s
  qs = (q.astype(jnp.float32) * (scale * math.log2(math.e))).astype(q.dtype)
  qs = jnp.pad(qs, ((0, 0), (0, 0), (0, pad_q), (0, 0)))
  ks = jnp.pad(k, ((0, 0), (0, 0), (0, pad_kv), (0, 0)))
  vs = jnp.pad(v, ((0, 0), (0, 0), (0, pad_kv), (0, 0)))
  out = jax.vmap(kernel)(qs, ks, vs)
  if not return_lse:
    return out[:, :, :s].astype(q.dtype)
  out, stats = out
  return out[:, :, :s].astype(q.dtype), stats["logsumexp"][:, :, :s].astype(jnp.float32)
