"""Compensation (as in SVG-EAR): each key tile a row skips is stood for by its sub-blocks' mean key
and value, biased by ``log(count)`` in the row's softmax. A plan that skips nothing adds nothing.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg.kernels.api import SparseKernel, prepare_kernel
from maxdiffusion_svg.kernels.row_keys import RowKeys
from maxdiffusion_svg.plan.target import target_for_call
from maxdiffusion_svg.plan.tiles import TilePlan
from maxdiffusion_svg.routing.layouts import index, layout_ids, names


def check_compensation(enabled: Any, blocks: Any, block_kv: int | None = None) -> None:
  """Refuses a non-bool ``enabled`` and ``blocks`` < 1 or not dividing ``block_kv`` (if given)."""
  if not isinstance(enabled, bool):
    raise ValueError(f"svg_compensation must be true or false, got {enabled!r}")
  if isinstance(blocks, bool) or not isinstance(blocks, (int, np.integer)) or blocks < 1:
    raise ValueError(f"svg_compensation_blocks must be an integer >= 1 dividing the key tile "
                     f"(svg_block_kv), got {blocks!r}")
  if block_kv is not None and block_kv % blocks:
    divisors = [d for d in (1, 2, 4, 8, 16, 32) if block_kv % d == 0]
    raise ValueError(f"svg_compensation_blocks must divide the key tile svg_block_kv "
                     f"({block_kv}), got {blocks}; e.g. {', '.join(map(str, divisors))}")


class Centroids(NamedTuple):
  """Per sub-block of each key tile: mean key ``k [B, H, N, D]``, mean value ``v [B, H, N, Dv]``
  (q's and v's dtypes) and ``log_count [N]`` (static; ``-inf`` for an all-padding block)."""

  k: jax.Array
  v: jax.Array
  log_count: np.ndarray


def block_counts(seq_len: int, num_kv_tiles: int, block_kv: int, blocks: int) -> np.ndarray:
  """Real keys in each of the ``num_kv_tiles * blocks`` sub-blocks (padding excluded)."""
  size = block_kv // blocks
  starts = np.arange(num_kv_tiles * blocks, dtype=np.int64) * size
  return np.clip(seq_len - starts, 0, size)


def _log(counts: np.ndarray) -> np.ndarray:
  """``float32`` log of key counts, ``-inf`` for none (a block of padding only)."""
  with np.errstate(divide="ignore"):
    return np.log(counts.astype(np.float64)).astype(np.float32)


def centroid_log_counts(plan: TilePlan, blocks: int) -> np.ndarray:
  """``float32 [tiles * blocks]``: log of each sub-block's real keys (``-inf``: padding only)."""
  return _log(block_counts(plan.seq_len, plan.num_kv_tiles, plan.block_kv, blocks))


