"""The SVG router: per head, the layout that best approximates dense attention.

Band layouts by MSE against dense on sampled rows (ties: spatial), masks by index arithmetic in
frame-major order; semantic and the band winner by a whole-sequence estimate (:func:`left_out`),
as sampled rows miss the errors at a cluster's edge.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from maxdiffusion_svg.kernels.row_keys import merge, softmax_over
from maxdiffusion_svg.kernels.sampled_rows import masked_lse, masked_rows, row_logits
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.masks import Mask, probe_mask
from maxdiffusion_svg.plan.tiles import TilePlan
from maxdiffusion_svg.routing.compensation import (Centroids, block_means, centroid_log_counts,
                                                   centroids, ordered_block_means, plan_bias,
                                                   skipped_bias)
from maxdiffusion_svg.routing.layouts import (DEFAULT_LAYOUTS, SPATIAL, TEMPORAL, HeadLayout, get,
                                             index, names, registered)
from maxdiffusion_svg.routing.semantic import (SemanticLayout, block_shares, placed_block_means,
                                               token_positions, visited_table)

PROFILE_POOLS = ("prefix", "stratified")
PROFILE_MASKS = ("probe", "execution")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
  """How the router samples query rows."""

  profile_queries: int = 64
  profile_pool: str = "stratified"
  sample_max_row: int = 10_000
  include_sink: bool = True
  profile_masks: str = "execution"  # chosen by measurement: docs/benchmarks.md, "Which masks the router judges by"
  sink_frames: int = 1  # frames the probe mask's sink covers (svg_sink_frames)

  def __post_init__(self):
    for name in ("profile_queries", "sample_max_row"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"svg_{name} must be an integer >= 1, got {value!r}")
    if self.profile_pool not in PROFILE_POOLS:
      raise ValueError(f"svg_profile_pool must be one of {', '.join(PROFILE_POOLS)}, "
                       f"got {self.profile_pool!r}")
    if self.profile_masks not in PROFILE_MASKS:
      raise ValueError(f"svg_profile_masks must be one of {', '.join(PROFILE_MASKS)}, "
                       f"got {self.profile_masks!r}")


@dataclasses.dataclass(frozen=True)
class Routing:
  """Router result: ``layout [B, H]`` layout ids (indices into ``layouts.names()``); ``errors
  [B, H, n_layouts]`` sampled errors (``inf`` for non-candidates and ``own`` tables); ``left_out``,
  same shape: :func:`left_out` estimates, where an ``own`` table competes."""

  layout: jax.Array
  errors: jax.Array
  left_out: jax.Array | None = None

  @property
  def layouts(self) -> jax.Array:
    """Alias of :attr:`layout`."""
    return self.layout

  def chose(self, name: str) -> jax.Array:
    """``bool [B, H]``: the heads routed to layout ``name``."""
    return self.layout == index(name)

  def error(self, name: str) -> jax.Array:
    """``[B, H]``: layout ``name``'s sampled error."""
    return self.errors[..., index(name)]

  @property
  def temporal(self) -> jax.Array:
    """``bool [B, H]``: the heads routed temporal (``route_heads``' answer)."""
    return self.chose(TEMPORAL)

  @property
  def spatial_error(self) -> jax.Array:
    return self.error(SPATIAL)

  @property
  def temporal_error(self) -> jax.Array:
    return self.error(TEMPORAL)

  def info(self) -> dict[str, jax.Array]:
    """The call info's routing entries (:func:`info_keys`)."""
    out = {"layout": self.layout, "errors": self.errors, "temporal": self.temporal}
    for i, layout in enumerate(registered()):
      if layout.band:
        out[f"{layout.name}_error"] = self.errors[..., i]
    return out


def info_keys() -> tuple[str, ...]:
  """The call info's routing entries: ``layout``, ``errors``, ``temporal``, ``<band>_error``."""
  return ("layout", "errors", "temporal") + tuple(
      f"{layout.name}_error" for layout in registered() if layout.band)


