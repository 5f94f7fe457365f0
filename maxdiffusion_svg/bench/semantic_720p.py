"""``bench semantic-720p``: the semantic layout's quality at 720p, measured on CPU (slow: minutes).

The quality benchmark's semantic section runs a 5,040-token grid, where a semantic head's
placement moves single tokens. At 720p (75,600 tokens) it moves groups of tokens, so that its
gathers cost what the TPU budget allows; what that grouping costs in quality shows only at 720p.
This regenerates the 720p table of docs/benchmarks.md ("At 720p: what groups cost in
quality"): moving-content heads (:func:`moving_qkv`, sharp and soft), each layout forced (spatial,
temporal, semantic at each token group), optionally both routers, at our kernel's TPU tile on the
XLA executor; PSNR of each head's output against the exact dense one (the same executor on a
density-1 plan), averaged per kind. Target (issue 45): the semantic layout at least
:data:`GAIN_DB` over the better SVG1 layout at the default group (:func:`group_size`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg.bench.compensation_quality import SOFT_STRENGTH
from maxdiffusion_svg.bench.quality import psnr
from maxdiffusion_svg.bench.synthetic import PLANTED_STRENGTH, planted_qkv
from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.call.attention import (placed_attention, semantic_placed_attention,
                                             svg_attention)
from maxdiffusion_svg.kernels import sparse_attention
from maxdiffusion_svg.plan.geometry import VideoGrid, grid_for_resolution
from maxdiffusion_svg.plan.tiling import PALLAS_TILES
from maxdiffusion_svg.routing.layouts import LAYOUTS, SEMANTIC
from maxdiffusion_svg.routing.semantic import group_size, semantic_layout

GAIN_DB = 1.0
COMPENSATED = " +comp"
KINDS = ("moving", "soft_moving")
ROUTERS = {"router SVG1": ("spatial", "temporal"),
           "router 3 layouts": ("spatial", "temporal", "semantic")}


@dataclasses.dataclass(frozen=True)
class Semantic720pConfig:
  """What ``bench semantic-720p`` runs; defaults are the documented table's."""

  resolution: str = "720p"
  densities: tuple[float, ...] = (0.15,)
  groups: tuple[int, ...] = (1, 8, 16)  # tokens a semantic placement moves together
  heads: int = 2  # per kind (sharp and soft moving)
  head_dim: int = 64
  clusters: int = 32
  block_q: int = PALLAS_TILES.block_q  # our kernel's TPU tile
  block_kv: int = PALLAS_TILES.block_kv
  routers: bool = False
  compensation: bool = False  # also each SVG1 layout and the default group compensated
  compensation_blocks: int = 8
  seed: int = 2
  grid: VideoGrid | None = None  # in place of the resolution's (tests: a small grid)

  @property
  def video_grid(self) -> VideoGrid:
    return self.grid or grid_for_resolution(self.resolution)

  def __post_init__(self):
    grid = self.video_grid
    for g in self.groups:
      if g < 1 or grid.width % g:
        raise ValueError(f"--groups: each must divide the frame's width ({grid.width} tokens at "
                         f"{grid}), got {g}")
    if self.heads < 1:
      raise ValueError(f"--heads must be >= 1, got {self.heads}")
    self.svg_config(self.densities[0])  # validates densities, tiles and clusters

  def svg_config(self, density: float, layouts: Sequence[str] = ("semantic",),
                 compensation: bool = False) -> SvgConfig:
    return SvgConfig(density=density, tile_mode="aligned", block_q=self.block_q,
                     block_kv=self.block_kv, backend="xla", layouts=tuple(layouts),
                     semantic_clusters=self.clusters, compensation=compensation,
                     compensation_blocks=self.compensation_blocks)


def moving_qkv(grid: VideoGrid, heads: int, head_dim: int,
               seed: int) -> tuple[tuple[np.ndarray, ...], list[str]]:
  """``heads`` moving-content heads at the planted strength, then ``heads`` soft ones (the
  compensation section's strengths), and each head's kind."""
  sharp = planted_qkv(grid, ("moving",) * heads, head_dim, seed=seed)
  soft = planted_qkv(grid, ("moving",) * heads, head_dim,
                     strength=PLANTED_STRENGTH * SOFT_STRENGTH, seed=seed + 1)
  return (tuple(np.concatenate(pair, axis=1) for pair in zip(sharp, soft)),
          [KINDS[0]] * heads + [KINDS[1]] * heads)


