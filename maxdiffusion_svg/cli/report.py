"""The tile report: what a (grid, density, tiles) choice costs in each traversal mode."""

from __future__ import annotations

from typing import Any, Sequence

from maxdiffusion_svg.plan.geometry import TokenOrder, VideoGrid
from maxdiffusion_svg.plan.masks import Mask, PlacedMask, SvgMask, check_density, svg_mask
from maxdiffusion_svg.plan.tiles import TileMode, check_block_size, plan_mask_tiles

# Head types: the layout whose band the head keeps, and whether its tokens are placed
# in that layout before the kernel. "temporal_unplaced" is what a temporal head would
# cost without the permutation: the band scattered into per-frame stripes.
HEADS: dict[str, tuple[TokenOrder, bool]] = {
    "spatial": (TokenOrder.FRAME_MAJOR, True),
    "temporal": (TokenOrder.TEMPORAL_MAJOR, True),
    "temporal_unplaced": (TokenOrder.TEMPORAL_MAJOR, False),
}


def kernel_mask(mask: SvgMask, grid: VideoGrid, head: str) -> Mask:
  """The mask the kernel sees for ``head``, in the order its tokens arrive."""
  layout, placed = HEADS[head]
  return mask if placed else PlacedMask(mask, grid, layout)


# (header, width, value format); text columns are left-aligned, the rest right-aligned.
_COLUMNS = (
    ("mode", 8, "s"), ("head", 17, "s"), ("kept%", 7, ".2f"), ("budget%", 8, "+.2f"),
    ("recall%", 8, ".2f"), ("visited%", 9, ".2f"), ("masked%", 8, ".2f"),
    ("masked/visited%", 16, ".2f"), ("tiles v/m/f", 14, ""),
)


def _cell(value: Any, width: int, fmt: str) -> str:
  text = format(value, fmt)
  return text.ljust(width) if fmt == "s" else text.rjust(width)


def tile_report(grid: VideoGrid, density: float, block_q: int, block_kv: int,
                modes: Sequence[TileMode | str] = tuple(TileMode), *,
                include_sink: bool = True) -> dict[str, Any]:
  """Plan statistics per mode and head type, as a JSON-ready dict.

  After placement both head types share one band+sink mask in their own layout, so
  their plans and statistics are the same; ``temporal_unplaced`` shows what that buys.
  """
  density = check_density(density)
  block_q, block_kv = check_block_size(block_q, "block_q"), check_block_size(block_kv, "block_kv")
  mask = svg_mask(grid, density, include_sink)
  report: dict[str, Any] = {
      "grid": list(grid.shape), "tokens": grid.tokens, "frame_size": grid.frame_size,
      "density": density, "include_sink": include_sink, "band_half_width": mask.half_width,
      "block_q": block_q, "block_kv": block_kv,
      "q_tiles": -(-grid.tokens // block_q), "kv_tiles": -(-grid.tokens // block_kv),
      "modes": {},
  }
  for mode in modes:
    mode = TileMode.parse(mode)
    report["modes"][mode.value] = {
        head: plan_mask_tiles(kernel_mask(mask, grid, head), block_q, block_kv, mode).stats.as_dict()
        for head in HEADS}
  # The exact mask's share of pairs: svg_density is the band's, and the sink comes on top.
  report["kept_pair_fraction"] = next(iter(report["modes"].values()))["spatial"][
      "exact_pair_fraction"]
  return report


def format_report(report: dict[str, Any]) -> str:
  """A fixed-width table of :func:`tile_report`'s output."""
  lines = [
      f"grid {'x'.join(map(str, report['grid']))} = {report['tokens']:,} tokens, "
      f"band density {report['density']} ({report['kept_pair_fraction']:.2%} of pairs kept with "
      f"the sink {'on' if report['include_sink'] else 'off'}), band half-width "
      f"{report['band_half_width']:,} tokens",
      f"tiles {report['block_q']}x{report['block_kv']}: {report['q_tiles']} q-tiles x "
      f"{report['kv_tiles']} kv-tiles = {report['q_tiles'] * report['kv_tiles']:,}",
      "  ".join(_cell(name, width, "s" if fmt == "s" else "") for name, width, fmt in _COLUMNS),
  ]
  for mode, heads in report["modes"].items():
    for head, s in heads.items():
      values = (mode, head, 100 * s["retained_pair_fraction"], 100 * s["budget_error"],
                100 * s["recall"], 100 * s["visited_tile_fraction"], 100 * s["masked_tile_fraction"],
                100 * s["masked_visited_fraction"],
                f"{s['visited_tiles']}/{s['masked_tiles']}/{s['full_tiles']}")
      lines.append("  ".join(_cell(v, width, fmt) for (_, width, fmt), v in zip(_COLUMNS, values)))
  return "\n".join(lines)