jax.tree_util.register_dataclass(Routing, data_fields=["layout", "errors", "left_out"],
                                 meta_fields=[])


def sample_rows(key: jax.Array, seq_len: int, config: RouterConfig) -> jax.Array:
  """Query rows to profile: ``prefix``, uniform with replacement from the first ``sample_max_row``
  tokens; ``stratified``, one from each of ``profile_queries`` equal slices of the sequence."""
  n = config.profile_queries
  if config.profile_pool == "prefix":
    return jax.random.randint(key, (n,), 0, min(config.sample_max_row, seq_len), dtype=jnp.int32)
  offsets = jax.random.uniform(key, (n,))
  return jnp.minimum(((jnp.arange(n) + offsets) * (seq_len / n)).astype(jnp.int32), seq_len - 1)


# (plan, centroids per key tile): the router judges the compensated call that plan will run.
Compensated = tuple[TilePlan, int]


class Sampled(NamedTuple):
  """Sampled rows' float32 queries, logits over all keys, values and dense output."""

  qs: jax.Array
  logits: jax.Array
  v32: jax.Array
  dense: jax.Array


# Rows taken one dynamic slice each, up to this many (more: one gather). On a TPU XLA gave the
# gather q with the heads minor, a copy of all of q a call (1.4 ms of a 720p layer on a v5e); the
# slices read the row-major q the kernels take (docs/benchmarks.md, "A denoising step timed on a
# TPU v5e").
SLICED_ROWS = 256


def take_rows(q: jax.Array, rows: jax.Array) -> jax.Array:
  """``q[:, :, rows]`` for ``[B, H, S, D]`` q and int ``rows [R]``."""
  if rows.shape[0] > SLICED_ROWS:
    return jnp.take(q, rows, axis=2)
  return jnp.concatenate([jax.lax.dynamic_slice_in_dim(q, rows[i], 1, axis=2)
                          for i in range(rows.shape[0])], axis=2)


def sample_dense(q: jax.Array, k: jax.Array, v: jax.Array, rows: jax.Array, scale: float) -> Sampled:
  qs = take_rows(q, rows).astype(jnp.float32)
  logits, v32 = row_logits(qs, k, scale), v.astype(jnp.float32)
  return Sampled(qs, logits, v32, masked_rows(logits, v32, None))


def compensated_rows(qs: jax.Array, exact: jax.Array, lse: jax.Array, rows: jax.Array,
                     grid: VideoGrid, layout: HeadLayout, plan: TilePlan, cents: Centroids,
                     scale: float, visited: jax.Array | None = None) -> jax.Array:
  """``exact`` rows (log-sum-exp ``lse``) merged with the centroids their query tiles skip in
  ``layout``: the plan's skipped tiles, or each head's (``visited [B, H, q_tiles, kv_tiles]``)."""
  tiles = layout.positions(grid, rows) // plan.block_q
  if visited is None:
    bias = jnp.asarray(plan_bias(plan, cents.log_count).T)[:, tiles]  # [N, R]
  else:  # [B, H, N, R]: each head's own skipped sub-blocks
    bias = skipped_bias(~jnp.take(visited, tiles, axis=2), cents.log_count).swapaxes(-1, -2)
  extra, extra_lse = softmax_over(qs, cents.k, cents.v, bias, scale)
  return merge(exact, lse, extra, extra_lse)


def layout_centroids(k: jax.Array, v: jax.Array, grid: VideoGrid, layout: HeadLayout,
                     plan: TilePlan, blocks: int) -> Centroids:
  """Centroids of frame-major ``[B, H, S, D]`` keys placed in band ``layout`` for ``plan``."""
  return centroids(layout.placed(k, grid), layout.placed(v, grid), block_kv=plan.block_kv,
                   blocks=blocks)


