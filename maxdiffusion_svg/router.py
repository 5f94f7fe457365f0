"""The SVG router: per head, is attention better approximated spatially or temporally?

A few query rows are sampled; their attention output is computed densely over all keys
and under one mask placed in each layout (frame-major = spatial, temporal-major =
temporal); each head takes the layout whose output is closer to dense (mean squared
error, float32; ties go to spatial). The mask is either the reference SVG router's fixed
*probe* (about two frames either side, whatever the density) or the *execution* mask,
the one the kernel will run (the plan's, tile-rounded in ``aligned`` mode). Masks are
evaluated in the original frame-major order by index arithmetic, so routing needs no
permutation and no ``S x S`` array: its cost is ``rows x S`` per head.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from maxdiffusion_svg.compensation import Centroids, centroids, plan_bias
from maxdiffusion_svg.geometry import Layout, VideoGrid, layout_positions, to_temporal_major
from maxdiffusion_svg.kernels.row_keys import merge, softmax_over
from maxdiffusion_svg.layouts import DEFAULT_LAYOUTS, LAYOUTS, SEMANTIC, SPATIAL, TEMPORAL
from maxdiffusion_svg.masks import Mask, PlacedMask, probe_mask
from maxdiffusion_svg.semantic import SemanticLayout, token_positions, visited_table
from maxdiffusion_svg.tiles import TilePlan

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
  """Router result: ``temporal[B, H]`` (True = temporal), each candidate layout's error
  (``inf`` for a layout not among the candidates) and ``layout[B, H]``, each head's layout id
  (an index into :data:`maxdiffusion_svg.layouts.LAYOUTS`)."""

  temporal: jax.Array
  spatial_error: jax.Array
  temporal_error: jax.Array
  layout: jax.Array | None = None
  semantic_error: jax.Array | None = None

  @property
  def layouts(self) -> jax.Array:
    """``int32 [B, H]``: the layout ids (from the temporal flags where none were recorded)."""
    return self.temporal.astype(jnp.int32) if self.layout is None else self.layout


jax.tree_util.register_dataclass(
    Routing, data_fields=["temporal", "spatial_error", "temporal_error", "layout", "semantic_error"],
    meta_fields=[])


def sample_rows(key: jax.Array, seq_len: int, config: RouterConfig) -> jax.Array:
  """Query rows to profile.

  ``prefix``: uniform, with replacement, from the first ``sample_max_row`` tokens (the
  reference SVG router). ``stratified``: one row from each of ``profile_queries`` equal
  slices of the whole sequence, so every frame is seen.
  """
  n = config.profile_queries
  if config.profile_pool == "prefix":
    return jax.random.randint(key, (n,), 0, min(config.sample_max_row, seq_len), dtype=jnp.int32)
  offsets = jax.random.uniform(key, (n,))
  return jnp.minimum(((jnp.arange(n) + offsets) * (seq_len / n)).astype(jnp.int32), seq_len - 1)


def _masked_output(logits: jax.Array, v: jax.Array, keep: jax.Array | None) -> jax.Array:
  if keep is not None:
    logits = jnp.where(keep, logits, -jnp.inf)
  return jnp.einsum("bhrk,bhkd->bhrd", jax.nn.softmax(logits, axis=-1), v,
                    precision=jax.lax.Precision.HIGHEST)


# (plan, centroids per key tile): the router judges the compensated call that plan will run.
Compensated = tuple[TilePlan, int]


class Sampled(NamedTuple):
  """The sampled rows' queries (float32), logits over every key, values and dense output: what
  every candidate layout's error is measured against (computed once per call)."""

  qs: jax.Array
  logits: jax.Array
  v32: jax.Array
  dense: jax.Array


def sample_dense(q: jax.Array, k: jax.Array, v: jax.Array, rows: jax.Array, scale: float) -> Sampled:
  f32 = jnp.float32
  qs = jnp.take(q, rows, axis=2).astype(f32)
  logits = jnp.einsum("bhrd,bhkd->bhrk", qs, k.astype(f32),
                      precision=jax.lax.Precision.HIGHEST) * scale
  v32 = v.astype(f32)
  return Sampled(qs, logits, v32, _masked_output(logits, v32, None))


def compensated_rows(qs: jax.Array, exact: jax.Array, lse: jax.Array, rows: jax.Array,
                     grid: VideoGrid, layout: Layout, plan: TilePlan, cents: Centroids,
                     scale: float) -> jax.Array:
  """What a compensated call gives ``rows``: ``exact`` (their softmax over the kept keys, with
  its log-sum-exp ``lse``) merged with the centroids of the key tiles each row's query tile
  skips in ``layout`` (``cents``: that layout's)."""
  tiles = layout_positions(grid, layout, rows) // plan.block_q
  bias = jnp.asarray(plan_bias(plan, cents.log_count).T)[:, tiles]  # [N, R]
  extra, extra_lse = softmax_over(qs, cents.k, cents.v, bias, scale)
  return merge(exact, lse, extra, extra_lse)


