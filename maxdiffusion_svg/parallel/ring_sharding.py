"""SVG over a context axis split as Ulysses ``U`` x ring ``R`` (MaxDiffusion's ``ulysses_shards``).

For axes no divisor of the heads fills (Wan's 40 heads on 32 or 64 chips). In one ``shard_map``,
``context`` split ring-major into ``(svg_ring, svg_ulysses)``: (1) all-to-all over
``svg_ulysses`` to ``H / U`` heads of ring shard ``r``'s tokens; (2) route by per-shard softmaxes
merged exactly over the ring (same flags on every shard); (3) place temporal heads
temporal-major, all heads on the plan's shards (one all-to-all); (4) fetch the visited key tiles
(permutes, one sink broadcast); (5) run this shard's plan rows, restore, all-to-all back.
Temporal heads are placed, not ringed (frame-major they need every key shard): ``q, k, v`` and
the output cross once, where a ring moves ``k, v`` ``R - 1`` times.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from maxdiffusion_svg.call.attention import profile_key
from maxdiffusion_svg.call.prepared import Branch, PreparedCall
from maxdiffusion_svg.kernels.splash import RING_REFUSAL
from maxdiffusion_svg.parallel.exchange import HeadExchange, in_context, reshard_explicit
from maxdiffusion_svg.parallel.ring_placement import ShardPermutation, ring_placement
from maxdiffusion_svg.parallel.ring_plan import (KeyFetch, RingSplit, budget_keys, check_on_ring,
                                                 key_fetch, ring_split, window_plan)
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.masks import Mask
from maxdiffusion_svg.plan.tiles import TilePlan
from maxdiffusion_svg.routing.compensation import (Centroids, centroid_log_counts,
                                                   centroids_by_position, per_head, plan_bias,
                                                   row_keys, skips_any)
from maxdiffusion_svg.routing.layouts import SPATIAL, TEMPORAL, get, names
from maxdiffusion_svg.routing.router import (Routing, compensated_rows, constants, placed_keep,
                                             routing_mask, sample_rows)

RING, ULYSSES = "svg_ring", "svg_ulysses"
# The plan and each layout's whole-sequence centroids: the ring router's compensated outputs.
RingCompensation = tuple[TilePlan, dict[str, Centroids]]
# The layouts a ring places: each has its shards' permutation (ring_placement).
RING_BAND = (SPATIAL, TEMPORAL)


def split_mesh(mesh: Mesh, seq_axis: str, ulysses: int) -> Mesh:
  """``mesh`` with ``seq_axis`` split into ``(svg_ring, svg_ulysses)``, same devices in the
  same order: context index ``r * U + u`` is ring shard ``r``, Ulysses rank ``u``."""
  names = tuple(mesh.axis_names)
  i = names.index(seq_axis)
  ring = mesh.shape[seq_axis] // ulysses
  devices = mesh.devices.reshape(mesh.devices.shape[:i] + (ring, ulysses)
                                 + mesh.devices.shape[i + 1:])
  types = tuple(mesh.axis_types)
  return Mesh(devices, names[:i] + (RING, ULYSSES) + names[i + 1:],
              axis_types=types[:i] + (types[i], types[i]) + types[i + 1:])


def _rows_of(x: jax.Array, rows: jax.Array, shard: jax.Array, chunk: int) -> jax.Array:
  """``x``'s global ``rows`` (``[b, h, n, D]``, float32), from whichever shard holds each."""
  local = rows - shard * chunk
  inside = (local >= 0) & (local < chunk)
  picked = jnp.take(x, jnp.clip(local, 0, chunk - 1), axis=2).astype(jnp.float32)
  return jax.lax.psum(jnp.where(inside[None, None, :, None], picked, 0.0), RING)


def ring_layout_errors(q: jax.Array, k: jax.Array, v: jax.Array, rows: jax.Array,
                       grid: VideoGrid, mask: Mask, shard: jax.Array, chunk: int,
                       scale: float | None = None,
                       compensation: RingCompensation | None = None) -> tuple[jax.Array, jax.Array]:
  """:func:`maxdiffusion_svg.routing.router.layout_errors` over the ring: per-shard softmaxes
  merged, moving ``rows x D`` per head, never keys; compensated given the plan and centroids."""
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  qs = _rows_of(q, rows, shard, chunk)
  keys = shard * chunk + jnp.arange(chunk, dtype=jnp.int32)
  logits = jnp.einsum("bhrd,bhkd->bhrk", qs, k.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST) * scale
  v32 = v.astype(jnp.float32)

  def output(keep: jax.Array) -> tuple[jax.Array, jax.Array]:
    x = jnp.where(keep, logits, -jnp.inf)
    m = jax.lax.pmax(x.max(axis=-1), RING)
    safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(x - safe[..., None])
    total = jax.lax.psum(p.sum(axis=-1), RING)
    acc = jax.lax.psum(jnp.einsum("bhrk,bhkd->bhrd", p, v32,
                                  precision=jax.lax.Precision.HIGHEST), RING)
    return acc / jnp.where(total > 0, total, 1.0)[..., None], safe + jnp.log(total)

  dense, _ = output((keys < grid.tokens)[None, :])
  errors = []
  for name in RING_BAND:
    keep = placed_keep(mask, grid, get(name), rows[:, None], keys[None, :])
    out, lse = output(keep)
    if compensation is not None:
      plan, cents = compensation
      out = compensated_rows(qs, out, lse, rows, grid, get(name), plan, cents[name], scale)
    errors.append(jnp.mean((out - dense) ** 2, axis=(2, 3)))
  return errors[0], errors[1]