def placed_keep(mask: Mask, grid: VideoGrid, layout: HeadLayout, rows: jax.Array,
                keys: jax.Array) -> jax.Array:
  """Which frame-major ``keys`` each frame-major row keeps under ``mask`` placed in ``layout``."""
  return ((rows < mask.seq_len) & (keys < mask.seq_len)
          & mask.contains(layout.positions(grid, rows), layout.positions(grid, keys)))


@dataclasses.dataclass(frozen=True)
class HeadTileMask:
  """Per-head execution masks: ``visited [B, H, num_q_tiles, num_kv_tiles]``, placed order."""

  visited: jax.Array
  block_q: int
  block_kv: int

  def keep(self, rows: jax.Array, grid: VideoGrid, layout: HeadLayout) -> jax.Array:
    """``bool [B, H, R, S]``: keys each head's frame-major ``rows`` keep, placed by ``layout``."""
    keys = jnp.arange(grid.tokens, dtype=jnp.int32)
    row_tiles = layout.positions(grid, rows) // self.block_q
    key_tiles = layout.positions(grid, keys) // self.block_kv
    return jnp.take(jnp.take(self.visited, row_tiles, axis=2), key_tiles, axis=3)


# A TPU's sampled rows: ``(q_rows, k, v, keeps, scale) -> (out, lse)`` with the dense row first
# (:func:`maxdiffusion_svg.kernels.sampled_rows.sampled_rows`); None: the XLA path below.
RowsKernel = Callable[..., tuple[jax.Array, jax.Array]]


def layout_errors(q: jax.Array, k: jax.Array, v: jax.Array, rows: jax.Array, grid: VideoGrid,
                  mask: Mask | HeadTileMask, *, scale: float | None = None,
                  compensation: Compensated | None = None,
                  cents: dict[str, Centroids] | None = None,
                  sampled: Sampled | None = None,
                  layouts: tuple[str, ...] = (SPATIAL, TEMPORAL),
                  rows_kernel: RowsKernel | None = None) -> tuple[jax.Array, ...]:
  """``[B, H]`` MSE against dense of ``rows``' outputs under ``mask`` in each band layout of
  ``layouts``; with ``compensation`` (plan, centroids per key tile), of the compensated outputs.
  ``rows_kernel``: every layout's rows in one pass over the keys (a TPU's), else XLA's."""
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  keys = jnp.arange(grid.tokens, dtype=jnp.int32)[None, :]

  def keep_in(name: str) -> jax.Array:
    if isinstance(mask, HeadTileMask):
      return mask.keep(rows, grid, get(name))
    return placed_keep(mask, grid, get(name), rows[:, None], keys)

  if rows_kernel is not None:
    q_rows = take_rows(q, rows)
    outs, lses = rows_kernel(q_rows, k, v,
                             jnp.stack([keep_in(name) for name in layouts], -3), scale)
    dense, qs = outs[:, :, 0], q_rows.astype(jnp.float32)
    masked = [(outs[:, :, i + 1], lambda i=i: lses[:, :, i + 1]) for i in range(len(layouts))]
  else:
    qs, logits, v32, dense = sampled or sample_dense(q, k, v, rows, scale)
    keeps = [keep_in(name) for name in layouts]
    masked = [(masked_rows(logits, v32, keep), lambda keep=keep: masked_lse(logits, keep))
              for keep in keeps]
  errors = []
  for name, (out, lse) in zip(layouts, masked):
    if compensation is not None:
      plan, blocks = compensation
      layout = get(name)
      layout_cents = (cents or {}).get(name) or layout_centroids(k, v, grid, layout, plan, blocks)
      out = compensated_rows(qs, out, lse(), rows, grid, layout, plan, layout_cents, scale,
                             mask.visited if isinstance(mask, HeadTileMask) else None)
    errors.append(jnp.mean((out - dense) ** 2, axis=(2, 3)))
  return tuple(errors)


