"""When SVG runs: dense warm-up steps and layers as half-open intervals, and named presets.
``is_active`` takes Python ints or traced int32 scalars, so one compiled forward serves all."""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any, Mapping, Sequence

import jax.numpy as jnp


def _is_int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class Interval:
  """Half-open ``[start, end)``; ``end=None`` runs to the last step or layer."""

  start: int = 0
  end: int | None = None

  @classmethod
  def parse(cls, value: Any, key: str) -> "Interval":
    """From ``[start, end]`` (YAML list); ``end`` may be null or -1 for "to the end"."""
    if isinstance(value, Interval):
      return value
    if not isinstance(value, (list, tuple)) or len(value) != 2:
      raise ValueError(f"{key} must be a [start, end) pair, got {value!r}")
    start, end = value
    if end is not None and end == -1:
      end = None
    if not _is_int(start) or start < 0 or (end is not None and not _is_int(end)):
      raise ValueError(f"{key} must hold integers >= 0 (end may be null or -1), got {value!r}")
    if end is not None and start >= end:
      raise ValueError(f"{key} needs start < end, got [{start}, {end})")
    return cls(start, end)

  def count(self, total: int) -> int:
    """How many of ``0 .. total - 1`` it holds (steps of a run, layers of a model)."""
    return self.within(0, total)

  def within(self, start: int, end: int) -> int:
    """How many of ``start .. end - 1`` it holds (a Wan 2.2 expert's steps)."""
    return max(0, min(end, self.end if self.end is not None else end) - max(start, self.start))

  def contains(self, i: Any) -> Any:
    """Whether step or layer ``i`` is inside: a Python bool for an int or for ``[0, None)``
    (so a schedule active everywhere traces no dense branch), else a traced bool."""
    if self.start == 0 and self.end is None:
      return True
    if _is_int(i):
      return self.start <= i and (self.end is None or i < self.end)
    inside = jnp.asarray(i) >= self.start
    return inside if self.end is None else inside & (jnp.asarray(i) < self.end)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Steps and layers where sparse attention runs; everything else runs dense."""

  active_steps: Interval = Interval()
  active_layers: Interval = Interval()

  def is_active(self, step: Any, layer: Any) -> Any:
    """Python bool for ints, a traced bool for traced step or layer."""
    steps, layers = self.active_steps.contains(step), self.active_layers.contains(layer)
    if isinstance(steps, bool) and isinstance(layers, bool):
      return steps and layers
    return jnp.logical_and(steps, layers)


@dataclasses.dataclass(frozen=True)
class Preset:
  """A named trade-off: density, share of denoising steps kept dense, dense first layers."""

  density: float
  dense_step_fraction: float
  dense_layers: int

  def schedule(self, num_steps: int) -> Schedule:
    return Schedule(Interval(math.floor(self.dense_step_fraction * num_steps), None),
                    Interval(self.dense_layers, None))


# Wan 2.1 values; see docs/reference.md ("Presets") for where they come from.
PRESETS: Mapping[str, Preset] = {
    "conservative": Preset(density=0.40, dense_step_fraction=0.30, dense_layers=1),
    "moderate": Preset(density=0.30, dense_step_fraction=0.20, dense_layers=1),
    "aggressive": Preset(density=0.20, dense_step_fraction=0.10, dense_layers=1),
}


def preset_hint(name: Any) -> str:
  """``"; did you mean 'aggressive'?"`` for a near miss of a preset's name, else ``""``."""
  close = difflib.get_close_matches(str(name), list(PRESETS), n=1)
  return f"; did you mean {close[0]!r}?" if close else ""


def get_preset(name: str) -> Preset:
  if name not in PRESETS:
    raise ValueError(f"svg_schedule must be one of {', '.join(PRESETS)}, got {name!r}"
                     f"{preset_hint(name)}")
  return PRESETS[name]


def check_preset_overrides(overrides: Sequence[str]) -> None:
  """Each ``svg_schedule=NAME`` among ``key=value`` overrides names a preset: a typo is refused
  (with the nearest name) before a config, JAX's backend or MaxDiffusion loads."""
  for item in overrides:
    key, _, value = item.partition("=")
    if key == "svg_schedule":
      get_preset(value)
