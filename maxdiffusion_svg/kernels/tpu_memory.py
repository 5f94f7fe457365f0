"""Will a plan's TPU kernel fit the chip's VMEM and SMEM? Estimates, limits and refusals.

Over either, a kernel fails deep in libtpu; these checks refuse first, naming chip, bytes, limit
and settings to change. Tests compile against libtpu to hold both sides of that line.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from maxdiffusion_svg.kernels.row_keys import row_key_slots
from maxdiffusion_svg.kernels.vmem_model import fitted_bytes
from maxdiffusion_svg.plan.target import GENERATIONS, MIB, Target, VMEM_FLAG, VMEM_KEY
from maxdiffusion_svg.plan.tiles import MASKED, TilePlan
from maxdiffusion_svg.plan.tiling import default_kv_compute

LANES = 128


def mask_strategy(plan: TilePlan) -> str | None:
  """How masked tiles get their mask: ``stored`` (aligned: one padding pattern), ``function``
  (naive/split: band edges, computed in-kernel), or ``None`` (no masked tile)."""
  if not (plan.kind == MASKED).any():
    return None
  return "function" if plan.masks_exact else "stored"


def vmem_estimate(plan: TilePlan, head_dim: int, dtype: Any, block_kv_compute: int | None,
                  target: Target) -> int:
  """Scoped-VMEM bytes of one Splash kernel on ``target``'s known generation (fitted model)."""
  if not target.known:
    raise ValueError("vmem_estimate needs a known TPU generation (vmem_need holds an unknown "
                     "one to the largest of them)")
  bkc = block_kv_compute or default_kv_compute(plan.block_kv)
  strategy = "function" if mask_strategy(plan) == "function" else "stored"
  return int(fitted_bytes(target.generation.name, strategy, plan.block_q, plan.block_kv, bkc,
                          head_dim, jnp.dtype(dtype).itemsize))


def smem_estimate(plan: TilePlan) -> int:
  """SMEM bytes of the tile tables: per work-list entry its row, column (narrowest int), kind,
  two int32 row bounds and, for a stored mask, the block index."""
  entries = plan.work_list()[0].size
  width = lambda n: 1 if n <= 127 else 2 if n <= 32767 else 4
  per_entry = (width(plan.num_q_tiles) + width(plan.num_kv_tiles) + 1 + 8
               + (1 if mask_strategy(plan) == "stored" else 0))
  return entries * per_entry + 4


def vmem_need(plan: TilePlan, head_dim: int, dtype: Any, block_kv_compute: int | None,
              target: Target) -> int:
  """Scoped VMEM ``target`` is held to: its generation's estimate, or if unknown the largest."""
  if target.known:
    return vmem_estimate(plan, head_dim, dtype, block_kv_compute, target)
  return max(vmem_estimate(plan, head_dim, dtype, block_kv_compute, Target("tpu", generation))
             for generation in GENERATIONS.values())


# Our Pallas kernel (kernels/pallas.py): libtpu's scoped-VMEM need grows with the score chunk
# (block_q x block_kv_compute, float32, plus its exponent and bfloat16 copy), a little with the
# heads and the video, barely with block_kv. The bound sits above every need libtpu reported
# (docs/benchmarks.md, "Figures behind choices in the code").
PALLAS_VMEM_BASE = 6 * MIB
PALLAS_VMEM_PER_SCORE = 5.0
# With row keys (compensation) the kernel reads three more blocks per query tile row, each
# double-buffered: the row's keys and values ``(m, D)`` and their logit bias ``(m, 128)``
# float32; their scores run in chunks no larger than a tile's, inside the bound above.
PALLAS_ROW_KEY_BIAS_BYTES = 128 * 4


def pallas_vmem_bound(plan: TilePlan, head_dim: int, dtype: Any, block_kv_compute: int,
                      row_keys: int = 0) -> int:
  """Upper bound on our kernel's scoped VMEM (figures above); ``row_keys``: extra keys per row."""
  itemsize = jnp.dtype(dtype).itemsize
  wide = max(1.0, itemsize / 2) * max(1.0, head_dim / 128)
  slots = row_key_slots(row_keys, block_kv_compute)
  extra = 2 * slots * (2 * head_dim * itemsize + PALLAS_ROW_KEY_BIAS_BYTES)
  return int(PALLAS_VMEM_BASE + PALLAS_VMEM_PER_SCORE * wide * plan.block_q * block_kv_compute
             + extra)