# Rows the whole-sequence estimate reads, stratified (every row where the sequence is shorter): a
# row's loss is a share in [0, 1], so a thousand rows pin the mean where 64 squared errors do not.
ESTIMATE_ROWS = 1024
# Keys per centroid the estimate reads: a centroid of many keys blurs their logits towards its
# mean's, most where a layout's blocks mix unlike keys (at 720p, 192-key centroids saw every
# layout skip ~80% of the mass; 16 keys still sent soft moving heads to the wrong layout; 8 did
# not: docs/benchmarks.md, "The router without a margin").
ESTIMATE_KEYS = 8
ROW_CHUNK = 128  # rows whose shares are held at once


def estimate_rows(key: jax.Array, seq_len: int, count: int = ESTIMATE_ROWS) -> jax.Array:
  """``int32 [min(count, seq_len)]``: one row from each of that many equal slices."""
  if count >= seq_len:
    return jnp.arange(seq_len, dtype=jnp.int32)
  offsets = jax.random.uniform(key, (count,))
  return jnp.minimum(((jnp.arange(count) + offsets) * (seq_len / count)).astype(jnp.int32),
                     seq_len - 1)


def left_out(q: jax.Array, rows: jax.Array, row_tiles: jax.Array, visited: jax.Array,
             cents: Centroids, scale: float) -> jax.Array:
  """``float32 [B, H]``: mean over ``rows`` of the softmax share a row loses to the key tiles its
  query tile skips, from key centroids (:func:`maxdiffusion_svg.routing.semantic.block_shares`).
  ``row_tiles``: ``[R]`` or ``[B, H, R]``; ``visited [B or 1, H or 1, num_q_tiles, num_kv_tiles]``.
  Compensated calls use it too (docs/benchmarks.md, "The router without a margin")."""
  b, h = q.shape[:2]
  count = rows.shape[0]
  chunk = math.gcd(count, ROW_CHUNK)  # rows per step: the shares of all rows at once took
  # 1.2 GB more temporaries in the Wan 14B forward (test_wan_aot's semantic bound)
  row_tiles = jnp.broadcast_to(row_tiles, (b, h, count))
  visited = jnp.broadcast_to(visited, (b, h) + visited.shape[2:])
  blocks = cents.log_count.size // visited.shape[-1]

  def lost(part):
    part_rows, part_tiles = part
    qs = jnp.take(q, part_rows, axis=2).astype(jnp.float32)  # [B, H, chunk, D]
    share = block_shares(qs, cents, scale)
    row_visits = jnp.take_along_axis(visited, part_tiles[..., None], axis=2)  # [B, H, chunk, nkv]
    skipped = jnp.repeat(~row_visits, blocks, axis=-1)
    return jnp.sum(jnp.where(skipped, share, 0.0), axis=(-1, -2))

  parts = (rows.reshape(-1, chunk), jnp.moveaxis(row_tiles.reshape(b, h, -1, chunk), 2, 0))
  return jnp.sum(jax.lax.map(lost, parts), axis=0) / count


def layout_left_out(q: jax.Array, k: jax.Array, rows: jax.Array, grid: VideoGrid, plan: TilePlan,
                    semantic: SemanticLayout, layouts: tuple[str, ...], scale: float) -> jax.Array:
  """``float32 [B, H, n_layouts]``: :func:`left_out` of each candidate (else ``inf``)."""
  blocks = plan.block_kv // ESTIMATE_KEYS
  log_count = centroid_log_counts(plan, blocks)
  means = lambda x: block_means(x, block_kv=plan.block_kv, blocks=blocks, seq_len=plan.seq_len)
  visited = jnp.asarray(plan.tile_map() != 0)[None, None]  # every band layout's table
  estimates = []
  for layout in registered():
    if layout.name not in layouts:
      estimates.append(jnp.full(q.shape[:2], jnp.inf, jnp.float32))
    elif not layout.band:
      cents = Centroids(placed_block_means(k, semantic.k_perm, block=plan.block_kv, blocks=blocks,
                                           seq_len=plan.seq_len), None, log_count)
      tiles = jnp.take(token_positions(semantic.q_pos, q.shape[2]), rows, axis=2) // plan.block_q
      estimates.append(left_out(q, rows, tiles, visited_table(semantic.kv_index, plan), cents,
                                scale))
    else:
      placed = (means(k) if layout.to_placed is None else ordered_block_means(
          k, layout.order(grid), block_kv=plan.block_kv, blocks=blocks, seq_len=plan.seq_len))
      tiles = layout.positions(grid, rows) // plan.block_q
      estimates.append(left_out(q, rows, tiles, visited, Centroids(placed, None, log_count), scale))
  return jnp.stack(estimates, -1)


