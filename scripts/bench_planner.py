"""Times and sizes tile-plan construction (cold cache) at the Wan presets.

Usage: python scripts/bench_planner.py [--blocks 3328x1536 512x512 ...] [--density 0.35]
Prints wall time (best of 3) and peak traced memory (numpy allocations, tracemalloc) per plan.
"""

import argparse
import time
import tracemalloc

from maxdiffusion_svg.plan.geometry import TokenOrder, RESOLUTIONS, grid_for_resolution
from maxdiffusion_svg.plan.masks import PlacedMask, svg_mask
from maxdiffusion_svg.plan.tiles import TileMode, _plan, plan_mask_tiles


def measure(mask, bq, bkv, mode):
  best = float("inf")
  for _ in range(3):
    _plan.cache_clear()
    start = time.perf_counter()
    plan_mask_tiles(mask, bq, bkv, mode)
    best = min(best, time.perf_counter() - start)
  _plan.cache_clear()
  tracemalloc.start()
  plan = plan_mask_tiles(mask, bq, bkv, mode)
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  return best, peak, plan


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--blocks", nargs="+", default=["3328x1536", "512x512", "128x128"])
  parser.add_argument("--density", type=float, default=0.35)
  parser.add_argument("--unplaced", action="store_true",
                      help="also plan temporal heads left in frame-major order (every tile)")
  args = parser.parse_args()
  print(f"{'resolution':<10} {'tokens':>8} {'tiles':>10} {'head':<18} {'mode':<8} "
        f"{'tiles total':>12} {'visited':>10} {'ms':>9} {'peak MB':>8}")
  for name in RESOLUTIONS:
    grid = grid_for_resolution(name)
    mask = svg_mask(grid, args.density)
    heads = {"placed": mask}
    if args.unplaced:
      heads["temporal_unplaced"] = PlacedMask(mask, grid, TokenOrder.TEMPORAL_MAJOR)
    for blocks in args.blocks:
      bq, bkv = (int(x) for x in blocks.split("x"))
      for head, m in heads.items():
        for mode in TileMode:
          seconds, peak, plan = measure(m, bq, bkv, mode)
          print(f"{name:<10} {grid.tokens:>8} {blocks:>10} {head:<18} {mode.value:<8} "
                f"{plan.stats.total_tiles:>12,} {plan.stats.visited_tiles:>10,} "
                f"{1e3 * seconds:>9.1f} {peak / 2**20:>8.1f}")


if __name__ == "__main__":
  main()
