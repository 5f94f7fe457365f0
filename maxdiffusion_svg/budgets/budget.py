"""One expert's budget (density, compensation, per-layer and per-head values) and the key each
value came from, resolved once by :meth:`maxdiffusion_svg.budgets.config.SvgConfig.budget`."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from maxdiffusion_svg.budgets.per_layer import Rung, layer_ranges

PER_LAYER = ("densities", "compensation")  # svg_layer_<what>


def own_key(what: str, expert: str | None) -> str:
  """``expert``'s own key (the shared one for None): ``what`` is ``densities`` or
  ``compensation`` (per layer), ``head`` (per head) or ``density``."""
  prefix = f"svg_{expert}_" if expert else "svg_"
  if what == "head":
    return f"{prefix}head_densities"
  if what == "density":
    return f"{prefix}density"
  return f"{prefix}layer_{what}"


@dataclasses.dataclass(frozen=True)
class Budget:
  """What one expert's calls run (``expert`` None: no experts). Per-layer values and
  ``head_densities`` (one list per layer, or one for all) are None where unset; ``own`` names
  those set by the expert's own key (``densities``, ``compensation``, ``head``)."""

  expert: str | None
  density: float
  compensation: bool
  layer_densities: tuple[float, ...] | None = None
  layer_compensation: tuple[bool, ...] | None = None
  head_densities: tuple[tuple[float, ...], ...] | None = None
  own: frozenset[str] = frozenset()

  def key(self, what: str) -> str:
    """The key a value was read from: the expert's own where set, else the shared one."""
    return own_key(what, self.expert if what in self.own else None)

  def per_layer(self, what: str) -> tuple[Any, ...] | None:
    """``layer_densities`` (``what="densities"``) or ``layer_compensation``."""
    return getattr(self, f"layer_{what}")

  @property
  def layer_rungs(self) -> tuple[Rung, ...] | None:
    """Each layer's :class:`~maxdiffusion_svg.budgets.per_layer.Rung`, or None where neither
    per-layer key is set. Lists of two lengths are refused."""
    densities, compensation = self.layer_densities, self.layer_compensation
    if densities is None and compensation is None:
      return None
    if densities is not None and compensation is not None and len(densities) != len(compensation):
      raise ValueError(f"{self.key('densities')} gives {len(densities)} layers "
                       f"but {self.key('compensation')} {len(compensation)}: "
                       f"give both one value per layer")
    layers = len(densities if densities is not None else compensation)
    densities = densities or (self.density,) * layers
    compensation = compensation or (self.compensation,) * layers
    return tuple(Rung(d, c) for d, c in zip(densities, compensation))

  def set_keys(self) -> tuple[str, ...]:
    """The per-layer and per-head keys this budget reads, where set."""
    keys = [self.key(what) for what in PER_LAYER if self.per_layer(what) is not None]
    if self.head_densities is not None:
      keys.append(self.key("head"))
    return tuple(keys)

  def describe(self) -> str:
    """The density its calls run, for the run summary: one, per layer range, or per head."""
    if self.head_densities is not None:  # each layer's heads, as least-most (mean), per range
      spans = [f"{min(row):g}-{max(row):g} (mean {sum(row) / len(row):.3g})"
               for row in self.head_densities]
      if len(spans) == 1:
        return f"densities per head (svg_head_densities), {spans[0]} in every layer"
      return f"densities per head (svg_head_densities) {layer_ranges(spans)}"
    if self.layer_densities is None:
      return f"density {self.density}"
    return f"densities per layer {layer_ranges(self.layer_densities)}"

  def recorded(self) -> tuple[tuple[float, ...], tuple[bool, ...]] | None:
    """Each layer's recorded (density, compensation), or None: all the same. Per-head budgets
    record a layer's mean head density, uncompensated."""
    if self.head_densities is not None:
      means = tuple(float(np.mean(row)) for row in self.head_densities)
      return means, (False,) * len(means)
    rungs = self.layer_rungs
    if rungs is None:
      return None
    return tuple(r.density for r in rungs), tuple(r.compensation for r in rungs)