def band_winner(errors: dict[str, jax.Array], layouts: tuple[str, ...], shape: tuple[int, ...]
                ) -> jax.Array | None:
  """``int32 [B, H]``: the lowest-error band layout (ties: lower id), or None if none competes."""
  band = [name for name in names() if name in layouts and get(name).band]
  if not band:
    return None
  winner = jnp.full(shape, index(band[0]), jnp.int32)
  if len(band) == 1:
    return winner
  best = errors[band[0]]
  for name in band[1:]:
    better = errors[name] < best
    winner = jnp.where(better, jnp.int32(index(name)), winner)
    best = jnp.where(better, errors[name], best)
  return winner


def choose_layouts(errors: dict[str, jax.Array], estimates: jax.Array,
                   layouts: tuple[str, ...]) -> jax.Array:
  """``int32 [B, H]``: layout ids. Band candidates by sampled ``errors`` (ties: lower id, spatial);
  an ``own`` table takes a head only where its ``estimates [B, H, n_layouts]`` (:func:`left_out`)
  are below the winner's so far (ties: the band layout)."""
  own = [name for name in names() if name in layouts and not get(name).band]
  if not own:
    raise ValueError("choose_layouts decides where a layout with its own table competes")
  shape = estimates.shape[:2]
  winner = band_winner(errors, layouts, shape)
  if winner is None:
    winner, own = jnp.full(shape, index(own[0]), jnp.int32), own[1:]
  for name in own:
    so_far = jnp.take_along_axis(estimates, winner[..., None], axis=-1)[..., 0]
    winner = jnp.where(estimates[..., index(name)] < so_far, jnp.int32(index(name)), winner)
  return winner


def probe_errors(q: jax.Array, k: jax.Array, v: jax.Array, rows: jax.Array, grid: VideoGrid,
                 *, include_sink: bool = True, scale: float | None = None) -> tuple[jax.Array, jax.Array]:
  """MSE against dense of the spatial and temporal probe outputs of ``rows``: ``[B, H]`` each."""
  return layout_errors(q, k, v, rows, grid, probe_mask(grid, include_sink), scale=scale)


def routing_mask(grid: VideoGrid, router: RouterConfig, plan: TilePlan | None) -> Mask:
  """The mask the router compares layouts under: the probe, or ``plan``'s computed mask."""
  if router.profile_masks == "probe":
    return probe_mask(grid, router.include_sink, router.sink_frames)
  if plan is None:
    raise ValueError("svg_profile_masks=execution needs the call's tile plan (plan=...)")
  return plan.computed_mask


def constants(tree: Any) -> Any:
  """``tree`` with gradients stopped: a chosen layout or tile is fixed, not differentiated."""
  if isinstance(tree, dict):  # by hand: a NamedTuple is rebuilt field by field below
    return {key: constants(value) for key, value in tree.items()}
  if isinstance(tree, tuple):
    values = [constants(value) for value in tree]
    return type(tree)(*values) if hasattr(tree, "_fields") else tuple(values)
  return jax.lax.stop_gradient(tree) if isinstance(tree, jax.Array) else tree