def layout_centroids(k: jax.Array, v: jax.Array, grid: VideoGrid, layout: Layout,
                     plan: TilePlan, blocks: int) -> Centroids:
  """Centroids of ``[B, H, S, D]`` frame-major keys as ``plan``'s call would see them placed."""
  placed = (lambda x: x) if layout is Layout.FRAME_MAJOR else (lambda x: to_temporal_major(x, grid))
  return centroids(placed(k), placed(v), block_kv=plan.block_kv, blocks=blocks)


def layout_errors(q: jax.Array, k: jax.Array, v: jax.Array, rows: jax.Array, grid: VideoGrid,
                  mask: Mask, *, scale: float | None = None,
                  compensation: Compensated | None = None,
                  cents: dict[Layout, Centroids] | None = None,
                  sampled: Sampled | None = None) -> tuple[jax.Array, jax.Array]:
  """MSE against dense of ``rows``' outputs under ``mask`` placed frame-major (spatial) and
  temporal-major (temporal): ``[B, H]`` each. With ``compensation`` (the plan and centroids
  per key tile), each output is the compensated one that plan's call would give (``cents``:
  each layout's centroids, where the caller has them)."""
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  qs, logits, v32, dense = sampled or sample_dense(q, k, v, rows, scale)
  keys = jnp.arange(grid.tokens, dtype=jnp.int32)[None, :]
  errors = []
  for layout in (Layout.FRAME_MAJOR, Layout.TEMPORAL_MAJOR):
    keep = PlacedMask(mask, grid, layout).contains(rows[:, None], keys)
    out = _masked_output(logits, v32, keep)
    if compensation is not None:
      plan, blocks = compensation
      lse = jax.nn.logsumexp(jnp.where(keep, logits, -jnp.inf), axis=-1)
      layout_cents = (cents or {}).get(layout) or layout_centroids(k, v, grid, layout, plan, blocks)
      out = compensated_rows(qs, out, lse, rows, grid, layout, plan, layout_cents, scale)
    errors.append(jnp.mean((out - dense) ** 2, axis=(2, 3)))
  return errors[0], errors[1]


def semantic_errors(q: jax.Array, k: jax.Array, v: jax.Array, rows: jax.Array, plan: TilePlan,
                    semantic: SemanticLayout, *, scale: float | None = None,
                    compensation_blocks: int = 0, sampled: Sampled | None = None) -> jax.Array:
  """MSE against dense of ``rows``' outputs under each head's semantic order and tile table, as
  its call will run them (compensated, with ``compensation_blocks``): ``[B, H]``. Membership
  is a lookup of each row's and key's placed tile in the head's ``[q_tiles, kv_tiles]`` table."""
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  qs, logits, v32, dense = sampled or sample_dense(q, k, v, rows, scale)
  visited = visited_table(semantic.kv_index, plan)  # [B, H, nq, nkv]
  q_pos = token_positions(semantic.q_pos, q.shape[2])
  row_tiles = jnp.take(q_pos, rows, axis=2) // plan.block_q  # [B, H, R]
  row_visits = jnp.take_along_axis(visited, row_tiles[..., None], axis=2)  # [B, H, R, nkv]
  key_tiles = token_positions(semantic.k_pos, k.shape[2]) // plan.block_kv  # [B, H, S]
  keep = jnp.take_along_axis(row_visits, jnp.broadcast_to(
      key_tiles[:, :, None, :], row_visits.shape[:3] + key_tiles.shape[-1:]), axis=3)
  out = _masked_output(logits, v32, keep)
  if compensation_blocks:
    cents = semantic.cents
    lse = jax.nn.logsumexp(jnp.where(keep, logits, -jnp.inf), axis=-1)
    blocks = cents.log_count.size // plan.num_kv_tiles  # the layout's own centroids
    skipped = jnp.repeat(~row_visits, blocks, axis=-1)  # [B, H, R, N]
    bias = jnp.where(skipped, cents.log_count, -jnp.inf)
    extra, extra_lse = softmax_over(qs, cents.k, cents.v, jnp.swapaxes(bias, -1, -2), scale)
    out = merge(out, lse, extra, extra_lse)
  return jnp.mean((out - dense) ** 2, axis=(2, 3))


# A semantic head must show at most this share of the best static layout's error on the sampled
# rows: its errors sit in fewer rows (a cluster's edge), so a few samples flatter it (measured:
# docs/benchmarks.md, "The semantic layout"; 0.25 = 6 dB).
SEMANTIC_MARGIN = 0.25


def choose_layouts(errors: dict[str, jax.Array], layouts: tuple[str, ...]) -> jax.Array:
  """``int32 [B, H]``: each head's layout id, the candidate with the least error, semantic's
  counted as if :data:`SEMANTIC_MARGIN` times larger where a static layout competes (ties: the
  first in :data:`LAYOUTS` order, spatial before temporal before semantic)."""
  margin = SEMANTIC_MARGIN if set(layouts) - {SEMANTIC} else 1.0
  weight = {SEMANTIC: 1.0 / margin}
  stacked = jnp.stack([errors[name] * weight.get(name, 1.0) if name in layouts
                       else jnp.full_like(errors[SPATIAL], jnp.inf)
                       for name in LAYOUTS[:max(LAYOUTS.index(n) for n in layouts) + 1]], axis=-1)
  return jnp.argmin(stacked, axis=-1).astype(jnp.int32)


