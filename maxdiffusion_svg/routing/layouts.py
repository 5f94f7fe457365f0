"""Head layouts: the orders a router chooses among for each head, and how a call is placed.

A layout is a token order plus a tile table. ``spatial`` keeps frame-major order, ``temporal``
moves a head to temporal-major order: both run the band plan every head shares, static.
``semantic`` orders a head's tokens by cluster and gives it its own tile table, computed on
device (:mod:`maxdiffusion_svg.routing.semantic`) with the band plan's per-row counts. Heads carry a
layout id (``[B, H]`` int32, an index into :data:`LAYOUTS`); shapes never depend on it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import yaml

SPATIAL, TEMPORAL, SEMANTIC = "spatial", "temporal", "semantic"
LAYOUTS: tuple[str, ...] = (SPATIAL, TEMPORAL, SEMANTIC)  # a head's layout id indexes this
# Chosen by measurement (docs/benchmarks.md, "The semantic layout"): the third layout is asked for.
DEFAULT_LAYOUTS: tuple[str, ...] = (SPATIAL, TEMPORAL)


def check_layouts(value: Any) -> tuple[str, ...]:
  """``svg_layouts`` as a tuple in :data:`LAYOUTS` order: a list (or YAML/comma text) of
  distinct names among them, at least one."""
  names = value
  if isinstance(names, str):
    try:
      names = yaml.safe_load(names)
    except yaml.YAMLError:
      pass
    if isinstance(names, str):
      names = [n.strip() for n in names.split(",") if n.strip()]
  allowed = ", ".join(LAYOUTS)
  if (not isinstance(names, (list, tuple)) or not names
      or not all(isinstance(n, str) for n in names)):
    raise ValueError(f"svg_layouts must be a non-empty list of {allowed}, got {value!r}")
  unknown = [n for n in names if n not in LAYOUTS]
  if unknown:
    raise ValueError(f"svg_layouts: unknown layout(s) {', '.join(map(repr, unknown))}; allowed: "
                     f"{allowed}")
  if len(set(names)) != len(names):
    raise ValueError(f"svg_layouts lists a layout twice: {list(names)!r}")
  return tuple(n for n in LAYOUTS if n in names)


def ring_layouts(layouts: tuple[str, ...], ulysses: int, ring: int) -> tuple[str, ...]:
  """The layouts a ring runs (``ulysses_shards`` below the context axis): a semantic head's
  clusters span the whole sequence, which a ring splits over ``ring`` devices, so semantic is
  left out of the router's choices there (the settings line, ``tiles --config`` and the
  pre-flight say so). Refused where nothing would be left."""
  kept = tuple(n for n in layouts if n != SEMANTIC)
  if not kept:
    raise ValueError(f"svg_layouts [semantic] cannot run on a ring (ulysses_shards {ulysses} "
                     f"leaves the sequence split over {ring} devices): add spatial and temporal "
                     f"to svg_layouts, or set ulysses_shards to the context axis's size")
  return kept


def ring_note(layouts: tuple[str, ...], ulysses: int, ring: int) -> str:
  """What a ring changes in the layouts, for the settings line and the pre-flight ("" if
  nothing)."""
  if SEMANTIC not in layouts or ring <= 1:
    return ""
  kept = ring_layouts(layouts, ulysses, ring)
  return (f"semantic left out on the ring (ulysses_shards {ulysses}, sequence split over {ring} "
          f"devices): layouts [{', '.join(kept)}]")


def layout_names(ids: Any) -> list[str]:
  """Names of layout ids (any nested sequence or array of ints), for reports."""
  return np.asarray(LAYOUTS, dtype=object)[np.asarray(ids)].tolist()