def pallas_smem_bytes(plan: TilePlan, tables: int = 1) -> int:
  """Our work list's SMEM: one int32 per grid step, times ``tables`` heads walking their own."""
  return 4 * plan.work_list()[0].size * tables + 1024


def kernel_vmem(plan: TilePlan, head_dim: int, dtype: Any, block_kv_compute: int | None,
                target: Target, backend: str = "splash", row_keys: int = 0) -> int:
  """Scoped VMEM ``backend``'s kernel is held to (``row_keys``: ours only; Splash merges after)."""
  bkc = block_kv_compute or default_kv_compute(plan.block_kv, backend)
  if backend == "pallas":
    return pallas_vmem_bound(plan, head_dim, dtype, bkc, row_keys)
  return vmem_need(plan, head_dim, dtype, bkc, target)


def kernel_smem(plan: TilePlan, backend: str = "splash", tables: int = 1) -> int:
  return pallas_smem_bytes(plan, tables) if backend == "pallas" else smem_estimate(plan)


def _keys_to_change(plan: TilePlan) -> str:
  return (f"lower svg_block_q ({plan.block_q}), svg_block_kv ({plan.block_kv}) or "
          f"svg_block_kv_compute, or raise the limit: {VMEM_KEY} (our check) and "
          f"--{VMEM_FLAG} in LIBTPU_INIT_ARGS (the compiler's), to the same KiB")


def check_fits(plan: TilePlan, head_dim: int, dtype: Any, block_kv_compute: int | None,
               target: Target, backend: str = "splash", row_keys: int = 0,
               tables: int = 1) -> None:
  """Raises before compiling when ``backend``'s kernel for ``plan`` cannot fit ``target``'s VMEM
  or SMEM (unknown TPU: the strictest known; off TPU: no limit). ``row_keys``: extra keys per
  row (ours); ``tables``: heads walking their own tile tables, else 1."""
  if not target.is_tpu:
    return
  name = "Pallas" if backend == "pallas" else "Splash"
  bkc = block_kv_compute or default_kv_compute(plan.block_kv, backend)
  try:
    need = kernel_vmem(plan, head_dim, dtype, bkc, target, backend, row_keys)
  except ValueError as err:  # outside the model's range: name the chip and the tile
    raise ValueError(f"Splash tiles {plan.block_q}x{plan.block_kv} on {target.chip}: {err}") from None
  smem = kernel_smem(plan, backend, tables)
  how = "bound from libtpu's allocations" if backend == "pallas" else "estimate fitted to libtpu"
  if need > target.vmem_limit:
    raise ValueError(
        f"{name} tiles {plan.block_q}x{plan.block_kv} with block_kv_compute {bkc}"
        f"{f' and {row_keys} row keys (svg_compensation)' if row_keys and backend == 'pallas' else ''}"
        f" need about "
        f"{need / MIB:.1f} MiB of VMEM on {target.chip} ({how}), over its "
        f"{target.vmem_limit / MIB:g} MiB scoped-VMEM limit ({target.vmem_source}): "
        f"{_keys_to_change(plan)}")
  if smem > target.smem and tables > 1:
    raise ValueError(
        f"{name}'s per-head tile tables (svg_layouts semantic, or svg_head_densities' ragged "
        f"list) for {tables} work lists of {plan.num_q_tiles}x{plan.num_kv_tiles} tiles need "
        f"about {smem / 1024:.0f} KiB of SMEM, over {target.chip}'s {target.smem // 1024} KiB: "
        f"shard the heads over more devices (ulysses_shards), raise svg_block_q or svg_block_kv, "
        f"or drop semantic from svg_layouts (or svg_head_densities)")
  if smem > target.smem:
    raise ValueError(
        f"{name}'s tile tables for {plan.num_q_tiles}x{plan.num_kv_tiles} tiles of "
        f"{plan.block_q}x{plan.block_kv} need about {smem / 1024:.0f} KiB of SMEM, over "
        f"{target.chip}'s {target.smem // 1024} KiB: raise svg_block_q or svg_block_kv (fewer, "
        f"larger tiles)")
