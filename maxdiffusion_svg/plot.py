"""Pictures of masks and tile plans (matplotlib, imported only when plotting)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from maxdiffusion_svg.geometry import VideoGrid
from maxdiffusion_svg.masks import PlacedMask, svg_mask
from maxdiffusion_svg.report import HEADS, kernel_mask
from maxdiffusion_svg.tiles import EMPTY, FULL, MASKED, TileMode, plan_mask_tiles

_TILE_COLOURS = {EMPTY: "#f2f2f2", MASKED: "#e4572e", FULL: "#2e86ab"}


def plot_tiles(path: str, grid: VideoGrid, density: float, block_q: int, block_kv: int,
               modes: Sequence[TileMode | str] = tuple(TileMode), *, include_sink: bool = True,
               crop_frames: int = 2, max_pixels: int = 800) -> None:
  """Writes one row per head type: its token-level mask, then a tile map per mode.

  Token-level panels are in the original frame-major order, where a temporal head's
  band shows as per-frame stripes: the whole sequence (every n-th token) and a crop of
  the first ``crop_frames`` frames. Tile maps are in the order tokens reach the kernel.
  """
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import colors, patches, pyplot  # pylint: disable=import-outside-toplevel

  mask = svg_mask(grid, density, include_sink)
  crop = min(crop_frames * grid.frame_size, grid.tokens)
  views = (("whole sequence", grid.tokens), (f"first {crop:,} tokens", crop))
  cmap = colors.ListedColormap([_TILE_COLOURS[k] for k in (EMPTY, MASKED, FULL)])
  cols = len(views) + len(modes)
  fig, axes = pyplot.subplots(len(HEADS), cols, figsize=(3.6 * cols, 3.8 * len(HEADS)),
                              squeeze=False)
  for row, (head, (layout, placed_first)) in enumerate(HEADS.items()):
    placed = PlacedMask(mask, grid, layout)
    for col, (label, extent) in enumerate(views):
      step = max(1, -(-extent // max_pixels))
      idx = np.arange(0, extent, step)
      ax = axes[row, col]
      ax.imshow(placed.contains(idx[:, None], idx[None, :]), cmap="Greys", vmin=0, vmax=1,
                interpolation="nearest", extent=(0, extent, extent, 0))
      ax.set_title(f"{head} head, {label}\n(frame-major order, every {step}th token)"
                   if step > 1 else f"{head} head, {label}\n(frame-major order)", fontsize=9)
      ax.set_xlabel("key token")
      ax.set_ylabel("query token")
    plans = [plan_mask_tiles(kernel_mask(mask, grid, head), block_q, block_kv, m) for m in modes]
    order = f"{layout.value} layout" if placed_first else "frame-major, not placed"
    for col, plan in enumerate(plans, start=len(views)):
      ax = axes[row, col]
      ax.imshow(plan.tile_map(), cmap=cmap, vmin=0, vmax=2, interpolation="nearest", aspect="auto")
      s = plan.stats
      ax.set_title(f"{head}, {plan.mode.value} ({order})\nvisited "
                   f"{100 * s.visited_tile_fraction:.1f}%, masked {100 * s.masked_tile_fraction:.1f}%",
                   fontsize=8)
      ax.set_xlabel(f"kv tile ({block_kv} tokens)")
      ax.set_ylabel(f"q tile ({block_q} tokens)")
  legend = [patches.Patch(color=_TILE_COLOURS[k], label=name)
            for k, name in ((EMPTY, "empty (skipped)"), (FULL, "full (no mask)"),
                            (MASKED, "masked"))]
  fig.legend(handles=legend, loc="lower center", ncol=3)
  fig.suptitle(f"grid {grid} ({grid.tokens:,} tokens), density {density}, "
               f"tiles {block_q}x{block_kv}")
  fig.tight_layout(rect=(0, 0.05, 1, 0.95))
  fig.savefig(path, dpi=90)
  pyplot.close(fig)

