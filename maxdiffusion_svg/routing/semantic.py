"""The semantic layout (SVG2 on TPU): each head's tokens ordered by k-means cluster of its keys,
with its own tile table, on device in fixed shapes: row ``i`` visits its ``K_i`` key tiles of most
estimated mass (:func:`tile_scores`), ``K_i`` the band plan's, so it costs what a spatial head does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.tiles import TileMode, TilePlan
from maxdiffusion_svg.routing.compensation import (Centroids, block_counts, block_means,
                                                   centroid_log_counts)

CLUSTER_ON = ("keys", "queries_and_keys", "separate")
# Measured (docs/benchmarks.md, "The semantic layout"): one clustering of the keys, its order
# applied to queries, keys and values alike.
DEFAULT_CLUSTER_ON = "keys"
CRITERIA = ("mass", "error")
# The table's criterion without and with compensation (measured: docs/benchmarks.md).
SEMANTIC_CRITERION = {False: "mass", True: "error"}
_POWER_STEPS = 8  # power iterations for the centroids' principal direction
SAMPLE_PER_CLUSTER = 256  # tokens per cluster the k-means updates read (a strided sample)
_COUNT_BLOCK = 128  # tokens per block when counting placed positions
# Tokens that move as one when placed. A TPU gather's cost is per moved row: 720p on a v6e, one
# semantic call by the static schedule is 1.38x the band call with single tokens, 1.21x with 4,
# 1.11x with 8; quality falls as groups grow (docs/benchmarks.md, "The semantic layout"). So the
# groups a placement moves are bounded (MAX_UNITS), which the kernel's cost (S^2) outgrows.
MAX_GROUP = 16
MAX_UNITS = 9_450  # groups a head's placement moves at most: 720p's 75,600 tokens in groups of 8
QUERY_BLOCKS = 8  # sub-blocks per query tile the table's estimate reads


@dataclasses.dataclass(frozen=True)
class SemanticConfig:
  """How a semantic head is clustered and how its tiles are chosen."""

  clusters: int = 32
  iterations: int = 4  # k-means updates from the deterministic start (cold)
  warm_iterations: int = 0  # ... from the previous step's centroids (warm); 0: no warm start
  blocks: int = 8  # sub-blocks per key tile the estimate reads (compensation's, when on)
  cluster_on: str = DEFAULT_CLUSTER_ON
  criterion: str = "mass"  # "error" with compensation on: what the centroids leave
  compensated: bool = False  # the call compensates skipped tiles: value centroids are needed

  def __post_init__(self):
    check_semantic(self.clusters, self.iterations, warm_iterations=self.warm_iterations)
    if self.cluster_on not in CLUSTER_ON:
      raise ValueError(f"cluster_on must be one of {', '.join(CLUSTER_ON)}, got {self.cluster_on!r}")
    if self.criterion not in CRITERIA:
      raise ValueError(f"criterion must be one of {', '.join(CRITERIA)}, got {self.criterion!r}")


def _is_int(x: Any) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_semantic(clusters: Any, iterations: Any, tokens: int | None = None,
                   warm_iterations: Any = 0) -> None:
  """Refuses clusters < 1 (or > ``tokens``), iterations < 1, and warm iterations outside
  ``[0, iterations]`` (0: no warm start)."""
  if not _is_int(clusters) or clusters < 1 or (
      tokens is not None and clusters > tokens):
    most = f" and <= the tokens ({tokens})" if tokens is not None else ""
    raise ValueError(f"svg_semantic_clusters must be an integer >= 1{most}, got {clusters!r}")
  if not _is_int(iterations) or iterations < 1:
    raise ValueError(f"svg_semantic_iterations must be an integer >= 1, got {iterations!r}")
  if not _is_int(warm_iterations) or not 0 <= warm_iterations <= iterations:
    raise ValueError(f"svg_semantic_warm_iterations must be an integer from 0 (no warm start) to "
                     f"svg_semantic_iterations ({iterations}), got {warm_iterations!r}")


def check_plan(plan: TilePlan) -> None:
  """A semantic table replaces an aligned plan's columns, row for row: aligned plans only."""
  if plan.mode is not TileMode.ALIGNED:
    raise ValueError(f"svg_layouts semantic needs svg_tile_mode aligned (its tiles run whole), "
                     f"got {plan.mode.value}")
  if plan.q_len is not None:
    raise ValueError("a semantic table is per call, not per ring window")


