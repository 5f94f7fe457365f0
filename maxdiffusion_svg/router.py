"""The SVG router: per head, is attention better approximated spatially or temporally?

A few query rows are sampled; their attention output is computed densely over all keys
and under the spatial and the temporal probe masks; each head takes the mask whose
output is closer to dense (mean squared error, float32; ties go to spatial). Probe masks
are evaluated in the original frame-major order by index arithmetic, so routing needs
no permutation and no ``S x S`` array: its cost is ``rows x S`` per head.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from maxdiffusion_svg.geometry import Layout, VideoGrid
from maxdiffusion_svg.masks import PlacedMask, probe_mask

PROFILE_POOLS = ("prefix", "stratified")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
  """How the router samples query rows."""

  profile_queries: int = 64
  profile_pool: str = "stratified"
  sample_max_row: int = 10_000
  include_sink: bool = True

  def __post_init__(self):
    for name in ("profile_queries", "sample_max_row"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"svg_{name} must be an integer >= 1, got {value!r}")
    if self.profile_pool not in PROFILE_POOLS:
      raise ValueError(f"svg_profile_pool must be one of {', '.join(PROFILE_POOLS)}, "
                       f"got {self.profile_pool!r}")


@dataclasses.dataclass(frozen=True)
class Routing:
  """Router result: ``temporal[B, H]`` (True = temporal) and the two probe errors."""

  temporal: jax.Array
  spatial_error: jax.Array
  temporal_error: jax.Array


jax.tree_util.register_dataclass(Routing, data_fields=["temporal", "spatial_error", "temporal_error"],
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


def probe_errors(q: jax.Array, k: jax.Array, v: jax.Array, rows: jax.Array, grid: VideoGrid,
                 *, include_sink: bool = True, scale: float | None = None) -> tuple[jax.Array, jax.Array]:
  """MSE against dense of the spatial and temporal probe outputs of ``rows``: ``[B, H]`` each."""
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  f32 = jnp.float32
  qs = jnp.take(q, rows, axis=2).astype(f32)
  logits = jnp.einsum("bhrd,bhkd->bhrk", qs, k.astype(f32), precision=jax.lax.Precision.HIGHEST)
  logits = logits * scale
  v32 = v.astype(f32)
  dense = _masked_output(logits, v32, None)
  probe = probe_mask(grid, include_sink)
  keys = jnp.arange(grid.tokens, dtype=jnp.int32)[None, :]
  errors = []
  for layout in (Layout.FRAME_MAJOR, Layout.TEMPORAL_MAJOR):
    keep = PlacedMask(probe, grid, layout).contains(rows[:, None], keys)
    errors.append(jnp.mean((_masked_output(logits, v32, keep) - dense) ** 2, axis=(2, 3)))
  return errors[0], errors[1]


def profile_heads(q: jax.Array, k: jax.Array, v: jax.Array, *, grid: VideoGrid, config: Any,
                  key: jax.Array, scale: float | None = None) -> Routing:
  """The router's decision for ``[B, H, S, D]`` inputs (frame-major), with its two errors.

  ``config`` is a :class:`RouterConfig` or anything with a ``router`` attribute holding one
  (e.g. ``SvgConfig``). The same key gives the same flags.
  """
  router = getattr(config, "router", config)
  if q.shape[2] != grid.tokens:
    raise ValueError(f"sequence length {q.shape[2]} does not match grid {grid} "
                     f"({grid.tokens} tokens)")
  rows = sample_rows(key, grid.tokens, router)
  spatial, temporal = probe_errors(q, k, v, rows, grid, include_sink=router.include_sink,
                                   scale=scale)
  return Routing(temporal < spatial, spatial, temporal)


def route_heads(q: jax.Array, k: jax.Array, v: jax.Array, *, grid: VideoGrid, config: Any,
                key: jax.Array, scale: float | None = None) -> jax.Array:
  """``bool[B, H]``: True where a head is routed temporal (see :func:`profile_heads`)."""
  return profile_heads(q, k, v, grid=grid, config=config, key=key, scale=scale).temporal