def permute(x: jax.Array, perm: ShardPermutation, shard: jax.Array,
            inverse: bool = False) -> jax.Array:
  """``[b, h, N, D]`` exchange shards -> ``[b, h, chunk, D]`` plan shards (``inverse``: back):
  a gather, one all-to-all, then gathers from what crossed and what stayed."""
  send, crossed, stayed = _tables(perm, shard, inverse)
  got = _all_to_all(_take(x, send))
  return _take(got, crossed) + _take(x, stayed)


def place(x: jax.Array, temporal: jax.Array, spatial: ShardPermutation | None,
          perm: ShardPermutation, shard: jax.Array, inverse: bool = False) -> jax.Array:
  """Heads flagged ``temporal`` (``[b, h]``) moved by ``perm``, the others by ``spatial`` (in
  place where it is None), around one all-to-all; ``inverse`` moves them back."""
  pick = temporal[:, :, None, None]
  if spatial is None:  # the plan's shards are the exchange's: spatial heads stay
    return jnp.where(pick, permute(x, perm, shard, inverse), x)
  send, crossed, stayed = _tables(perm, shard, inverse)
  spatial_send, spatial_crossed, spatial_stayed = _tables(spatial, shard, inverse)
  got = _all_to_all(jnp.where(pick, _take(x, send), _take(x, spatial_send)))
  return jnp.where(pick, _take(got, crossed) + _take(x, stayed),
                   _take(got, spatial_crossed) + _take(x, spatial_stayed))


def _tables(perm: ShardPermutation, shard: jax.Array, inverse: bool) -> tuple[jax.Array, ...]:
  """What a shard sends, and each output's index in what crossed and in what stayed."""
  send, gather = (perm.recv, perm.back_from) if inverse else (perm.send, perm.place_from)
  crossed = perm.split.ring * perm.block
  gather = jnp.asarray(gather)[shard]
  return (jnp.asarray(send)[shard].reshape(-1), gather,
          jnp.where(gather >= crossed, gather - crossed, jnp.iinfo(jnp.int32).max))


def _all_to_all(blocks: jax.Array) -> jax.Array:
  return jax.lax.all_to_all(blocks, RING, split_axis=2, concat_axis=2, tiled=True)


