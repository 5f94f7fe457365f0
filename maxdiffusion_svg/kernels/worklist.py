"""A TilePlan as the packed work list our Pallas kernel walks: one int32 per grid step.

A step packs row, kv column, kind and open/close-row flags (a 1440p dense call: ~18k steps,
under 80 KiB of SMEM); a row that visits nothing gets one step, so its output is written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg.plan.tiles import FULL, MASKED, TilePlan

KIND_BITS, FIRST_BIT, LAST_BIT, COL_SHIFT, ROW_SHIFT = 2, 2, 3, 4, 18
MAX_COLS, MAX_ROWS = 1 << (ROW_SHIFT - COL_SHIFT), 1 << (31 - ROW_SHIFT)
# A ragged call's lanes of heads: the grid's parallel dimension, which a two-core chip splits.
RAGGED_CORES = 2


def ragged_cores(heads: int) -> int:
  """Lanes a ragged call splits ``heads`` (B x H) lists into: at least one head per lane."""
  return min(RAGGED_CORES, heads)


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
  """``(rows, slots)`` of each work-list step in the plan's ``[num_q_tiles, width]`` table."""
  if (plan.num_visited < 1).any():
    raise ValueError("a per-head tile table needs every query tile row to visit a tile "
                     "(aligned plans keep each row's diagonal)")
  rows, slots = np.nonzero(plan.kind)
  return rows.astype(np.int32), slots.astype(np.int32)


def pack_head_work(plan: TilePlan, kv_index: jax.Array) -> jax.Array:
  """``int32 [B * H * steps]``, head after head: the plan's rows, order and flags with each head's
  columns from ``kv_index [B, H, num_q_tiles, width]`` (kinds by the aligned rule)."""
  rows, slots = head_table_slots(plan)
  static = pack_work(plan) & ~np.int32((MAX_COLS - 1) << COL_SHIFT | ((1 << KIND_BITS) - 1))
  cols = kv_index[:, :, rows, slots]  # [B, H, steps]
  return (static | cols << COL_SHIFT | _column_kinds(plan, cols)).astype(jnp.int32).reshape(-1)


def _column_kinds(plan: TilePlan, cols: jax.Array) -> jax.Array:
  """The aligned rule: ``MASKED`` for the last column of a padded sequence, else ``FULL``."""
  padded = plan.seq_len % plan.block_kv != 0
  return jnp.where(padded & (cols == plan.num_kv_tiles - 1), MASKED, FULL)


def ragged_tables(plan: TilePlan, heads: int, steps: int) -> int:
  """A ragged call's SMEM (work list and step heads) in units of the plan's work list."""
  return -(-2 * ragged_cores(heads) * steps // plan.work_list()[0].size)


def pack_ragged_work(plan: TilePlan, kv_index: jax.Array, steps: int,
                     cores: int) -> tuple[jax.Array, jax.Array]:
  """``(work, heads)``, int32 ``[cores * steps]``: a per-head budget's lists end to end, heads in
  ``cores`` contiguous groups, each padded to ``steps``. ``kv_index [B, H, num_q_tiles, width]``
  holds ``-1`` past a head's count; ``heads`` names each step's head (``b * H + h``). Padding
  steps repeat the last real blocks as ``EMPTY`` (no copy, compute or write). ``steps`` must
  bound each group's visited tiles (``HeadBudget.steps_bound``); more would be dropped."""
  rows, slots = head_table_slots(plan)
  b, h = kv_index.shape[:2]
  n = b * h
  cols = kv_index[:, :, rows, slots].reshape(n, rows.size)  # [heads, plan steps]
  valid = cols >= 0
  # The next step continues the row: a step whose next slot is this head's too is not its last.
  same_row = np.append(rows[1:] == rows[:-1], False)
  following = jnp.pad(valid[:, 1:], ((0, 0), (0, 1))) & same_row
  words = (rows.astype(np.int32) << ROW_SHIFT | jnp.maximum(cols, 0) << COL_SHIFT
           | (valid & ~following).astype(jnp.int32) << LAST_BIT
           | (valid & (slots == 0)).astype(jnp.int32) << FIRST_BIT | _column_kinds(plan, cols))
  per = -(-n // cores)
  flat = lambda x: jnp.pad(x, ((0, cores * per - n), (0, 0))).reshape(cores, per * rows.size)
  words, valid = flat(words), flat(valid)
  heads = flat(jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], (n, rows.size)))
  # Each core's valid steps to the front, in order (a scatter by their running count).
  position = jnp.where(valid, jnp.cumsum(valid, axis=1) - 1, steps)
  core = jnp.arange(cores)[:, None]
  work = jnp.zeros((cores, steps), jnp.int32).at[core, position].set(words, mode="drop")
  step_heads = jnp.zeros((cores, steps), jnp.int32).at[core, position].set(heads, mode="drop")
  count = valid.sum(axis=1, keepdims=True)
  last = jnp.maximum(count - 1, 0)
  flags = np.int32((1 << KIND_BITS) - 1 | 1 << FIRST_BIT | 1 << LAST_BIT)
  pad_word = jnp.take_along_axis(work, last, axis=1) & ~flags
  pad_head = jnp.take_along_axis(step_heads, last, axis=1)
  real = jnp.arange(steps)[None, :] < count
  return (jnp.where(real, work, pad_word).reshape(-1),
          jnp.where(real, step_heads, pad_head).reshape(-1))