def run_semantic_720p(cfg: Semantic720pConfig,
                      log: Callable[[str], None] = print) -> dict[str, Any]:
  """Per density, each layout's (and router's) mean PSNR per kind; JSON-ready."""
  grid = cfg.video_grid
  (q, k, v), kinds = moving_qkv(grid, cfg.heads, cfg.head_dim, cfg.seed)
  q, k, v = (jnp.asarray(x) for x in (q, k, v))
  members = {kind: [h for h, name in enumerate(kinds) if name == kind] for kind in KINDS}
  start = time.perf_counter()
  log(f"semantic quality: {grid} = {grid.tokens:,} tokens, {len(kinds)} heads; the dense reference...")
  dense_plan = cfg.svg_config(1.0).dense_plan(grid, backend="xla")
  dense = np.asarray(jax.jit(lambda q, k, v: sparse_attention(q, k, v, dense_plan,
                                                              backend="xla"))(q, k, v))

  def scores(out: jax.Array) -> dict[str, float]:
    out = np.asarray(out)
    per_head = [psnr(out[:, h], dense[:, h]) for h in range(len(kinds))]
    return {kind: float(np.mean([per_head[h] for h in members[kind]])) for kind in KINDS}

  rows: dict[str, Any] = {}
  for density in cfg.densities:
    config = cfg.svg_config(density)
    plan = config.plan(grid, backend="xla")
    row: dict[str, Any] = {"visited_tile_fraction": plan.stats.visited_tile_fraction}
    for name, temporal in (("spatial", False), ("temporal", True)):
      run = jax.jit(lambda q, k, v, t=temporal: placed_attention(
          q, k, v, jnp.full(q.shape[:2], t), grid=grid, plan=plan, backend="xla"))
      row[name] = scores(run(q, k, v))
      log(f"  density {density} {name}: {_line(row[name])} ({time.perf_counter() - start:.0f} s)")
    layout = jnp.full(q.shape[:2], LAYOUTS.index(SEMANTIC), jnp.int32)
    for group in cfg.groups:
      run = jax.jit(lambda q, k, v, group=group: semantic_placed_attention(
          q, k, v, layout, semantic_layout(q, k, v, plan, config.semantic, group=group),
          grid=grid, plan=plan, backend="xla"))
      row[f"semantic g{group}"] = scores(run(q, k, v))
      log(f"  density {density} semantic, groups of {group}: {_line(row[f'semantic g{group}'])} "
          f"({time.perf_counter() - start:.0f} s)")
    if cfg.compensation:
      _compensated(cfg, row, density, grid, plan, (q, k, v), scores,
                   lambda name: log(f"  density {density} {name}: {_line(row[name])} "
                                    f"({time.perf_counter() - start:.0f} s)"))
    if cfg.routers:
      for name, layouts in ROUTERS.items():
        for compensation in (False, True) if cfg.compensation else (False,):
          routed = cfg.svg_config(density, layouts, compensation)
          label = name + COMPENSATED * compensation
          run = jax.jit(lambda q, k, v, routed=routed: svg_attention(
              q, k, v, grid=grid, config=routed, return_info=True)[0])
          row[label] = scores(run(q, k, v))
          log(f"  density {density} {label}: {_line(row[label])} "
              f"({time.perf_counter() - start:.0f} s)")
    rows[str(density)] = row
  default = group_size(grid)
  return {"kind": "measured on CPU", "grid": [grid.frames, grid.height, grid.width], "tokens": grid.tokens,
          "heads": kinds, "head_dim": cfg.head_dim, "tiles": [cfg.block_q, cfg.block_kv],
          "clusters": cfg.clusters, "default_group": default, "rows": rows,
          "targets": _targets(rows, default), "seconds": round(time.perf_counter() - start, 1)}


