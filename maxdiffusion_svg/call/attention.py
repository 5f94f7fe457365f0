"""``svg_attention``: route -> place -> sparse kernel -> restore, on one device's heads. Every
decision made before the data is made once, in :func:`maxdiffusion_svg.call.prepared.prepare`;
placement is a per-head select among the layouts' orders, so re-routing never recompiles."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.budgets.per_layer import levels
from maxdiffusion_svg.call.prepared import Branch, PreparedCall, prepare
from maxdiffusion_svg.kernels.api import SparseKernel, prepare_kernel
from maxdiffusion_svg.kernels.fixed_offset import BASE2_SCALE, base2_factor, scaled
from maxdiffusion_svg.kernels.sampled_rows import sampled_rows, sampled_rows_xla
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.target import Target, target_for_call
from maxdiffusion_svg.plan.tiles import TilePlan
from maxdiffusion_svg.routing.compensation import (Centroids, centroids, compensated_call, per_head,
                                                   table_row_keys)
from maxdiffusion_svg.routing.layouts import SEMANTIC, get, index, layout_ids, names
from maxdiffusion_svg.routing.router import Routing, RowsKernel, layout_centroids, profile_heads
from maxdiffusion_svg.routing.semantic import (Seed, SemanticLayout, gather_tokens, semantic_layout,
                                               visited_table)


def _moved(layouts: tuple[str, ...] | None) -> list[str]:
  """The band layouts among ``layouts`` (default: all) whose order is not frame-major."""
  return [name for name in names() if (layouts is None or name in layouts)
          and get(name).band and get(name).to_placed is not None]


def _reorder_heads(x: jax.Array, layout: jax.Array, moves: list[tuple[int, Callable[..., Any]]]
                   ) -> jax.Array:
  """``[B, H, S, D]`` with each head whose layout id is a move's reordered by it, the rest as
  they are. One head at a time, in place: a head that keeps its order costs nothing, where
  reordering every head and selecting per head read and wrote each array several times over."""
  if not moves:
    return x
  ids = layout_ids(layout)
  b, h = x.shape[:2]
  heads = jnp.asarray(x).reshape(b * h, *x.shape[2:])  # a NumPy input cannot take a traced index
  branch = jnp.zeros((b * h,), jnp.int32)
  for i, (layout_id, _) in enumerate(moves):
    branch = jnp.where(jnp.broadcast_to(ids, (b, h)).reshape(-1) == layout_id, i + 1, branch)

  def one(i: jax.Array, out: jax.Array) -> jax.Array:
    def moved(fn: Callable[..., Any]) -> Callable[[jax.Array], jax.Array]:
      return lambda out: jax.lax.dynamic_update_index_in_dim(out, fn(heads[i]), i, 0)
    return jax.lax.switch(branch[i], [lambda out: out] + [moved(fn) for _, fn in moves], out)

  return jax.lax.fori_loop(0, b * h, one, heads).reshape(x.shape)


def place(x: jax.Array, layout: jax.Array, grid: VideoGrid,
          layouts: tuple[str, ...] | None = None) -> jax.Array:
  """``[B, H, S, D]``: each head in its band layout's order (``layout [B, H]``: ids or bool
  temporal flags); ``layouts``: those the call runs (default: all)."""
  return _reorder_heads(x, layout, [(index(name), lambda y, n=name: get(n).to_placed(y, grid))
                                    for name in _moved(layouts)])


def restore(x: jax.Array, layout: jax.Array, grid: VideoGrid,
            layouts: tuple[str, ...] | None = None) -> jax.Array:
  """Inverse of :func:`place`."""
  return _reorder_heads(x, layout, [(index(name),
                                     lambda y, n=name: get(n).to_frame_major(y, grid))
                                    for name in _moved(layouts)])


def placed_attention(q: jax.Array, k: jax.Array, v: jax.Array, layout: jax.Array, *,
                     grid: VideoGrid, plan: TilePlan, scale: float | None = None,
                     backend: str = "auto", block_kv_compute: int | None = None,
                     target: Target | None = None, compensation_blocks: int = 0,
                     cents: dict[str, Centroids] | None = None,
                     semantic: SemanticLayout | None = None,
                     layouts: tuple[str, ...] | None = None) -> jax.Array:
  """SVG after routing: place by ``layout [B, H]`` (ids or bool temporal flags), run ``plan``,
  restore; ``compensation_blocks``: 0 off; ``semantic``: see :func:`semantic_placed_attention`."""
  kernel = prepare_kernel(plan, target_for_call(q, k, v, target=target), backend=backend,
                          block_kv_compute=block_kv_compute)
  return _placed(kernel, q, k, v, layout, grid, scale, compensation_blocks, cents, semantic,
                 layouts=layouts)


def _placed(kernel: SparseKernel, q: jax.Array, k: jax.Array, v: jax.Array, layout: jax.Array,
            grid: VideoGrid, scale: float | None, compensation_blocks: int,
            cents: dict[str, Centroids] | None,
            semantic: SemanticLayout | None, heads: HeadTables | None = None,
            layouts: tuple[str, ...] | None = None) -> jax.Array:
  """:func:`placed_attention` on a prepared kernel; ``heads``: per-head tables on its plan."""
  if semantic is not None:
    return _semantic_placed(kernel, q, k, v, layout, semantic, grid, scale,
                            compensation_blocks, cents, layouts)
  # Our kernel multiplies q by the scale (and log2 e) first: the placement pass does it on the
  # way, where the kernel's prepass wrote a copy of q (docs/benchmarks.md, "A denoising step
  # timed on a TPU v5e"); the kernel then takes BASE2_SCALE.
  factor = base2_factor(scale, q.shape[-1]) if kernel.resolved == "pallas" else None
  with jax.named_scope("svg_place"):
    placed = [_ordered(kernel, x, layout, grid, layouts, to_placed=True, scale=s)
              for x, s in ((q, factor), (k, None), (v, None))]
  with jax.named_scope("svg_kernel"):
    out = _run_placed(kernel, placed, layout, scale if factor is None else BASE2_SCALE,
                      compensation_blocks, cents, heads)
  with jax.named_scope("svg_restore"):
    return _ordered(kernel, out, layout, grid, layouts, to_placed=False)


def _ordered(kernel: SparseKernel, x: jax.Array, layout: jax.Array, grid: VideoGrid,
             layouts: tuple[str, ...] | None, *, to_placed: bool,
             scale: float | None = None) -> jax.Array:
  """:func:`place` (``to_placed``) or :func:`restore`; where a TPU lowers the call and every
  moved layout has its pass there (``on_tpu``), by those passes (each one read and write).
  ``scale`` (placing): x also multiplied by it in float32, in its dtype (in the pass, on a TPU)."""
  def xla(x: jax.Array, layout: jax.Array) -> jax.Array:
    out = (place if to_placed else restore)(x, layout, grid=grid, layouts=layouts)
    return out if scale is None else scaled(out, scale)

  b, h, s, d = x.shape
  moved = [get(name) for name in _moved(layouts)]
  if not moved or not all(m.on_tpu is not None and m.on_tpu.supported(grid, d, x.dtype)
                          for m in moved):
    return xla(x, layout)

  def on_tpu(x: jax.Array, layout: jax.Array) -> jax.Array:
    ids = jnp.broadcast_to(layout_ids(layout), (b, h)).reshape(-1)
    heads = x.reshape(b * h, s, d)
    for i, m in enumerate(moved):  # each moves its own heads only; the first scales them all
      heads = m.on_tpu.run(heads, ids == index(m.name), grid, to_placed,
                           scale=scale if i == 0 else None)
    return heads.reshape(x.shape)

  return kernel.per_lowering(lambda: on_tpu, lambda: xla)(jnp.asarray(x), layout)


def _run_placed(kernel: SparseKernel, placed: list[jax.Array], layout: jax.Array,
                scale: float | None, compensation_blocks: int,
                cents: dict[str, Centroids] | None, heads: HeadTables | None) -> jax.Array:
  """The kernel on placed inputs (:func:`_placed`'s middle)."""
  if heads is not None:  # the band in each head's placed order: its tables need no routing
    kwargs = {"head_tiles": heads.tables, "head_steps": heads.steps}
    if compensation_blocks:  # each head's own skipped tiles, by its layout's centroids
      plan = kernel.plan
      head_cents = per_head(cents, layout) if cents is not None else centroids(
          placed[1], placed[2], block_kv=plan.block_kv, blocks=compensation_blocks,
          seq_len=plan.seq_len)
      kwargs["row_keys"] = table_row_keys(head_cents, heads.visited, plan, compensation_blocks,
                                          placed[0].dtype, heads.fewest_visited)
    out = kernel(*placed, scale=scale, **kwargs)
  elif compensation_blocks:
    out = compensated_call(kernel, *placed, blocks=compensation_blocks, scale=scale,
                           cents=None if cents is None else per_head(cents, layout))
  else:
    out = kernel(*placed, scale=scale)
  return out


def semantic_placed_attention(q: jax.Array, k: jax.Array, v: jax.Array, layout: jax.Array,
                              semantic: SemanticLayout, *, grid: VideoGrid, plan: TilePlan,
                              scale: float | None = None, backend: str = "auto",
                              block_kv_compute: int | None = None, target: Target | None = None,
                              compensation_blocks: int = 0,
                              cents: dict[str, Centroids] | None = None,
                              layouts: tuple[str, ...] | None = None) -> jax.Array:
  """SVG after routing among band layouts and semantic: each head placed by its layout's order,
  run on its layout's table (the shared plan's or its own), restored by the inverse order."""
  return placed_attention(q, k, v, layout, grid=grid, plan=plan, scale=scale, backend=backend,
                          block_kv_compute=block_kv_compute, target=target,
                          compensation_blocks=compensation_blocks, cents=cents,
                          semantic=semantic, layouts=layouts)


def _semantic_placed(kernel: SparseKernel, q: jax.Array, k: jax.Array, v: jax.Array,
                     layout: jax.Array, semantic: SemanticLayout, grid: VideoGrid,
                     scale: float | None, compensation_blocks: int,
                     cents: dict[str, Centroids] | None,
                     layouts: tuple[str, ...] | None) -> jax.Array:
  """:func:`semantic_placed_attention` on a prepared kernel."""
  plan = kernel.plan
  semantic_head = (layout == index(SEMANTIC))[:, :, None, None]
  # Semantic heads by their groups' order (a gather of whole groups), the rest as before:
  # gathering every head after the band's placement needs more temporaries (docs/benchmarks.md,
  # "Figures behind choices in the code").
  placed = lambda x, perm: jnp.where(semantic_head, gather_tokens(x, perm),
                                     place(x, layout, grid, layouts))
  tables = jnp.where(semantic_head, semantic.kv_index, jnp.asarray(plan.kv_index))
  # One input at a time: each gather's copy is dead before the next is made.
  qp = placed(q, semantic.q_perm)
  qp, k = jax.lax.optimization_barrier((qp, k))
  kp = placed(k, semantic.k_perm)
  kp, v = jax.lax.optimization_barrier((kp, v))
  vp = placed(v, semantic.k_perm)
  kwargs = {"head_tiles": tables}
  if compensation_blocks:
    static = per_head(cents, layout) if cents is not None else centroids(
        kp, vp, block_kv=plan.block_kv, blocks=compensation_blocks, seq_len=plan.seq_len)
    pick = lambda a, b: jnp.where(semantic_head, a, b)
    head_cents = Centroids(pick(semantic.cents.k, static.k), pick(semantic.cents.v, static.v),
                           static.log_count)
    kwargs["row_keys"] = table_row_keys(head_cents, visited_table(tables, plan), plan,
                                        compensation_blocks, q.dtype)
  out = kernel(qp, kp, vp, scale=scale, **kwargs)
  return jnp.where(semantic_head, gather_tokens(out, semantic.q_pos),
                   restore(out, layout, grid, layouts))


def with_dense_rows(branch: Branch, q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array,
                    scale: float | None) -> jax.Array:
  """``out`` with the leading frames' rows (``svg_dense_frames``) replaced by dense attention."""
  kernel = branch.rows_kernel
  if kernel is None:
    return out
  if branch.backend == "splash" and q.shape[-1] % 128:  # refused alike wherever it runs
    raise ValueError(f"svg_dense_frames with svg_backend splash runs the dense rows on our kernel, "
                     f"which needs head_dim a multiple of 128, got {q.shape[-1]}: set svg_backend "
                     f"to xla, or svg_dense_frames to 0")
  rows = kernel.plan.q_len
  dense = kernel(q[:, :, :rows], k, v, scale=scale)
  return jax.lax.dynamic_update_slice_in_dim(out, dense.astype(out.dtype), 0, axis=2)


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array, grid: VideoGrid) -> None:
  """Frame-major ``[B, H, S, D]`` inputs with ``S`` equal to the grid's token count."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4 or x.shape[2] != grid.tokens:
      raise ValueError(f"{name} must be [B, H, S, D] with S = grid.tokens = {grid.tokens} "
                       f"(grid {grid}), got shape {tuple(x.shape)}")


def profile_key(config: SvgConfig, step: Any = None, layer: Any = None,
                key: jax.Array | None = None) -> jax.Array:
  """The router's key: ``key`` (default: the config's seed) folded with ``layer`` and ``step``."""
  key = jax.random.key(config.profile_seed) if key is None else key
  for count in (layer, step):
    if count is not None:
      key = jax.random.fold_in(key, count)
  return key


class HeadTables(NamedTuple):
  """A per-head budget's call: ``tables int32 [B, H, q_tiles, width]``, visited key tiles,
  the ragged grid's length and the fewest tiles any head's row visits."""

  tables: jax.Array
  visited: jax.Array
  steps: int
  fewest_visited: int


def all_heads(call: PreparedCall, shape: tuple[int, ...]) -> jax.Array:
  """``int32 [B, H]``: all the model's heads in order (their count must be the call's)."""
  listed = call.host.heads.heads
  if shape[1] != listed:
    raise ValueError(f"{call.config.head_key(call.expert)} lists {listed} heads; the call has "
                     f"{shape[1]}")
  return jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32), shape[:2])


def head_tables(call: PreparedCall, branch: Branch, shape: tuple[int, ...], layer: Any,
                head_ids: jax.Array | None) -> HeadTables | None:
  """Tables of ``head_ids [B, H]`` (default: all) in ``layer``; None without a per-head budget."""
  heads = branch.heads
  if heads is None:
    return None
  key = call.config.head_key(call.expert)
  head_ids = all_heads(call, shape) if head_ids is None else head_ids
  if heads.layers > 1:
    if layer is None:
      raise ValueError(f"{key} gives {heads.layers} layers: the call needs its layer index")
    if isinstance(layer, int) and not 0 <= layer < heads.layers:
      raise ValueError(f"{key} gives {heads.layers} layers; the call's layer is {layer}")
  return HeadTables(heads.tables_for(head_ids, layer), heads.visited_for(head_ids, layer),
                    heads.steps_bound(*shape[:2]), heads.fewest_visited)


def route(call: PreparedCall, branch: Branch, q: jax.Array, k: jax.Array, v: jax.Array,
          key: jax.Array, scale: float | None, seed: Seed | None,
          heads: HeadTables | None = None
          ) -> tuple[Routing, dict[str, Centroids] | None, SemanticLayout | None]:
  """Each head's layout judged on ``branch``'s mask (``heads``: each head's own): the routing,
  each layout's centroids (with compensation) and the semantic order and table."""
  plan, blocks = branch.plan, branch.compensation_blocks
  # each band candidate's (semantic alone: the first band layout's, which no head picks)
  band = [name for name in call.config.layouts if get(name).band] or [names()[0]]
  cents = ({name: layout_centroids(k, v, call.grid, get(name), plan, blocks) for name in band}
           if blocks else None)
  semantic = (None if call.semantic is None
              else semantic_layout(q, k, v, plan, call.semantic, scale, call.semantic_group, seed))
  routing = profile_heads(q, k, v, grid=call.grid, config=call.router, key=key, scale=scale,
                          plan=plan, compensation_blocks=blocks, cents=cents,
                          layouts=call.config.layouts, semantic=semantic,
                          head_visited=None if heads is None else heads.visited,
                          rows_kernel=rows_kernel(branch, q.shape[-1]))
  return routing, cents, semantic


def rows_kernel(branch: Branch, head_dim: int) -> RowsKernel | None:
  """The router's sampled rows on ``branch``: our Pallas pass where it lowers for a TPU (XLA's
  six passes over the float32 logits cost 4x as much there), XLA's on the host; None where the
  branch runs XLA (``svg_backend: xla``) or heads are not whole lanes."""
  kernel = branch.kernel
  if kernel.resolved == "xla" or head_dim % 128 or not (kernel.on_tpu or kernel.follows_lowering):
    return None
  return lambda q, k, v, keeps, scale: kernel.per_lowering(
      lambda: functools.partial(sampled_rows, scale=scale),
      lambda: functools.partial(sampled_rows_xla, scale=scale))(q, k, v, keeps)


def prepared_svg_attention(call: PreparedCall, q: jax.Array, k: jax.Array, v: jax.Array, *,
                           key: jax.Array | None = None, scale: float | None = None,
                           return_info: bool = False, seed: Seed | None = None,
                           layer: Any = None, head_ids: jax.Array | None = None) -> Any:
  """:func:`svg_attention` of a prepared call; per-head budgets: ``layer`` picks the densities,
  ``head_ids [B, H]`` the model's heads held (default: all, in order)."""
  check_qkv(q, k, v, call.grid)
  key = profile_key(call.config) if key is None else key
  if seed is not None and call.semantic is None:
    raise ValueError("a warm start (seed) is for calls with semantic among svg_layouts")

  def build(branch: Branch) -> Callable[..., Any]:
    heads = head_tables(call, branch, q.shape, layer, head_ids)

    def run(q, k, v, key):
      with jax.named_scope("svg_route"):
        routing, cents, semantic = route(call, branch, q, k, v, key, scale, seed, heads)
      if semantic is not None:
        # The route is decided before anything is placed: scheduled among the placed copies,
        # the semantic estimate left them scattered and took more temporaries. Not for the band
        # layouts alone: there it kept the compensated call's centroids alive (figures:
        # docs/benchmarks.md, "Figures behind choices in the code").
        routing, semantic, q, k, v = jax.lax.optimization_barrier((routing, semantic, q, k, v))
      out = _placed(branch.kernel, q, k, v, routing.layout, call.grid, scale,
                    branch.compensation_blocks, cents, semantic, heads, call.config.layouts)
      clusters = None if semantic is None else semantic.clusters
      with jax.named_scope("svg_rows"):
        out = with_dense_rows(branch, q, k, v, out, scale)
      return out, routing, clusters
    return run

  out, routing, clusters = call.per_platform(build)(q, k, v, key)
  if not return_info:
    return out
  plan = call.host.plan  # the plan the host's executor lowers (with auto off TPU, the XLA path's)
  info = {**routing.info(),
          # every layout runs the band's count per query tile row: what the kernel visits
          "visited_tiles": _visited_tiles(call, q.shape, layer, head_ids),
          "plan": plan.stats.as_dict()}
  if routing.left_out is not None:
    info["left_out"] = routing.left_out
    info["clusters"] = clusters
  return out, info


def _visited_tiles(call: PreparedCall, shape: tuple[int, ...], layer: Any,
                   head_ids: jax.Array | None) -> jax.Array:
  """``int32 [B, H]``: the tiles each head's call visits, dense rows included."""
  host, heads = call.host, call.host.heads
  rows = 0 if host.rows_plan is None else host.rows_plan.stats.visited_tiles
  if heads is None:
    return jnp.full(shape[:2], host.plan.stats.visited_tiles + rows, jnp.int32)
  steps = jnp.asarray(heads.head_steps, jnp.int32)[
      0 if layer is None or heads.layers == 1 else layer]
  return jnp.take(steps, all_heads(call, shape) if head_ids is None else head_ids) + rows


def svg_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, grid: VideoGrid,
                  config: SvgConfig, key: jax.Array | None = None, scale: float | None = None,
                  expert: str | None = None, return_info: bool = False,
                  target: Target | None = None, seed: Seed | None = None) -> Any:
  """Sparse VideoGen attention of frame-major ``[B, H, S, D]`` inputs. ``return_info`` adds a dict:
  ``layout`` ids and ``temporal`` flags ``[B, H]``, ``errors``, each ``<band>_error``, ``plan``
  statistics and, with semantic, ``clusters [B, H, C, D]`` (the next ``seed``)."""
  check_qkv(q, k, v, grid)
  call = prepare(config, grid, expert, target=target, arrays=(q, k, v))
  return prepared_svg_attention(call, q, k, v, key=key, scale=scale, return_info=return_info,
                                seed=seed)


