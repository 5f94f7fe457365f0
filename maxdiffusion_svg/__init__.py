"""Sparse VideoGen (SVG) attention for MaxDiffusion's Wan video models on TPU.

The data path is route -> place -> sparse kernel -> restore; one concern per module:
``geometry`` (token grid and layouts), ``masks`` (the SVG rule), ``tiles`` (which tiles a
kernel visits and masks), ``kernels`` (Splash and XLA executors), ``router`` (per-head
spatial/temporal choice), ``attention`` (``svg_attention``), ``sharding`` (the Ulysses head
exchange around it), ``config`` and ``schedule``.
"""

from maxdiffusion_svg.attention import scheduled_svg_attention, svg_attention
from maxdiffusion_svg.config import SvgConfig
from maxdiffusion_svg.geometry import (Layout, RESOLUTIONS, VideoGrid, frame_major_order,
                                       grid_for_resolution, temporal_major_order, to_frame_major,
                                       to_temporal_major)
from maxdiffusion_svg.kernels import sparse_attention
from maxdiffusion_svg.masks import (Mask, PlacedMask, ProbeMask, SvgMask, band_half_width,
                                    probe_mask, svg_mask)
from maxdiffusion_svg.router import RouterConfig, Routing, profile_heads, route_heads
from maxdiffusion_svg.schedule import PRESETS, Interval, Schedule
from maxdiffusion_svg.sharding import sharded_svg_attention
from maxdiffusion_svg.tiles import TileMode, TilePlan, TileStats, plan_mask_tiles, plan_tiles

__version__ = "0.1.0"