class SemanticLayout(NamedTuple):
  """Every head's placement, in groups of ``g = S / perm.shape[-1]`` tokens. ``*_perm [B, H,
  S / g]``: the frame-major group at each placed position; ``*_pos``: its inverse. ``kv_index [B, H,
  num_q_tiles, width]``: each row's key tiles, ascending in the first ``plan.num_visited[i]``.
  ``cents``: placed keys' sub-block centroids; ``clusters [B, H, C, D]``: the next warm start."""

  q_perm: jax.Array
  q_pos: jax.Array
  k_perm: jax.Array
  k_pos: jax.Array
  kv_index: jax.Array
  cents: Centroids
  clusters: jax.Array


class Seed(NamedTuple):
  """A warm start: the previous step's key centroids (float32, broadcastable to ``[B, H, C, D]``)
  and ``ready`` (traced bool; False: the cold start runs)."""

  centroids: jax.Array
  ready: jax.Array


def kmeans(x: jax.Array, clusters: int, iterations: int, sample: int | None = None,
           seed: Seed | None = None,
           warm_iterations: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-head k-means of ``[B, H, S, D]``: ``(assign [B, H, S] int32, centroids [B, H, C, D]
  float32, counts [B, H, C] float32)``. ``iterations`` updates from evenly spaced tokens, or
  ``warm_iterations`` from ``seed.centroids`` where ``seed.ready`` (one ``lax.cond``). Updates and
  ``counts`` read every ``S // sample``-th token; an empty cluster keeps its centroid."""
  b, h, s, d = x.shape
  check_semantic(clusters, iterations, s, warm_iterations if seed is not None else 0)
  if seed is not None and warm_iterations < 1:
    raise ValueError("a warm start (seed) needs svg_semantic_warm_iterations >= 1 (0: none)")
  f32 = jnp.float32
  stride = max(1, s // (sample or clusters * SAMPLE_PER_CLUSTER))
  # Materialised once: fused into each step, the strided read would be redone every time.
  points = jax.lax.optimization_barrier(x[:, :, ::stride])
  start = points[:, :, (np.arange(clusters) * points.shape[2]) // clusters].astype(f32)

  def assign(x, c):
    dots = jnp.einsum("bhsd,bhcd->bhsc", x, c.astype(x.dtype), preferred_element_type=f32)
    return jnp.argmin(jnp.sum(c * c, axis=-1)[:, :, None, :] - 2.0 * dots, axis=-1).astype(jnp.int32)

  def members(a):
    onehot = jax.nn.one_hot(a, clusters, dtype=x.dtype)  # exact 0/1 in any float dtype
    sums = jnp.einsum("bhsc,bhsd->bhcd", onehot, points, preferred_element_type=f32)
    return sums, jnp.sum(onehot, axis=2, dtype=f32)

  def updates(c, count):
    for _ in range(count):  # unrolled: a handful of static steps, no loop in the program
      sums, counts = members(assign(points, c))
      c = jnp.where(counts[..., None] > 0, sums / jnp.maximum(counts, 1.0)[..., None], c)
    return c

  if seed is None:
    c = updates(start, iterations)
  else:
    warm = jnp.broadcast_to(seed.centroids.astype(f32), start.shape)
    c = jax.lax.cond(jnp.asarray(seed.ready, bool), lambda: updates(warm, warm_iterations),
                     lambda: updates(start, iterations))
  return assign(x, c), c, members(assign(points, c))[1]


def cluster_ranks(cents: jax.Array, counts: jax.Array) -> jax.Array:
  """``int32 [B, H, C]``: cluster ranks along the centroids' count-weighted principal direction."""
  w = counts / jnp.maximum(counts.sum(axis=-1, keepdims=True), 1.0)
  centered = cents - jnp.einsum("bhc,bhcd->bhd", w, cents)[:, :, None, :]
  cov = jnp.einsum("bhc,bhcd,bhce->bhde", w, centered, centered)
  vec = jnp.full(cents.shape[:2] + cents.shape[-1:], cents.shape[-1] ** -0.5, cents.dtype)
  for _ in range(_POWER_STEPS):  # a fixed count: deterministic, no data-dependent loop
    vec = jnp.einsum("bhde,bhe->bhd", cov, vec)
    vec = vec / jnp.maximum(jnp.linalg.norm(vec, axis=-1, keepdims=True), 1e-30)
  projection = jnp.einsum("bhcd,bhd->bhc", centered, vec)
  return jnp.argsort(jnp.argsort(projection, axis=-1), axis=-1).astype(jnp.int32)


def placed_positions(slot: jax.Array, slots: int) -> jax.Array:
  """``int32 [B, H, S]``: positions once stably grouped by ``slot [B, H, S]`` in ``[0, slots)``."""
  b, h, s = slot.shape
  blocks = -(-s // _COUNT_BLOCK)
  padded = jnp.pad(slot, ((0, 0), (0, 0), (0, blocks * _COUNT_BLOCK - s)), constant_values=slots)
  onehot = jax.nn.one_hot(padded.reshape(b, h, blocks, _COUNT_BLOCK), slots, dtype=jnp.bfloat16)
  per_block = jnp.sum(onehot, axis=3, dtype=jnp.int32)  # [B, H, blocks, slots]
  before_block = jnp.cumsum(per_block, axis=2) - per_block
  start = jnp.cumsum(per_block.sum(axis=2), axis=-1) - per_block.sum(axis=2)  # [B, H, slots]
  earlier = np.tril(np.ones((_COUNT_BLOCK, _COUNT_BLOCK), np.float32), -1).astype(jnp.bfloat16)
  in_block = jnp.einsum("ij,bhnjc->bhnic", earlier, onehot, preferred_element_type=jnp.float32)
  own = lambda table: jnp.sum(table * onehot, axis=-1)  # each token's own slot's entry
  pos = (own(in_block) + own(before_block[:, :, :, None, :].astype(jnp.float32))
         + own(jnp.broadcast_to(start[:, :, None, None, :], onehot.shape).astype(jnp.float32)))
  return pos.reshape(b, h, -1)[:, :, :s].astype(jnp.int32)


def group_size(grid: VideoGrid, largest: int = MAX_GROUP, units: int = MAX_UNITS) -> int:
  """Tokens placed as one: the least power of two leaving at most ``units`` groups, up to
  ``largest`` and dividing the frame width (a run along one row). 720p: 8; 480p: 4."""
  group = 1
  while grid.tokens > units * group and group < largest and grid.width % (2 * group) == 0:
    group *= 2
  return group


def _rows(x: jax.Array, group: int) -> jax.Array:
  """``[B, H, S / group, group * D]``: each group of tokens as one row (a free reshape)."""
  b, h, s, d = x.shape
  return x.reshape(b, h, s // group, group * d)


def group_means(x: jax.Array, group: int, dtype: Any = None) -> jax.Array:
  """``[B, H, S / group, D]``: each group's mean (float32 sum), in ``dtype`` (default ``x``'s)."""
  d = x.shape[-1]
  rows = _rows(x, group)
  total = sum(rows[..., j * d:(j + 1) * d].astype(jnp.float32) for j in range(group))
  return (total / group).astype(dtype or x.dtype)


def placed_block_means(x: jax.Array, perm: jax.Array, *, block: int, blocks: int,
                       seq_len: int) -> jax.Array:
  """float32 :func:`block_means` of ``x`` placed in ``perm``'s order, from group means where
  sub-blocks hold whole groups (reading placed tokens took 0.9 GiB more at 720p on a v6e)."""
  group = x.shape[2] // perm.shape[-1]
  if group == 1 or (block // blocks) % group or seq_len % group:
    return block_means(gather_tokens(x, perm), block_kv=block, blocks=blocks, seq_len=seq_len)
  placed = jnp.take_along_axis(group_means(x, group, jnp.float32), perm[..., None], axis=2)
  return block_means(placed, block_kv=block // group, blocks=blocks, seq_len=seq_len // group)


def cluster_order(x: jax.Array, clusters: int, iterations: int, group: int = 1,
                  seed: Seed | None = None,
                  warm_iterations: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(perm, pos, centroids)``: ``[B, H, S, D]`` tokens ordered by cluster in groups of ``group``
  (``perm``, ``pos``: ``[B, H, S / group]``); ``centroids [B, H, C, D]`` seed the next call."""
  points = group_means(x, group) if group > 1 else x
  assign, cents, counts = kmeans(points, min(clusters, points.shape[2]), iterations, seed=seed,
                                 warm_iterations=warm_iterations)
  rank = jnp.take_along_axis(cluster_ranks(cents, counts), assign, axis=-1)
  n = points.shape[2]
  perm = jnp.argsort(rank * n + jnp.arange(n, dtype=jnp.int32), axis=-1).astype(jnp.int32)
  return perm, placed_positions(rank, cents.shape[2]), cents


def gather_tokens(x: jax.Array, perm: jax.Array) -> jax.Array:
  """``[B, H, S, D]`` tokens in ``perm [B, H, S / g]`` order, moved in blocks of ``g``."""
  b, h, s, d = x.shape
  rows = _rows(x, s // perm.shape[-1])
  return jnp.take_along_axis(rows, perm[..., None], axis=2).reshape(b, h, s, d)


def token_positions(pos: jax.Array, seq_len: int) -> jax.Array:
  """``int32 [B, H, S]``: each token's placed position, from its group's (``pos [B, H, S / g]``)."""
  group = seq_len // pos.shape[-1]
  within = np.arange(seq_len, dtype=np.int32) % group
  return jnp.repeat(pos, group, axis=-1) * group + within


def block_shares(qbar: jax.Array, cents: Centroids, scale: float, criterion: str = "mass",
                 q_sq: jax.Array | None = None, k_sq: jax.Array | None = None) -> jax.Array:
  """float32 ``[B, H, R, N]``: what each query ``qbar [B, H, R, D]`` loses by skipping each key
  block (centroid ``k̄_n``, ``n_n`` keys): ``softmax_n(s q̄·k̄_n + log n_n)`` (``mass``), or what
  compensation misses (``error``): that times ``expm1(s² |q|² σ²_n / 2)`` for Gaussian keys of
  variance ``σ²_n``, from ``q_sq [B, H, R]`` and ``k_sq [B, H, N, D]`` (mean squares)."""
  f32 = jnp.float32
  logits = scale * jnp.einsum("bhrd,bhnd->bhrn", qbar.astype(f32), cents.k.astype(f32),
                              precision=jax.lax.Precision.HIGHEST) + cents.log_count
  share = jax.nn.softmax(logits, axis=-1)  # [B, H, R, N]
  if criterion == "error":
    var = jnp.maximum(k_sq - jnp.square(cents.k.astype(f32)), 0.0).mean(-1)  # [B, H, N]
    share = share * jnp.expm1(0.5 * scale ** 2 * q_sq[..., None] * var[:, :, None, :])
  return share


def tile_scores(qbar: jax.Array, cents: Centroids, plan: TilePlan, scale: float,
                criterion: str = "mass", q_sq: jax.Array | None = None,
                k_sq: jax.Array | None = None) -> jax.Array:
  """float32 ``[B, H, num_q_tiles, num_kv_tiles]``: what each query tile row loses by skipping each
  key tile: its sub-blocks' :func:`block_shares` (``qbar``: their mean queries), count-weighted."""
  query_blocks = qbar.shape[2] // plan.num_q_tiles
  blocks = cents.log_count.size // plan.num_kv_tiles
  b, h = qbar.shape[:2]
  share = block_shares(qbar, cents, scale, criterion, q_sq, k_sq)
  weight = block_counts(plan.seq_len, plan.num_q_tiles, plan.block_q, query_blocks).astype(np.float32)
  per_tile = share.reshape(b, h, -1, plan.num_kv_tiles, blocks).sum(-1) * weight[:, None]
  return per_tile.reshape(b, h, plan.num_q_tiles, query_blocks, plan.num_kv_tiles).sum(3)


def top_tiles(scores: jax.Array, plan: TilePlan) -> jax.Array:
  """``int32 [B, H, num_q_tiles, width]``: row ``i``'s ``plan.num_visited[i]`` best key tiles,
  ascending, the remaining slots repeating the last (the plan's packing)."""
  counts = plan.num_visited
  width = min(plan.width, plan.num_kv_tiles)
  _, top = jax.lax.top_k(scores, width)
  valid = np.arange(plan.width)[None, :] < counts[:, None]  # [nq, width]
  top = jnp.pad(top, ((0, 0), (0, 0), (0, 0), (0, plan.width - width)))
  top = jnp.sort(jnp.where(valid, top, plan.num_kv_tiles), axis=-1)
  last = jnp.take_along_axis(top, np.maximum(counts - 1, 0)[None, None, :, None], axis=-1)
  return jnp.where(valid, top, last).astype(jnp.int32)


def semantic_layout(q: jax.Array, k: jax.Array, v: jax.Array, plan: TilePlan, config: SemanticConfig,
                    scale: float | None = None, group: int = 1,
                    seed: Seed | None = None) -> SemanticLayout:
  """Every head's semantic placement and table for frame-major ``[B, H, S, D]``, sized by the
  aligned ``plan``; tokens move in groups of ``group`` (dividing ``S``); ``seed``: a warm start."""
  check_plan(plan)
  check_semantic(config.clusters, config.iterations, q.shape[2])
  if q.shape[2] % group:
    raise ValueError(f"semantic groups of {group} tokens do not divide the sequence ({q.shape[2]})")
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  if seed is not None and config.cluster_on != "keys":
    raise ValueError(f"a warm start seeds the clustering of the keys (cluster_on 'keys'), got "
                     f"cluster_on {config.cluster_on!r}")
  # The clusters and the table are choices: no derivative flows through them (the means the
  # compensation merges, below, keep theirs).
  order = lambda x, seed=None: cluster_order(jax.lax.stop_gradient(x), config.clusters,
                                             config.iterations, group, seed,
                                             config.warm_iterations)
  if config.cluster_on == "queries_and_keys":  # one clustering of both: the token's q and k
    k_perm, k_pos, clusters = order(jnp.concatenate([q, k], axis=-1))
  else:
    k_perm, k_pos, clusters = order(k, seed)
  if config.cluster_on == "separate":  # SVG2's: queries and keys each by their own clusters
    q_perm, q_pos, _ = order(q)
  else:
    q_perm, q_pos = k_perm, k_pos
  # Every mean below is of placed tokens, read from the groups' means (placed_block_means).
  key_means = lambda x: placed_block_means(x, k_perm, block=plan.block_kv, blocks=config.blocks,
                                           seq_len=plan.seq_len)
  query_means = lambda x: placed_block_means(x, q_perm, block=plan.block_q, blocks=QUERY_BLOCKS,
                                             seq_len=plan.seq_len)
  cents = Centroids(key_means(k).astype(k.dtype),
                    # the call merges value centroids too where it compensates
                    key_means(v).astype(v.dtype) if config.compensated else None,
                    centroid_log_counts(plan, config.blocks))
  q_sq = k_sq = None
  if config.criterion == "error":
    f32 = jnp.float32
    q_sq = query_means(jnp.sum(jnp.square(q.astype(f32)), -1, keepdims=True))[..., 0]
    k_sq = key_means(jnp.square(k.astype(f32)))
  table = top_tiles(jax.lax.stop_gradient(
      tile_scores(query_means(q), cents, plan, scale, config.criterion, q_sq, k_sq)), plan)
  return SemanticLayout(q_perm, q_pos, k_perm, k_pos, table, cents, clusters)


def visited_table(kv_index: jax.Array, plan: TilePlan) -> jax.Array:
  """``bool [B, H, num_q_tiles, num_kv_tiles]``: which key tiles each head's rows visit."""
  valid = np.arange(plan.width)[None, :] < plan.num_visited[:, None]
  onehot = kv_index[..., None] == np.arange(plan.num_kv_tiles)
  return jnp.any(onehot & valid[..., None], axis=-2)


__all__ = ["CLUSTER_ON", "SemanticConfig", "SemanticLayout", "Seed", "block_shares", "check_semantic",
           "cluster_order", "kmeans", "semantic_layout", "tile_scores", "top_tiles", "visited_table"]
