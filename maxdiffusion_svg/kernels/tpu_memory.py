"""Will a Splash plan fit a TPU's on-chip memories? VMEM and SMEM needs, limits and defaults.

Splash keeps its pipelined blocks, online-softmax scratch and per-step temporaries in
scoped VMEM, under a per-kernel limit the compiler enforces (the generation's default
unless ``--xla_tpu_scoped_vmem_limit_kib`` raises it), and copies its tile tables whole
into SMEM. A configuration over either fails deep inside libtpu; these estimates refuse
it first, naming the generation, the bytes, the limit and the ``svg_*`` keys to change.
The VMEM model's coefficients are fitted to libtpu's own allocations (docs: the compile
benchmark's calibration table) and kept above them; tests compile against libtpu to hold
both claims: what is accepted compiles, and what is refused would not have.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg.target import GENERATIONS, MIB, Target, VMEM_FLAG, VMEM_KEY
from maxdiffusion_svg.tiles import MASKED, TilePlan
from maxdiffusion_svg.tiling import default_kv_compute

LANES = 128


def mask_strategy(plan: TilePlan) -> str | None:
  """How masked tiles get their mask: ``stored`` (aligned: one padding pattern), ``function``
  (naive/split: band edges, computed in-kernel), or ``None`` (no masked tile)."""
  if not (plan.kind == MASKED).any():
    return None
  return "function" if plan.masks_exact else "stored"


# Scoped VMEM of one Splash kernel, fitted to libtpu 0.0.50.1's own allocations (bf16,
# head_dim 128; tests/test_target.py holds the measurements) as
#   bytes = a*bq*bkc + b*bq*(bkv/bkc) + c*bq + d + e*bq*bkv
# per chip family and mask strategy: the inner kv loop is unrolled, so its step count matters
# as well as its width. No physical model fits every chip (v6e needs less than v5e for the
# same tile, and more for a narrower inner step); the fit is within 6% of every v5e and v6e
# measurement (v5p and v4 use the v5e fit, checked by compiling their defaults)
# and scaled by its largest under-estimate plus 2%, so it stays above them.
_VMEM_FIT = {
    ("v5e", "stored"): ((9.148, 26.2, 0.0, 1026.0e3, 1.611), 1.012),
    ("v5e", "function"): ((15.919, 396.5, 0.0, 0.0, 0.0), 1.021),
    ("v6e", "stored"): ((0.0, 62.8, 2114.6, 2677.3e3, 0.0), 1.036),
    ("v6e", "function"): ((17.245, 0.0, 0.0, 102.0e3, 0.0), 1.053),
}
_FAMILY = {"v4": "v5e", "v5e": "v5e", "v5p": "v5e", "v6e": "v6e"}
_CHIP_SCALE = {"v5p": 1.03}  # v5p allocated up to 3% more than v5e for the same kernel
_MARGIN = 0.02


def vmem_estimate(plan: TilePlan, head_dim: int, dtype: Any, block_kv_compute: int | None = None,
                  target: Target | None = None) -> dict[str, int]:
  """Scoped-VMEM bytes of one Splash kernel for ``plan`` on ``target``'s chip (a v5e-like chip
  when unknown): ``total``, and the part that ``mask`` blocks (stored) take on a v4, which
  holds int8 blocks as 32-bit. Fitted at head_dim 128 and 2-byte inputs; other sizes scale
  the per-row terms."""
  bq, bkv = plan.block_q, plan.block_kv
  bkc = block_kv_compute or default_kv_compute(bkv)
  generation = target.generation.name if target and target.generation else "v5e"
  kind = mask_strategy(plan)
  strategy = "function" if kind == "function" else "stored"
  (a, b, c, d, e), worst = _VMEM_FIT[(_FAMILY.get(generation, "v5e"), strategy)]
  rows = max(1.0, head_dim / 128 * jnp.dtype(dtype).itemsize / 2)
  fitted = a * bq * bkc + b * bq * (bkv // bkc) + c * bq * rows + d + e * bq * bkv
  widened = 3 * bq * bkv if generation == "v4" and kind == "stored" else 0
  scale = (worst + _MARGIN) * _CHIP_SCALE.get(generation, 1.0)
  return {"total": int((fitted + widened) * scale), "widened_mask": widened}


def smem_estimate(plan: TilePlan) -> int:
  """SMEM bytes of the tile tables: per work-list entry (visited tiles, plus one per q-tile
  row with none) its row, column, kind, two int32 row bounds and, for a stored mask, the
  block index; rows and columns as narrow as they fit."""
  rows, cols, _ = plan.visited_tiles()
  entries = rows.size + np.setdiff1d(np.arange(plan.num_q_tiles), rows).size
  width = lambda n: 1 if n <= 127 else 2 if n <= 32767 else 4
  per_entry = (width(plan.num_q_tiles) + width(plan.num_kv_tiles) + 1 + 8
               + (1 if mask_strategy(plan) == "stored" else 0))
  return entries * per_entry + 4


def vmem_need(plan: TilePlan, head_dim: int, dtype: Any, block_kv_compute: int | None,
              target: Target) -> int:
  """The scoped VMEM ``target`` is held to: its generation's estimate, or for a TPU of unknown
  generation the largest of the known generations' (what must fit wherever it runs)."""
  if target.known:
    return vmem_estimate(plan, head_dim, dtype, block_kv_compute, target)["total"]
  return max(vmem_estimate(plan, head_dim, dtype, block_kv_compute,
                           Target("tpu", generation))["total"]
             for generation in GENERATIONS.values())


def _keys_to_change(plan: TilePlan) -> str:
  return (f"lower svg_block_q ({plan.block_q}), svg_block_kv ({plan.block_kv}) or "
          f"svg_block_kv_compute, or raise the limit: {VMEM_KEY} (our check) and "
          f"--{VMEM_FLAG} in LIBTPU_INIT_ARGS (the compiler's), to the same KiB")


def check_fits(plan: TilePlan, head_dim: int, dtype: Any, block_kv_compute: int | None,
               target: Target) -> None:
  """Raises before compiling when ``plan`` cannot fit ``target``'s VMEM or SMEM.

  Any TPU target is checked: a known generation against its own limits, an unknown one
  against the strictest known. Off TPU there is no limit (interpreted Splash on CPU).
  """
  if not target.is_tpu:
    return
  need = vmem_need(plan, head_dim, dtype, block_kv_compute, target)
  if need > target.vmem_limit:
    raise ValueError(
        f"Splash tiles {plan.block_q}x{plan.block_kv} with block_kv_compute "
        f"{block_kv_compute or default_kv_compute(plan.block_kv)} need about "
        f"{need / MIB:.1f} MiB of VMEM on {target.chip} (estimate fitted to libtpu), over its "
        f"{target.vmem_limit / MIB:g} MiB scoped-VMEM limit ({target.vmem_source}): "
        f"{_keys_to_change(plan)}")
  smem = smem_estimate(plan)
  if smem > target.smem:
    raise ValueError(
        f"Splash's tile tables for {plan.num_q_tiles}x{plan.num_kv_tiles} tiles of "
        f"{plan.block_q}x{plan.block_kv} need about {smem / 1024:.0f} KiB of SMEM, over "
        f"{target.chip}'s {target.smem // 1024} KiB: raise svg_block_q or svg_block_kv (fewer, "
        f"larger tiles)")
