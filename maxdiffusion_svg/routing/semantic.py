"""The semantic layout (SVG2 on TPU): each head's tokens ordered by k-means cluster, and its own
tile table, chosen on device within the band's budget.

Attention that follows content as it moves is neither local in time (spatial) nor fixed in place
(temporal): a band misses it at any density. Ordered by cluster, tokens that attend to each other
sit in a few tiles. Per head and per call, on device and in fixed shapes:

1. **Cluster**: k-means of the head's keys (:data:`CLUSTER_ON`, chosen by measurement), distances
   as matrix products on the MXU, ``iterations`` updates from a deterministic start (evenly
   spaced tokens), so runs are reproducible.
2. **Order**: clusters placed along the principal direction of their centroids (similar clusters
   next to each other), each cluster contiguous, frame-major inside it. Padding stays at the end.
3. **Table**: each query tile row's key tiles ranked by an estimate of the attention mass it
   puts on them, from its query sub-blocks' mean queries and each key tile's sub-block
   centroids (with compensation on: by the error the centroids would leave, see
   :func:`tile_scores`); row ``i``
   visits the top ``K_i`` tiles, ``K_i`` being what the band plan's row ``i`` visits, so a
   semantic head costs what a spatial head costs in the kernel.

The kernel runs the head's table like any plan (:func:`maxdiffusion_svg.kernels.sparse_attention`
with ``head_tiles``); the output goes back to frame-major order by the inverse permutation.
Nothing here depends on the data's values for shapes: new clusters never recompile.
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
  """Refuses clusters below 1 (or above the tokens, when known), iterations below 1 and warm
  iterations below 0 (0: no warm start) or above the cold ones (a warm start never costs more
  than a cold one)."""
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
  """One call's semantic placement of every head, by groups of ``g = S / perm.shape[-1]``
  consecutive tokens. ``*_perm [B, H, S / g]``: the frame-major group at each placed group
  position; ``*_pos``: the placed position of each frame-major group (its inverse).
  ``kv_index [B, H, num_q_tiles, width]``: each head's key tiles per query tile row, ascending
  in the first ``plan.num_visited[i]`` slots. ``cents``: the placed keys' sub-block centroids.
  ``clusters [B, H, C, D]`` float32: the keys' k-means centroids, the next step's warm start."""

  q_perm: jax.Array
  q_pos: jax.Array
  k_perm: jax.Array
  k_pos: jax.Array
  kv_index: jax.Array
  cents: Centroids
  clusters: jax.Array


class Seed(NamedTuple):
  """A warm start: ``centroids`` broadcastable to ``[B, H, C, D]`` (float32, the previous
  denoising step's k-means centroids of the keys) and ``ready`` (a traced bool: False before
  the first semantic call of a run, when the cold start runs instead)."""

  centroids: jax.Array
  ready: jax.Array


def kmeans(x: jax.Array, clusters: int, iterations: int, sample: int | None = None,
           seed: Seed | None = None,
           warm_iterations: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
  """k-means of ``[B, H, S, D]`` points per head: ``(assign [B, H, S] int32, centroids [B, H, C,
  D] float32, counts [B, H, C] float32)``. Starts from evenly spaced tokens (``iterations``
  updates), or where ``seed.ready`` from ``seed.centroids`` (``warm_iterations`` updates: the
  two counts are branches of one ``lax.cond``, so a warm call runs only its own). The updates
  read every ``S // sample``-th token (default :data:`SAMPLE_PER_CLUSTER` per cluster), the
  final assignment every token; ``counts`` are of the sample. Distances and sums are matrix
  products in ``x``'s dtype with float32 accumulation; an empty cluster keeps its centroid."""
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
  """``int32 [B, H, C]``: each cluster's place along the principal direction of the centroids
  (count-weighted), so that similar clusters are placed next to each other."""
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
  """``int32 [B, H, S]``: where each token goes when tokens are grouped by ``slot [B, H, S]``
  (values in ``[0, slots)``), groups in slot order, tokens in their own order inside a group.
  Counted, not sorted: a group's start, plus its tokens in earlier blocks of 128 (a cumulative
  sum over blocks), plus those earlier in the token's own block (a triangular matrix product
  with the one-hot slots, exact: counts of at most 128)."""
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
  """Tokens that move together: the least power of two that leaves at most ``units`` groups
  (the placement's cost follows the groups it moves), up to ``largest`` and dividing the frame's
  width, so a group is a run of neighbours along one row of one frame. 720p: 8; 480p: 4; a
  sequence of at most ``units`` tokens: 1."""
  group = 1
  while grid.tokens > units * group and group < largest and grid.width % (2 * group) == 0:
    group *= 2
  return group


