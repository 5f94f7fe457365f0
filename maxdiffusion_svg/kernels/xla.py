"""Portable block-sparse attention in plain JAX: cost follows the plan's visited tiles.

A ``lax.scan`` folds a fixed number of work-list tiles per step into the online-softmax state
of the rows they touch; full and masked tiles scan separately, so full tiles skip the mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg.kernels.worklist import head_table_slots
from maxdiffusion_svg.plan.tiles import FULL, MASKED, TilePlan

# Logits held per scan step (bytes); bounds memory while keeping matmuls large.
_STEP_LOGIT_BYTES = 64 * 2**20


def _pad_tiles(x: jax.Array, tiles: int, block: int) -> jax.Array:
  """``[B, H, S, D]`` -> ``[B, H, tiles, block, D]``, zero-padding the sequence."""
  b, h, s, d = x.shape
  x = jnp.pad(x, ((0, 0), (0, 0), (0, tiles * block - s), (0, 0)))
  return x.reshape(b, h, tiles, block, d)


def _work_steps(rows: np.ndarray, cols: np.ndarray, per_step: int, dummy_row: int):
  """A row-sorted work list cut into equal steps: ``(step_rows, cols, slots, rows)``, each step's
  distinct rows (padded with ``dummy_row``, whose updates drop) and per tile its kv tile and its
  row's slot in them, so a step costs O(its tiles)."""
  steps = -(-rows.size // per_step)
  per_step = -(-rows.size // steps)  # same step count, least padding
  pad = steps * per_step - rows.size
  rows = np.concatenate([rows, np.full(pad, dummy_row, rows.dtype)]).reshape(steps, per_step)
  cols = np.concatenate([cols, np.zeros(pad, cols.dtype)]).reshape(steps, per_step)
  step_rows = np.full((steps, per_step), dummy_row, np.int32)
  slots = np.zeros((steps, per_step), np.int32)
  for i in range(steps):  # O(steps): at most a few thousand
    unique, slots[i] = np.unique(rows[i], return_inverse=True)
    step_rows[i, :unique.size] = unique
  return jnp.asarray(step_rows), jnp.asarray(cols), jnp.asarray(slots), jnp.asarray(rows)


def xla_sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, plan: TilePlan,
                         scale: float, tiles_per_step: int | None = None,
                         return_lse: bool = False,
                         head_tiles: jax.Array | None = None,
                         ragged: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Attention of ``[B, H, S, D]`` inputs over the plan's visited tiles; ``return_lse`` adds
  float32 ``[B, H, S]`` (natural log, ``-inf``: row keeps nothing). ``head_tiles [B, H,
  num_q_tiles, width]``: each head's own tiles, all taken with the aligned rule; ``ragged``:
  their ``-1`` slots (a per-head budget) are dropped."""
  b, h, s, _ = q.shape
  dv = v.shape[-1]
  bq, bkv = plan.block_q, plan.block_kv
  nq, nkv = plan.num_q_tiles, plan.num_kv_tiles
  qt = _pad_tiles(q, nq, bq)
  kt = _pad_tiles(k, nkv, bkv)
  vt = _pad_tiles(v, nkv, bkv)
  rows, cols, kinds = plan.visited_tiles()
  if tiles_per_step is None:
    tiles_per_step = max(1, _STEP_LOGIT_BYTES // (b * h * bq * bkv * 4))
  q_iota = jnp.arange(bq, dtype=jnp.int32)
  k_iota = jnp.arange(bkv, dtype=jnp.int32)

  def step(state, work, masked: bool):
    m, l, acc = state
    step_rows, c, slot, r = work
    qs = jnp.take(qt, r, axis=2, mode="clip")  # [B, H, C, bq, D]
    if c.ndim == 1:  # the plan's columns, shared by every head
      ks, vs = jnp.take(kt, c, axis=2), jnp.take(vt, c, axis=2)
    else:  # each head's own: [B, H, C]
      ks = jnp.take_along_axis(kt, c[..., None, None], axis=2, mode="clip")
      vs = jnp.take_along_axis(vt, c[..., None, None], axis=2, mode="clip")
    logits = jnp.einsum("bhcqd,bhckd->bhcqk", qs, ks, preferred_element_type=jnp.float32) * scale
    if masked:
      qpos = (r[:, None] * bq + q_iota)[:, :, None]
      kpos = (c[..., None] * bkv + k_iota)[..., None, :]
      keep = plan.masked_tile_rule(qpos, kpos)
      if c.ndim > 1:  # a per-head budget's row may end early: -1 in its unused slots
        keep = keep & (c >= 0)[..., None, None]
      logits = jnp.where(keep, logits, -jnp.inf)
    # Fold the step's tiles into the state of the rows they touch (a row may recur).
    m_old = jnp.take(m, step_rows, axis=2, mode="clip")  # [B, H, C, bq]
    m_new = m_old.at[:, :, slot].max(logits.max(axis=-1))
    m_tile = jnp.take(m_new, slot, axis=2)
    weights = jnp.exp(logits - jnp.where(jnp.isfinite(m_tile), m_tile, 0.0)[..., None])
    alpha = jnp.where(jnp.isfinite(m_new), jnp.exp(m_old - m_new), 1.0)
    l_new = (jnp.take(l, step_rows, axis=2, mode="clip") * alpha).at[:, :, slot].add(
        weights.sum(axis=-1))
    pv = jnp.einsum("bhcqk,bhckd->bhcqd", weights.astype(vs.dtype), vs,
                    preferred_element_type=jnp.float32)
    acc_new = (jnp.take(acc, step_rows, axis=2, mode="clip") * alpha[..., None]).at[:, :, slot].add(pv)
    return (m.at[:, :, step_rows].set(m_new, mode="drop"),
            l.at[:, :, step_rows].set(l_new, mode="drop"),
            acc.at[:, :, step_rows].set(acc_new, mode="drop")), None

  state = (jnp.full((b, h, nq, bq), -jnp.inf, jnp.float32),
           jnp.zeros((b, h, nq, bq), jnp.float32),
           jnp.zeros((b, h, nq, bq, dv), jnp.float32))
  if head_tiles is not None:
    step_rows, _, slot, r = _work_steps(rows, cols, tiles_per_step, dummy_row=nq)
    head_rows, head_slots = head_table_slots(plan)
    pad = r.size - head_rows.size
    per_head = jnp.pad(head_tiles[:, :, head_rows, head_slots], ((0, 0), (0, 0), (0, pad)))
    per_head = jnp.moveaxis(per_head.reshape(b, h, *r.shape), 2, 0)  # [steps, B, H, per_step]
    masked = ragged or plan.seq_len % bkv != 0
    state, _ = jax.lax.scan(lambda st, w: step(st, w, masked), state,
                            (step_rows, per_head, slot, r))
  else:
    for kind in (FULL, MASKED):
      pick = kinds == kind
      if pick.any():
        work = _work_steps(rows[pick], cols[pick], tiles_per_step, dummy_row=nq)
        state, _ = jax.lax.scan(lambda st, w, masked=kind == MASKED: step(st, w, masked), state,
                                work)
  m, l, acc = state
  out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
  out = out.reshape(b, h, nq * bq, dv)[:, :, :s].astype(q.dtype)
  if not return_lse:
    return out
  lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
  return out, lse.reshape(b, h, nq * bq)[:, :, :s]