def profile_heads(q: jax.Array, k: jax.Array, v: jax.Array, *, grid: VideoGrid, config: Any,
                  key: jax.Array, scale: float | None = None,
                  plan: TilePlan | None = None, expert: str | None = None,
                  compensation_blocks: int = 0,
                  cents: dict[str, Centroids] | None = None,
                  layouts: tuple[str, ...] | None = None,
                  semantic: SemanticLayout | None = None,
                  head_visited: jax.Array | None = None,
                  rows_kernel: RowsKernel | None = None) -> Routing:
  """The router's decision for frame-major ``[B, H, S, D]`` inputs, with its errors.

  ``config``: a :class:`RouterConfig`, or an object holding one as ``router``; ``plan``: default,
  the config's for ``grid`` and ``expert``; ``compensation_blocks``: 0 off; ``layouts``: default the
  config's, else spatial and temporal (``semantic`` needed among them); ``rows_kernel``: see
  :func:`layout_errors`. Same key, same result."""
  router = getattr(config, "router", config)
  q, k, v, cents, semantic = constants((q, k, v, cents, semantic))
  if q.shape[2] != grid.tokens:
    raise ValueError(f"sequence length {q.shape[2]} does not match grid {grid} "
                     f"({grid.tokens} tokens)")
  if plan is None and router.profile_masks == "execution" and hasattr(config, "plan"):
    plan = config.plan(grid, expert)
  mask = routing_mask(grid, router, plan)
  if head_visited is not None and router.profile_masks == "execution":
    mask = HeadTileMask(jax.lax.stop_gradient(head_visited), plan.block_q, plan.block_kv)
  rows = sample_rows(key, grid.tokens, router)
  compensation = None
  if compensation_blocks and router.profile_masks == "execution":
    compensation = (plan, compensation_blocks)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  layouts = getattr(config, "layouts", DEFAULT_LAYOUTS) if layouts is None else layouts
  band = tuple(name for name in names() if name in layouts and get(name).band)
  errors = dict(zip(band, layout_errors(q, k, v, rows, grid, mask, scale=scale,
                                        compensation=compensation, cents=cents, layouts=band,
                                        rows_kernel=rows_kernel)))
  shape = q.shape[:2]
  stacked = jnp.stack([errors.get(name, jnp.full(shape, jnp.inf, jnp.float32))
                       for name in names()], -1)
  if len(band) == len(layouts):  # band layouts only: the sampled errors decide
    return Routing(band_winner(errors, layouts, shape), stacked)
  if semantic is None or plan is None:
    raise ValueError("a semantic candidate needs its layout (semantic=...) and the call's plan")
  estimates = layout_left_out(q, k, estimate_rows(jax.random.fold_in(key, 1), grid.tokens),
                              grid, plan, semantic, layouts, scale)
  return Routing(choose_layouts(errors, estimates, layouts), stacked, estimates)


def route_heads(q: jax.Array, k: jax.Array, v: jax.Array, *, grid: VideoGrid, config: Any,
                key: jax.Array, scale: float | None = None,
                plan: TilePlan | None = None, expert: str | None = None) -> jax.Array:
  """``bool[B, H]``: True where a head is routed temporal (see :func:`profile_heads`).

  >>> import jax, jax.numpy as jnp
  >>> from maxdiffusion_svg import SvgConfig, VideoGrid, route_heads
  >>> grid = VideoGrid(frames=4, height=8, width=16)  # 512 tokens
  >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 2, grid.tokens, 64))
  >>> config = SvgConfig(density=0.5, block_q=128, block_kv=128)
  >>> route_heads(q, k, v, grid=grid, config=config, key=jax.random.key(1)).shape
  (1, 2)
  """
  return profile_heads(q, k, v, grid=grid, config=config, key=key, scale=scale,
                       plan=plan, expert=expert).temporal