def prepared_dense_attention(call: PreparedCall, q: jax.Array, k: jax.Array, v: jax.Array, *,
                             scale: float | None = None) -> jax.Array:
  """The schedule's dense branch (every tile full) through the prepared call's executor."""
  with jax.named_scope("svg_dense"):
    return call.per_platform(lambda branch: lambda q, k, v: branch.dense_kernel(
        q, k, v, scale=scale))(q, k, v)


def dense_tiled_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, grid: VideoGrid,
                          config: SvgConfig, scale: float | None = None,
                          target: Target | None = None) -> jax.Array:
  """Dense attention through the same executor (every tile full): the schedule's dense branch."""
  return prepared_dense_attention(prepare(config, grid, target=target, arrays=(q, k, v)),
                                  q, k, v, scale=scale)


def prepared_scheduled_attention(call: PreparedCall, q: jax.Array, k: jax.Array, v: jax.Array, *,
                                 step: Any, layer: Any, scale: float | None = None,
                                 key: jax.Array | None = None, return_layout: bool = False,
                                 seed: Seed | None = None,
                                 head_ids: jax.Array | None = None) -> Any:
  """:func:`scheduled_svg_attention` of a prepared call (``head_ids``: the heads held)."""
  check_qkv(q, k, v, call.grid)
  config = call.config
  active = config.schedule.is_active(step, layer)
  key = profile_key(config, step, layer, key)
  aux = return_layout or seed is not None

  def sparse_at(rung: PreparedCall) -> Callable[..., Any]:
    def sparse(q, k, v):
      out, info = prepared_svg_attention(rung, q, k, v, key=key, scale=scale, return_info=True,
                                         seed=seed, layer=layer, head_ids=head_ids)
      extra = {"layout": info["layout"]}
      if seed is not None:
        extra["clusters"] = info["clusters"]
      return (out, extra) if aux else out
    return sparse

  sparse = sparse_at(call)
  per_layer = config.budget(call.expert).layer_rungs
  if per_layer is not None:  # one prepared plan per distinct rung; the layer picks one
    distinct, rung_of_layer = levels(per_layer)
    rungs = [sparse_at(call.at_rung(rung)) for rung in distinct]
    if isinstance(layer, int):
      sparse = rungs[int(rung_of_layer[layer])]
    elif len(rungs) == 1:
      sparse = rungs[0]
    else:
      sparse = lambda q, k, v: jax.lax.switch(jnp.asarray(rung_of_layer)[layer], rungs, q, k, v)

  def dense(q, k, v):
    out = prepared_dense_attention(call, q, k, v, scale=scale)
    extra = {"layout": jnp.zeros(q.shape[:2], jnp.int32)}
    if seed is not None:
      clusters = jnp.broadcast_to(seed.centroids.astype(jnp.float32),
                                  q.shape[:2] + seed.centroids.shape[-2:])
      extra["clusters"] = clusters
    return (out, extra) if aux else out

  if isinstance(active, bool):
    return (sparse if active else dense)(q, k, v)
  return jax.lax.cond(active, sparse, dense, q, k, v)


def scheduled_svg_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, grid: VideoGrid,
                            config: SvgConfig, step: Any, layer: Any,
                            scale: float | None = None, expert: str | None = None,
                            key: jax.Array | None = None, target: Target | None = None,
                            return_layout: bool = False, seed: Seed | None = None) -> Any:
  """SVG in the schedule's active steps and layers, dense outside; ``step``, ``layer``: ints or
  traced int32 (one ``lax.cond``). ``return_layout`` or ``seed``: returns ``(out, aux)`` with
  ``aux["layout"] [B, H]`` (spatial when dense) and, with ``seed``, ``aux["clusters"] [B, H, C,
  D]`` (the seed's when dense)."""
  check_qkv(q, k, v, grid)
  call = prepare(config, grid, expert, target=target, arrays=(q, k, v))
  return prepared_scheduled_attention(call, q, k, v, step=step, layer=layer, scale=scale,
                                      key=key, return_layout=return_layout, seed=seed)
