"""``bench schedule --compensation``: what compensation adds to a call, by the static schedule.

Each mode is compiled twice for one chip: the plain call (the kernel alone, what ``bench
schedule`` prices) and the compensated one
(:func:`maxdiffusion_svg.routing.compensation.compensated_attention`: the centroid sums and each
row's packing in XLA; our kernel takes the row keys in its closing
step, Splash returns its log-sum-exp for a separate pass and merge). The kernel is priced from
its plan's tiles as always (its closing step once per row); the XLA around it from the
program's schedule dump (:mod:`maxdiffusion_svg.bench.schedule_xla`). What compensation adds is
the compensated program's XLA less the plain program's (the gate and padding both share
cancel), plus what it adds to the kernel. ``static_bundles`` of a compensated mode is the plain figure's kind
(the kernel) plus all of that, so it compares with ``bench schedule``'s directly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from maxdiffusion_svg.bench.schedule import default_tiles, mode_cases, run_case
from maxdiffusion_svg.plan.geometry import grid_for_resolution
from maxdiffusion_svg.tpu.aot import libtpu_version

# What the static count cannot see, said beside every figure.
CAVEAT = ("XLA computations priced as their listings with each literal-trip loop run its trip "
          "count (predicated pipeline steps counted as always run); bundles are not time: "
          "memory-bound XLA passes (the centroid sums; with Splash or XLA, the separate "
          "centroid pass and merge) take longer than their bundles show")


def compensated_row(plain: dict[str, Any], comp: dict[str, Any]) -> dict[str, Any]:
  """One mode's row from its plain and compensated compiles (each run with ``price_xla``)."""
  if not plain.get("ok") or not comp.get("ok"):
    bad = comp if plain.get("ok") else plain
    return {**bad, "ok": False}
  kernel_added = comp["static_bundles"] - plain["static_bundles"]
  xla_added = comp["xla"]["bundles"] - plain["xla"]["bundles"]
  total = comp["static_bundles"] + xla_added
  return {**comp, "static_bundles": total, "kernel_bundles": comp["static_bundles"],
          "kernel_lse_bundles_added": kernel_added, "centroid_pass_and_merge_bundles": xla_added,
          "plain_static_bundles": plain["static_bundles"],
          "ratio_to_plain": round(total / plain["static_bundles"], 4),
          "xla_plain_bundles": plain["xla"]["bundles"], "xla_compensated_bundles": comp["xla"]["bundles"],
          "xla_plain": plain["xla"]}


def run_compensation_bench(chip: str = "v6e", resolution: str = "720p", density: float = 0.35,
                           tiles: tuple[int, int, int] | None = None,
                           vmem_limit_kib: int | None = None, backend: str = "pallas",
                           blocks: int = 8, log: Callable[[str], None] = print) -> dict[str, Any]:
  """Each mode's compensated call against its plain one, and the dense branch (nothing skipped:
  compensation adds nothing, so it is compiled once)."""
  grid = grid_for_resolution(resolution)
  block_q, block_kv, kv_compute = tiles or default_tiles(chip, vmem_limit_kib, backend)
  modes = {}
  for mode, case in mode_cases(chip, resolution, density, tiles, vmem_limit_kib, backend):
    plain = run_case(case, log, price_xla=True)
    comp = plain if mode == "dense" else run_case(
        dataclasses.replace(case, compensation_blocks=blocks), log, price_xla=True)
    modes[mode] = compensated_row(plain, comp)
  return {"kind": "compiler-static schedule", "libtpu": libtpu_version(), "chip": chip,
          "resolution": resolution, "grid": list(grid.shape), "tokens": grid.tokens,
          "density": density, "tiles": [block_q, block_kv, kv_compute], "backend": backend,
          "vmem_limit_kib": vmem_limit_kib, "compensation_blocks": blocks, "caveat": CAVEAT,
          "modes": modes}


def format_compensation_bench(result: dict[str, Any]) -> str:
  block_q, block_kv, kv_compute = result["tiles"]
  lines = [f"compensated call, compiler-static schedule (libtpu {result['libtpu']}, TPU "
           f"{result['chip']}, backend {result['backend']}): {result['resolution']} "
           f"{result['tokens']:,} tokens, band density {result['density']}, tiles "
           f"{block_q}x{block_kv}/{kv_compute}, {result['compensation_blocks']} centroids per "
           "key tile, 1 head, bf16", result["caveat"], "",
           f"{'mode':<9}{'plain Mb':>10}{'kernel Mb':>11}{'centroids Mb':>14}"
           f"{'compensated Mb':>16}{'ratio':>8}"]
  for mode, row in result["modes"].items():
    if not row.get("ok"):
      lines.append(f"{mode:<9}  {row.get('error', '')}")
      continue
    lines.append(f"{mode:<9}{row['plain_static_bundles'] / 1e6:>10.3f}"
                 f"{row['kernel_bundles'] / 1e6:>11.3f}"
                 f"{row['centroid_pass_and_merge_bundles'] / 1e6:>14.3f}"
                 f"{row['static_bundles'] / 1e6:>16.3f}{row['ratio_to_plain']:>8.3f}")
  return "\n".join(lines)
