"""Head layouts: the token orders the router picks among per head (a layout id, ``[B, H]`` int32,
indexes :func:`names`; shapes never depend on it). Band layouts share the band plan's table."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
import yaml

from maxdiffusion_svg.kernels import head_order
from maxdiffusion_svg.plan.geometry import (TokenOrder, VideoGrid, layout_positions,
                                            temporal_major_order, to_frame_major,
                                            to_temporal_major)

BAND, OWN = "band", "own"  # a layout's tile table: the shared band plan's, or each head's own


@dataclasses.dataclass(frozen=True)
class HeadsReorder:
  """A band layout's TPU pass: ``run(x [N, S, D], flags [N], grid, to_placed, scale=None)``
  places (or restores) the heads ``flags`` marks and copies the rest, one read and write of
  ``x``, where ``supported(grid, head_dim, dtype)``; placing, it may multiply every head by
  ``scale`` in the same pass."""

  run: Callable[..., Any]
  supported: Callable[[VideoGrid, int, Any], bool]


# Temporal heads: frames interleaved in one Pallas pass (kernels/head_order.py).
_TEMPORAL_ON_TPU = HeadsReorder(
    run=lambda x, flags, grid, to_placed, scale=None: head_order.reorder_heads(
        x, flags, grid.frames, to_temporal=to_placed, scale=scale),
    supported=lambda grid, head_dim, dtype: head_order.supported(grid.frames, grid.frame_size,
                                                                 head_dim, dtype))


@dataclasses.dataclass(frozen=True)
class HeadLayout:
  """One head layout. ``table``: ``band`` (the call's shared static plan) or ``own`` (each head's,
  made on device). Band layouts give ``positions(grid, tokens)``, frame-major tokens' placed
  positions, and ``order(grid)``, ``order[u]`` the frame-major token placed at ``u`` (numpy).
  ``to_placed``/``to_frame_major``: ``(x [..., S, D], grid) -> x`` and back (None: frame-major);
  ``on_tpu``: the same for a TPU lowering, by heads in one pass (None: XLA's, a head at a time).
  ``on_ring``: runs where a ring splits the sequence; ``reported``: always in the run summary."""

  name: str
  table: str = BAND
  positions: Callable[[VideoGrid, Any], Any] | None = None
  order: Callable[[VideoGrid], np.ndarray] | None = None
  to_placed: Callable[[Any, VideoGrid], Any] | None = None
  to_frame_major: Callable[[Any, VideoGrid], Any] | None = None
  on_tpu: HeadsReorder | None = None
  on_ring: bool = True
  reported: bool = False

  def __post_init__(self) -> None:
    if self.table not in (BAND, OWN):
      raise ValueError(f"a head layout's table is {BAND} or {OWN}, got {self.table!r}")
    if self.table == BAND and (self.positions is None or self.order is None
                               or (self.to_placed is None) != (self.to_frame_major is None)):
      raise ValueError(f"band layout {self.name!r} needs positions, order, and to_placed with "
                       f"to_frame_major (both None: frame-major)")

  @property
  def band(self) -> bool:
    return self.table == BAND

  def placed(self, x: Any, grid: VideoGrid) -> Any:
    """``x`` in this layout's order (a band layout)."""
    return x if self.to_placed is None else self.to_placed(x, grid)

  def restored(self, x: Any, grid: VideoGrid) -> Any:
    """Inverse of :meth:`placed`."""
    return x if self.to_frame_major is None else self.to_frame_major(x, grid)


def _frame_major_order(grid: VideoGrid) -> np.ndarray:
  return np.arange(grid.tokens, dtype=np.int32)


SPATIAL, TEMPORAL, SEMANTIC = "spatial", "temporal", "semantic"
_BUILT_IN = (
    HeadLayout(SPATIAL, positions=lambda grid, tokens: layout_positions(
        grid, TokenOrder.FRAME_MAJOR, tokens), order=_frame_major_order),
    HeadLayout(TEMPORAL, positions=lambda grid, tokens: layout_positions(
        grid, TokenOrder.TEMPORAL_MAJOR, tokens), order=temporal_major_order,
               to_placed=to_temporal_major, to_frame_major=to_frame_major, on_tpu=_TEMPORAL_ON_TPU,
               reported=True),
    HeadLayout(SEMANTIC, table=OWN, on_ring=False),
)
LAYOUTS: tuple[str, ...] = tuple(layout.name for layout in _BUILT_IN)  # the built-in layouts
_REGISTRY: list[HeadLayout] = list(_BUILT_IN)
# Chosen by measurement (docs/benchmarks.md, "The semantic layout"): the third layout is asked for.
DEFAULT_LAYOUTS: tuple[str, ...] = (SPATIAL, TEMPORAL)


def register(layout: HeadLayout) -> None:
  """Appends a head layout (id: the count before it); an ``own`` table also needs its builder."""
  if any(known.name == layout.name for known in _REGISTRY):
    raise ValueError(f"head layout {layout.name!r} is registered already")
  _REGISTRY.append(layout)


def unregister(name: str) -> None:
  """Removes a layout :func:`register` added (a built-in stays)."""
  if name in LAYOUTS:
    raise ValueError(f"{name!r} is a built-in head layout")
  _REGISTRY[:] = [layout for layout in _REGISTRY if layout.name != name]


def registered() -> tuple[HeadLayout, ...]:
  """Every head layout, in id order."""
  return tuple(_REGISTRY)


def names() -> tuple[str, ...]:
  """Every head layout's name, in id order: a head's layout id indexes this."""
  return tuple(layout.name for layout in _REGISTRY)


def index(name: str) -> int:
  """A layout's id."""
  return names().index(name)


def get(name: str) -> HeadLayout:
  """The record of a registered layout."""
  return _REGISTRY[index(name)]


def check_layouts(value: Any) -> tuple[str, ...]:
  """``svg_layouts`` (a list, or YAML/comma text, of distinct registered names) in id order."""
  requested = value
  if isinstance(requested, str):
    try:
      requested = yaml.safe_load(requested)
    except yaml.YAMLError:
      pass
    if isinstance(requested, str):
      requested = [n.strip() for n in requested.split(",") if n.strip()]
  known = names()
  allowed = ", ".join(known)
  if (not isinstance(requested, (list, tuple)) or not requested
      or not all(isinstance(n, str) for n in requested)):
    raise ValueError(f"svg_layouts must be a non-empty list of {allowed}, got {value!r}")
  unknown = [n for n in requested if n not in known]
  if unknown:
    raise ValueError(f"svg_layouts: unknown layout(s) {', '.join(map(repr, unknown))}; allowed: "
                     f"{allowed}")
  if len(set(requested)) != len(requested):
    raise ValueError(f"svg_layouts lists a layout twice: {list(requested)!r}")
  return tuple(n for n in known if n in requested)


def _off_ring(layouts: tuple[str, ...]) -> tuple[str, ...]:
  return tuple(n for n in layouts if not get(n).on_ring)


def ring_layouts(layouts: tuple[str, ...], ulysses: int, ring: int) -> tuple[str, ...]:
  """The layouts a ring runs: those ``on_ring``. Refused where none is left."""
  kept = tuple(n for n in layouts if get(n).on_ring)
  if not kept:
    raise ValueError(f"svg_layouts [{', '.join(layouts)}] cannot run on a ring (ulysses_shards "
                     f"{ulysses} leaves the sequence split over {ring} devices): add spatial and "
                     f"temporal to svg_layouts, or set ulysses_shards to the context axis's size")
  return kept


def ring_note(layouts: tuple[str, ...], ulysses: int, ring: int) -> str:
  """What a ring changes in the layouts, for the settings line and pre-flight ("" if nothing)."""
  left_out = _off_ring(layouts)
  if not left_out or ring <= 1:
    return ""
  kept = ring_layouts(layouts, ulysses, ring)
  return (f"{' and '.join(left_out)} left out on the ring (ulysses_shards {ulysses}, sequence "
          f"split over {ring} devices): layouts [{', '.join(kept)}]")


def layout_ids(layout: Any) -> Any:
  """``int32 [B, H]`` layout ids from ids, or from bool temporal flags (spatial or temporal)."""
  if layout.dtype == bool:
    return jnp.where(layout, jnp.int32(index(TEMPORAL)), jnp.int32(index(SPATIAL)))
  return layout


def layout_names(ids: Any) -> list[str]:
  """Names of layout ids (any nested sequence or array of ints), for reports."""
  return np.asarray(names(), dtype=object)[np.asarray(ids)].tolist()