def block_means(x: jax.Array, *, block_kv: int, blocks: int, seq_len: int | None = None) -> jax.Array:
  """float32 ``[B, H, tiles * blocks, D]``: mean of each sub-block of ``block_kv`` tiles of
  ``[B, H, S, D]`` over its real tokens (the first ``seq_len``, default ``S``)."""
  b, h, s, d = x.shape
  seq_len = s if seq_len is None else seq_len
  tiles = -(-s // block_kv)
  n, size = tiles * blocks, block_kv // blocks
  counts = block_counts(seq_len, tiles, block_kv, blocks)
  group = math.gcd(seq_len, size)  # a divisor of both: its reshape moves no data
  # Sums of ``group`` keys straight from the inputs (float32 accumulation), then of
  # ``size / group`` of those: only the small partial sums are ever padded or copied.
  part = x[:, :, :seq_len].reshape(b, h, seq_len // group, group, d).sum(axis=3, dtype=jnp.float32)
  part = jnp.pad(part, ((0, 0), (0, 0), (0, n * size // group - part.shape[2]), (0, 0)))
  total = part.reshape(b, h, n, size // group, d).sum(axis=3)
  return total / np.maximum(counts, 1).astype(np.float32)[:, None]


def ordered_block_means(x: jax.Array, order: np.ndarray, *, block_kv: int, blocks: int,
                        seq_len: int | None = None) -> jax.Array:
  """:func:`block_means` of ``x[:, :, order]``, never building the placed copy (369 MiB at 720p)."""
  b, h, s, d = x.shape
  seq_len = s if seq_len is None else seq_len
  tiles = -(-s // block_kv)
  n, size = tiles * blocks, block_kv // blocks
  index = np.zeros(n * size, np.int32)
  index[:seq_len] = np.asarray(order)[:seq_len]
  real = np.arange(n * size) < seq_len
  total = jnp.zeros((b, h, n, d), jnp.float32)
  for j in range(size):  # the j-th key of every sub-block
    part = jnp.take(x, index[j::size], axis=2).astype(jnp.float32)
    total = total + jnp.where(real[j::size, None], part, 0.0)
  return total / np.maximum(block_counts(seq_len, tiles, block_kv, blocks), 1).astype(np.float32)[:, None]


def centroids(k: jax.Array, v: jax.Array, *, block_kv: int, blocks: int,
              seq_len: int | None = None) -> Centroids:
  """:class:`Centroids` of ``[B, H, S, D]`` keys and values (see :func:`block_means`)."""
  check_compensation(True, blocks, block_kv)
  s = k.shape[2]
  seq_len = s if seq_len is None else seq_len
  mean = lambda x: block_means(x, block_kv=block_kv, blocks=blocks, seq_len=seq_len)
  counts = block_counts(seq_len, -(-s // block_kv), block_kv, blocks)
  return Centroids(mean(k).astype(k.dtype), mean(v).astype(v.dtype), _log(counts))


def centroids_by_position(k: jax.Array, v: jax.Array, positions: jax.Array, *, seq_len: int,
                          num_kv_tiles: int, block_kv: int, blocks: int,
                          axis_name: str | None = None) -> Centroids:
  """:func:`centroids` of keys out of order or split over devices: ``positions [L]`` are their
  placed positions (``>= seq_len``: padding); sums are psummed over ``axis_name`` if given."""
  b, h, _, _ = k.shape
  n, size = num_kv_tiles * blocks, block_kv // blocks
  counts = block_counts(seq_len, num_kv_tiles, block_kv, blocks)
  ids = jnp.where(positions < seq_len, positions // size, n)  # padding: a dropped segment

  def mean(x):
    total = jax.ops.segment_sum(jnp.moveaxis(x.astype(jnp.float32), 2, 0), ids, n + 1)[:n]
    if axis_name is not None:
      total = jax.lax.psum(total, axis_name)
    return jnp.moveaxis(total, 0, 2) / np.maximum(counts, 1).astype(np.float32)[:, None]

  return Centroids(mean(k).astype(k.dtype), mean(v).astype(v.dtype), _log(counts))


def per_head(cents: dict[str, Centroids], layout: jax.Array) -> Centroids:
  """Each head's centroids from ``cents`` (by name), picked by ``layout [B, H]`` (ids or bool
  temporal flags); every band layout has the same counts."""
  ids = layout_ids(layout)
  first, *rest = [name for name in names() if name in cents]
  k, v = cents[first].k, cents[first].v
  for name in rest:
    pick = (ids == index(name))[:, :, None, None]
    k, v = jnp.where(pick, cents[name].k, k), jnp.where(pick, cents[name].v, v)
  return Centroids(k, v, cents[first].log_count)


@functools.lru_cache(maxsize=64)
def _skipped(plan: TilePlan) -> np.ndarray:
  skipped = plan.tile_map() == 0  # EMPTY
  skipped.setflags(write=False)
  return skipped


def skips_any(plan: TilePlan) -> bool:
  """Whether any query tile row of ``plan`` skips a key tile (a dense plan skips none)."""
  return bool(_skipped(plan).any())


def skipped_bias(skipped: Any, log_count: np.ndarray) -> Any:
  """``float32 [..., rows, tiles * blocks]``: pseudo-key logit bias, ``log(count)`` where the row
  skips the tile, else ``-inf``; ``skipped [..., rows, tiles]``: numpy or on device."""
  xp = jnp if isinstance(skipped, jax.Array) else np
  blocks = log_count.size // skipped.shape[-1]
  return xp.where(xp.repeat(skipped, blocks, axis=-1), log_count, -np.inf).astype(np.float32)


def plan_bias(plan: TilePlan, log_count: np.ndarray) -> np.ndarray:
  """:func:`skipped_bias` of ``plan``'s query tile rows."""
  return skipped_bias(_skipped(plan), log_count)


def _slots(count: int) -> int:
  """Row-key slots for ``count`` keys: at least one, rounded up to 8 (a sublane tile)."""
  return -(-max(1, count) // 8) * 8


def row_key_count(bias: np.ndarray) -> int:
  """The extra keys each query tile row is given: the most any row sees, rounded up to 8."""
  return _slots(int(np.isfinite(bias).sum(axis=1).max()))


def plan_row_keys(plan: TilePlan, blocks: int) -> int:
  """:func:`row_key_count` of ``plan`` at ``blocks`` per key tile; 0 if it skips nothing."""
  if not skips_any(plan):
    return 0
  return row_key_count(plan_bias(plan, centroid_log_counts(plan, blocks)))


def row_keys(cents: Centroids, bias: np.ndarray, dtype: Any) -> RowKeys:
  """Each query tile row's pseudo-keys: the centroids ``bias [num_q_tiles, N]`` admits, packed
  first (unused slots: ``-inf``), picked by an exact static one-hot matmul, not a gather."""
  nq, n = bias.shape
  seen = np.isfinite(bias)
  m = row_key_count(bias)
  order = np.argsort(~seen, axis=1, kind="stable")[:, :m]  # each row's seen pseudo-keys first
  order = np.pad(order, ((0, 0), (0, m - order.shape[1])))  # m may exceed N (rounded up to 8)
  used = np.arange(m)[None, :] < seen.sum(axis=1)[:, None]
  pick = np.zeros((nq, m, n), np.float32)
  rows, slots = np.nonzero(used)
  pick[rows, slots, order[rows, slots]] = 1.0
  select = lambda x: jnp.einsum("tmn,bhnd->bhtmd", pick.astype(x.dtype), x,
                                preferred_element_type=jnp.float32,
                                precision=jax.lax.Precision.HIGHEST).astype(x.dtype)
  return RowKeys(select(cents.k.astype(dtype)), select(cents.v),
                 np.where(used, np.take_along_axis(bias, order, axis=1), -np.inf).astype(np.float32))


def compensated_attention(q: jax.Array, k: jax.Array, v: jax.Array, plan: TilePlan, *,
                          blocks: int, scale: float | None = None,
                          cents: Centroids | None = None, **kernel_kwargs: Any) -> jax.Array:
  """:func:`maxdiffusion_svg.kernels.sparse_attention` over ``plan`` plus the centroids of the tiles
  each row skips (``blocks`` per key tile); ``kernel_kwargs``: for :func:`prepare_kernel`."""
  target = target_for_call(q, k, v, target=kernel_kwargs.pop("target", None))
  return compensated_call(prepare_kernel(plan, target, **kernel_kwargs), q, k, v, blocks=blocks,
                          scale=scale, cents=cents)


def compensated_call(kernel: SparseKernel, q: jax.Array, k: jax.Array, v: jax.Array, *,
                     blocks: int, scale: float | None = None,
                     cents: Centroids | None = None) -> jax.Array:
  """:func:`compensated_attention` through a prepared kernel (its plan's tiles)."""
  plan = kernel.plan
  check_compensation(True, blocks, plan.block_kv)
  if not skips_any(plan):
    return kernel(q, k, v, scale=scale)
  if cents is None:
    cents = centroids(k, v, block_kv=plan.block_kv, blocks=blocks, seq_len=plan.seq_len)
  extra = row_keys(cents, plan_bias(plan, cents.log_count), q.dtype)
  return kernel(q, k, v, scale=scale, row_keys=extra)


def table_row_keys(cents: Centroids, visited: jax.Array, plan: TilePlan, blocks: int,
                   dtype: Any, fewest_visited: int | None = None) -> RowKeys:
  """:func:`row_keys` with each head's own tiles (``visited [B, H, num_q_tiles, num_kv_tiles]``)
  and centroids (``[B, H, N, D]``); ``fewest_visited``: fewest tiles a head's row visits."""
  seen = jnp.repeat(~visited, blocks, axis=-1) & np.isfinite(cents.log_count)  # [B, H, nq, N]
  fewest = int(plan.num_visited.min()) if fewest_visited is None else fewest_visited
  m = min(_slots(int(plan.num_kv_tiles - fewest) * blocks), cents.log_count.size)
  order = jnp.argsort(~seen, axis=-1, stable=True)[..., :m]  # [B, H, nq, m]: seen ones first
  used = jnp.take_along_axis(seen, order, axis=-1)
  pick = lambda x: jnp.take_along_axis(x[:, :, None], order[..., None], axis=3)
  bias = jnp.where(used, jnp.asarray(cents.log_count)[order], -jnp.inf).astype(jnp.float32)
  return RowKeys(pick(cents.k.astype(dtype)), pick(cents.v), bias)
