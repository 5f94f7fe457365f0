"""A TilePlan as the flat, packed work list our Pallas kernel walks (one int32 per grid step).

Each visited tile is one grid step; a q-tile row that visits nothing still gets one step, so
its output block is written (as zeros). A step packs its row, kv column, tile kind and whether
it opens or closes its row, so the kernel needs one scalar-memory read per step and the whole
list of a 1440p dense call (about 18k steps) stays under 80 KiB of SMEM. Steps that keep the
previous step's q or kv block index make the Pallas pipeline skip that block's copy, so a
do-nothing step reuses the kv column before it (:meth:`TilePlan.work_list`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg.tiles import FULL, MASKED, TilePlan

KIND_BITS, FIRST_BIT, LAST_BIT, COL_SHIFT, ROW_SHIFT = 2, 2, 3, 4, 18
MAX_COLS, MAX_ROWS = 1 << (ROW_SHIFT - COL_SHIFT), 1 << (31 - ROW_SHIFT)


def pack_work(plan: TilePlan) -> np.ndarray:
  """``int32 [steps]``: the plan's visited tiles row by row, plus one step per empty row."""
  rows, cols, kinds = plan.work_list()
  nq = plan.num_q_tiles
  if nq > MAX_ROWS or plan.num_kv_tiles > MAX_COLS:
    raise ValueError(f"{nq}x{plan.num_kv_tiles} tiles exceed the work list's "
                     f"{MAX_ROWS}x{MAX_COLS}: raise svg_block_q / svg_block_kv")
  cols = cols.astype(np.int64)
  first = np.ones(rows.size, bool)
  first[1:] = rows[1:] != rows[:-1]
  last = np.ones(rows.size, bool)
  last[:-1] = rows[:-1] != rows[1:]
  packed = (rows.astype(np.int64) << ROW_SHIFT | cols << COL_SHIFT | last.astype(np.int64) << LAST_BIT
            | first.astype(np.int64) << FIRST_BIT | kinds.astype(np.int64))
  return packed.astype(np.int32)


def unpack_work(word):
  """``(row, col, kind, first, last)`` of packed steps (numpy arrays or traced scalars)."""
  return (word >> ROW_SHIFT, (word >> COL_SHIFT) & (MAX_COLS - 1), word & ((1 << KIND_BITS) - 1),
          (word >> FIRST_BIT) & 1, (word >> LAST_BIT) & 1)


def head_table_slots(plan: TilePlan) -> tuple[np.ndarray, np.ndarray]:
  """``(rows, slots)`` of the plan's work-list steps in its packed ``[num_q_tiles, width]``
  table: where each step of a per-head table (same rows, same counts) reads its column."""
  if (plan.num_visited < 1).any():
    raise ValueError("a per-head tile table needs every query tile row to visit a tile "
                     "(aligned plans keep each row's diagonal)")
  rows, slots = np.nonzero(plan.kind)
  return rows.astype(np.int32), slots.astype(np.int32)


def pack_head_work(plan: TilePlan, kv_index: jax.Array) -> jax.Array:
  """``int32 [B * H * steps]``: each head's work list, where heads visit their own key tiles
  (``kv_index [B, H, num_q_tiles, width]``, computed on device) with the plan's per-row counts:
  rows, order and open/close flags are the plan's, columns the head's. A column holding
  padding keys is ``MASKED`` (aligned rule), any other ``FULL``. Flat, head after head."""
  rows, slots = head_table_slots(plan)
  static = pack_work(plan) & ~np.int32((MAX_COLS - 1) << COL_SHIFT | ((1 << KIND_BITS) - 1))
  cols = kv_index[:, :, rows, slots]  # [B, H, steps]
  padded = plan.seq_len % plan.block_kv != 0
  kinds = jnp.where(padded & (cols == plan.num_kv_tiles - 1), MASKED, FULL)
  return (static | cols << COL_SHIFT | kinds).astype(jnp.int32).reshape(-1)
