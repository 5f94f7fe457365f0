"""MaxDiffusion's ``enable_tile_search``, ``tile_search_mode``, ``tile_search_iters`` and
``tile_search_out`` as an ``attention: svg`` run reads them, checked before weights load (the
search itself: :mod:`tile_tuning`)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from maxdiffusion_svg.tpu.tile_search import SEARCH_MODES

ENABLE_KEY, MODE_KEY, ITERS_KEY, OUT_KEY = ("enable_tile_search", "tile_search_mode",
                                            "tile_search_iters", "tile_search_out")
# MaxDiffusion's defaults where a config lacks a key (its maybe_tune_block_sizes' own).
DEFAULT_MODE, DEFAULT_ITERS = "smart", 10
CACHE_FILE = "svg_tiles.json"  # the cache's name inside tile_search_out
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no", "")


@dataclasses.dataclass(frozen=True)
class SearchSettings:
  """The run's ``enable_tile_search``, ``tile_search_mode``, ``tile_search_iters`` and
  ``tile_search_out``, checked."""

  enabled: bool = False
  mode: str = DEFAULT_MODE
  calls: int = DEFAULT_ITERS
  out: str = ""

  @property
  def cache_path(self) -> str | None:
    """``<tile_search_out>/svg_tiles.json``; None: the search's default cache
    (``$MAXDIFFUSION_SVG_TILE_CACHE``, else ``~/.cache/maxdiffusion_svg/tiles.json``)."""
    return os.path.join(os.path.expanduser(self.out), CACHE_FILE) if self.out else None


def _enabled(value: Any) -> bool:
  """``enable_tile_search`` as MaxDiffusion reads it (a bool; generate_ltx2 also reads the text
  ``true``/``1``/``yes``)."""
  if isinstance(value, bool) or value is None:
    return bool(value)
  if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
    return value.strip().lower() in _TRUE
  raise ValueError(f"{ENABLE_KEY} must be true or false, got {value!r}: give "
                   f"{ENABLE_KEY}=true to time our kernel's tiles on the chip before the run")


def search_settings(keys: Mapping[str, Any]) -> SearchSettings:
  """The tile search keys of a config (MaxDiffusion's defaults where absent); with the search on,
  a bad mode, count or folder raises ``ValueError`` naming the key and the fix."""
  enabled = _enabled(keys.get(ENABLE_KEY, False))
  mode = keys.get(MODE_KEY, DEFAULT_MODE)
  calls = keys.get(ITERS_KEY, DEFAULT_ITERS)
  out = keys.get(OUT_KEY) or ""
  if not enabled:  # MaxDiffusion reads none of them then: neither do we
    return SearchSettings()
  if mode not in SEARCH_MODES:
    raise ValueError(f"{MODE_KEY} must be smart or full, got {mode!r}: give {MODE_KEY}=smart "
                     f"(12 candidate tiles) or {MODE_KEY}=full (90)")
  if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
    raise ValueError(f"{ITERS_KEY} must be an integer of at least 1 (timed calls per candidate "
                     f"tile), got {calls!r}: give {ITERS_KEY}={DEFAULT_ITERS}")
  if not isinstance(out, str):
    raise ValueError(f"{OUT_KEY} must be a folder or '' (the default cache), got {out!r}: "
                     f"give {OUT_KEY}=/path/to/folder (the cache is its {CACHE_FILE})")
  if out and os.path.exists(os.path.expanduser(out)) and not os.path.isdir(
      os.path.expanduser(out)):
    raise ValueError(f"{OUT_KEY} {out!r} is a file, not a folder: give a folder (the cache is "
                     f"its {CACHE_FILE}) or '' for the default cache")
  return SearchSettings(True, mode, calls, out)


def check_tile_search(keys: Mapping[str, Any]) -> None:
  """The pre-flight's check of the tile search keys (``ValueError`` names the key and the fix)."""
  search_settings(keys)