def _compensated(cfg: Semantic720pConfig, row: dict[str, Any], density: float, grid: VideoGrid,
                 plan: Any, qkv: tuple[jax.Array, ...], scores: Callable, log: Callable) -> None:
  """Each SVG1 layout and the semantic one at the default group, compensated (the tiles a row
  skips enter its softmax as centroids, ``compensation_blocks`` per key tile)."""
  blocks = cfg.compensation_blocks
  for name, temporal in (("spatial", False), ("temporal", True)):
    run = jax.jit(lambda q, k, v, t=temporal: placed_attention(
        q, k, v, jnp.full(q.shape[:2], t), grid=grid, plan=plan, backend="xla",
        compensation_blocks=blocks))
    row[name + COMPENSATED] = scores(run(*qkv))
    log(name + COMPENSATED)
  group = group_size(grid)
  semantic = cfg.svg_config(density, compensation=True).semantic
  layout = jnp.full(qkv[0].shape[:2], LAYOUTS.index(SEMANTIC), jnp.int32)
  run = jax.jit(lambda q, k, v: semantic_placed_attention(
      q, k, v, layout, semantic_layout(q, k, v, plan, semantic, group=group), grid=grid,
      plan=plan, backend="xla", compensation_blocks=blocks))
  name = f"semantic g{group}{COMPENSATED}"
  row[name] = scores(run(*qkv))
  log(name)


def _line(cell: dict[str, float]) -> str:
  return ", ".join(f"{kind} {value:.2f} dB" for kind, value in cell.items())


def _targets(rows: dict[str, Any], group: int) -> dict[str, Any]:
  """The semantic layout at the default group against the better SVG1 layout, per kind; with
  compensation, the better compensated SVG1 layout against the better plain one."""
  gains, comp = {}, {}
  best = lambda row, kind, suffix="": max(row["spatial" + suffix][kind], row["temporal" + suffix][kind])
  for density, row in rows.items():
    for kind in KINDS:
      if f"semantic g{group}" in row:
        gains[f"{kind} {density}"] = row[f"semantic g{group}"][kind] - best(row, kind)
      if "spatial" + COMPENSATED in row:
        comp[f"{kind} {density}"] = best(row, kind, COMPENSATED) - best(row, kind)
  targets = {"semantic_gain_db": gains, "gain_target_db": GAIN_DB,
             "met": bool(gains) and min(gains.values()) >= GAIN_DB}
  if comp:
    targets["compensation_gain_db"] = comp
    targets["compensation_met"] = min(comp.values()) >= GAIN_DB
  return targets


def format_semantic_720p(result: dict[str, Any]) -> str:
  tiles = "x".join(map(str, result["tiles"]))
  lines = [f"semantic layout at 720p (measured on CPU): mean PSNR (dB) against dense per kind, "
           f"{result['tokens']:,} tokens, tiles {tiles}, {result['clusters']} clusters, XLA "
           f"executor, layouts forced",
           f"{'density':<9}{'visited%':>9}  {'layout':<22}" + "".join(f"{k:>14}" for k in KINDS)]
  for density, row in result["rows"].items():
    first = True
    for name, cell in row.items():
      if not isinstance(cell, dict):
        continue
      head = f"{density:<9}{row['visited_tile_fraction']:>8.1%}" if first else " " * 17
      lines.append(f"{head}  {name:<22}" + "".join(f"{cell[k]:>14.2f}" for k in KINDS))
      first = False
  targets = result["targets"]
  gains = ", ".join(f"{name} {gain:+.2f}" for name, gain in targets["semantic_gain_db"].items())
  lines.append(f"semantic (groups of {result['default_group']}) over the better SVG1 layout: "
               f"{gains} dB (target +{targets['gain_target_db']:g} dB: "
               f"{'met' if targets['met'] else 'missed'})")
  if "compensation_gain_db" in targets:
    comp = ", ".join(f"{name} {gain:+.2f}" for name, gain in targets["compensation_gain_db"].items())
    lines.append(f"compensation (the better SVG1 layout, compensated against plain): {comp} dB "
                 f"(target +{targets['gain_target_db']:g} dB: "
                 f"{'met' if targets['compensation_met'] else 'missed'})")
  return "\n".join(lines)
