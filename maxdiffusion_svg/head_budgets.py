"""Per-head budgets: each head's own band density, run by one kernel call in one compile.

A layer's heads differ (some nearly dense, some very local), so one density per layer
over-spends on some heads and starves others. Here each head ``h`` of a call gets its own
aligned plan at ``densities[h]`` on the same tiles. Spatial and temporal heads share the band
in their placed order, so a head's plan does not depend on its route: the tables are static,
built once per (grid, tiles, densities) in O(heads x tiles).

The kernel takes them as per-head tile tables (``head_tiles``) on a *carrier* plan whose
rows hold the widest head's count, ``-1`` in the slots a narrower head leaves unused, and
walks a ragged grid: the heads' own lists end to end, so a call costs the tiles its heads
visit (:func:`maxdiffusion_svg.kernels.worklist.pack_ragged_work`). Its static length bounds
what any device's heads can need after the Ulysses exchange (:meth:`HeadBudget.steps_bound`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg.geometry import VideoGrid
from maxdiffusion_svg.kernels.worklist import ragged_cores
from maxdiffusion_svg.tiles import FULL, MASKED, TilePlan, TileMode, plan_tiles


def check_head_densities(value: object, name: str = "svg_head_densities") -> tuple[float, ...]:
  """One density in (0, 1] per head, refused by ``name`` otherwise."""
  if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
    raise ValueError(f"{name} must be a non-empty list of densities in (0, 1], one per head, "
                     f"got {value!r}")
  out = []
  for i, d in enumerate(value):
    if isinstance(d, bool) or not isinstance(d, (int, float, np.floating, np.integer)) \
        or not 0.0 < float(d) <= 1.0:
      raise ValueError(f"{name}[{i}] must be a density in (0, 1], got {d!r}")
    out.append(float(d))
  return tuple(out)


@dataclasses.dataclass(frozen=True, eq=False)
class HeadBudget:
  """Each head's plan at its own density, the carrier plan and the heads' tables."""

  densities: tuple[float, ...]  # one per (global) head
  plans: tuple[TilePlan, ...]  # one per head, aligned, on the same tiles
  carrier: TilePlan  # per row the widest head's count: the slots every head's table fills
  tables: np.ndarray  # int32 [heads, num_q_tiles, carrier.width]; -1 past a head's count

  @property
  def heads(self) -> int:
    return len(self.plans)

  @functools.cached_property
  def head_steps(self) -> np.ndarray:
    """``int64 [heads]``: the tiles each head visits (its work list's length)."""
    return np.array([plan.stats.visited_tiles for plan in self.plans], np.int64)

  def visited_tiles(self) -> int:
    """Tiles one example's heads visit in all (the call's cost, per example)."""
    return int(self.head_steps.sum())

  def steps_bound(self, batch: int, local_heads: int) -> int:
    """The most steps one core of a ragged call on ``[batch, local_heads]`` heads can walk.

    A device's heads are a window of consecutive heads (mod ``heads``) in each batch row: the
    whole call on one device, ``H/n`` heads after the Ulysses exchange, or ``B*H/n`` folded
    heads with the batch folded in. Every window start is tried, so the bound holds on every
    device; a device's cores split its ``batch x local_heads`` lists as the kernel does."""
    n = batch * local_heads
    cores = ragged_cores(n)
    per = -(-n // cores)
    starts = np.arange(self.heads)[:, None]
    ids = (starts + np.arange(local_heads)[None, :]) % self.heads  # [starts, local_heads]
    steps = np.tile(self.head_steps[ids], (1, batch))  # [starts, n], batch row after row
    steps = np.pad(steps, ((0, 0), (0, cores * per - n)))
    return int(steps.reshape(self.heads, cores, per).sum(axis=2).max())

  def tables_for(self, head_ids: jax.Array) -> jax.Array:
    """``int32 [*head_ids.shape, num_q_tiles, width]``: the tables of the heads named."""
    return jnp.take(jnp.asarray(self.tables), head_ids, axis=0)


def head_budget(grid: VideoGrid, densities: Sequence[float], block_q: int, block_kv: int, *,
                include_sink: bool = True) -> HeadBudget:
  """The per-head budget of ``densities`` (one per head) on ``grid``'s aligned tiles
  (cached: static per shape)."""
  return _head_budget(grid, check_head_densities(densities), block_q, block_kv, include_sink)


@functools.lru_cache(maxsize=32)
def _head_budget(grid: VideoGrid, densities: tuple[float, ...], block_q: int, block_kv: int,
                 include_sink: bool) -> HeadBudget:
  plans = tuple(plan_tiles(grid, d, block_q, block_kv, TileMode.ALIGNED,
                           include_sink=include_sink) for d in densities)
  counts = np.stack([plan.num_visited for plan in plans])  # [heads, q_tiles]
  widest = counts.argmax(axis=0)  # per row, a head with the most tiles
  width = int(counts.max())
  slots = np.arange(width)
  tables = np.full((len(plans), counts.shape[1], width), -1, np.int32)
  for h, plan in enumerate(plans):
    cols = np.pad(plan.kv_index, ((0, 0), (0, width - plan.width)), mode="edge")
    tables[h] = np.where(slots[None, :] < plan.num_visited[:, None], cols, -1)
  carrier = _carrier(plans, tables[widest, np.arange(counts.shape[1])], counts.max(axis=0))
  tables.setflags(write=False)
  return HeadBudget(densities, plans, carrier, tables)


def _carrier(plans: tuple[TilePlan, ...], kv_index: np.ndarray, counts: np.ndarray) -> TilePlan:
  """The plan whose rows hold the widest head's tiles (that head's columns): the slots a ragged
  call's tables fill. Its pair statistics are the densest head's."""
  densest = max(plans, key=lambda plan: plan.stats.visited_tiles)
  present = np.arange(kv_index.shape[1])[None, :] < counts[:, None]
  padded = densest.seq_len % densest.block_kv != 0
  kind = np.where(present, np.where(padded & (kv_index == densest.num_kv_tiles - 1), MASKED, FULL),
                  0).astype(np.int8)
  kv_index = np.where(present, kv_index, np.take_along_axis(
      kv_index, np.maximum(counts - 1, 0)[:, None], axis=1)).astype(np.int32)
  for a in (kv_index, kind, counts):
    a.setflags(write=False)
  stats = dataclasses.replace(densest.stats, visited_tiles=int(counts.sum()),
                              masked_tiles=int((kind == MASKED).sum()),
                              full_tiles=int((kind == FULL).sum()))
  return dataclasses.replace(densest, kv_index=kv_index, kind=kind,
                             num_visited=counts.astype(np.int32), stats=stats)


__all__ = ["HeadBudget", "check_head_densities", "head_budget"]