def fetch_window(x: jax.Array, fetch: KeyFetch, shard: jax.Array) -> jax.Array:
  """``[b, h, L, D]`` -> this shard's window ``[b, h, slots * block_kv, D]``: its own, each
  permute's and the sink's pieces, written in place into one buffer."""
  b, h, chunk, d = x.shape
  pieces = x.reshape(b, h, chunk // fetch.piece, fetch.piece, d)
  window = jnp.zeros((b, h, fetch.window_pieces, fetch.piece, d), x.dtype)

  def put(window, dst, got):
    return window.at[:, :, jnp.asarray(dst)[shard]].set(got, mode="drop")

  pick = lambda src: jnp.take(pieces, src, axis=2, mode="fill", fill_value=0)
  window = put(window, fetch.own_dst, pick(jnp.asarray(fetch.own_src)[shard]))
  for hop in fetch.hops:
    window = put(window, hop.recv,
                 jax.lax.ppermute(pick(jnp.asarray(hop.send)[shard]), RING, hop.pairs))
  if fetch.broadcasts_sink:
    sink = pick(jnp.asarray(fetch.sink_src))
    window = put(window, fetch.sink_dst,
                 jax.lax.psum(jnp.where(shard == 0, sink, jnp.zeros_like(sink)), RING))
  return window.reshape(b, h, fetch.window_pieces * fetch.piece, d)


def _take(x: jax.Array, index: jax.Array) -> jax.Array:
  """``x`` along the sequence at ``index``; out-of-range entries give zeros."""
  return jnp.take(x, index, axis=2, mode="fill", fill_value=0)


def _shard_kernels(branch: Branch, plan: TilePlan, split: RingSplit, scale: float | None,
                   blocks: int = 0) -> tuple[KeyFetch, Callable[..., Any]]:
  """The fetch and ``run(shard, q, k_window, v_window, centroids=None)`` of each shard's rows;
  with ``blocks``, compensated for every skipped key tile (centroids: :func:`ring_centroids`)."""
  fetch = key_fetch(plan, split)
  compensate = blocks and skips_any(plan)

  def shard_kernel(r: int) -> Callable[..., Any]:
    window = window_plan(plan, split, r)
    kernel = functools.partial(branch.kernel_for(window), scale=scale)
    if not compensate:
      return kernel
    row0, row1 = split.starts[r] // plan.block_q, split.starts[r + 1] // plan.block_q
    log_count = centroid_log_counts(plan, blocks)
    bias = np.full((window.num_q_tiles, log_count.size), -np.inf, np.float32)
    own = plan_bias(plan, log_count)[row0:row1]
    bias[:own.shape[0]] = own  # the buffer's rows past the sequence see nothing

    def run(q, k, v, k_mean, v_mean):
      return kernel(q, k, v, row_keys=row_keys(Centroids(k_mean, v_mean, log_count), bias,
                                               q.dtype))
    return run

  kernels = [shard_kernel(r) for r in range(split.ring)]

  def run(shard, q, k, v, cents=None):
    means = (cents.k, cents.v) if compensate else ()  # log counts are static, in each branch
    return jax.lax.switch(shard, kernels, q, k, v, *means)
  return fetch, run


def ring_centroids(k: jax.Array, v: jax.Array, grid: VideoGrid, plan: TilePlan, blocks: int,
                   shard: jax.Array, natural: int) -> dict[str, Centroids]:
  """Each layout's whole-sequence centroids: each shard sums its keys by placed sub-block, then
  a sum over the ring (``tiles x blocks x D`` per head, never remote tiles)."""
  frame_major = shard * natural + jnp.arange(natural, dtype=jnp.int32)
  real = frame_major < grid.tokens
  out = {}
  for name in RING_BAND:
    positions = jnp.where(real, get(name).positions(grid, frame_major), grid.tokens)
    out[name] = centroids_by_position(k, v, positions, seq_len=grid.tokens,
                                        num_kv_tiles=plan.num_kv_tiles, block_kv=plan.block_kv,
                                        blocks=blocks, axis_name=RING)
  return out


def ring_svg_attention(q: jax.Array, k: jax.Array, v: jax.Array, ex: HeadExchange,
                       call: PreparedCall, *, key: jax.Array | None = None,
                       scale: float | None = None, step: Any = None, layer: Any = None,
                       return_info: bool = False,
                       on_routing: Callable[..., None] | None = None) -> Any:
  """SVG of frame-major ``[B, H, S, D]`` on exchange ``ex``, heads exchanged in groups of
  ``ex.ulysses`` (module doc): :func:`maxdiffusion_svg.parallel.sharding.sharded_svg_attention`'s
  ring path, with its arguments (``call``: prepared for the ring, ``PreparedCall.on_ring``)."""
  mesh, seq_axis, batch_axes, ulysses = ex.mesh, ex.seq_axis, ex.batch_axes, ex.ulysses
  grid, config = call.grid, call.config
  off_ring = [name for name in config.layouts if not get(name).on_ring]
  if off_ring:  # e.g. a semantic head's clusters span the whole sequence, split here
    raise ValueError(f"svg_layouts with {' and '.join(off_ring)} does not run on a ring yet "
                     f"(ulysses_shards {ulysses} leaves the sequence split over "
                     f"{mesh.shape[seq_axis] // ulysses} devices): set ulysses_shards to the "
                     f"context axis's size, or svg_layouts to [spatial, temporal]")
  check_on_ring(ulysses, mesh.shape[seq_axis] // ulysses, dense_frames=config.dense_frames,
                budgets=budget_keys(config, (call.expert,)))
  inner = split_mesh(mesh, seq_axis, ulysses)
  ring = inner.shape[RING]
  batch_spec = tuple(batch_axes) or None
  spec = P(batch_spec, None, (RING, ULYSSES), None)
  head_spec = P(batch_spec, ULYSSES)
  outer_spec = P(batch_spec, None, seq_axis, None)
  outer_axes, inner_axes = (seq_axis, *batch_axes), (RING, ULYSSES, *batch_axes)
  scheduled = step is not None
  extras = {"key": key, "step": step, "layer": layer}
  traced = {name: x for name, x in extras.items() if isinstance(x, jax.Array)}
  static = {name: x for name, x in extras.items() if name not in traced}
  seq_len = grid.tokens

  def build(branch: Branch) -> Callable[..., Any]:
    if branch.backend == "splash":  # refused before any kernel is built for it
      raise ValueError(RING_REFUSAL)
    plan, blocks = branch.plan, branch.compensation_blocks
    split = ring_split(seq_len, ring, ulysses, branch.tiles.block_q)
    sparse_fetch, sparse_run = _shard_kernels(branch, plan, split, scale, blocks)
    if scheduled:
      dense_fetch, dense_run = _shard_kernels(branch, branch.dense_plan, split, scale)
    spatial_perm, temporal_perm = ring_placement(grid.frames, grid.frame_size, split)
    router_mask = routing_mask(grid, call.router, plan)

    def body(q, k, v, *values):
      given = {**static, **dict(zip(traced, values))}
      q, k, v = (jax.lax.all_to_all(x, ULYSSES, split_axis=1, concat_axis=2, tiled=True)
                 for x in (q, k, v))
      shard = jax.lax.axis_index(RING)
      route_key = (profile_key(config, given["step"], given["layer"], given["key"]) if scheduled
                   else profile_key(config) if given["key"] is None else given["key"])

      def sparse(q, k, v):
        rows = sample_rows(route_key, seq_len, config.router)
        cents = (ring_centroids(k, v, grid, plan, blocks, shard, split.natural) if blocks
                 else None)
        judged = (plan, cents) if blocks and config.router.profile_masks == "execution" else None
        spatial, temporal_error = ring_layout_errors(*constants((q, k, v)), rows, grid,
                                                     router_mask, shard, split.natural, scale,
                                                     constants(judged))
        temporal = temporal_error < spatial
        run_cents = None if cents is None else per_head(cents, temporal)
        q, k, v = (place(x, temporal, spatial_perm, temporal_perm, shard) for x in (q, k, v))
        out = sparse_run(shard, q, fetch_window(k, sparse_fetch, shard),
                         fetch_window(v, sparse_fetch, shard), run_cents)
        out = place(out, temporal, spatial_perm, temporal_perm, shard, inverse=True)
        return out, (temporal, spatial, temporal_error)

      def dense(q, k, v):
        if spatial_perm is not None:
          q, k, v = (permute(x, spatial_perm, shard) for x in (q, k, v))
        out = dense_run(shard, q, fetch_window(k, dense_fetch, shard),
                        fetch_window(v, dense_fetch, shard))
        if spatial_perm is not None:
          out = permute(out, spatial_perm, shard, inverse=True)
        zeros = jnp.zeros(q.shape[:2], jnp.float32)
        return out, (jnp.zeros(q.shape[:2], bool), zeros, zeros)

      if scheduled:
        active = config.schedule.is_active(given["step"], given["layer"])
        if isinstance(active, bool):
          out, info = (sparse if active else dense)(q, k, v)
        else:
          out, info = jax.lax.cond(active, sparse, dense, q, k, v)
        if on_routing is not None:
          # layout ids: the ring's heads are spatial (0) or temporal (1)
          on_routing(info[0].astype(jnp.int32), active, given["step"], given["layer"])
      else:
        out, info = sparse(q, k, v)
      out = jax.lax.all_to_all(out, ULYSSES, split_axis=2, concat_axis=1, tiled=True)
      return (out, info) if return_info else out

    in_specs = (spec,) * 3 + (P(),) * len(traced)
    out_specs = (spec, (head_spec,) * 3) if return_info else spec
    mapped = jax.shard_map(body, mesh=inner, in_specs=in_specs, out_specs=out_specs,
                           check_vma=False)

    def run(q, k, v, *values):
      pad = ((0, 0), (0, 0), (0, split.natural_len - seq_len), (0, 0))
      q, k, v = (reshard_explicit(reshard_explicit(jnp.pad(x, pad), mesh, outer_spec, outer_axes),
                                  inner, spec, inner_axes) for x in (q, k, v))
      # Under jax.set_mesh(mesh) the shard_map's mesh must be the one in context.
      with (jax.sharding.use_abstract_mesh(inner.abstract_mesh) if in_context(mesh)
            else contextlib.nullcontext()):
        result = mapped(q, k, v, *values)
      out, info = result if return_info else (result, None)
      out = reshard_explicit(out, mesh, P(batch_spec), outer_axes)[:, :, :seq_len]
      return (out, info) if return_info else out

    return run

  result = call.per_platform(build)(q, k, v, *traced.values())
  if not return_info:
    return result
  out, (temporal, spatial, temporal_error) = result
  errors = {SPATIAL: spatial, TEMPORAL: temporal_error}
  layout = jnp.where(temporal, names().index(TEMPORAL), names().index(SPATIAL)).astype(jnp.int32)
  stacked = jnp.stack([errors.get(name, jnp.full(temporal.shape, jnp.inf, jnp.float32))
                       for name in names()], -1)
  return out, Routing(layout, stacked).info()
