"""Head layouts: the orders a router chooses among for each head, and how a call is placed.

A layout is a token order plus a tile table. ``spatial`` keeps frame-major order, ``temporal``
moves a head to temporal-major order: both run the band plan every head shares, static.
``semantic`` orders a head's tokens by cluster and gives it its own tile table, computed on
device (:mod:`maxdiffusion_svg.semantic`) with the band plan's per-row counts. Heads carry a
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


def layout_names(ids: Any) -> list[str]:
  """Names of layout ids (any nested sequence or array of ints), for reports."""
  return np.asarray(LAYOUTS, dtype=object)[np.asarray(ids)].tolist()