def _rows(x: jax.Array, group: int) -> jax.Array:
  """``[B, H, S / group, group * D]``: each group of consecutive tokens as one row (no copy;
  a ``[..., group, D]`` view would pad ``group`` sublanes out to a whole tile)."""
  b, h, s, d = x.shape
  return x.reshape(b, h, s // group, group * d)


def group_means(x: jax.Array, group: int, dtype: Any = None) -> jax.Array:
  """``[B, H, S / group, D]``: each group of consecutive tokens' mean, in ``dtype`` (default
  ``x``'s; a float32 sum of lane-aligned slices of its row)."""
  d = x.shape[-1]
  rows = _rows(x, group)
  total = sum(rows[..., j * d:(j + 1) * d].astype(jnp.float32) for j in range(group))
  return (total / group).astype(dtype or x.dtype)


def placed_block_means(x: jax.Array, perm: jax.Array, *, block: int, blocks: int,
                       seq_len: int) -> jax.Array:
  """float32 ``[B, H, tiles * blocks, D]``: :func:`block_means` of ``x`` placed in ``perm``'s
  order (groups of ``g = S / perm.shape[-1]`` tokens), from the groups' means where a sub-block
  holds whole groups: the placed tokens themselves are never read. (Read from them, the means
  of a 720p call's placed queries and keys took 0.9 GiB more temporaries on a v6e.)"""
  group = x.shape[2] // perm.shape[-1]
  if group == 1 or (block // blocks) % group or seq_len % group:
    return block_means(gather_tokens(x, perm), block_kv=block, blocks=blocks, seq_len=seq_len)
  placed = jnp.take_along_axis(group_means(x, group, jnp.float32), perm[..., None], axis=2)
  return block_means(placed, block_kv=block // group, blocks=blocks, seq_len=seq_len // group)


def cluster_order(x: jax.Array, clusters: int, iterations: int, group: int = 1,
                  seed: Seed | None = None,
                  warm_iterations: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(perm, pos, centroids)`` of ``[B, H, S, D]`` tokens ordered by cluster (see module
  docstring), by groups of ``group`` consecutive tokens clustered by their mean (``[B, H, S /
  group]``): ``perm`` by one sort, ``pos`` (its inverse) counted (:func:`placed_positions`);
  ``centroids [B, H, C, D]`` (float32) for the next call's ``seed`` (see :func:`kmeans`)."""
  points = group_means(x, group) if group > 1 else x
  assign, cents, counts = kmeans(points, min(clusters, points.shape[2]), iterations, seed=seed,
                                 warm_iterations=warm_iterations)
  rank = jnp.take_along_axis(cluster_ranks(cents, counts), assign, axis=-1)
  n = points.shape[2]
  perm = jnp.argsort(rank * n + jnp.arange(n, dtype=jnp.int32), axis=-1).astype(jnp.int32)
  return perm, placed_positions(rank, cents.shape[2]), cents


def gather_tokens(x: jax.Array, perm: jax.Array) -> jax.Array:
  """``[B, H, S, D]`` tokens taken in ``perm [B, H, S / g]`` order, by groups of ``g`` consecutive
  tokens (a gather of ``g``-row blocks: on a TPU a gather's cost is per moved block)."""
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
  """float32 ``[B, H, R, N]``: what each query (or sub-block's mean query) ``q̄_r`` (``qbar
  [B, H, R, D]``) would lose by skipping each key block, from the blocks' centroids ``k̄_n``
  (``n_n`` keys): its share ``softmax_n(s q̄_r·k̄_n + log n_n)`` (``mass``), or (``error``) the
  part compensation, which gives a block its centroid's share, would miss: with a block's keys
  Gaussian about ``k̄_n`` with per-coordinate variance ``σ²_n``, the share times ``expm1(s²
  |q|² σ²_n / 2)``; ``q_sq [B, H, R]`` is each query's (mean) ``|q|²``, ``k_sq [B, H, N, D]``
  each key block's mean square. The semantic table and the router share this estimate."""
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
  """float32 ``[B, H, num_q_tiles, num_kv_tiles]``: what each query tile row would lose by
  skipping each key tile. Each query tile is cut into sub-blocks (a tile holds several clusters:
  its mean query would stand for none of them); each sub-block's mean query (``qbar [B, H,
  num_q_tiles * query_blocks, D]``) shares its attention over the key sub-blocks' centroids
  (:func:`block_shares`, by ``criterion``), and a row's score for a key tile is its sub-blocks'
  shares of the tile's blocks, weighted by their queries."""
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
  """The semantic placement and tile table of every head of frame-major ``[B, H, S, D]`` inputs,
  sized by the band ``plan`` (aligned) every head shares; tokens move in groups of ``group``
  (:func:`group_size` of the video grid; ``S`` must be a multiple). ``seed``: the keys' k-means
  starts from the previous denoising step's centroids (``config.warm_iterations`` updates)."""
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
