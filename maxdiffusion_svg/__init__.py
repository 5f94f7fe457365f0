"""Sparse VideoGen (SVG) attention for MaxDiffusion's Wan video models on TPU.

The package reads as the data path, lowest layer first: ``plan`` (token grid and orders,
masks, tile tables, the target's tiles), ``kernels`` (the sparse executors), ``routing`` (head
layouts, router, semantic layout, compensation), ``budgets`` (``SvgConfig``, when SVG runs,
per-layer and per-head budgets), ``call`` (``svg_attention``: route -> place -> kernel ->
restore), ``parallel`` (Ulysses and ring), ``tpu`` (libtpu compiles and prices), ``measure``;
then ``plugin`` (MaxDiffusion), ``testing``, ``bench`` and ``cli``. docs/development.md has the map.

The names below are imported on first use: ``python -m maxdiffusion_svg.generate --help`` (whose
parent package is this one) and MaxDiffusion's plugin loading then import neither JAX nor
tokamax before they need to.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public name -> the submodule that defines it.
_EXPORTS = {
    **dict.fromkeys(("scheduled_svg_attention", "svg_attention"), "call.attention"),
    "SvgConfig": "budgets.config",
    **dict.fromkeys(("RESOLUTIONS", "TokenOrder", "VideoGrid", "frame_major_order",
                     "grid_for_resolution", "temporal_major_order", "to_frame_major",
                     "to_temporal_major"), "plan.geometry"),
    "sparse_attention": "kernels",
    **dict.fromkeys(("Mask", "PlacedMask", "ProbeMask", "SvgMask", "band_half_width",
                     "probe_mask", "svg_mask"), "plan.masks"),
    **dict.fromkeys(("RouterConfig", "Routing", "profile_heads", "route_heads"), "routing.router"),
    **dict.fromkeys(("PRESETS", "Interval", "Schedule"), "budgets.schedule"),
    "sharded_svg_attention": "parallel.sharding",
    **dict.fromkeys(("TileMode", "TilePlan", "TileStats", "plan_mask_tiles", "plan_tiles"),
                    "plan.tiles"),
}
# Old public names -> today's: ``Layout`` was the token order, a word now kept for head layouts.
_RENAMED = {"Layout": "TokenOrder"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
  module = _EXPORTS.get(_RENAMED.get(name, name))
  if module is None:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(f"{__name__}.{module}"), _RENAMED.get(name, name))
  globals()[name] = value  # later lookups skip this function
  return value


def __dir__() -> list[str]:
  return sorted({*globals(), *_EXPORTS})
