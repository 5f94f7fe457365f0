"""Pictures of masks and tile plans (matplotlib, imported only when plotting)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from maxdiffusion_svg.cli.report import HEADS, kernel_mask
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.masks import PlacedMask, svg_mask
from maxdiffusion_svg.plan.tiles import EMPTY, FULL, MASKED, TileMode, plan_mask_tiles

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


def plot_quality(path: str, cfg, result: dict, max_pixels: int = 504) -> None:
  """Attention maps of a spatial and a temporal head with their chosen masks drawn over
  them, and the router's per-head errors, for the quality benchmark."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=import-outside-toplevel

  from maxdiffusion_svg.bench.synthetic import planted_qkv  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.plan.geometry import TokenOrder  # pylint: disable=import-outside-toplevel

  grid = cfg.grid
  q, k, _ = planted_qkv(grid, cfg.head_types, cfg.head_dim, seed=cfg.seed)
  heads = {t: cfg.head_types.index(t) for t in ("spatial", "temporal") if t in cfg.head_types}
  oracle = result["oracle"]["temporal"]
  mask = svg_mask(grid, cfg.timing_density)
  step = max(1, -(-grid.tokens // max_pixels))
  idx = np.arange(0, grid.tokens, step)
  fig, axes = pyplot.subplots(1, len(heads) + 1, figsize=(5.2 * (len(heads) + 1), 5))
  for ax, (kind, h) in zip(axes, heads.items()):
    logits = jnp.asarray(q[0, h]) @ jnp.asarray(k[0, h]).T / np.sqrt(cfg.head_dim)
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    s = grid.tokens - grid.tokens % step
    pooled = probs[:s, :s].reshape(s // step, step, s // step, step).sum(axis=(1, 3))
    ax.imshow(np.log10(pooled + 1e-9), cmap="magma", interpolation="nearest",
              extent=(0, s, s, 0))
    layout = TokenOrder.TEMPORAL_MAJOR if oracle[h] else TokenOrder.FRAME_MAJOR
    chosen = PlacedMask(mask, grid, layout).contains(idx[:, None], idx[None, :])
    ax.contour(idx, idx, chosen.astype(float), levels=[0.5], colors="cyan", linewidths=0.6)
    ax.set_title(f"planted {kind} head {h}: attention (log10)\nrouted {layout.value}; "
                 f"cyan: its mask at density {cfg.timing_density}", fontsize=9)
    ax.set_xlabel("key token (frame-major)")
    ax.set_ylabel("query token")
  ax = axes[-1]
  errors = result["routing"]["stratified_errors"]
  x = np.arange(len(cfg.head_types))
  ax.bar(x - 0.2, errors["spatial"], 0.4, label="spatial probe MSE", color="#2e86ab")
  ax.bar(x + 0.2, errors["temporal"], 0.4, label="temporal probe MSE", color="#e4572e")
  ax.set_yscale("log")
  ax.set_xticks(x, [f"{h}\n{t[0].upper()}" for h, t in enumerate(cfg.head_types)], fontsize=7)
  ax.set_xlabel("head (planted S = spatial, T = temporal, D = drifting, U = unstructured)")
  ax.set_title("router errors per head (lower wins)", fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  pyplot.close(fig)
