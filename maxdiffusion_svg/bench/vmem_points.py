"""``bench vmem``: the scoped VMEM libtpu allocates for Splash kernels, per TPU generation.

Compiles one kernel per case (tiles, inner kv step, mask strategy, dtype, head_dim) for one
chip of each generation and asks the compiler what it allocated
(:func:`maxdiffusion_svg.tpu.aot.scoped_vmem_need`). The cases and what the compiler said are
written with the libtpu and jax versions to ``docs/measurements/vmem_points.json``; the
VMEM model (:mod:`maxdiffusion_svg.kernels.vmem_model`) is fitted to the points not marked
held out, and tests hold it to the held-out ones. Nothing runs on a device.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import pathlib
import time
from typing import Any, Callable, Sequence

from maxdiffusion_svg.plan.geometry import grid_for_resolution

DEFAULT_OUT = pathlib.Path(__file__).resolve().parents[2] / "docs" / "measurements" / \
    "vmem_points.json"
# Tiles (block_q, block_kv, block_kv_compute) at bf16 / head_dim 128, both strategies; the
# first three also at f32 and at head_dim 64.
TILES = ((3328, 1536, 256), (2048, 1024, 256), (3328, 2816, 256), (1024, 1024, 256),
         (3328, 1536, 128), (2048, 1536, 256), (4096, 1536, 512), (512, 512, 256),
         (256, 256, 256), (128, 128, 128))
VARIANTS = (("float32", 128), ("bfloat16", 64))
# Generations whose every case is compiled; the others get the first SHORT tiles.
FULL = ("v5e", "v6e")
SHORT = {"tpu7x": 4, "v5p": 3, "v4": 3}
# v4 holds 16 MiB in all (and stored masks as 32-bit): tiles it can hold, its default first.
CHIP_TILES = {"v4": ((1536, 1024, 256), (2048, 1024, 256), (1024, 1024, 256), (2048, 1536, 256))}
STRATEGY_MODE = {"stored": "aligned", "function": "split"}
# Heads per kernel call change the allocation, not monotonically (v5e 3328x1536/256: stored
# 1 head 12.80 MiB, 2: 16.25, 5: 16.80, 10 and 40: 17.55; mask function 5 heads 20.07, 10
# heads 17.57): the points are at 10 heads, the first tiles also at 5 (Wan 14B's heads per
# device under an 8-way exchange), and each chip's scale covers both; held-out points at 1, 5
# and 40 check the rest.
RESOLUTION, DENSITY, HEADS = "720p", 0.3, 10
# Tiles under 1024 at 720p would overflow SMEM with their tables: they compile at 480p.
SMALL_TILE_RESOLUTION = "480p"
ALSO_HEADS = 5
OTHER_HEADS = (1, 5, 40)


@dataclasses.dataclass(frozen=True)
class VmemCase:
  chip: str
  strategy: str  # stored (aligned plans) or function (naive/split)
  block_q: int
  block_kv: int
  block_kv_compute: int
  dtype: str = "bfloat16"
  head_dim: int = 128
  heads: int = HEADS
  held_out: bool = False  # kept out of the fit: the test's check that the model generalises


def vmem_cases(chips: Sequence[str]) -> list[VmemCase]:
  """Per chip: every tile and strategy (FULL) or the first few, plus the dtype and head_dim
  variants; every third case of a chip and strategy is held out of the fit."""
  cases = []
  for chip in chips:
    tiles = CHIP_TILES.get(chip, TILES if chip in FULL else TILES[:SHORT.get(chip, 4)])
    for strategy in STRATEGY_MODE:
      chosen = [(t, "bfloat16", 128) for t in tiles]
      chosen += [(t, dtype, dim) for dtype, dim in VARIANTS for t in tiles[:3 if chip in FULL else 1]]
      for i, ((bq, bkv, bkc), dtype, dim) in enumerate(chosen):
        cases.append(VmemCase(chip, strategy, bq, bkv, bkc, dtype, dim, held_out=i % 3 == 2))
    for strategy in STRATEGY_MODE:
      cases += [VmemCase(chip, strategy, *t, heads=ALSO_HEADS) for t in tiles[:2]]
    if chip in FULL:
      cases += [VmemCase(chip, strategy, *TILES[0], heads=h, held_out=True)
                for h, strategy in zip(OTHER_HEADS, ("stored", "function", "stored"))]
  return cases


def measure(case: VmemCase) -> dict[str, Any]:
  """Compiles the case's kernel for one chip; the compiler's scoped-VMEM figure."""
  # pylint: disable=import-outside-toplevel
  import jax
  import jax.numpy as jnp

  from maxdiffusion_svg.kernels.splash import splash_sparse_attention
  from maxdiffusion_svg.kernels.tpu_memory import vmem_estimate
  from maxdiffusion_svg.plan.target import generation_named, tpu_target
  from maxdiffusion_svg.plan.tiles import plan_tiles
  from maxdiffusion_svg.tpu.aot import abstract, chip_mesh, scoped_vmem_need
  # pylint: enable=import-outside-toplevel
  start = time.perf_counter()
  resolution = RESOLUTION if case.block_q >= 1024 else SMALL_TILE_RESOLUTION
  grid = grid_for_resolution(resolution)
  plan = plan_tiles(grid, DENSITY, case.block_q, case.block_kv, STRATEGY_MODE[case.strategy])
  mesh = chip_mesh(case.chip)
  spec = abstract((1, case.heads, grid.tokens, case.head_dim), jnp.dtype(case.dtype), mesh)
  # The kernel itself, without our check: the compiler is the judge here.
  lowered = jax.jit(lambda q, k, v: splash_sparse_attention(
      q, k, v, plan, 0.1, interpret=False,
      block_kv_compute=case.block_kv_compute)).lower(spec, spec, spec)
  physical = generation_named(case.chip).vmem // 1024
  try:  # start just below the model's guess: two compiles when it is close
    guess = vmem_estimate(plan, case.head_dim, jnp.dtype(case.dtype), case.block_kv_compute,
                          tpu_target(case.chip, physical))
    start_kib = max(256, min(physical, int(guess * 0.7) // 1024))
  except ValueError:  # no model yet, or a case outside its range
    start_kib = 1024
  need = scoped_vmem_need(lowered, start_kib=start_kib, max_kib=physical)
  return {**dataclasses.asdict(case), "mode": STRATEGY_MODE[case.strategy],
          "resolution": resolution,
          "compiler_bytes": need.bytes if need else None,
          "exact": need.exact if need else None, "compiles": need.compiles if need else None,
          "fits_physical": need is not None, "seconds": round(time.perf_counter() - start, 1)}


def run_vmem_points(chips: Sequence[str], workers: int = 2,
                         log: Callable[[str], None] = print,
                         done: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
  """Every case of ``chips``, ``workers`` compiles at a time (one process each); cases in
  ``done`` (rows of an earlier run with the same libtpu) are kept, not compiled again."""
  import jax  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.tpu.aot import libtpu_version  # pylint: disable=import-outside-toplevel
  fields = [f.name for f in dataclasses.fields(VmemCase)]
  # A compile does not depend on whether its point is held out: match without the mark.
  key = lambda case: dataclasses.replace(case, held_out=False)
  kept = {key(VmemCase(**{k: r[k] for k in fields})): r for r in done}
  order = vmem_cases(chips)
  cases = [c for c in order if key(c) not in kept]
  rows = [{**kept[key(c)], "held_out": c.held_out} for c in order if key(c) in kept]
  with concurrent.futures.ProcessPoolExecutor(workers) as pool:
    for case, row in zip(cases, pool.map(measure, cases)):
      rows.append(row)
      figure = (f"{row['compiler_bytes'] / 2**20:.2f} MiB" if row["compiler_bytes"]
                else "over the chip's VMEM")
      log(f"{case.chip} {case.strategy} {case.block_q}x{case.block_kv}/{case.block_kv_compute} "
          f"{case.dtype} d{case.head_dim} h{case.heads}: {figure} ({row['compiles']} compiles, "
          f"{row['seconds']} s)")
  return {"kind": "measured: libtpu's scoped-VMEM allocation, compiled on this host",
          "libtpu": libtpu_version(), "jax": jax.__version__, "resolution": RESOLUTION,
          "density": DENSITY,
          "command": f"python -m maxdiffusion_svg bench vmem --chips {','.join(chips)}",
          "rows": sorted(rows, key=lambda r: order.index(VmemCase(**{k: r[k] for k in fields})))}
