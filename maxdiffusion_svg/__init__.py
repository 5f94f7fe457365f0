"""Sparse VideoGen (SVG) attention for MaxDiffusion's Wan video models on TPU.

The data path is route -> place -> sparse kernel -> restore; one concern per module:
``geometry`` (token grid and layouts), ``masks`` (the SVG rule), ``tiles`` (which tiles a
kernel visits and masks), ``kernels`` (Splash and XLA executors), ``router`` (per-head
spatial/temporal choice), ``attention`` (``svg_attention``), ``sharding`` (the Ulysses head
exchange around it), ``config`` and ``schedule``.

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
    **dict.fromkeys(("scheduled_svg_attention", "svg_attention"), "attention"),
    "SvgConfig": "config",
    **dict.fromkeys(("Layout", "RESOLUTIONS", "VideoGrid", "frame_major_order",
                     "grid_for_resolution", "temporal_major_order", "to_frame_major",
                     "to_temporal_major"), "geometry"),
    "sparse_attention": "kernels",
    **dict.fromkeys(("Mask", "PlacedMask", "ProbeMask", "SvgMask", "band_half_width",
                     "probe_mask", "svg_mask"), "masks"),
    **dict.fromkeys(("RouterConfig", "Routing", "profile_heads", "route_heads"), "router"),
    **dict.fromkeys(("PRESETS", "Interval", "Schedule"), "schedule"),
    "sharded_svg_attention": "sharding",
    **dict.fromkeys(("TileMode", "TilePlan", "TileStats", "plan_mask_tiles", "plan_tiles"),
                    "tiles"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
  globals()[name] = value  # later lookups skip this function
  return value


def __dir__() -> list[str]:
  return sorted({*globals(), *_EXPORTS})