def probe_errors(q: jax.Array, k: jax.Array, v: jax.Array, rows: jax.Array, grid: VideoGrid,
                 *, include_sink: bool = True, scale: float | None = None) -> tuple[jax.Array, jax.Array]:
  """MSE against dense of the spatial and temporal probe outputs of ``rows``: ``[B, H]`` each."""
  return layout_errors(q, k, v, rows, grid, probe_mask(grid, include_sink), scale=scale)


def routing_mask(grid: VideoGrid, router: RouterConfig, plan: TilePlan | None) -> Mask:
  """The mask the router compares layouts under: the probe, or ``plan``'s computed mask."""
  if router.profile_masks == "probe":
    return probe_mask(grid, router.include_sink)
  if plan is None:
    raise ValueError("svg_profile_masks=execution needs the call's tile plan (plan=...)")
  return plan.computed_mask


def constants(tree: Any) -> Any:
  """``tree`` with no derivative through its arrays: what decides a layout or a tile is a
  choice, not a function to differentiate (a gradient sees the chosen mask as fixed)."""
  if isinstance(tree, dict):  # by hand: layouts key the centroids, and enums do not sort
    return {key: constants(value) for key, value in tree.items()}
  if isinstance(tree, tuple):
    values = [constants(value) for value in tree]
    return type(tree)(*values) if hasattr(tree, "_fields") else tuple(values)
  return jax.lax.stop_gradient(tree) if isinstance(tree, jax.Array) else tree


def profile_heads(q: jax.Array, k: jax.Array, v: jax.Array, *, grid: VideoGrid, config: Any,
                  key: jax.Array, scale: float | None = None,
                  plan: TilePlan | None = None, expert: str | None = None,
                  compensation_blocks: int = 0,
                  cents: dict[Layout, Centroids] | None = None,
                  layouts: tuple[str, ...] | None = None,
                  semantic: SemanticLayout | None = None) -> Routing:
  """The router's decision for ``[B, H, S, D]`` inputs (frame-major), with its two errors.

  ``config`` is a :class:`RouterConfig` or anything with a ``router`` attribute holding one
  (e.g. ``SvgConfig``). Execution masks need the call's tile plan: ``plan`` when given, else
  the one an ``SvgConfig`` makes for ``grid`` (and ``expert``'s density), as its kernel would.
  The same key gives the same flags. With ``compensation_blocks`` (centroids per key tile, 0:
  off) and execution masks, each layout is judged by the compensated output its call gives
  (``cents``: each layout's centroids, where the caller has them). ``layouts``: the candidate
  layouts (default: the config's ``layouts``, else spatial and temporal); ``semantic`` (each
  head's semantic order and table) is required where semantic is among them.
  """
  router = getattr(config, "router", config)
  q, k, v, cents, semantic = constants((q, k, v, cents, semantic))
  if q.shape[2] != grid.tokens:
    raise ValueError(f"sequence length {q.shape[2]} does not match grid {grid} "
                     f"({grid.tokens} tokens)")
  if plan is None and router.profile_masks == "execution" and hasattr(config, "plan"):
    plan = config.plan(grid, expert)
  mask = routing_mask(grid, router, plan)
  rows = sample_rows(key, grid.tokens, router)
  compensation = None
  if compensation_blocks and router.profile_masks == "execution":
    compensation = (plan, compensation_blocks)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  sampled = sample_dense(q, k, v, rows, scale)  # shared by every candidate
  spatial, temporal = layout_errors(q, k, v, rows, grid, mask, scale=scale,
                                    compensation=compensation, cents=cents, sampled=sampled)
  layouts = getattr(config, "layouts", DEFAULT_LAYOUTS) if layouts is None else layouts
  if layouts == (SPATIAL, TEMPORAL):  # today's router, unchanged
    return Routing(temporal < spatial, spatial, temporal)
  errors = {SPATIAL: spatial, TEMPORAL: temporal}
  semantic_error = jnp.full_like(spatial, jnp.inf)
  if SEMANTIC in layouts:
    if semantic is None or plan is None:
      raise ValueError("a semantic candidate needs its layout (semantic=...) and the call's plan")
    semantic_error = errors[SEMANTIC] = semantic_errors(
        q, k, v, rows, plan, semantic, scale=scale,
        compensation_blocks=compensation_blocks if compensation is not None else 0,
        sampled=sampled)
  layout = choose_layouts(errors, layouts)
  return Routing(layout == LAYOUTS.index(TEMPORAL),
                 jnp.where(SPATIAL in layouts, spatial, jnp.inf),
                 jnp.where(TEMPORAL in layouts, temporal, jnp.inf), layout, semantic_error)


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
