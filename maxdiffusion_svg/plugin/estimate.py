"""What a generation config buys, computed from its tile plans: an estimate a user can run.

For a config's video, steps and SVG keys: the tiles each sparse call visits, the share of
self-attention calls that run sparse (steps x layers of the schedule), the attention work
relative to dense and the bound that puts on attention's speed-up. Every figure is computed
from the plan (tile counts), not measured: the router, the permutation and the extra cost of
masked tiles are not counted, so the real speed-up is below the bound.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from maxdiffusion_svg.config import EXPERTS
from maxdiffusion_svg.geometry import VideoGrid
from maxdiffusion_svg.kernels.vmem_model import libtpu_note
from maxdiffusion_svg.plugin.settings import PluginSettings, config_defaults
from maxdiffusion_svg.schedule import Interval
from maxdiffusion_svg.schedule_costs import LIBTPU, PRICES
from maxdiffusion_svg.target import Target, resolve_backend

# Transformer depth by checkpoint (the YAML does not hold it): Wan 2.1 1.3B has 30 blocks,
# the 14B models and each Wan 2.2 A14B expert 40.
LAYERS_1_3B, LAYERS_14B = 30, 40


def layers_of(config: Mapping[str, Any]) -> int:
  name = str(config.get("pretrained_model_name_or_path", ""))
  return LAYERS_1_3B if "1.3B" in name else LAYERS_14B


def _count(interval: Interval, total: int) -> int:
  return max(0, min(total, interval.end if interval.end is not None else total) - interval.start)


@dataclasses.dataclass(frozen=True)
class Estimate:
  """One model's (or Wan 2.2 expert's) sparse attention, as its plan computes it."""

  expert: str | None
  density: float
  kept_pair_fraction: float  # of all pairs: the band plus the first-frame sink (exact mask)
  visited_tile_fraction: float  # tiles a sparse call computes, of all tiles
  full_tiles: int
  masked_tiles: int
  sparse_steps: int
  sparse_layers: int
  steps: int
  layers: int

  @property
  def sparse_call_share(self) -> float:
    return self.sparse_steps * self.sparse_layers / (self.steps * self.layers)

  @property
  def work_vs_dense(self) -> float:
    """Self-attention tiles computed over the run, relative to all-dense."""
    share = self.sparse_call_share
    return (1 - share) + share * self.visited_tile_fraction

  @property
  def speedup_bound(self) -> float:
    return 1 / self.work_vs_dense

  def as_dict(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), "sparse_call_share": self.sparse_call_share,
            "work_vs_dense": self.work_vs_dense, "speedup_bound": self.speedup_bound}


def estimate_config(config: Mapping[str, Any], target: Target,
                    layers: int | None = None) -> dict[str, Any]:
  """The estimate for a merged MaxDiffusion config (its ``svg_*`` keys over their defaults)."""
  keys = {**config_defaults(), **config}
  for key in ("num_frames", "height", "width", "num_inference_steps"):
    if key not in keys:
      raise ValueError(f"the config has no {key}: the estimate needs the video and the steps")
  steps = keys["num_inference_steps"]
  settings = PluginSettings.from_mapping(keys)
  svg = settings.svg
  grid = VideoGrid.for_video(keys["num_frames"], keys["height"], keys["width"])
  layers = layers_of(keys) if layers is None else layers
  target = svg.target(target=target)  # under the config's svg_vmem_limit_kib, if set
  backend = resolve_backend(svg.backend, target)
  tiles = svg.tiles(target, backend)
  experts = EXPERTS if keys.get("model_name") == "wan2.2" else (None,)
  rows, schedule = [], []
  for expert in experts:
    plan = svg.plan(grid, expert, target, backend)
    stats = plan.stats
    rows.append(Estimate(
        expert=expert, density=svg.density_for(expert),
        kept_pair_fraction=stats.exact_pair_fraction,
        visited_tile_fraction=stats.visited_tile_fraction, full_tiles=stats.full_tiles,
        masked_tiles=stats.masked_tiles,
        sparse_steps=_count(svg.schedule.active_steps, steps),
        sparse_layers=_count(svg.schedule.active_layers, layers), steps=steps, layers=layers))
    schedule.append(_against_fixed_m(plan, rows[-1].sparse_call_share, tiles, target, backend))
  return {"kind": "computed from the tile plan", "target": target.describe(),
          "libtpu_note": libtpu_note() if backend == "splash" else "",
          "backend": backend, "tiles": [tiles.block_q, tiles.block_kv],
          "tile_mode": svg.tile_mode.value, "video": [keys["num_frames"], keys["height"],
                                                       keys["width"]],
          "grid": list(grid.shape), "tokens": grid.tokens, "preset": settings.preset,
          "rows": [{**row.as_dict(), "vs_fixed_m": vs} for row, vs in zip(rows, schedule)]}


def _against_fixed_m(plan, share: float, tiles, target: Target, backend: str) -> dict[str, Any]:
  """The run's self-attention bundles by libtpu's static schedule (schedule_costs.PRICES),
  ours (``share`` of the calls sparse, the rest dense) against MaxDiffusion's fixed-m kernel at
  its fast recipe on every call; or why it cannot be priced."""
  chip = target.generation.name if target.known else None
  prices = PRICES.get(chip or "", {})
  ours, theirs = prices.get("ours"), prices.get("maxdiffusion_fixed_m")
  if backend != "pallas" or ours is None or theirs is None:
    return {"priced": False, "why": f"no static-schedule figures for {backend} on "
                                    f"{target.chip} (measured: pallas on {', '.join(PRICES)})"}
  if (tiles.block_q, tiles.block_kv, tiles.block_kv_compute) != ours.tiles or plan.masks_exact:
    return {"priced": False, "why": f"figures are for aligned {ours.tiles[0]}x{ours.tiles[1]}/"
                                    f"{ours.tiles[2]} tiles"}
  stats, tokens = plan.stats, plan.seq_len
  out: dict[str, Any] = {"priced": True, "chip": chip, "libtpu": LIBTPU,
                         "fixed_m_call": theirs.dense_call(tokens)}
  for path, online in (("fixed", False), ("online", True)):
    sparse = ours.call(stats.full_tiles, stats.masked_tiles, plan.num_q_tiles, online)
    dense = ours.dense_call(tokens, online)
    run = share * sparse + (1 - share) * dense
    out[path] = {"sparse_call": sparse, "dense_call": dense,
                 "bound": out["fixed_m_call"] / run}
  return out


def format_estimate(result: dict[str, Any]) -> str:
  frames, height, width = result["video"]
  lines = [
      f"Estimate, {result['kind']} (not measured): {result['target']}, {result['backend']} "
      f"tiles {result['tiles'][0]}x{result['tiles'][1]}, mode {result['tile_mode']}",
      f"video {frames}x{height}x{width} -> grid {'x'.join(map(str, result['grid']))} = "
      f"{result['tokens']:,} tokens; preset {result['preset']}",
  ]
  for row in result["rows"]:
    who = f"{row['expert']} expert: " if row["expert"] else ""
    lines += [
        f"{who}svg_density {row['density']} (band density; with the first-frame sink "
        f"{row['kept_pair_fraction']:.1%} of pairs kept); a sparse call visits "
        f"{row['visited_tile_fraction']:.1%} of the tiles ({row['full_tiles']:,} full, "
        f"{row['masked_tiles']:,} masked)",
        f"  sparse calls: {row['sparse_steps']} of {row['steps']} steps x {row['sparse_layers']} "
        f"of {row['layers']} layers = {row['sparse_call_share']:.1%} of self-attention calls",
        f"  self-attention work vs dense: {row['work_vs_dense']:.3f} -> attention speed-up at "
        f"most {row['speedup_bound']:.2f}x (tiles only: the router, the permutation and "
        f"masked-tile cost are not counted)",
    ]
    vs = row.get("vs_fixed_m") or {}
    if vs.get("priced"):
      fixed, online = vs["fixed"], vs["online"]
      lines.append(
          f"  against MaxDiffusion's ulysses_custom_fixed_m (fast recipe; libtpu {vs['libtpu']}'s "
          f"static schedule, {vs['chip']}): a sparse call {fixed['sparse_call'] / vs['fixed_m_call']:.2f}"
          f" of its call, a dense step {fixed['dense_call'] / vs['fixed_m_call']:.2f}; attention "
          f"speed-up at most {fixed['bound']:.2f}x with dense steps (heads on online softmax: "
          f"{online['bound']:.2f}x)")
    elif vs:
      lines.append(f"  against MaxDiffusion's ulysses_custom_fixed_m: not priced ({vs['why']})")
  if result.get("libtpu_note"):
    lines.append(f"note: {result['libtpu_note']}")
  if len(result["rows"]) > 1:
    lines.append("(Wan 2.2: each expert's line is as if it ran every step; the run splits the "
                 "steps between them at boundary_ratio)")
  return "\n".join(lines)
