"""Will a plan's TPU kernel fit the chip's VMEM and SMEM? Estimates, limits and refusals.

Over either, a kernel fails deep in libtpu; these checks refuse first, naming chip, bytes, limit
and settings to change. Tests compile against libtpu to hold both sides of that line.
"""

from __future__ import annotations

import dataclasses
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


# Our Pallas kernel (kernels/pallas.py): an upper bound on libtpu's scoped-VMEM need, from the
# kernel's buffers, with the compiler's own share fitted to what libtpu allocated
# (docs/benchmarks.md, "Our kernel's VMEM bound"; the points:
# docs/measurements/pallas_vmem_points.json). Per byte of each buffer (itemsize: q's dtype):
#   q and output blocks (block_q, D), k and v blocks (block_kv, D): double-buffered, 4 each
#   (exact: libtpu's need moves by 4 x block_kv x D x itemsize with block_kv);
#   the row's accumulator and the lazy pass's spare, (Dv, block_q) float32, and the transposed
#   output: ``acc`` per accumulator;
#   the score chunk (block_kv_compute, block_q) float32, with its exponent and bfloat16 copy:
#   ``score``; a tile of PALLAS_OVERLAP_CHUNKS chunks or more may hold a second chunk beside it,
#   ``second_score`` more (libtpu overlaps consecutive chunks: 1.6x to 1.9x a chunk measured
#   there, at most 1.17x with fewer; not every such tile does, which is libtpu's choice);
#   per query, the softmax rows (m, l and the lazy sum: (8, block_q) float32 each), the fixed
#   offset and the share of what grows with the heads (below) that grows with block_q:
#   ``per_query`` bytes.
# libtpu's need also grows with the heads (and video) one call walks, up to a ceiling by about 8
# heads at 720p (v5e 4096x2048/512: 19.56 MiB at 1 head, 23.56 at 2 and 5, 25.56 at 10, 16 and
# 40): the points are at 16 heads, so the bound holds for any call, and lies up to ~2x above a
# call of one head. Fitted above every point by at least 3%.
@dataclasses.dataclass(frozen=True)
class PallasVmemTerms:
  base: float  # bytes
  score: float  # per byte of one float32 score chunk
  second_score: float  # more per score byte, for tiles of PALLAS_OVERLAP_CHUNKS chunks or more
  acc: float  # per byte of one (Dv, block_q) float32 accumulator
  per_query: float  # bytes per query of the tile


PALLAS_OVERLAP_CHUNKS = 4
_V5E_TERMS = PallasVmemTerms(0.0, 1.00, 0.80, 2.19, 407.0)
_V6E_TERMS = PallasVmemTerms(0.0, 1.05, 0.70, 2.19, 160.0)
# v5p allocates as a v5e does, v4 up to 0.2 MiB more (its points), TPU7x as a v6e (its
# 256-wide MXU).
PALLAS_VMEM_TERMS: dict[str, PallasVmemTerms] = {
    "v4": dataclasses.replace(_V5E_TERMS, base=0.2 * MIB), "v5e": _V5E_TERMS,
    "v5p": _V5E_TERMS, "v6e": _V6E_TERMS, "tpu7x": _V6E_TERMS}
# With row keys (compensation) the kernel reads three more blocks per query tile row, each
# double-buffered: the row's keys and values ``(m, D)`` and their logit bias ``(m, 128)``
# float32; their scores run in chunks no larger than a tile's, inside the score terms.
PALLAS_ROW_KEY_BIAS_BYTES = 128 * 4


def pallas_vmem_bound(plan: TilePlan, head_dim: int, dtype: Any, block_kv_compute: int,
                      row_keys: int = 0, generation: str | None = None) -> int:
  """Upper bound on our kernel's scoped VMEM (terms above) on ``generation`` (``v5e``, ...;
  None or unknown: the largest of them); ``row_keys``: extra keys per row."""
  if generation not in PALLAS_VMEM_TERMS:
    return max(pallas_vmem_bound(plan, head_dim, dtype, block_kv_compute, row_keys, name)
               for name in PALLAS_VMEM_TERMS)
  terms = PALLAS_VMEM_TERMS[generation]
  itemsize = jnp.dtype(dtype).itemsize
  bq, bkv = plan.block_q, plan.block_kv
  overlap = bkv // block_kv_compute >= PALLAS_OVERLAP_CHUNKS
  scores = (terms.score + (terms.second_score if overlap else 0.0)) * bq * block_kv_compute * 4
  blocks = 4 * (bq + bkv) * head_dim * itemsize
  slots = row_key_slots(row_keys, block_kv_compute)
  extra = 2 * slots * (2 * head_dim * itemsize + PALLAS_ROW_KEY_BIAS_BYTES)
  return int(terms.base + scores + terms.acc * bq * head_dim * 4 + terms.per_query * bq + blocks
             + extra)


def pallas_smem_bytes(plan: TilePlan, tables: int = 1) -> int:
  """Our work list's SMEM: one int32 per grid step, times ``tables`` heads walking their own."""
  return 4 * plan.work_list()[0].size * tables + 1024


def kernel_vmem(plan: TilePlan, head_dim: int, dtype: Any, block_kv_compute: int | None,
                target: Target, backend: str = "splash", row_keys: int = 0) -> int:
  """Scoped VMEM ``backend``'s kernel is held to (``row_keys``: ours only; Splash merges after)."""
  bkc = block_kv_compute or default_kv_compute(plan.block_kv, backend)
  if backend == "pallas":
    return pallas_vmem_bound(plan, head_dim, dtype, bkc, row_keys,
                             target.generation.name if target.known else None)
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
