"""What a call costs by libtpu's static schedule: our kernel against MaxDiffusion's fastest.

``python -m maxdiffusion_svg bench schedule --maxdiffusion`` compiles our kernel and
MaxDiffusion's own dense kernel (``ulysses_custom_fixed_m`` at its fast Wan recipe) for a chip
and reads back each tile body's bundles (docs/measurements/schedule_<chip>_720p.json). A body's
bundles do not depend on the video, only on the tile, so a call of any length is priced from
them: tiles x body + rows x (row start + row end) + grid steps x loop overhead. PRICES holds
those figures (a test rebuilds them from the stored files); ``tiles --config`` uses them for a
config's attention bound against that kernel, dense steps included. Counts of issue slots as
scheduled, not times: no DMA or memory stalls, no clock.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from maxdiffusion_svg.parallel.ring_plan import ring_split, window_plan

LIBTPU = "0.0.50.1"  # the compiler the figures below come from


@dataclasses.dataclass(frozen=True)
class KernelPrices:
  """One kernel's static bundles per tile body, at the tile it was compiled with."""

  tiles: tuple[int, int, int]  # block_q, block_kv, block_kv_compute
  full: int  # a mask-free tile (fixed offset where the kernel has one)
  online: int  # a mask-free tile of a head on online softmax (ours: its lazy pass held)
  masked: int  # ours: an aligned plan's padding tile; MaxDiffusion's: a row's ragged last block
  row: int  # opening plus closing a q-tile row
  step: int  # loop overhead of every grid step
  online_rescaled: int | None = None  # ours: a row's first mask-free tile on online softmax

  def call(self, full: int, masked: int, rows: int, online: bool = False) -> int:
    """Bundles of one head's call that visits ``full`` + ``masked`` tiles over ``rows`` rows
    (``online``: each row's first full tile rescales; a tile whose maximum jumps past the
    headroom runs twice, which no plan can count)."""
    out = masked * self.masked + rows * self.row + (full + masked) * self.step
    if not online:
      return out + full * self.full
    first = min(rows, full)  # MaxDiffusion's online body rescales on every tile: no other
    rescaled = self.online if self.online_rescaled is None else self.online_rescaled
    return out + (full - first) * self.online + first * rescaled

  def dense_call(self, tokens: int, online: bool = False) -> int:
    """A dense call over every tile, its last kv column priced as the masked body."""
    rows = -(-tokens // self.tiles[0])
    cols = -(-tokens // self.tiles[1])
    return self.call(rows * (cols - 1), rows, rows, online)


def prices_from_schedule(result: dict[str, Any]) -> dict[str, KernelPrices]:
  """``{"ours", "maxdiffusion_fixed_m"}`` prices from a ``bench schedule --maxdiffusion --json``
  result (our aligned mode and MaxDiffusion's fixed-m kernel at its fast recipe)."""
  return {name: kernel_prices(result["modes"][mode])
          for name, mode in (("ours", "aligned"), ("maxdiffusion_fixed_m",
                                                   "maxdiffusion_custom_fixed_m fast recipe"))}


def kernel_prices(row: dict[str, Any]) -> KernelPrices:
  """One compiled case's prices (a ``bench schedule`` row: its case and its bodies' bundles)."""
  kernel, case = row["kernel"], row["case"]
  region = lambda key: (kernel.get(key) or {}).get("bundles", 0)
  return KernelPrices(
      tiles=(case["block_q"], case["block_kv"], case["block_kv_compute"]),
      full=region("full"), online=region("online"), masked=region("masked"),
      row=region("row_init") + region("row_final"), step=kernel["step_overhead"],
      online_rescaled=region("online_rescaled") or None)


# From docs/measurements/schedule_<chip>_720p.json (libtpu 0.0.50.1; tests/tpu/test_schedule_costs.py
# rebuilds these from the files).
_OURS = (3328, 1536, 512)
_FAST_RECIPE = (6400, 2048, 2048)
PRICES: dict[str, dict[str, KernelPrices]] = {
    "v6e": {"ours": KernelPrices(_OURS, 7900, 8122, 4190, 769, 60, 11486),
            "maxdiffusion_fixed_m": KernelPrices(_FAST_RECIPE, 20246, 27204, 25207, 3658, 89)},
    "tpu7x": {"ours": KernelPrices(_OURS, 7641, 7958, 3821, 779, 188, 10715),
              "maxdiffusion_fixed_m": KernelPrices(_FAST_RECIPE, 19589, 25739, 24007, 3469, 97)},
    "v5e": {"ours": KernelPrices(_OURS, 18389, 19123, 8062, 1171, 60, 22006),
            "maxdiffusion_fixed_m": KernelPrices(_FAST_RECIPE, 46844, 55350, 50936, 4975, 93)},
}


def ring_kernel_prices(plan: Any, tokens: int, context: int, ulysses: int, launches: int,
                       chip: str | None, online: bool = False) -> dict[str, Any] | None:
  """One device's kernel bundles per call on a ring (a plan over ``tokens`` on ``context``
  devices split ``ulysses`` x ring; ``launches`` heads x items a device): svg's slowest and
  fastest ring shard (its window of the plan), our dense branch over the same pairs, and
  MaxDiffusion's custom kernel as ``ulysses_ring_custom`` runs it (``R`` chunk x chunk calls,
  fixed-m or online). ``online``: our heads on online softmax. None where PRICES lacks the chip."""
  prices = PRICES.get(chip or "")
  if not prices:
    return None
  ours, theirs = prices["ours"], prices["maxdiffusion_fixed_m"]
  ring = context // ulysses
  split = ring_split(tokens, ring, ulysses, plan.block_q)
  shards = []
  for r in range(ring):
    stats = window_plan(plan, split, r).stats
    shards.append(launches * ours.call(stats.full_tiles, stats.masked_tiles,
                                       split.chunk // plan.block_q, online))
  chunk = -(-tokens // context) * ulysses
  return {"chip": chip, "svg_shards": shards, "svg_max": max(shards), "svg_min": min(shards),
          "ours_dense": launches * ring * ours.dense_call(chunk, online),
          "ring_custom_online": launches * ring * theirs.dense_call(chunk, online=True),
          "ring_custom_fixed_m": launches * ring * theirs.dense_call(chunk)}
