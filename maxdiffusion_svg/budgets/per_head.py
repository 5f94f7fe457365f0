"""Per-head budgets: each head's own band density, run by one kernel call in one compile, as
static per-head tile tables (``-1`` past a head's count) on a *carrier* plan of the widest
head's rows."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from maxdiffusion_svg.budgets.per_layer import UNIFORM, per_layer_values
from maxdiffusion_svg.kernels.worklist import ragged_cores
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.masks import check_density
from maxdiffusion_svg.plan.tiles import FULL, MASKED, TilePlan, TileMode, plan_tiles


def check_head_densities(value: Any, key: str = "svg_head_densities"
                         ) -> tuple[tuple[float, ...], ...] | None:
  """``value`` as per-head density lists per layer (None: unset), from ``uniform``, one list
  (every layer: a 1-tuple), one per layer, a mapping of layer ranges to lists, or YAML text.
  Lists must match in length, densities in (0, 1]; else refused naming ``key``."""
  if isinstance(value, str) and value.strip() != UNIFORM:
    try:
      value = yaml.safe_load(value)
    except yaml.YAMLError as e:
      raise ValueError(f"{key}: cannot read {value!r} ({_FORMS})") from e
  if isinstance(value, (list, tuple)) and value and all(
      isinstance(d, (int, float, np.integer, np.floating)) and not isinstance(d, bool)
      for d in value):
    value = [value]  # one list of heads: every layer
  layers = per_layer_values(value, key, "per-head density lists")
  if layers is None:
    return None
  out = []
  for i, heads in enumerate(layers):
    if isinstance(heads, (str, bytes)) or not isinstance(heads, Sequence) or not heads:
      raise ValueError(f"{key}[{i}] must be a non-empty list of densities, one per head "
                       f"({_FORMS}), got {heads!r}")
    for h, density in enumerate(heads):
      check_density(density, f"{key}[{i}][{h}]")
    out.append(tuple(float(d) for d in heads))
  if len({len(heads) for heads in out}) > 1:
    raise ValueError(f"{key}: every layer must list the same number of heads, got "
                     f"{sorted({len(heads) for heads in out})}")
  return tuple(out)


def check_head_shape(densities: tuple[tuple[float, ...], ...], layers: int, heads: int,
                     key: str = "svg_head_densities") -> None:
  """Refuses densities that are not one list per layer (or one) of one density per head."""
  if len(densities) not in (1, layers):
    raise ValueError(f"{key} gives {len(densities)} layers; the model has {layers} (give one "
                     f"list of heads per layer, one list for every layer, or {UNIFORM!r})")
  if len(densities[0]) != heads:
    raise ValueError(f"{key} lists {len(densities[0])} heads; the model has {heads} (one "
                     f"density per attention head)")


_FORMS = ("one density per head for every layer, a list of such lists per layer, a mapping of "
          f"layer ranges to such lists, or {UNIFORM!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class HeadBudget:
  """Each (layer, head)'s plan, the carrier plan and the tables; one layer stands for all."""

  densities: tuple[tuple[float, ...], ...]  # [layers][heads] (global heads)
  plans: tuple[tuple[TilePlan, ...], ...]  # [layers][heads], aligned, on the same tiles
  carrier: TilePlan  # per row the widest head's count: the slots every head's table fills
  tables: np.ndarray  # int32 [layers, heads, num_q_tiles, carrier.width]; -1 past a head's count

  @property
  def layers(self) -> int:
    return len(self.plans)

  @property
  def heads(self) -> int:
    return len(self.plans[0])

  @functools.cached_property
  def head_steps(self) -> np.ndarray:
    """``int64 [layers, heads]``: the tiles each head visits (its work list's length)."""
    return np.array([[plan.stats.visited_tiles for plan in layer] for layer in self.plans],
                    np.int64)

  @functools.cached_property
  def visited(self) -> np.ndarray:
    """``bool [layers, heads, num_q_tiles, num_kv_tiles]``: the key tiles each head's rows visit."""
    return np.stack([np.stack([plan.computed_mask.visited for plan in layer])
                     for layer in self.plans])

  @functools.cached_property
  def fewest_visited(self) -> int:
    """The fewest key tiles any head's query tile row visits."""
    return int(min(plan.num_visited.min() for layer in self.plans for plan in layer))

  def visited_tiles(self, layer: int = 0) -> int:
    """Tiles one example's heads visit in ``layer`` (the call's cost, per example)."""
    return int(self.head_steps[layer].sum())

  def steps_bound(self, batch: int, local_heads: int) -> int:
    """The most steps one lane of a ragged call on ``[batch, local_heads]`` heads can walk, in
    any layer and for any window of consecutive heads (so on every device after Ulysses)."""
    n = batch * local_heads
    cores = ragged_cores(n)
    per = -(-n // cores)
    starts = np.arange(self.heads)[:, None]
    ids = (starts + np.arange(local_heads)[None, :]) % self.heads  # [starts, local_heads]
    steps = np.tile(self.head_steps[:, ids], (1, 1, batch))  # [layers, starts, n]
    steps = np.pad(steps, ((0, 0), (0, 0), (0, cores * per - n)))
    return int(steps.reshape(self.layers, self.heads, cores, per).sum(axis=3).max())

  def _at(self, table: np.ndarray, layer: Any, head_ids: jax.Array) -> jax.Array:
    if self.layers == 1 or layer is None:
      return jnp.take(jnp.asarray(table[0]), head_ids, axis=0)
    if isinstance(layer, (int, np.integer)):
      return jnp.take(jnp.asarray(table[int(layer)]), head_ids, axis=0)
    return jnp.asarray(table)[layer, head_ids]

  def tables_for(self, head_ids: jax.Array, layer: Any = None) -> jax.Array:
    """``int32 [*head_ids.shape, num_q_tiles, width]`` tables of the heads named, in ``layer``
    (a Python int or a traced index; None with one layer)."""
    return self._at(self.tables, layer, head_ids)

  def visited_for(self, head_ids: jax.Array, layer: Any = None) -> jax.Array:
    """``bool [*head_ids.shape, num_q_tiles, num_kv_tiles]``: :attr:`visited` of those heads."""
    return self._at(self.visited, layer, head_ids)


def head_budget(grid: VideoGrid, densities: Any, block_q: int, block_kv: int, *,
                include_sink: bool = True, sink_frames: int = 1) -> HeadBudget:
  """The per-head budget of ``densities`` on ``grid``'s aligned tiles (cached)."""
  layers = check_head_densities(densities)
  if layers is None:
    raise ValueError("svg_head_densities is unset (uniform): there is no per-head budget")
  return _head_budget(grid, layers, block_q, block_kv, include_sink, sink_frames)


@functools.lru_cache(maxsize=32)
def _head_budget(grid: VideoGrid, densities: tuple[tuple[float, ...], ...], block_q: int,
                 block_kv: int, include_sink: bool, sink_frames: int) -> HeadBudget:
  plans = tuple(tuple(plan_tiles(grid, d, block_q, block_kv, TileMode.ALIGNED,
                                 include_sink=include_sink, sink_frames=sink_frames)
                      for d in layer)
                for layer in densities)
  flat = [plan for layer in plans for plan in layer]
  counts = np.stack([plan.num_visited for plan in flat])  # [layers * heads, q_tiles]
  width = int(counts.max())
  # Each head's columns and kinds in the widest row's slots (unused slots repeat the last
  # column as a plan's do, kind EMPTY).
  cols = np.stack([np.pad(plan.kv_index, ((0, 0), (0, width - plan.width)), mode="edge")
                   for plan in flat])
  kinds = np.stack([np.pad(plan.kind, ((0, 0), (0, width - plan.width))) for plan in flat])
  tables = np.where(np.arange(width) < counts[..., None], cols, -1).astype(np.int32)
  rows, widest = np.arange(counts.shape[1]), counts.argmax(axis=0)  # per row, a widest head
  carrier = _carrier(flat, cols[widest, rows], kinds[widest, rows], counts.max(axis=0))
  tables = tables.reshape(len(plans), len(plans[0]), *tables.shape[1:])
  tables.setflags(write=False)
  return HeadBudget(densities, plans, carrier, tables)


def _carrier(plans: list[TilePlan], kv_index: np.ndarray, kind: np.ndarray,
             counts: np.ndarray) -> TilePlan:
  """The plan of the widest head's rows (the slots tables fill), with the densest head's stats."""
  densest = max(plans, key=lambda plan: plan.stats.visited_tiles)
  kv_index, kind, counts = kv_index.astype(np.int32), kind.astype(np.int8), counts.astype(np.int32)
  for a in (kv_index, kind, counts):
    a.setflags(write=False)
  stats = dataclasses.replace(densest.stats, visited_tiles=int(counts.sum()),
                              masked_tiles=int((kind == MASKED).sum()),
                              full_tiles=int((kind == FULL).sum()))
  return dataclasses.replace(densest, kv_index=kv_index, kind=kind, num_visited=counts,
                             stats=stats)


__all__ = ["HeadBudget", "check_head_densities", "check_head_shape", "head_budget"]
